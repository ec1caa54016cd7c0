#include "loongforge/nn/loss.h"

#include <ATen/ATen.h>

namespace lf::nn {

at::Tensor next_token_targets(const at::Tensor& labels) {
  at::Tensor pad = at::full({labels.size(0), 1}, kIgnoreIndex, labels.options());
  return at::cat({labels.narrow(1, 1, labels.size(1) - 1), pad}, 1);
}

at::Tensor token_loss_sum(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}), targets.reshape({-1}), {},
                                at::Reduction::Sum, kIgnoreIndex);
}

std::pair<at::Tensor, int64_t> causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  at::Tensor target = next_token_targets(labels);
  int64_t counted = (target != kIgnoreIndex).sum().item<int64_t>();
  return {token_loss_sum(logits, target), counted};
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  at::Tensor target = next_token_targets(labels).reshape({-1});
  at::Tensor flat = logits.to(at::kFloat).reshape({-1, logits.size(-1)});
  return at::cross_entropy_loss(flat, target, {}, at::Reduction::Mean, kIgnoreIndex);
}

}  // namespace lf::nn

// Losses. causal_lm_loss is transformers' ForCausalLMLoss: logits[:, t] predicts labels[:, t+1]; -100 is ignored;
// the mean is over the counted tokens.
#pragma once
#include <ATen/core/Tensor.h>

namespace lf::nn {

constexpr int64_t kIgnoreIndex = -100;

// Sum (float32) of the cross-entropies of logits [..., V] against targets [...] that are already shifted (the token
// each position predicts; kIgnoreIndex not counted). Every summed token loss in LoongForge is this one.
at::Tensor token_loss_sum(const at::Tensor& logits, const at::Tensor& targets);
// labels[:, t+1] at position t and kIgnoreIndex at the last position: the next-token targets of [B,T] labels.
at::Tensor next_token_targets(const at::Tensor& labels);

// Sum of the token losses (float32) and the number of counted tokens. logits [B,T,V], labels [B,T].
std::pair<at::Tensor, int64_t> causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& labels);
// The mean over counted tokens (NaN when none is counted, as in PyTorch).
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace lf::nn

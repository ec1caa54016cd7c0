#include "loongforge/models/policy/temporal_ensemble.h"

#include <ATen/ATen.h>

#include <string>

#include "loongforge/core/error.h"

namespace lf::models::policy {

namespace {
std::string shape_of(const at::Tensor& t) {
  std::string s;
  for (int64_t d : t.sizes()) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return "[" + s + "]";
}
}  // namespace

TemporalEnsembler::TemporalEnsembler(double coeff, int64_t chunk_size) : chunk_(chunk_size) {
  if (chunk_size < 1) throw Error("temporal ensembling: chunk_size must be positive, got " + std::to_string(chunk_size));
  // as LeRobot: float32 exp(-coeff * i) (the integer steps times the coefficient in float32), cumulative sums
  weights_ = at::exp(at::arange(chunk_size, at::kLong) * (-coeff));
  cumsum_ = at::cumsum(weights_, 0);
}

void TemporalEnsembler::reset() {
  avg_ = at::Tensor();
  count_ = at::Tensor();
}

at::Tensor TemporalEnsembler::update(const at::Tensor& actions) {
  if (actions.dim() != 3 || actions.size(1) != chunk_ || !at::isFloatingType(actions.scalar_type()))
    throw Error("temporal ensembling: expected a floating-point action chunk [B, " + std::to_string(chunk_) +
                ", action_dim], got " + shape_of(actions));
  if (avg_.defined() && (actions.size(0) != avg_.size(0) || actions.size(2) != avg_.size(2)))
    throw Error("temporal ensembling: the action chunk " + shape_of(actions) + " does not continue the pending " +
                shape_of(avg_) + " (reset() starts a new episode)");
  if (weights_.device() != actions.device()) {
    weights_ = weights_.to(actions.device());
    cumsum_ = cumsum_.to(actions.device());
  }
  auto at_counts = [](const at::Tensor& table, const at::Tensor& counts) {  // table[counts] as [pending, 1]
    return table.index_select(0, counts).unsqueeze(1);
  };
  if (!avg_.defined()) {
    avg_ = actions.clone();
    count_ = at::ones({chunk_}, actions.options().dtype(at::kLong));
  } else {
    // the steps already pending: their running average takes this chunk's prediction in (in place, in the chunk's
    // dtype, in LeRobot's order of operations)
    avg_.mul_(at_counts(cumsum_, count_ - 1));
    avg_.add_(actions.narrow(1, 0, chunk_ - 1) * at_counts(weights_, count_));
    avg_.div_(at_counts(cumsum_, count_));
    count_ = at::clamp_max(count_ + 1, chunk_);
    // the chunk's last step has no earlier prediction
    avg_ = at::cat({avg_, actions.narrow(1, chunk_ - 1, 1)}, 1);
    count_ = at::cat({count_, at::ones({1}, count_.options())});
  }
  at::Tensor now = avg_.select(1, 0).clone();
  avg_ = avg_.narrow(1, 1, chunk_ - 1);
  count_ = count_.narrow(0, 1, chunk_ - 1);
  return now;
}

}  // namespace lf::models::policy

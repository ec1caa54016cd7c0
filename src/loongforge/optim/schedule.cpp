#include "loongforge/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace lf::optim {

double Schedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const double min_lr = lr * min_lr_ratio;
  if (kind == "constant") return lr;
  if (kind == "wsd") {
    int64_t decay = decay_steps > 0 ? decay_steps : std::max<int64_t>(1, total_steps / 10);
    int64_t start = std::max(warmup_steps, total_steps - decay);
    if (step < start) return lr;
    double p = std::min(1.0, static_cast<double>(step - start + 1) / static_cast<double>(decay));
    return lr + (min_lr - lr) * p;
  }
  int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
  double p = std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(span), 0.0, 1.0);
  if (kind == "linear") return lr + (min_lr - lr) * p;
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));  // cosine
}

}  // namespace lf::optim

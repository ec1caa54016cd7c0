// Learning-rate schedules: linear warmup, then cosine / linear / constant / WSD (warmup-stable-decay).
#pragma once
#include <cstdint>
#include <string>

namespace lf::optim {

struct Schedule {
  std::string kind = "cosine";  // cosine | linear | constant | wsd
  double lr = 3e-4, min_lr_ratio = 0.1;
  int64_t warmup_steps = 0, total_steps = 1, decay_steps = 0;  // decay_steps: WSD's final decay (0: 10% of total)
  // The learning rate of step `step` (0-based: the update about to be applied).
  double at(int64_t step) const;
};

}  // namespace lf::optim

// AdamW (decoupled weight decay) with torch.optim.AdamW's arithmetic, one fused CPU loop per tensor, and global
// gradient-norm clipping as torch.nn.utils.clip_grad_norm_.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lf::optim {

struct AdamWOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  // "lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1" (any subset); throws lf::Error naming the key.
  static AdamWOptions parse(const std::string& spec);
};

// An exponential moving average of the weights, kept by the optimizer beside its moments (so every layout shards,
// gathers and checkpoints it as it does exp_avg), with diffusers' EMAModel schedule: at optimizer step s (1-based),
// k = s - update_after_step - 1; decay 0 while k <= 0 (the average starts as a copy), else
// min(decay, (1 + k) / (10 + k)) (warmup "ramp", EMAModel's default), min(decay, 1 - (1 + k / inv_gamma)^-power)
// ("power": use_ema_warmup), then at least min_decay; warmup "none" (DiT's trainer): decay from the first step after
// update_after_step (0 before). The average moves by ema -= (1 - decay) (ema - param).
struct EmaOptions {
  double decay = 0;  // 0: no average
  double min_decay = 0;
  int64_t update_after_step = 0;
  std::string warmup = "ramp";  // ramp | power | none
  double inv_gamma = 1.0, power = 2.0 / 3.0;
  double decay_at(int64_t step) const;
};

class AdamW {
 public:
  // weight_decay[i] overrides the options' decay for params[i] (empty: the options' value for all).
  AdamW(std::vector<at::Tensor> params, AdamWOptions opts, std::vector<double> weight_decay = {});
  // One update with the parameters' .grad() (parameters without a gradient are skipped); lr overrides opts.lr.
  // grad_scale != 1 multiplies every gradient by it first (the coefficient of grad_norm_and_clip_coef), fused into
  // the update on the CPU.
  void step(std::optional<double> lr = std::nullopt, double grad_scale = 1.0);
  // Drops the gradients (set_to_none) or zeroes them in place, keeping their storage (a CUDA graph that
  // accumulates into them needs the same addresses every step).
  void zero_grad(bool set_to_none = true);
  // Per-parameter learning-rate multipliers (empty: 1 for all): parameter i steps with lr * scale[i] (its weight
  // decay too, as a parameter group's lr does in torch).
  void set_lr_scale(std::vector<double> scale);
  int64_t steps() const { return step_; }
  const AdamWOptions& options() const { return opts_; }
  std::vector<at::Tensor>& exp_avg() { return m_; }
  std::vector<at::Tensor>& exp_avg_sq() { return v_; }
  void set_steps(int64_t s) { step_ = s; }
  // Keeps an average of the parameters from now on (a copy of them to start); step() updates it after each update.
  void enable_ema(const EmaOptions& o);
  bool has_ema() const { return ema_opts_.decay > 0; }
  std::vector<at::Tensor>& ema() { return ema_; }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  void update_ema();
  std::vector<at::Tensor> params_, m_, v_, ema_;
  EmaOptions ema_opts_;
  std::vector<double> wd_, lr_scale_;
  AdamWOptions opts_;
  int64_t step_ = 0;
};

// The global 2-norm of the gradients (before clipping); scales them by min(1, max_norm / (norm + 1e-6)) like
// torch.nn.utils.clip_grad_norm_ when max_norm > 0.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);
// The same norm and coefficient min(1, max_norm / (norm + 1e-6)) (1 when max_norm <= 0), without scaling the CPU
// gradients: pass the coefficient to AdamW::step, which scales each gradient as it reads it (one pass less).
// Gradients elsewhere than on the CPU are clipped in place here and the coefficient returned is 1.
std::pair<double, double> grad_norm_and_clip_coef(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace lf::optim

// The diffusion training objectives as a batch source: rows of clean `latents` (plus the model's conditions:
// class_labels / encoder_hidden_states) become what a denoising model trains on, under diffusers' argument names —
// `hidden_states` (the noised latents), `timestep`, `target` and a per-row `loss_weight` — as diffusers' training
// scripts make them:
//  - flow matching (rectified flow, SD3 / Flux / Wan trainers): u from the timestep density (uniform, logit-normal,
//    or SD3's "mode"), index floor(u T) into the scheduler's shifted sigmas (FlowMatchEulerDiscreteScheduler's
//    training schedule), x_t = (1 - sigma) x + sigma eps, target eps - x, timestep sigma T, the loss weighted by
//    diffusers' compute_loss_weighting_for_sd3 (none, sigma_sqrt, cosmap);
//  - DDPM epsilon prediction: t uniform in [0, T), x_t = sqrt(abar_t) x + sqrt(1 - abar_t) eps (DDPMScheduler's
//    add_noise), target eps; for models that predict their variance (their schema has `vlb_terms`: learned-sigma
//    DiT) also `x_start` and `vlb_terms`, the schedule's terms of DiT's variational bound (guided diffusion's
//    posterior coefficients in float64 from the betas), weighted by vlb_weight.
// Classifier-free-guidance condition dropout replaces a row's conditions by the model's unconditional ones.
// Every row draws from its own generator, seeded from the run's seed and the row's index in the stream
// (row_seed), in the order u, noise, dropout: a row gets the same noise however the rows are split over
// processes, micro-batches or balancing, and resume continues the stream exactly.
#pragma once
#include <memory>
#include <string>

#include "loongforge/models/model.h"
#include "loongforge/models/sample.h"
#include "loongforge/train/batch.h"

namespace lf::train {

struct DiffusionObjective {
  std::string kind = "flow_matching";         // flow_matching | ddpm
  std::string timestep_sampling = "uniform";  // uniform | logit_normal | mode (flow matching)
  double logit_mean = 0.0, logit_std = 1.0, mode_scale = 1.29;
  std::string loss_weighting = "none";  // none | sigma_sqrt | cosmap (flow matching)
  double condition_dropout = 0.0;       // probability of training a row unconditionally
  double vlb_weight = 1.0;  // DDPM, models that predict their variance: weight of the variational-bound term
  models::SchedulerConfig schedule;     // num_train_timesteps, shift; DDPM's betas
};

// The generator seed of the row with stream index k: (seed * 6364136223846793005 + k * 1442695040888963407 + 1)
// mod 2^64, then its low 63 bits.
uint64_t row_seed(uint64_t seed, int64_t k);

class DiffusionObjectiveSource : public BatchSource {
 public:
  // inner: the clean rows (latents [B, C, ...] and conditions); model: for its unconditional inputs.
  DiffusionObjectiveSource(std::unique_ptr<BatchSource> inner, DiffusionObjective o, uint64_t seed,
                           const models::Model* model);
  Batch next(int64_t micro_batch_size) override;
  Batch next_rows(int64_t global_rows, int64_t first, int64_t n) override;
  std::vector<data::RowShape> draw(int64_t global_rows) override;
  Batch take(const std::vector<int64_t>& which) override;
  nlohmann::json state() const override { return {{"inner", inner_->state()}, {"rows", rows_}}; }
  void restore(const nlohmann::json& state) override;
  std::string origin() const override { return inner_->origin(); }
  std::map<std::string, at::Tensor> null_conditions() const override { return inner_->null_conditions(); }

  // The training inputs of clean rows whose stream indices are `index` [rows] (int64).
  Batch make(const Batch& clean, const std::vector<int64_t>& index) const;
  // The next n clean rows of the inner stream as they are (sample grids take their conditions from them).
  Batch clean(int64_t n) { return inner_->next(n); }
  const DiffusionObjective& objective() const { return o_; }
  // Validation per timestep bucket: from now on each row's timestep is drawn uniformly within bucket k of
  // `buckets` equal ranges of [0, num_train_timesteps) (flow matching: the training sigma whose timestep is nearest);
  // buckets 0: the objective's own density again.
  void set_timestep_bucket(int64_t k, int64_t buckets) {
    bucket_ = k;
    buckets_ = buckets;
  }

 private:
  std::unique_ptr<BatchSource> inner_;
  DiffusionObjective o_;
  uint64_t seed_;
  const models::Model* model_;
  at::Tensor alphas_cumprod_;  // DDPM
  at::Tensor vlb_table_;       // DDPM with the bound: per timestep the first 6 columns of vlb_terms (float64)
  at::Tensor sigmas_;          // flow matching: the scheduler's training sigmas
  int64_t rows_ = 0;           // rows of the stream served so far
  int64_t bucket_ = 0, buckets_ = 0;
  int64_t drawn_base_ = 0;     // stream index of the current draw's first row
};

}  // namespace lf::train

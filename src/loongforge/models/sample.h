// Sampling from a denoising model (the diffusion transformers): diffusers' schedulers — the flow-matching Euler
// sampler (FlowMatchEulerDiscreteScheduler: shifted sigmas, timestep = sigma x num_train_timesteps) and DDIM for
// epsilon-prediction models (DDIMScheduler, eta 0) — with classifier-free guidance. The model is driven through
// its reference_forward under its library's argument names (hidden_states, timestep and the conditions), reading
// the first channels of `output` (a learned-sigma model's prediction).
#pragma once
#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <map>
#include <string>

#include "loongforge/models/model.h"

namespace lf::models {

struct SchedulerConfig {
  std::string kind = "flow_match_euler";  // flow_match_euler | ddim
  int64_t num_train_timesteps = 1000;
  double shift = 1.0;  // flow matching: sigma -> shift * sigma / (1 + (shift - 1) * sigma)
  // DDIM (diffusers' DDIMScheduler fields and defaults)
  double beta_start = 0.0001, beta_end = 0.02;
  std::string beta_schedule = "linear";  // linear | scaled_linear | squaredcos_cap_v2
  bool clip_sample = true;
  double clip_sample_range = 1.0;
  bool set_alpha_to_one = true;
  int64_t steps_offset = 0;
  std::string timestep_spacing = "leading";  // leading | trailing
  // A diffusers scheduler_config.json (FlowMatchEulerDiscreteScheduler, DDIMScheduler, or DDPMScheduler whose betas
  // DDIM then samples with); unsupported values are one line naming `file` and the field.
  static SchedulerConfig from_json(const nlohmann::json& j, const std::string& file);
};

// The schedule of `steps` denoising steps: timesteps [steps] (float32 for flow matching, int64 for DDIM) and the
// noise level of each step plus the final one, sigmas [steps + 1] (flow matching: the sigmas, ending at 0; DDIM:
// sqrt((1 - alpha_bar) / alpha_bar) at each timestep, ending at the final alpha's).
struct Schedule {
  at::Tensor timesteps, sigmas;
};
Schedule make_schedule(const SchedulerConfig& c, int64_t steps);

// FlowMatchEulerDiscreteScheduler's training sigmas (float32 [num_train_timesteps], index i: t = T - i, sigma =
// shift(t / T)), computed as its constructor does; timestep i is sigma_i x T.
at::Tensor flow_training_sigmas(const SchedulerConfig& c);

// The DDPM / DDIM schedule's betas (float32 [num_train_timesteps]) as diffusers makes them.
at::Tensor betas(const SchedulerConfig& c);
// The DDPM / DDIM schedule's cumulative alpha products (float32 [num_train_timesteps]), as diffusers computes
// them from the betas.
at::Tensor alphas_cumprod(const SchedulerConfig& c);

struct SampleOptions {
  SchedulerConfig scheduler;
  int64_t steps = 50;
  double guidance = 1.0;  // classifier-free guidance scale (1: conditional prediction only)
};

struct SampleResult {
  at::Tensor samples;  // [steps + 1, ...noise shape]: index 0 the noise, the last the result
  Schedule schedule;
};

// Pixels in [-1, 1] from a denoiser's final samples: decoded by the autoencoder (its normalization undone first) when
// one is given, else the samples themselves (pixel-space models).
at::Tensor latents_to_pixels(LatentCodec* codec, const at::Tensor& samples);

// Denoises batch["noise"] with the batch's other tensors as conditions (`file` names the batch in errors). With
// guidance, tensors named negative_<condition> (1 row, or one per row) are the unconditional inputs (a text model's
// empty or negative prompt: WanPipeline's negative_prompt_embeds); else the model's unconditional().
SampleResult sample(Model& model, const std::map<std::string, at::Tensor>& batch, const SampleOptions& opts,
                    const std::string& file);

}  // namespace lf::models

// LeRobot's Diffusion Policy (DiffusionPolicy, config type "diffusion") on the model contract, with LeRobot's
// parameter names (diffusion.rgb_encoder[.N].backbone.4.0.conv1.weight, diffusion.rgb_encoder.pool.nets,
// diffusion.unet.down_modules.0.0.conv1.block.0.weight, diffusion.unet.final_conv.1, ...):
//   per camera image (optionally resized, then centre-cropped in eval / randomly cropped in training), a ResNet trunk
//   (torchvision's children as nn.Sequential; BatchNorm2d, or GroupNorm(C / 16, C) with use_group_norm) -> spatial
//   softmax keypoints -> linear + ReLU; the global condition = [state, camera features, environment state] per
//   observation step, flattened over the n_obs_steps; a 1D conditional U-Net (sinusoidal timestep embedding, Conv1d
//   + GroupNorm + Mish blocks with FiLM from [timestep embedding, global condition], stride-2 down / transposed-conv
//   up sampling) denoises an action trajectory [B, horizon, A].
// Training (LeRobot's compute_loss): x_t = sqrt(abar_t) a + sqrt(1 - abar_t) eps at a random t in [0,
// num_train_timesteps); the loss is the MSE between the U-Net's output and eps (prediction_type epsilon) or a
// (sample), over the non-padded steps with do_mask_loss_for_padding, else over all. Inference: DDPM or DDIM (eta 0)
// from standard-normal noise over num_inference_steps, as diffusers' schedulers step (written here: no diffusers).
// The batch is what LeRobot's policy.forward receives after its preprocessor (normalised): observation.state
// [B, n_obs_steps, D], observation.images.<camera> [B, n_obs_steps, 3, H, W], observation.environment_state, action
// [B, horizon, A], action_is_pad [B, horizon]; the random draws can be given: noise [B, horizon, A] and timesteps
// [B] (training), sample_noise [B, horizon, A] (the sampler's start) and the DDPM sampler's per-step noise.
// Random crops (crop_is_random in training) draw their offsets with LibTorch's generator, not LeRobot's.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "loongforge/models/policy/common.h"
#include "loongforge/models/policy/resnet.h"
#include "loongforge/models/registry.h"

namespace lf::models::policy {

struct DiffusionConfig {
  PolicyFeatures features;
  int64_t n_obs_steps = 2, horizon = 64, n_action_steps = 32;
  int64_t drop_n_last_frames = 7;  // training frames leave out each episode's last this many (LeRobot's sampler)
  std::string vision_backbone = "resnet18";
  std::vector<int64_t> resize_shape, crop_shape;  // [h, w]; empty: none
  bool crop_is_random = true, use_group_norm = false, separate_encoders = true;
  int64_t num_keypoints = 32;
  std::vector<int64_t> down_dims{512, 1024, 2048};
  int64_t kernel_size = 5, n_groups = 8, step_embed_dim = 128;
  bool film_scale = true;
  std::string scheduler_type = "DDPM", beta_schedule = "squaredcos_cap_v2", prediction_type = "epsilon";
  int64_t num_train_timesteps = 100, num_inference_steps = 100;
  double beta_start = 1e-4, beta_end = 0.02, clip_sample_range = 1.0;
  bool clip_sample = true, mask_loss_for_padding = false;
  ResNetLayout backbone;  // from vision_backbone (the weights may give another: io loads by shapes)
  nlohmann::json raw;
  static DiffusionConfig from_json(const nlohmann::json& j, const std::string& file);
  // The image size the trunk sees: the crop, else the resize, else the camera's.
  std::vector<int64_t> encoder_input_hw() const;
  int64_t global_cond_dim() const;  // per observation step
};

// diffusers' DDPMScheduler / DDIMScheduler as LeRobot configures them (timestep_spacing "leading", steps_offset 0;
// DDPM: variance_type fixed_small; DDIM: set_alpha_to_one, eta 0), in float32 as diffusers computes them.
class NoiseScheduler {
 public:
  explicit NoiseScheduler(const DiffusionConfig& c);
  // sqrt(abar_t) x + sqrt(1 - abar_t) noise, t [B].
  at::Tensor add_noise(const at::Tensor& x, const at::Tensor& noise, const at::Tensor& t) const;
  // The sampler's timesteps, first to last.
  const std::vector<int64_t>& timesteps() const { return timesteps_; }
  // How many standard-normal draws the sampler takes after its start (DDPM: one per step with t > 0; DDIM: none).
  int64_t step_draws() const;
  // One step x_t -> x_prev of the sampler's step `i`; `noise` the step's draw (DDPM with t > 0; undefined: drawn).
  at::Tensor step(const at::Tensor& model_output, size_t i, const at::Tensor& sample, const at::Tensor& noise) const;
  const at::Tensor& alphas_cumprod() const { return alphas_cumprod_; }

 private:
  DiffusionConfig c_;
  at::Tensor alphas_cumprod_;  // float32 [num_train_timesteps]
  std::vector<int64_t> timesteps_;
};

// SpatialSoftmax: a 1x1 convolution to the keypoint channels, a softmax over each channel's positions and their
// expected (x, y) on a [-1, 1] grid (pos_grid, a buffer [h * w, 2]).
class SpatialSoftmaxImpl : public torch::nn::Module {
 public:
  SpatialSoftmaxImpl(int64_t in_channels, int64_t h, int64_t w, int64_t keypoints);
  at::Tensor forward(const at::Tensor& features);  // [B, C, h, w] -> [B, K, 2]
  torch::nn::Conv2d nets{nullptr};
  at::Tensor pos_grid;

 private:
  int64_t keypoints_;
};
TORCH_MODULE(SpatialSoftmax);

class DiffusionRgbEncoderImpl : public torch::nn::Module {
 public:
  explicit DiffusionRgbEncoderImpl(const DiffusionConfig& c);
  at::Tensor forward(at::Tensor images);  // [N, 3, H, W] -> [N, 2 * keypoints]
  ResNet backbone{nullptr};
  SpatialSoftmax pool{nullptr};
  torch::nn::Linear out{nullptr};

 private:
  std::vector<int64_t> resize_, crop_;
  bool crop_is_random_;
};
TORCH_MODULE(DiffusionRgbEncoder);

// Conv1d -> GroupNorm -> Mish, as `block` (block.0, block.1).
class DiffusionConv1dBlockImpl : public torch::nn::Module {
 public:
  DiffusionConv1dBlockImpl(int64_t in, int64_t out, int64_t kernel, int64_t groups);
  at::Tensor forward(const at::Tensor& x) { return block->forward(x); }
  torch::nn::Sequential block{nullptr};
};
TORCH_MODULE(DiffusionConv1dBlock);

// conv1 -> FiLM from cond_encoder (Mish, Linear: per-channel scale and bias, or bias) -> conv2, plus the residual
// (residual_conv, a 1x1 convolution, when the width changes).
class DiffusionResidualBlock1dImpl : public torch::nn::Module {
 public:
  DiffusionResidualBlock1dImpl(int64_t in, int64_t out, int64_t cond_dim, const DiffusionConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cond);
  DiffusionConv1dBlock conv1{nullptr}, conv2{nullptr};
  torch::nn::Sequential cond_encoder{nullptr};
  torch::nn::Conv1d residual_conv{nullptr};

 private:
  int64_t out_;
  bool film_scale_;
};
TORCH_MODULE(DiffusionResidualBlock1d);

// One U-Net level as LeRobot's ModuleList [block, block, resample]: "0", "1" and "2" (a stride-2 Conv1d going down, a
// ConvTranspose1d going up; absent for the last level going down).
class DiffusionUnetLevelImpl : public torch::nn::Module {
 public:
  DiffusionUnetLevelImpl(int64_t in, int64_t out, int64_t cond_dim, const DiffusionConfig& c, int resample);  // -1 down, 1 up, 0 none
  at::Tensor forward(at::Tensor x, const at::Tensor& cond, std::vector<at::Tensor>* skips);
  DiffusionResidualBlock1d block0{nullptr}, block1{nullptr};
  torch::nn::Conv1d down{nullptr};
  torch::nn::ConvTranspose1d up{nullptr};
};
TORCH_MODULE(DiffusionUnetLevel);

class DiffusionConditionalUnet1dImpl : public torch::nn::Module {
 public:
  DiffusionConditionalUnet1dImpl(const DiffusionConfig& c, int64_t global_cond_dim);
  // x [B, T, A], timesteps [B] int64, global_cond [B, G] -> [B, T, A].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& global_cond);
  torch::nn::Sequential diffusion_step_encoder{nullptr}, final_conv{nullptr};
  torch::nn::ModuleList down_modules{nullptr}, mid_modules{nullptr}, up_modules{nullptr};

 private:
  int64_t embed_dim_;
};
TORCH_MODULE(DiffusionConditionalUnet1d);

// LeRobot's DiffusionModel (the policy's `diffusion`).
class DiffusionModelImpl : public torch::nn::Module {
 public:
  explicit DiffusionModelImpl(const DiffusionConfig& c);
  // [B, n_obs_steps * global_cond_dim]: per step [state, camera features (camera order), environment state].
  at::Tensor global_conditioning(const Batch& b);
  torch::nn::ModuleList rgb_encoders{nullptr};  // use_separate_rgb_encoder_per_camera: "rgb_encoder"
  DiffusionRgbEncoder rgb_encoder{nullptr};     // one encoder for every camera: "rgb_encoder"
  DiffusionConditionalUnet1d unet{nullptr};

 private:
  DiffusionConfig c_;
};
TORCH_MODULE(DiffusionModel);

class DiffusionPolicyImpl : public PolicyModel {
 public:
  explicit DiffusionPolicyImpl(DiffusionConfig c);

  std::string model_type() const override { return "diffusion"; }
  void init_weights(double std) override;
  BatchSchema batch_schema() const override;
  double train_flops_per_sample(int64_t) const override;
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;

  // LeRobot's compute_loss from a training forward's packed output.
  at::Tensor loss(const at::Tensor& h, const Batch& b) const;
  // The eval-mode action chunk [B, n_action_steps, A] (normalised), LeRobot's predict_action_chunk: the sampler from
  // `sample_noise` [B, horizon, A] (undefined: drawn) with the DDPM steps' draws `step_noise` [step_draws, B,
  // horizon, A] (undefined: drawn), then steps [n_obs_steps - 1, n_obs_steps - 1 + n_action_steps).
  at::Tensor predict_action_chunk(const Batch& b, const at::Tensor& sample_noise, const at::Tensor& step_noise);
  // The policy side of the contract: observations at offsets [1 - n_obs_steps, 0], actions at
  // [1 - n_obs_steps, 1 - n_obs_steps + horizon), drop_n_last_frames from the config; training draws noise [rows,
  // horizon, A] and timesteps [rows]; the sampler takes the batch's sample_noise (and the DDPM steps' noise, sample_step_noise) when given.
  PolicySpec policy_spec() const override;
  std::map<std::string, at::Tensor> training_draws(int64_t rows, at::Generator& gen) const override;
  at::Tensor predict_action_chunk(const Batch& b) override {
    return predict_action_chunk(b, b.get("sample_noise"), b.get("sample_step_noise"));
  }
  const DiffusionConfig& config() const { return config_; }
  const NoiseScheduler& scheduler() const { return scheduler_; }

  DiffusionModel diffusion{nullptr};

 protected:
  // [B, 2 * horizon * A]: the U-Net's prediction, then its target (noise or action), both flattened.
  at::Tensor forward_whole(const Batch& b) override;

 private:
  // The batch's tensors checked and cast to the model's dtype (images [B, 3, H, W] get the step dim when
  // n_obs_steps is 1); `step_noise` gets sample_step_noise.
  Batch check_batch(const std::map<std::string, at::Tensor>& batch, const std::string& file, bool need_action,
                    at::Tensor* step_noise) const;
  at::ScalarType dtype() const;  // the parameters'
  const DiffusionRgbEncoderImpl& rgb_encoders_or_shared() const;  // the (first) camera encoder
  DiffusionConfig config_;
  NoiseScheduler scheduler_;
};
TORCH_MODULE(DiffusionPolicy);

std::shared_ptr<Model> build_diffusion(const nlohmann::json& j, const std::string& file);
// The trunks' stages, blocks and widths from the stored tensors (narrow ResNets named "resnet18" load too).
std::shared_ptr<Model> build_diffusion_for_weights(const nlohmann::json& j, const std::string& file, const Family::TensorShapes& shapes);
nlohmann::json describe_diffusion(const nlohmann::json& j, const std::string& file);

}  // namespace lf::models::policy

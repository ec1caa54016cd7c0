// diffusers' AutoencoderKL (the Stable Diffusion / SDXL / Flux 2D VAE) on the model contract, with diffusers'
// parameter names (encoder.conv_in, encoder.down_blocks.N.resnets.M.norm1, encoder.mid_block.attentions.0.to_q,
// quant_conv, post_quant_conv, decoder.up_blocks.N.upsamplers.0.conv, ...):
//   encode: encoder -> quant_conv -> (mean, logvar) halves, logvar clamped to [-30, 20] (DiagonalGaussianDistribution)
//   decode: post_quant_conv -> decoder.
// As a training model (WholeModel) it reconstructs the batch's `sample` [B, C, H, W] from the posterior mean and its
// loss is the mean squared error over every element; `dump` gives the latents, the reconstruction and that loss.
// encode() / decode() are plain methods for latent-making tools; scaling_factor / shift_factor (applied by diffusers'
// pipelines, not by the model) come with the config.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/diffusion/vae_blocks.h"
#include "loongforge/models/whole_model.h"

namespace lf::models::diffusion {

struct AutoencoderKLConfig {
  int64_t in_channels = 3, out_channels = 3;
  std::vector<std::string> down_block_types{"DownEncoderBlock2D"}, up_block_types{"UpDecoderBlock2D"};
  std::vector<int64_t> block_out_channels{64};
  int64_t layers_per_block = 1;
  std::string act_fn = "silu";
  int64_t latent_channels = 4, norm_num_groups = 32;
  int64_t sample_height = 32, sample_width = 32;  // sample_size (an int, or [height, width])
  double scaling_factor = 0.18215;
  std::optional<double> shift_factor;
  std::vector<double> latents_mean, latents_std;  // per-channel latent statistics some pipelines use (empty: none)
  bool force_upcast = true, use_quant_conv = true, use_post_quant_conv = true, mid_block_add_attention = true;
  nlohmann::json raw;

  // The encoder's spatial reduction: 2^(blocks - 1).
  int64_t downsample_factor() const { return int64_t{1} << (block_out_channels.size() - 1); }
  BlockOptions block_options() const { return {norm_num_groups, 1e-6, act_fn}; }
  // `file` names the config in errors.
  static AutoencoderKLConfig from_json(const nlohmann::json& j, const std::string& file);
};

// Parameters and multiply-accumulates of each component on a height x width image, from the config alone.
struct VaeCost {
  int64_t params = 0;
  double macs = 0;
};
struct VaeCosts {
  VaeCost encoder, quant_conv, post_quant_conv, decoder;
  int64_t params() const { return encoder.params + quant_conv.params + post_quant_conv.params + decoder.params; }
  double macs() const { return encoder.macs + quant_conv.macs + post_quant_conv.macs + decoder.macs; }
};
VaeCosts vae_costs(const AutoencoderKLConfig& c, int64_t height, int64_t width);

// diffusers' Encoder (double_z): conv_in, down_blocks, mid_block, conv_norm_out -> SiLU -> conv_out
// [B, 2 * latent_channels, H / f, W / f].
class VaeEncoderImpl : public torch::nn::Module {
 public:
  explicit VaeEncoderImpl(const AutoencoderKLConfig& c);
  at::Tensor forward(at::Tensor x);
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down_blocks{nullptr};
  UNetMidBlock2D mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VaeEncoder);

// diffusers' Decoder: conv_in, mid_block, up_blocks (layers_per_block + 1 resnets each), conv_norm_out -> SiLU ->
// conv_out [B, out_channels, H, W].
class VaeDecoderImpl : public torch::nn::Module {
 public:
  explicit VaeDecoderImpl(const AutoencoderKLConfig& c);
  at::Tensor forward(at::Tensor z);
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  UNetMidBlock2D mid_block{nullptr};
  torch::nn::ModuleList up_blocks{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VaeDecoder);

class AutoencoderKLImpl : public WholeModel, public LatentCodec {
 public:
  explicit AutoencoderKLImpl(AutoencoderKLConfig c);

  // ---- plain use (latents for diffusion training, images from latents) ----
  // x [B, in_channels, H, W] -> the posterior's (mean, logvar) [B, latent_channels, H / f, W / f] (logvar clamped).
  std::pair<at::Tensor, at::Tensor> encode(const at::Tensor& x);
  // z [B, latent_channels, h, w] (unscaled latents) -> [B, out_channels, h * f, w * f].
  at::Tensor decode(const at::Tensor& z);
  // Pipelines feed the denoiser (z - shift_factor) * scaling_factor and decode z / scaling_factor + shift_factor.
  double scaling_factor() const { return config_.scaling_factor; }
  std::optional<double> shift_factor() const { return config_.shift_factor; }
  const AutoencoderKLConfig& config() const { return config_; }
  // ---- the latent space (LatentCodec) ----
  LatentCodec* latent_codec() override { return this; }
  std::pair<at::Tensor, at::Tensor> encode_latents(const at::Tensor& pixels) override { return encode(pixels); }
  at::Tensor decode_latents(const at::Tensor& z) override { return decode(z); }
  // (z - shift_factor) * scaling_factor; with latents_mean / latents_std (SDXL-style configs) per channel:
  // (z - mean) * scaling_factor / std.
  at::Tensor normalize_latents(const at::Tensor& z) const override;
  at::Tensor denormalize_latents(const at::Tensor& z) const override;
  int64_t latent_channels() const override { return config_.latent_channels; }
  int64_t pixel_channels() const override { return config_.in_channels; }
  int64_t spatial_factor() const override { return config_.downsample_factor(); }
  // its convolutions' weight gradients are wrong when several threads run backward at once (ATen CPU)
  bool thread_split_safe() const override { return false; }

  // ---- the model contract ----
  std::string family() const override { return "diffusion"; }
  std::string model_type() const override { return "AutoencoderKL"; }
  const nlohmann::json& config_json() const override { return config_.raw; }
  void init_weights(double std) override;
  BatchSchema batch_schema() const override;
  // Every element of `sample` is a term of the mean squared error.
  int64_t loss_terms(const Batch& b) const override { return b.at("sample").numel(); }
  double train_flops_per_sample(int64_t seq) const override;
  at::Tensor head_loss_sum(const at::Tensor& decoded, const Batch& b) override;
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;
  std::string weights_file_stem() const override { return "diffusion_pytorch_model"; }
  bool config_records_dtype() const override { return false; }
  // Checkpoints written with diffusers' deprecated attention names (query, key, value, proj_attn) load too.
  std::string canonical_checkpoint_name(const std::string& stored) const override;

  VaeEncoder encoder{nullptr};
  VaeDecoder decoder{nullptr};
  torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};  // null when the config turns them off

 protected:
  // The reconstruction of the batch's sample from the posterior mean.
  at::Tensor forward_whole(const Batch& b) override;

 private:
  // An error naming `file` and `sample` unless x is [B, in_channels, H, W] with H, W multiples of the downsampling.
  void check_sample(const at::Tensor& x, const std::string& file) const;
  AutoencoderKLConfig config_;
};
TORCH_MODULE(AutoencoderKL);

// Registry pieces of _class_name AutoencoderKL (models/diffusion/family.cpp lists them).
std::shared_ptr<Model> build_autoencoder_kl(const nlohmann::json& j, const std::string& file);
nlohmann::json describe_autoencoder_kl(const nlohmann::json& j, const std::string& file);

}  // namespace lf::models::diffusion

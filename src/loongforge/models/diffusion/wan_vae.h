// diffusers' AutoencoderKLWan (Wan 2.1's causal video VAE) on the model contract, with diffusers' parameter names
// (encoder.conv_in, encoder.down_blocks.N.{norm1.gamma, conv1, resample.1, time_conv}, encoder.mid_block.attentions.0
// .to_qkv, quant_conv, post_quant_conv, decoder.up_blocks.N.resnets.M, decoder.up_blocks.N.upsamplers.0.resample.1,
// ...). Videos are [B, C, F, H, W] with F = 1 + 4k; latents [B, z_dim, 1 + (F - 1) / tf, H / sf, W / sf].
//
// Time is causal. Every 3x3x3 conv sees its input zero-padded by two frames in front; frame 0 is special in the
// resamplers: the temporal downsampler passes frame 0 through and then convolves (stride 2, no padding) frames
// (0, 1, 2), (2, 3, 4), ...; the temporal upsampler passes frame 0 through as one frame and turns each later frame
// into two by a causal conv over frames 1.. only (frame 0 is not in its context). diffusers runs the clip as chunks
// with a feature cache (encode: frame 0, then 4 frames at a time; decode: one latent frame at a time); here every
// causal layer keeps its last input frames in a WanCache slot between chunks, which makes the result independent
// of the chunking: the codec's encode_latents / decode_latents and `dump` chunk as diffusers does (same
// convolutions, least memory), training runs frame 0 and then the rest of the clip as one chunk.
// decode() clamps to [-1, 1] as diffusers' decode does (the training loss is taken after that clamp too).
// Wan 2.2's variants (is_residual, patch_size) and attn_scales (which diffusers' encoder cannot run) are refused
// with an error naming the field.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/whole_model.h"

namespace lf::models::diffusion {

struct WanVaeConfig {
  int64_t base_dim = 96, decoder_base_dim = 96, z_dim = 16, num_res_blocks = 2;
  int64_t in_channels = 3, out_channels = 3;
  std::vector<int64_t> dim_mult{1, 2, 4, 4};
  std::vector<bool> temperal_downsample{false, true, true};  // one per downsampling level (diffusers' spelling)
  double dropout = 0.0;
  std::vector<double> latents_mean, latents_std;  // z_dim values each
  nlohmann::json raw;

  int64_t spatial_factor() const { return int64_t{1} << (dim_mult.size() - 1); }
  int64_t temporal_factor() const;
  static WanVaeConfig from_json(const nlohmann::json& j, const std::string& file);
};

// Parameters and multiply-accumulates of each component on a [frames, height, width] clip, from the config alone.
struct WanVaeCost {
  int64_t params = 0;
  double macs = 0;
};
struct WanVaeCosts {
  WanVaeCost encoder, quant_conv, post_quant_conv, decoder;
  int64_t params() const { return encoder.params + quant_conv.params + post_quant_conv.params + decoder.params; }
  double macs() const { return encoder.macs + quant_conv.macs + post_quant_conv.macs + decoder.macs; }
};
WanVaeCosts wan_vae_costs(const WanVaeConfig& c, int64_t frames, int64_t height, int64_t width);

// The causal layers' state between the chunks of one clip: one slot per causal layer, in call order (rewind() before
// each chunk). A slot holds the last input frames the layer keeps (undefined: none yet) and whether it has run.
struct WanCache {
  struct Slot {
    at::Tensor kept;
    bool started = false;
  };
  std::deque<Slot> slots;
  size_t next_slot = 0;
  Slot& next() {
    if (next_slot == slots.size()) slots.emplace_back();
    return slots[next_slot++];
  }
  void rewind() { next_slot = 0; }
};

// diffusers' WanCausalConv3d: a Conv3d (weight, bias) whose time padding is all in front (2 * padding_t frames), the
// frames kept in `slot` standing in for that many of the zeros; the slot then keeps the last 2 input frames.
class WanCausalConv3dImpl : public torch::nn::Conv3dImpl {
 public:
  WanCausalConv3dImpl(int64_t in, int64_t out, std::vector<int64_t> kernel, std::vector<int64_t> stride = {1, 1, 1},
                      std::vector<int64_t> padding = {0, 0, 0});
  at::Tensor forward(const at::Tensor& x, WanCache::Slot* slot = nullptr);

 private:
  std::vector<int64_t> pad_;  // F.pad order: w, w, h, h, t in front, 0
};
TORCH_MODULE(WanCausalConv3d);

// diffusers' WanRMS_norm: x / ||x|| over channels (dim 1; fp32 for half types) * sqrt(dim) * gamma.
class WanVaeRMSNormImpl : public torch::nn::Module {
 public:
  WanVaeRMSNormImpl(int64_t dim, bool images);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor gamma;

 private:
  double scale_;
};
TORCH_MODULE(WanVaeRMSNorm);

// norm1 -> SiLU -> conv1 -> norm2 -> SiLU -> dropout -> conv2, plus the input (through a 1x1x1 conv_shortcut when
// the channels change).
class WanResidualBlockImpl : public torch::nn::Module {
 public:
  WanResidualBlockImpl(int64_t in, int64_t out, double dropout);
  at::Tensor forward(const at::Tensor& x, WanCache& cache);
  WanVaeRMSNorm norm1{nullptr}, norm2{nullptr};
  WanCausalConv3d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};

 private:
  double dropout_;
};
TORCH_MODULE(WanResidualBlock);

// Single-head self-attention within each frame (norm, to_qkv and proj are 1x1 convs), plus the input.
class WanAttentionBlockImpl : public torch::nn::Module {
 public:
  explicit WanAttentionBlockImpl(int64_t dim);
  at::Tensor forward(const at::Tensor& x);
  WanVaeRMSNorm norm{nullptr};
  torch::nn::Conv2d to_qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(WanAttentionBlock);

// diffusers' WanResample: per-frame 2x nearest upsampling + conv to dim / 2 (up), or right/bottom zero pad + stride-2
// conv (down), as resample.1; the 3d modes add time_conv (see the header comment for frame 0).
class WanResampleImpl : public torch::nn::Module {
 public:
  enum class Mode { Upsample2d, Upsample3d, Downsample2d, Downsample3d };
  WanResampleImpl(int64_t dim, Mode mode);
  at::Tensor forward(const at::Tensor& x, WanCache& cache);
  torch::nn::ModuleList resample{nullptr};  // [0] no parameters (upsampling / padding), [1] the Conv2d
  WanCausalConv3d time_conv{nullptr};       // 3d modes only

 private:
  Mode mode_;
};
TORCH_MODULE(WanResample);

// resnets.0, attentions.0, resnets.1.
class WanMidBlockImpl : public torch::nn::Module {
 public:
  WanMidBlockImpl(int64_t dim, double dropout);
  at::Tensor forward(at::Tensor x, WanCache& cache);
  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr};
};
TORCH_MODULE(WanMidBlock);

// conv_in, down_blocks (one flat list of residual blocks and resamplers), mid_block, norm_out ->
// SiLU -> conv_out to 2 * z_dim channels.
class WanEncoder3dImpl : public torch::nn::Module {
 public:
  explicit WanEncoder3dImpl(const WanVaeConfig& c);
  at::Tensor forward(const at::Tensor& x, WanCache& cache);
  WanCausalConv3d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down_blocks{nullptr};
  WanMidBlock mid_block{nullptr};
  WanVaeRMSNorm norm_out{nullptr};
};
TORCH_MODULE(WanEncoder3d);

// num_res_blocks + 1 residual blocks and an optional upsampler (upsamplers.0).
class WanUpBlockImpl : public torch::nn::Module {
 public:
  WanUpBlockImpl(int64_t in, int64_t out, int64_t num_res_blocks, double dropout, int upsample /*0, 2 or 3*/);
  at::Tensor forward(at::Tensor x, WanCache& cache);
  torch::nn::ModuleList resnets{nullptr}, upsamplers{nullptr};
};
TORCH_MODULE(WanUpBlock);

// conv_in, mid_block, up_blocks, norm_out -> SiLU -> conv_out to out_channels.
class WanDecoder3dImpl : public torch::nn::Module {
 public:
  explicit WanDecoder3dImpl(const WanVaeConfig& c);
  at::Tensor forward(const at::Tensor& z, WanCache& cache);
  WanCausalConv3d conv_in{nullptr}, conv_out{nullptr};
  WanMidBlock mid_block{nullptr};
  torch::nn::ModuleList up_blocks{nullptr};
  WanVaeRMSNorm norm_out{nullptr};
};
TORCH_MODULE(WanDecoder3d);

class AutoencoderKLWanImpl : public WholeModel, public LatentCodec {
 public:
  explicit AutoencoderKLWanImpl(WanVaeConfig c);

  // ---- plain use ----
  // x [B, in_channels, 1 + 4k, H, W] -> the posterior's (mean, logvar) (logvar clamped to [-30, 20]). The encoder
  // runs frame 0, then `chunk` frames at a time (a multiple of 4; 0: the rest at once).
  std::pair<at::Tensor, at::Tensor> encode(const at::Tensor& x, int64_t chunk = 4);
  // z [B, z_dim, f, h, w] -> [B, out_channels, 1 + tf * (f - 1), h * sf, w * sf] in [-1, 1]; the decoder runs latent
  // frame 0, then `chunk` latent frames at a time (0: the rest at once).
  at::Tensor decode(const at::Tensor& z, int64_t chunk = 1);
  const WanVaeConfig& config() const { return config_; }
  // ---- the latent space (LatentCodec): diffusers' chunking ----
  LatentCodec* latent_codec() override { return this; }
  std::pair<at::Tensor, at::Tensor> encode_latents(const at::Tensor& pixels) override { return encode(pixels, 4); }
  at::Tensor decode_latents(const at::Tensor& z) override { return decode(z, 1); }
  // Wan's pipelines: (z - latents_mean) * (1 / latents_std) per channel, and z / (1 / latents_std) + latents_mean.
  at::Tensor normalize_latents(const at::Tensor& z) const override;
  at::Tensor denormalize_latents(const at::Tensor& z) const override;
  int64_t latent_channels() const override { return config_.z_dim; }
  int64_t pixel_channels() const override { return config_.in_channels; }
  int64_t spatial_factor() const override { return config_.spatial_factor(); }
  int64_t temporal_factor() const override { return config_.temporal_factor(); }
  bool video() const override { return true; }
  // its convolutions' weight gradients are wrong when several threads run backward at once (ATen CPU)
  bool thread_split_safe() const override { return false; }

  // ---- the model contract ----
  std::string family() const override { return "diffusion"; }
  std::string model_type() const override { return "AutoencoderKLWan"; }
  const nlohmann::json& config_json() const override { return config_.raw; }
  void init_weights(double std) override;
  BatchSchema batch_schema() const override;
  int64_t loss_terms(const Batch& b) const override { return b.at("sample").numel(); }
  // At a clip of 5 frames of 256 x 256 (the config has no sample size).
  double train_flops_per_sample(int64_t seq) const override;
  at::Tensor head_loss_sum(const at::Tensor& decoded, const Batch& b) override;
  // latent_mean, latent_logvar, decoded (chunked as diffusers) and the mean squared error.
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;
  std::string weights_file_stem() const override { return "diffusion_pytorch_model"; }
  bool config_records_dtype() const override { return false; }

  WanEncoder3d encoder{nullptr};
  WanDecoder3d decoder{nullptr};
  WanCausalConv3d quant_conv{nullptr}, post_quant_conv{nullptr};

 protected:
  // decode(encode(sample).mean), each as two chunks (frame 0, the rest).
  at::Tensor forward_whole(const Batch& b) override;

 private:
  void check_sample(const at::Tensor& x, const std::string& file) const;
  WanVaeConfig config_;
};
TORCH_MODULE(AutoencoderKLWan);

// The clip size train_flops_per_sample and `info` count FLOPs at: {5, 256, 256} (frame 0 and one chunk of 4).
std::vector<int64_t> wan_vae_flops_clip(const WanVaeConfig& c);

// Registry pieces of _class_name AutoencoderKLWan (models/diffusion/family.cpp lists them).
std::shared_ptr<Model> build_autoencoder_kl_wan(const nlohmann::json& j, const std::string& file);
nlohmann::json describe_autoencoder_kl_wan(const nlohmann::json& j, const std::string& file);

}  // namespace lf::models::diffusion

// The 2D building blocks of diffusers' VAEs (diffusers.models.resnet / unet_2d_blocks / attention_processor), with
// diffusers' module names: GroupNorm-based ResnetBlock2D, the spatial self-attention of a mid block (diffusers'
// `Attention` with a group norm, a residual and one head per `attention_head_dim` channels), the strided-conv
// Downsample2D and the nearest-neighbour Upsample2D, and the blocks AutoencoderKL's Encoder / Decoder stack
// (DownEncoderBlock2D, UpDecoderBlock2D, UNetMidBlock2D without a time embedding). Activations are [B, C, H, W].
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include <string>

#include "loongforge/nn/linear.h"

namespace lf::models::diffusion {

// diffusers' get_activation names (lower-cased): silu, swish, mish, gelu, relu.
bool known_activation(const std::string& name);
at::Tensor activation(const std::string& name, const at::Tensor& x);

// The blocks' shared settings: GroupNorm groups and epsilon, the resnets' activation.
struct BlockOptions {
  int64_t groups = 32;
  double eps = 1e-6;
  std::string act = "silu";
};

// norm1 -> act -> conv1 -> norm2 -> act -> conv2, plus the input (through a 1x1 conv_shortcut when the channels
// change). No time embedding (temb_channels None), output_scale_factor 1, dropout 0.
class ResnetBlock2DImpl : public torch::nn::Module {
 public:
  ResnetBlock2DImpl(int64_t in, int64_t out, const BlockOptions& o);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(ResnetBlock2D);

// Self-attention over the H*W positions: group_norm, to_q / to_k / to_v, softmax(q k^T / sqrt(head_dim)) v,
// to_out.0, plus the input (diffusers' Attention(..., residual_connection=True, _from_deprecated_attn_block=True)).
class SpatialAttentionImpl : public torch::nn::Module {
 public:
  SpatialAttentionImpl(int64_t channels, int64_t head_dim, const BlockOptions& o);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::GroupNorm group_norm{nullptr};
  nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out{nullptr};  // [0]: the output Linear (diffusers' [1] is a dropout, no parameters)

 private:
  int64_t heads_;
};
TORCH_MODULE(SpatialAttention);

// A 3x3 stride-2 conv; padding 0 pads right and bottom by one first (the VAE encoder's), else pads `padding` around.
class Downsample2DImpl : public torch::nn::Module {
 public:
  Downsample2DImpl(int64_t channels, int64_t padding);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Conv2d conv{nullptr};

 private:
  int64_t padding_;
};
TORCH_MODULE(Downsample2D);

// Nearest-neighbour 2x upsampling, then a 3x3 conv.
class Upsample2DImpl : public torch::nn::Module {
 public:
  explicit Upsample2DImpl(int64_t channels);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Upsample2D);

// resnets.0, then (attentions.i when add_attention, resnets.i+1) for each of `layers`.
class UNetMidBlock2DImpl : public torch::nn::Module {
 public:
  UNetMidBlock2DImpl(int64_t channels, int64_t layers, bool add_attention, const BlockOptions& o);
  at::Tensor forward(at::Tensor x);
  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr};  // attentions: null without attention
};
TORCH_MODULE(UNetMidBlock2D);

// `layers` resnets (in -> out, then out -> out) and an optional Downsample2D (downsamplers.0).
class DownEncoderBlock2DImpl : public torch::nn::Module {
 public:
  DownEncoderBlock2DImpl(int64_t in, int64_t out, int64_t layers, bool add_downsample, int64_t downsample_padding,
                         const BlockOptions& o);
  at::Tensor forward(at::Tensor x);
  torch::nn::ModuleList resnets{nullptr}, downsamplers{nullptr};
};
TORCH_MODULE(DownEncoderBlock2D);

// `layers` resnets (in -> out, then out -> out) and an optional Upsample2D (upsamplers.0).
class UpDecoderBlock2DImpl : public torch::nn::Module {
 public:
  UpDecoderBlock2DImpl(int64_t in, int64_t out, int64_t layers, bool add_upsample, const BlockOptions& o);
  at::Tensor forward(at::Tensor x);
  torch::nn::ModuleList resnets{nullptr}, upsamplers{nullptr};
};
TORCH_MODULE(UpDecoderBlock2D);

// PyTorch's default initialisation of every Conv2d / Linear / GroupNorm under `m` (what diffusers' models get from
// their constructors), or with std >= 0 normal(0, std) weights and zero biases (norms: ones and zeros).
void init_vae_weights(torch::nn::Module& m, double std);

}  // namespace lf::models::diffusion

// diffusers' VAE building blocks (models/diffusion/vae_blocks.h).
#include "loongforge/models/diffusion/vae_blocks.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/padding.h>
#include <torch/nn/functional/upsampling.h>

#include <cmath>

namespace lf::models::diffusion {

namespace F = torch::nn::functional;

bool known_activation(const std::string& name) {
  return name == "silu" || name == "swish" || name == "mish" || name == "gelu" || name == "relu";
}

at::Tensor activation(const std::string& name, const at::Tensor& x) {
  if (name == "silu" || name == "swish") return at::silu(x);
  if (name == "mish") return at::mish(x);
  if (name == "gelu") return at::gelu(x);  // nn.GELU(): exact erf form
  return at::relu(x);
}

namespace {

torch::nn::GroupNorm group_norm(int64_t channels, const BlockOptions& o) {
  return torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.groups, channels).eps(o.eps).affine(true));
}

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t padding = -1) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(padding < 0 ? k / 2 : padding).bias(true));
}

}  // namespace

ResnetBlock2DImpl::ResnetBlock2DImpl(int64_t in, int64_t out, const BlockOptions& o) : act_(o.act) {
  norm1 = register_module("norm1", group_norm(in, o));
  conv1 = register_module("conv1", conv(in, out, 3));
  norm2 = register_module("norm2", group_norm(out, o));
  conv2 = register_module("conv2", conv(out, out, 3));
  if (in != out) conv_shortcut = register_module("conv_shortcut", conv(in, out, 1));
}

at::Tensor ResnetBlock2DImpl::forward(const at::Tensor& x) {
  at::Tensor h = conv1(activation(act_, norm1(x)));
  h = conv2(activation(act_, norm2(h)));
  return (conv_shortcut ? conv_shortcut(x) : x) + h;
}

SpatialAttentionImpl::SpatialAttentionImpl(int64_t channels, int64_t head_dim, const BlockOptions& o)
    : heads_(channels / head_dim) {
  group_norm = register_module("group_norm", diffusion::group_norm(channels, o));
  to_q = register_module("to_q", nn::Linear(channels, channels, true));
  to_k = register_module("to_k", nn::Linear(channels, channels, true));
  to_v = register_module("to_v", nn::Linear(channels, channels, true));
  to_out = register_module("to_out", torch::nn::ModuleList());
  to_out->push_back(nn::Linear(channels, channels, true));
}

at::Tensor SpatialAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  // [B, C, H, W] -> tokens [B, HW, C]; the group norm runs on the channel-first layout
  const at::Tensor t = group_norm(x.reshape({b, c, h * w})).transpose(1, 2);
  auto heads = [&](const at::Tensor& y) { return y.view({b, -1, heads_, c / heads_}).transpose(1, 2); };
  at::Tensor a = at::scaled_dot_product_attention(heads(to_q(t)), heads(to_k(t)), heads(to_v(t)));
  a = a.transpose(1, 2).reshape({b, -1, c});
  a = to_out->ptr<nn::LinearImpl>(0)->forward(a);
  return a.transpose(-1, -2).reshape({b, c, h, w}) + x;
}

Downsample2DImpl::Downsample2DImpl(int64_t channels, int64_t padding) : padding_(padding) {
  conv = register_module("conv", diffusion::conv(channels, channels, 3, 2, padding));
}

at::Tensor Downsample2DImpl::forward(const at::Tensor& x) {
  if (padding_ == 0) return conv(F::pad(x, F::PadFuncOptions({0, 1, 0, 1}).mode(torch::kConstant).value(0)));
  return conv(x);
}

Upsample2DImpl::Upsample2DImpl(int64_t channels) { conv = register_module("conv", diffusion::conv(channels, channels, 3)); }

at::Tensor Upsample2DImpl::forward(const at::Tensor& x) {
  return conv(F::interpolate(
      x, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0}).mode(torch::kNearest)));
}

UNetMidBlock2DImpl::UNetMidBlock2DImpl(int64_t channels, int64_t layers, bool add_attention, const BlockOptions& o) {
  resnets = register_module("resnets", torch::nn::ModuleList());
  resnets->push_back(ResnetBlock2D(channels, channels, o));
  if (add_attention) attentions = register_module("attentions", torch::nn::ModuleList());
  for (int64_t i = 0; i < layers; ++i) {
    if (add_attention) attentions->push_back(SpatialAttention(channels, channels, o));  // one head of all channels
    resnets->push_back(ResnetBlock2D(channels, channels, o));
  }
}

at::Tensor UNetMidBlock2DImpl::forward(at::Tensor x) {
  x = resnets->ptr<ResnetBlock2DImpl>(0)->forward(x);
  for (size_t i = 1; i < resnets->size(); ++i) {
    if (attentions) x = attentions->ptr<SpatialAttentionImpl>(i - 1)->forward(x);
    x = resnets->ptr<ResnetBlock2DImpl>(i)->forward(x);
  }
  return x;
}

DownEncoderBlock2DImpl::DownEncoderBlock2DImpl(int64_t in, int64_t out, int64_t layers, bool add_downsample,
                                               int64_t downsample_padding, const BlockOptions& o) {
  resnets = register_module("resnets", torch::nn::ModuleList());
  for (int64_t i = 0; i < layers; ++i) resnets->push_back(ResnetBlock2D(i == 0 ? in : out, out, o));
  if (add_downsample) {
    downsamplers = register_module("downsamplers", torch::nn::ModuleList());
    downsamplers->push_back(Downsample2D(out, downsample_padding));
  }
}

at::Tensor DownEncoderBlock2DImpl::forward(at::Tensor x) {
  for (size_t i = 0; i < resnets->size(); ++i) x = resnets->ptr<ResnetBlock2DImpl>(i)->forward(x);
  if (downsamplers) x = downsamplers->ptr<Downsample2DImpl>(0)->forward(x);
  return x;
}

UpDecoderBlock2DImpl::UpDecoderBlock2DImpl(int64_t in, int64_t out, int64_t layers, bool add_upsample,
                                           const BlockOptions& o) {
  resnets = register_module("resnets", torch::nn::ModuleList());
  for (int64_t i = 0; i < layers; ++i) resnets->push_back(ResnetBlock2D(i == 0 ? in : out, out, o));
  if (add_upsample) {
    upsamplers = register_module("upsamplers", torch::nn::ModuleList());
    upsamplers->push_back(Upsample2D(out));
  }
}

at::Tensor UpDecoderBlock2DImpl::forward(at::Tensor x) {
  for (size_t i = 0; i < resnets->size(); ++i) x = resnets->ptr<ResnetBlock2DImpl>(i)->forward(x);
  if (upsamplers) x = upsamplers->ptr<Upsample2DImpl>(0)->forward(x);
  return x;
}

void init_vae_weights(torch::nn::Module& m, double std) {
  at::NoGradGuard no_grad;
  for (const auto& item : m.named_modules()) {
    torch::nn::Module* mod = item.value().get();
    if (auto* c = dynamic_cast<torch::nn::Conv2dImpl*>(mod)) {
      if (std < 0) c->reset_parameters();
      else {
        c->weight.normal_(0.0, std);
        c->bias.zero_();
      }
    } else if (auto* g = dynamic_cast<torch::nn::GroupNormImpl*>(mod)) {
      g->reset_parameters();
    } else if (auto* l = dynamic_cast<nn::LinearImpl*>(mod)) {
      // nn.Linear's reset_parameters: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(in)), bias U(+-1/sqrt(in))
      const double bound = 1.0 / std::sqrt(static_cast<double>(l->in_features));
      if (std < 0) l->weight.uniform_(-bound, bound);
      else l->weight.normal_(0.0, std);
      if (l->bias.defined()) {
        if (std < 0) l->bias.uniform_(-bound, bound);
        else l->bias.zero_();
      }
    }
  }
}

}  // namespace lf::models::diffusion

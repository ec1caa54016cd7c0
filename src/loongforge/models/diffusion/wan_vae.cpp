// diffusers' AutoencoderKLWan on the model contract (models/diffusion/wan_vae.h).
#include "loongforge/models/diffusion/wan_vae.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::models::diffusion {

namespace {

// diffusers' defaults (Wan 2.1's 16-channel latent statistics), used when config.json leaves them out.
const std::vector<double> kDefaultMean = {-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                                          0.4134,  -0.0715, 0.5517,  -0.3632, -0.1922, -0.9497, 0.2503, -0.2921};
const std::vector<double> kDefaultStd = {2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                                         3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160};

std::vector<double> number_list(const JsonReader& r, const std::string& key) {
  const nlohmann::json& v = r.get(key);
  if (!v.is_array()) r.expected(key, "a list of numbers");
  std::vector<double> out;
  for (const auto& e : v) {
    if (!e.is_number()) r.expected(key, "a list of numbers");
    out.push_back(e.get<double>());
  }
  return out;
}

torch::nn::Conv2d conv2d(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t padding) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(padding));
}

WanCausalConv3d causal_conv(int64_t in, int64_t out, std::vector<int64_t> kernel,
                            std::vector<int64_t> stride = {1, 1, 1}, std::vector<int64_t> padding = {0, 0, 0}) {
  return WanCausalConv3d(in, out, kernel, stride, padding);
}

// A causal conv with a 3x3x3 kernel, "same" padding.
WanCausalConv3d conv333(int64_t in, int64_t out) { return causal_conv(in, out, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}); }

// [B, C, T, H, W] <-> [B * T, C, H, W] for the per-frame 2D layers.
at::Tensor frames_to_batch(const at::Tensor& x) {
  return x.permute({0, 2, 1, 3, 4}).reshape({x.size(0) * x.size(2), x.size(1), x.size(3), x.size(4)});
}
at::Tensor batch_to_frames(const at::Tensor& y, int64_t b, int64_t t) {
  return y.view({b, t, y.size(1), y.size(2), y.size(3)}).permute({0, 2, 1, 3, 4});
}

std::string shape_str(const at::Tensor& x) {
  std::string s;
  for (int64_t d : x.sizes()) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return "[" + s + "]";
}

// Per-channel statistics as Wan's pipelines build them: torch.tensor(list) (float32), then z's dtype.
at::Tensor channel_stat(const std::vector<double>& v, const at::Tensor& z) {
  std::vector<int64_t> shape(z.dim(), 1);
  shape[1] = static_cast<int64_t>(v.size());
  return at::tensor(v, z.options().dtype(at::kDouble)).to(at::kFloat).view(shape);
}

}  // namespace

// ---- config ----

int64_t WanVaeConfig::temporal_factor() const {
  int64_t f = 1;
  for (bool t : temperal_downsample) f *= t ? 2 : 1;
  return f;
}

WanVaeConfig WanVaeConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  WanVaeConfig c;
  c.raw = j;
  auto positive = [&](const char* key, int64_t dflt) {
    const int64_t v = r.integer(key, dflt);
    if (v <= 0) r.fail(key, std::to_string(v) + " is not positive");
    return v;
  };
  if (r.boolean("is_residual", false)) r.fail("is_residual", "Wan 2.2's residual blocks are not built (Wan 2.1 only)");
  if (r.has("patch_size") && r.integer("patch_size") != 1)
    r.fail("patch_size", "Wan 2.2's patchified VAE is not built (Wan 2.1 only: null)");
  c.base_dim = positive("base_dim", 96);
  c.decoder_base_dim = positive("decoder_base_dim", c.base_dim);
  c.z_dim = positive("z_dim", 16);
  c.num_res_blocks = positive("num_res_blocks", 2);
  c.in_channels = positive("in_channels", 3);
  c.out_channels = positive("out_channels", 3);
  if (r.has("dim_mult")) c.dim_mult = r.int_list("dim_mult");
  if (c.dim_mult.empty()) r.fail("dim_mult", "no levels given");
  for (int64_t m : c.dim_mult)
    if (m <= 0) r.fail("dim_mult", std::to_string(m) + " is not positive");
  if (r.has("attn_scales") && !number_list(r, "attn_scales").empty())
    r.fail("attn_scales",
           "attention in the encoder's levels is not built (diffusers' encoder cannot run it; Wan 2.1: [])");
  if (r.has("temperal_downsample")) {
    const nlohmann::json& v = r.get("temperal_downsample");
    if (!v.is_array()) r.expected("temperal_downsample", "a list of booleans");
    c.temperal_downsample.clear();
    for (const auto& e : v) {
      if (!e.is_boolean()) r.expected("temperal_downsample", "a list of booleans");
      c.temperal_downsample.push_back(e.get<bool>());
    }
  }
  const size_t levels = c.dim_mult.size() - 1;
  if (c.temperal_downsample.size() != levels)
    r.fail("temperal_downsample", std::to_string(c.temperal_downsample.size()) + " values for " +
                                      std::to_string(levels) + " downsampling levels (len(dim_mult) - 1)");
  if (c.temporal_factor() > 4)
    r.fail("temperal_downsample", "more than two temporal downsamplings (diffusers encodes 4 frames at a time)");
  for (int64_t m : c.dim_mult)
    if ((c.decoder_base_dim * m) % 2 != 0)
      r.fail("decoder_base_dim", "decoder widths must be even (the upsamplers halve them)");
  c.dropout = r.number("dropout", 0.0);
  if (c.dropout < 0 || c.dropout >= 1) r.fail("dropout", std::to_string(c.dropout) + " is not in [0, 1)");
  for (const auto& [key, out, dflt] : {std::tuple{"latents_mean", &c.latents_mean, &kDefaultMean},
                                       std::tuple{"latents_std", &c.latents_std, &kDefaultStd}}) {
    if (r.has(key)) {
      *out = number_list(r, key);
      if (static_cast<int64_t>(out->size()) != c.z_dim)
        r.fail(key, std::to_string(out->size()) + " values for z_dim " + std::to_string(c.z_dim));
    } else if (c.z_dim == static_cast<int64_t>(dflt->size())) {
      *out = *dflt;
    }
  }
  for (double s : c.latents_std)
    if (s == 0) r.fail("latents_std", "a zero standard deviation");
  return c;
}

WanVaeCosts wan_vae_costs(const WanVaeConfig& c, int64_t frames, int64_t height, int64_t width) {
  WanVaeCost* cur = nullptr;
  double t = static_cast<double>(frames), hw = static_cast<double>(height * width);  // at the current level
  auto conv = [&](int64_t in, int64_t out, int64_t kvol, double positions) {
    cur->params += in * out * kvol + out;
    cur->macs += static_cast<double>(in * out * kvol) * positions;
  };
  auto norm = [&](int64_t ch) { cur->params += ch; };
  auto resnet = [&](int64_t in, int64_t out) {
    norm(in);
    conv(in, out, 27, t * hw);
    norm(out);
    conv(out, out, 27, t * hw);
    if (in != out) conv(in, out, 1, t * hw);
  };
  auto attention = [&](int64_t ch) {
    norm(ch);
    conv(ch, 3 * ch, 1, t * hw);
    conv(ch, ch, 1, t * hw);
    cur->macs += 2.0 * t * hw * hw * static_cast<double>(ch);  // q k^T and attn v, per frame
  };
  auto mid = [&](int64_t ch) {
    resnet(ch, ch);
    attention(ch);
    resnet(ch, ch);
  };
  const auto& m = c.dim_mult;
  const size_t n = m.size();
  WanVaeCosts out;
  cur = &out.encoder;
  int64_t dim = c.base_dim;
  conv(c.in_channels, dim, 27, t * hw);
  for (size_t i = 0; i < n; ++i) {
    int64_t in = dim * (i == 0 ? 1 : m[i - 1]);
    const int64_t o = dim * m[i];
    for (int64_t r = 0; r < c.num_res_blocks; ++r) {
      resnet(in, o);
      in = o;
    }
    if (i + 1 < n) {
      hw /= 4;
      conv(o, o, 9, t * hw);  // the stride-2 conv at the output resolution
      if (c.temperal_downsample[i]) {
        t = 1 + (t - 1) / 2;
        conv(o, o, 3, (t - 1) * hw);  // frame 0 passes through
      }
    }
  }
  const int64_t top = dim * m[n - 1];
  mid(top);
  norm(top);
  conv(top, 2 * c.z_dim, 27, t * hw);
  cur = &out.quant_conv;
  conv(2 * c.z_dim, 2 * c.z_dim, 1, t * hw);
  cur = &out.post_quant_conv;
  conv(c.z_dim, c.z_dim, 1, t * hw);
  cur = &out.decoder;
  dim = c.decoder_base_dim;
  std::vector<int64_t> dims = {dim * m[n - 1]};
  for (size_t i = 0; i < n; ++i) dims.push_back(dim * m[n - 1 - i]);
  conv(c.z_dim, dims[0], 27, t * hw);
  mid(dims[0]);
  for (size_t i = 0; i < n; ++i) {
    const int64_t in = i == 0 ? dims[0] : dims[i] / 2, o = dims[i + 1];
    for (int64_t r = 0; r <= c.num_res_blocks; ++r) resnet(r == 0 ? in : o, o);
    if (i + 1 < n) {
      if (c.temperal_downsample[n - 2 - i]) {
        conv(o, 2 * o, 3, (t - 1) * hw);  // frames after 0 double
        t = 1 + 2 * (t - 1);
      }
      hw *= 4;
      conv(o, o / 2, 9, t * hw);
    }
  }
  norm(dims[n]);
  conv(dims[n], c.out_channels, 27, t * hw);
  return out;
}

std::vector<int64_t> wan_vae_flops_clip(const WanVaeConfig&) { return {5, 256, 256}; }

// ---- layers ----

WanCausalConv3dImpl::WanCausalConv3dImpl(int64_t in, int64_t out, std::vector<int64_t> kernel,
                                         std::vector<int64_t> stride, std::vector<int64_t> padding)
    : torch::nn::Conv3dImpl(torch::nn::Conv3dOptions(in, out, torch::ExpandingArray<3>(kernel))
                                .stride(torch::ExpandingArray<3>(stride))
                                .padding(0)),
      pad_{padding[2], padding[2], padding[1], padding[1], 2 * padding[0], 0} {}

at::Tensor WanCausalConv3dImpl::forward(const at::Tensor& x, WanCache::Slot* slot) {
  at::Tensor in = x;
  std::vector<int64_t> pad = pad_;
  if (slot && pad_[4] > 0) {
    if (slot->kept.defined()) {
      in = at::cat({slot->kept, x}, 2);
      pad[4] = std::max<int64_t>(0, pad[4] - slot->kept.size(2));
    }
    const int64_t keep = std::min(pad_[4], in.size(2));
    slot->kept = in.narrow(2, in.size(2) - keep, keep).clone();
  }
  if (std::any_of(pad.begin(), pad.end(), [](int64_t p) { return p != 0; })) in = at::constant_pad_nd(in, pad, 0);
  return at::conv3d(in, weight, bias, options.stride());
}

WanVaeRMSNormImpl::WanVaeRMSNormImpl(int64_t dim, bool images) : scale_(std::sqrt(static_cast<double>(dim))) {
  gamma = register_parameter("gamma", images ? at::ones({dim, 1, 1}) : at::ones({dim, 1, 1, 1}));
}

at::Tensor WanVaeRMSNormImpl::forward(const at::Tensor& x) {
  const bool upcast = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  const at::Tensor xf = upcast ? x.to(at::kFloat) : x;
  // F.normalize: x / max(||x||, 1e-12)
  const at::Tensor norm = at::linalg_vector_norm(xf, 2, at::IntArrayRef{1}, true).clamp_min(1e-12);
  const at::Tensor n = (xf / norm).to(x.scalar_type());
  return n * scale_ * gamma;
}

WanResidualBlockImpl::WanResidualBlockImpl(int64_t in, int64_t out, double dropout) : dropout_(dropout) {
  norm1 = register_module("norm1", WanVaeRMSNorm(in, false));
  conv1 = register_module("conv1", conv333(in, out));
  norm2 = register_module("norm2", WanVaeRMSNorm(out, false));
  conv2 = register_module("conv2", conv333(out, out));
  if (in != out) conv_shortcut = register_module("conv_shortcut", causal_conv(in, out, {1, 1, 1}));
}

at::Tensor WanResidualBlockImpl::forward(const at::Tensor& x, WanCache& cache) {
  const at::Tensor h = conv_shortcut ? conv_shortcut->forward(x) : x;
  at::Tensor y = at::silu(norm1(x));
  y = conv1->forward(y, &cache.next());
  y = at::silu(norm2(y));
  if (dropout_ > 0) y = at::dropout(y, dropout_, is_training());
  y = conv2->forward(y, &cache.next());
  return y + h;
}

WanAttentionBlockImpl::WanAttentionBlockImpl(int64_t dim) {
  norm = register_module("norm", WanVaeRMSNorm(dim, true));
  to_qkv = register_module("to_qkv", conv2d(dim, 3 * dim, 1, 1, 0));
  proj = register_module("proj", conv2d(dim, dim, 1, 1, 0));
}

at::Tensor WanAttentionBlockImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), c = x.size(1), t = x.size(2), h = x.size(3), w = x.size(4);
  at::Tensor qkv = to_qkv(norm(frames_to_batch(x)));  // [B * T, 3C, H, W]
  qkv = qkv.reshape({b * t, 1, 3 * c, h * w}).permute({0, 1, 3, 2}).contiguous();
  auto p = qkv.chunk(3, -1);  // q, k, v [B * T, 1, HW, C]: one head
  at::Tensor o = at::scaled_dot_product_attention(p[0], p[1], p[2]);
  o = proj(o.squeeze(1).permute({0, 2, 1}).reshape({b * t, c, h, w}));
  return batch_to_frames(o, b, t) + x;
}

WanResampleImpl::WanResampleImpl(int64_t dim, Mode mode) : mode_(mode) {
  const bool up = mode == Mode::Upsample2d || mode == Mode::Upsample3d;
  resample = register_module("resample", torch::nn::ModuleList());
  resample->push_back(torch::nn::Identity());  // diffusers' WanUpsample / ZeroPad2d
  resample->push_back(up ? conv2d(dim, dim / 2, 3, 1, 1) : conv2d(dim, dim, 3, 2, 0));
  if (mode == Mode::Upsample3d)
    time_conv = register_module("time_conv", causal_conv(dim, 2 * dim, {3, 1, 1}, {1, 1, 1}, {1, 0, 0}));
  if (mode == Mode::Downsample3d)
    time_conv = register_module("time_conv", causal_conv(dim, dim, {3, 1, 1}, {2, 1, 1}, {0, 0, 0}));
}

at::Tensor WanResampleImpl::forward(const at::Tensor& input, WanCache& cache) {
  at::Tensor x = input;
  const int64_t b = x.size(0), c = x.size(1), h = x.size(3), w = x.size(4);
  if (mode_ == Mode::Upsample3d) {
    WanCache::Slot& s = cache.next();
    if (!s.started) {
      s.started = true;  // frame 0 stays one frame (diffusers' "Rep")
    } else {
      const int64_t t = x.size(2);
      at::Tensor y = time_conv->forward(x, &s).reshape({b, 2, c, t, h, w});
      x = at::stack({y.select(1, 0), y.select(1, 1)}, 3).reshape({b, c, 2 * t, h, w});
    }
  }
  const int64_t t = x.size(2);
  at::Tensor f = frames_to_batch(x);
  auto conv = resample->ptr<torch::nn::Conv2dImpl>(1);
  if (mode_ == Mode::Upsample2d || mode_ == Mode::Upsample3d)
    f = conv->forward(at::_upsample_nearest_exact2d(f.to(at::kFloat), std::nullopt, std::vector<double>{2.0, 2.0})
                          .to(x.scalar_type()));
  else
    f = conv->forward(at::constant_pad_nd(f, {0, 1, 0, 1}, 0));
  x = batch_to_frames(f, b, t);
  if (mode_ == Mode::Downsample3d) {
    WanCache::Slot& s = cache.next();
    const at::Tensor last = x.narrow(2, t - 1, 1).clone();
    if (!s.started) {
      s.started = true;  // frame 0 passes through
    } else {
      x = time_conv->forward(at::cat({s.kept, x}, 2));
    }
    s.kept = last;
  }
  return x;
}

WanMidBlockImpl::WanMidBlockImpl(int64_t dim, double dropout) {
  resnets = register_module("resnets", torch::nn::ModuleList());
  attentions = register_module("attentions", torch::nn::ModuleList());
  resnets->push_back(WanResidualBlock(dim, dim, dropout));
  attentions->push_back(WanAttentionBlock(dim));
  resnets->push_back(WanResidualBlock(dim, dim, dropout));
}

at::Tensor WanMidBlockImpl::forward(at::Tensor x, WanCache& cache) {
  x = resnets->ptr<WanResidualBlockImpl>(0)->forward(x, cache);
  x = attentions->ptr<WanAttentionBlockImpl>(0)->forward(x);
  return resnets->ptr<WanResidualBlockImpl>(1)->forward(x, cache);
}

WanEncoder3dImpl::WanEncoder3dImpl(const WanVaeConfig& c) {
  const auto& m = c.dim_mult;
  const int64_t dim = c.base_dim, n = static_cast<int64_t>(m.size());
  conv_in = register_module("conv_in", conv333(c.in_channels, dim));
  down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  int64_t out = dim;
  for (int64_t i = 0; i < n; ++i) {
    int64_t in = dim * (i == 0 ? 1 : m[i - 1]);
    out = dim * m[i];
    for (int64_t r = 0; r < c.num_res_blocks; ++r) {
      down_blocks->push_back(WanResidualBlock(in, out, c.dropout));
      in = out;
    }
    if (i + 1 < n)
      down_blocks->push_back(WanResample(
          out, c.temperal_downsample[i] ? WanResampleImpl::Mode::Downsample3d : WanResampleImpl::Mode::Downsample2d));
  }
  mid_block = register_module("mid_block", WanMidBlock(out, c.dropout));
  norm_out = register_module("norm_out", WanVaeRMSNorm(out, false));
  conv_out = register_module("conv_out", conv333(out, 2 * c.z_dim));
}

at::Tensor WanEncoder3dImpl::forward(const at::Tensor& input, WanCache& cache) {
  at::Tensor x = conv_in->forward(input, &cache.next());
  for (const auto& layer : *down_blocks) {
    if (auto* r = layer->as<WanResidualBlockImpl>()) x = r->forward(x, cache);
    else x = layer->as<WanResampleImpl>()->forward(x, cache);
  }
  x = mid_block->forward(x, cache);
  return conv_out->forward(at::silu(norm_out(x)), &cache.next());
}

WanUpBlockImpl::WanUpBlockImpl(int64_t in, int64_t out, int64_t num_res_blocks, double dropout, int upsample) {
  resnets = register_module("resnets", torch::nn::ModuleList());
  for (int64_t r = 0; r <= num_res_blocks; ++r) resnets->push_back(WanResidualBlock(r == 0 ? in : out, out, dropout));
  if (upsample != 0) {
    upsamplers = register_module("upsamplers", torch::nn::ModuleList());
    upsamplers->push_back(WanResample(
        out, upsample == 3 ? WanResampleImpl::Mode::Upsample3d : WanResampleImpl::Mode::Upsample2d));
  }
}

at::Tensor WanUpBlockImpl::forward(at::Tensor x, WanCache& cache) {
  for (const auto& r : *resnets) x = r->as<WanResidualBlockImpl>()->forward(x, cache);
  if (upsamplers) x = upsamplers->ptr<WanResampleImpl>(0)->forward(x, cache);
  return x;
}

WanDecoder3dImpl::WanDecoder3dImpl(const WanVaeConfig& c) {
  const auto& m = c.dim_mult;
  const int64_t dim = c.decoder_base_dim, n = static_cast<int64_t>(m.size());
  std::vector<int64_t> dims = {dim * m[n - 1]};
  for (int64_t i = 0; i < n; ++i) dims.push_back(dim * m[n - 1 - i]);
  conv_in = register_module("conv_in", conv333(c.z_dim, dims[0]));
  mid_block = register_module("mid_block", WanMidBlock(dims[0], c.dropout));
  up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < n; ++i) {
    // the upsamplers halve the width (Wan 2.1); temperal_upsample is temperal_downsample reversed
    const int64_t in = i == 0 ? dims[0] : dims[i] / 2;
    const int up = i + 1 < n ? (c.temperal_downsample[n - 2 - i] ? 3 : 2) : 0;
    up_blocks->push_back(WanUpBlock(in, dims[i + 1], c.num_res_blocks, c.dropout, up));
  }
  norm_out = register_module("norm_out", WanVaeRMSNorm(dims[n], false));
  conv_out = register_module("conv_out", conv333(dims[n], c.out_channels));
}

at::Tensor WanDecoder3dImpl::forward(const at::Tensor& z, WanCache& cache) {
  at::Tensor x = conv_in->forward(z, &cache.next());
  x = mid_block->forward(x, cache);
  for (const auto& u : *up_blocks) x = u->as<WanUpBlockImpl>()->forward(x, cache);
  return conv_out->forward(at::silu(norm_out(x)), &cache.next());
}

// ---- the model ----

AutoencoderKLWanImpl::AutoencoderKLWanImpl(WanVaeConfig c) : config_(std::move(c)) {
  encoder = register_module("encoder", WanEncoder3d(config_));
  const int64_t z = config_.z_dim;
  quant_conv = register_module("quant_conv", causal_conv(2 * z, 2 * z, {1, 1, 1}));
  post_quant_conv = register_module("post_quant_conv", causal_conv(z, z, {1, 1, 1}));
  decoder = register_module("decoder", WanDecoder3d(config_));
}

namespace {
// Runs `step` over frame 0 alone, then over `chunk` frames at a time (0: the rest at once), one cache throughout.
template <typename Step>
at::Tensor run_chunked(const at::Tensor& x, int64_t chunk, Step step) {
  const int64_t frames = x.size(2);
  WanCache cache;
  std::vector<at::Tensor> outs = {step(x.narrow(2, 0, 1), cache)};
  const int64_t n = chunk > 0 ? chunk : std::max<int64_t>(frames - 1, 1);
  for (int64_t t = 1; t < frames; t += n) {
    cache.rewind();
    outs.push_back(step(x.narrow(2, t, std::min(n, frames - t)), cache));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 2);
}
}  // namespace

std::pair<at::Tensor, at::Tensor> AutoencoderKLWanImpl::encode(const at::Tensor& x, int64_t chunk) {
  check_sample(x, "encode");
  if (chunk < 0 || chunk % 4 != 0)
    throw Error("AutoencoderKLWan.encode: chunk " + std::to_string(chunk) + " is not a multiple of 4 frames");
  at::Tensor h = run_chunked(x, chunk, [&](const at::Tensor& part, WanCache& c) { return encoder->forward(part, c); });
  h = quant_conv->forward(h);
  auto halves = h.chunk(2, 1);  // DiagonalGaussianDistribution
  return {halves[0], at::clamp(halves[1], -30.0, 20.0)};
}

at::Tensor AutoencoderKLWanImpl::decode(const at::Tensor& z, int64_t chunk) {
  if (z.dim() != 5 || z.size(1) != config_.z_dim || z.size(2) == 0)
    throw Error("AutoencoderKLWan.decode: expected latents [batch, " + std::to_string(config_.z_dim) +
                " (z_dim), frames, h, w], got " + shape_str(z));
  const at::Tensor x = post_quant_conv->forward(z);
  const at::Tensor out =
      run_chunked(x, chunk, [&](const at::Tensor& part, WanCache& c) { return decoder->forward(part, c); });
  return at::clamp(out, -1.0, 1.0);
}

at::Tensor AutoencoderKLWanImpl::normalize_latents(const at::Tensor& z) const {
  if (config_.latents_mean.empty() || config_.latents_std.empty())
    throw Error("AutoencoderKLWan: config.json gives no latents_mean / latents_std for z_dim " +
                std::to_string(config_.z_dim));
  const at::Tensor inv_std = at::reciprocal(channel_stat(config_.latents_std, z)).to(z.scalar_type());
  return (z - channel_stat(config_.latents_mean, z).to(z.scalar_type())) * inv_std;
}

at::Tensor AutoencoderKLWanImpl::denormalize_latents(const at::Tensor& z) const {
  if (config_.latents_mean.empty() || config_.latents_std.empty())
    throw Error("AutoencoderKLWan: config.json gives no latents_mean / latents_std for z_dim " +
                std::to_string(config_.z_dim));
  const at::Tensor inv_std = at::reciprocal(channel_stat(config_.latents_std, z)).to(z.scalar_type());
  return z / inv_std + channel_stat(config_.latents_mean, z).to(z.scalar_type());
}

void AutoencoderKLWanImpl::init_weights(double std) {
  at::NoGradGuard no_grad;
  for (const auto& item : named_modules()) {
    torch::nn::Module* mod = item.value().get();
    if (auto* c3 = dynamic_cast<torch::nn::Conv3dImpl*>(mod)) {
      if (std < 0) c3->reset_parameters();
      else {
        c3->weight.normal_(0.0, std);
        c3->bias.zero_();
      }
    } else if (auto* c2 = dynamic_cast<torch::nn::Conv2dImpl*>(mod)) {
      if (std < 0) c2->reset_parameters();
      else {
        c2->weight.normal_(0.0, std);
        c2->bias.zero_();
      }
    } else if (auto* g = dynamic_cast<WanVaeRMSNormImpl*>(mod)) {
      g->gamma.fill_(1.0);
    }
  }
}

BatchSchema AutoencoderKLWanImpl::batch_schema() const {
  return {required_field("sample", at::kFloat, 5,
                         "videos [B, " + std::to_string(config_.in_channels) + ", 1 + 4k, H, W] (H, W multiples of " +
                             std::to_string(config_.spatial_factor()) +
                             "; images as 1 frame), the VAE's input and reconstruction target")};
}

double AutoencoderKLWanImpl::train_flops_per_sample(int64_t) const {
  const std::vector<int64_t> clip = wan_vae_flops_clip(config_);
  // 2 FLOPs per multiply-accumulate, forward + backward = 3 forwards
  return 6.0 * wan_vae_costs(config_, clip[0], clip[1], clip[2]).macs();
}

void AutoencoderKLWanImpl::check_sample(const at::Tensor& x, const std::string& file) const {
  const int64_t f = config_.spatial_factor();
  if (!at::isFloatingType(x.scalar_type()))
    throw file_error(file, "sample",
                     "expected a floating-point tensor, got " + std::string(c10::toString(x.scalar_type())));
  if (x.dim() != 5 || x.size(1) != config_.in_channels || x.size(0) == 0 || x.size(2) == 0 ||
      (x.size(2) - 1) % 4 != 0 || x.size(3) == 0 || x.size(4) == 0 || x.size(3) % f != 0 || x.size(4) % f != 0)
    throw file_error(file, "sample",
                     "expected [batch, " + std::to_string(config_.in_channels) +
                         " (in_channels), 1 + 4k frames, H, W] with H and W multiples of " + std::to_string(f) +
                         ", got " + shape_str(x));
}

at::Tensor AutoencoderKLWanImpl::forward_whole(const Batch& b) {
  const at::Tensor& x = b.at("sample");
  check_sample(x, "batch");
  const at::Tensor xs = x.to(encoder->conv_in->weight.scalar_type());
  return decode(encode(xs, 0).first, 0);
}

at::Tensor AutoencoderKLWanImpl::head_loss_sum(const at::Tensor& decoded, const Batch& b) {
  return (decoded.to(at::kFloat) - b.at("sample").to(at::kFloat)).square().sum();
}

Model::ReferenceOutput AutoencoderKLWanImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                               const std::string& file) {
  auto it = batch.find("sample");
  if (it == batch.end()) throw file_error(file, "sample", "missing (videos [B, C, F, H, W])");
  check_sample(it->second, file);
  return autoencoder_reference(*this, it->second.to(encoder->conv_in->weight.scalar_type()));
}

std::shared_ptr<Model> build_autoencoder_kl_wan(const nlohmann::json& j, const std::string& file) {
  return AutoencoderKLWan(WanVaeConfig::from_json(j, file)).ptr();
}

nlohmann::json describe_autoencoder_kl_wan(const nlohmann::json& j, const std::string& file) {
  const WanVaeConfig c = WanVaeConfig::from_json(j, file);
  const std::vector<int64_t> clip = wan_vae_flops_clip(c);
  const WanVaeCosts costs = wan_vae_costs(c, clip[0], clip[1], clip[2]);
  nlohmann::json comps = {{"encoder", {{"parameters", costs.encoder.params}, {"in_channels", c.in_channels}}},
                          {"quant_conv", {{"parameters", costs.quant_conv.params}}},
                          {"post_quant_conv", {{"parameters", costs.post_quant_conv.params}}},
                          {"decoder", {{"parameters", costs.decoder.params}, {"out_channels", c.out_channels}}}};
  return {{"family", "diffusion"},
          {"model_type", "AutoencoderKLWan"},
          {"parameters", costs.params()},
          {"base_dim", c.base_dim},
          {"dim_mult", c.dim_mult},
          {"num_res_blocks", c.num_res_blocks},
          {"temperal_downsample", c.temperal_downsample},
          {"latent_channels", c.z_dim},
          {"spatial_factor", c.spatial_factor()},
          {"temporal_factor", c.temporal_factor()},
          {"flops_clip", clip},
          {"train_flops_per_sample", 6.0 * costs.macs()},
          {"components", comps}};
}

}  // namespace lf::models::diffusion

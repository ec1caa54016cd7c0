#include "loongforge/nn/rotary.h"

#include <ATen/ATen.h>

#include "loongforge/kernels/rope.h"

#include <cmath>
#include <numbers>

namespace lf::nn {

Rotary::Rotary(RopeSpec spec) : spec_(std::move(spec)) {
  inv_freq_ = compute_inv_freq(spec_.max_position_embeddings, &scaling_);
}

void Rotary::to(const at::Device& device) { inv_freq_ = inv_freq_.to(device); }

at::Tensor Rotary::compute_inv_freq(int64_t seq_len, double* scaling) const {
  const int64_t dim = spec_.head_dim;
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor exponents = at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / static_cast<double>(dim);
  double base = spec_.theta;
  *scaling = 1.0;
  const std::string& t = spec_.type;
  if (t == "default" || t == "linear") {
    at::Tensor inv = at::reciprocal(at::pow(base, exponents));
    return t == "linear" ? inv / spec_.factor : inv;
  }
  if (t == "dynamic") {
    // Below the trained context the frequencies are the default ones; above it the base grows with the length
    // (NTK). transformers evaluates the growth in float32 tensors, so do we.
    double max_pos = static_cast<double>(spec_.max_position_embeddings);
    if (seq_len <= spec_.max_position_embeddings) return at::reciprocal(at::pow(base, exponents));
    at::Tensor grown = at::scalar_tensor(spec_.factor, f32) * at::scalar_tensor(static_cast<double>(seq_len), f32) /
                           max_pos - (spec_.factor - 1);
    at::Tensor b = at::scalar_tensor(base, f32) * at::pow(grown, static_cast<double>(dim) / static_cast<double>(dim - 2));
    return at::reciprocal(at::pow(b, exponents));
  }
  if (t == "llama3") {
    at::Tensor inv = at::reciprocal(at::pow(base, exponents));
    double old_ctx = static_cast<double>(spec_.original_max_position_embeddings);
    double low_wl = old_ctx / spec_.low_freq_factor, high_wl = old_ctx / spec_.high_freq_factor;
    at::Tensor wavelen = at::reciprocal(inv) * (2 * std::numbers::pi);
    at::Tensor scaled = at::where(wavelen > low_wl, inv / spec_.factor, inv);
    at::Tensor smooth = (at::reciprocal(wavelen) * old_ctx - spec_.low_freq_factor) / (spec_.high_freq_factor - spec_.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / spec_.factor + smooth * scaled;
    at::Tensor medium = at::logical_not(wavelen < high_wl).logical_and(at::logical_not(wavelen > low_wl));
    return at::where(medium, smoothed, scaled);
  }
  // yarn
  double factor = spec_.factor;
  auto get_mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  if (spec_.attention_factor > 0) *scaling = spec_.attention_factor;
  else if (spec_.mscale != 0 && spec_.mscale_all_dim != 0)
    *scaling = get_mscale(factor, spec_.mscale) / get_mscale(factor, spec_.mscale_all_dim);
  else *scaling = get_mscale(factor, 1.0);
  double orig = static_cast<double>(spec_.original_max_position_embeddings);
  auto correction_dim = [&](double rot) {
    return (dim * std::log(orig / (rot * 2 * std::numbers::pi))) / (2 * std::log(base));
  };
  double low = correction_dim(spec_.beta_fast), high = correction_dim(spec_.beta_slow);
  if (spec_.truncate) { low = std::floor(low); high = std::ceil(high); }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  at::Tensor pos_freqs = at::pow(base, at::arange(0, dim, 2).to(at::kFloat) / static_cast<double>(dim));
  at::Tensor extrapolation = at::reciprocal(pos_freqs);
  at::Tensor interpolation = at::reciprocal(pos_freqs * factor);
  at::Tensor ramp = at::clamp((at::arange(dim / 2, f32) - low) / (high - low), 0, 1);
  at::Tensor extra_factor = 1 - ramp;
  return interpolation * (1 - extra_factor) + extrapolation * extra_factor;
}

std::pair<at::Tensor, at::Tensor> Rotary::cos_sin(const at::Tensor& position_ids) const {
  at::Tensor inv = inv_freq_;
  double scaling = scaling_;
  if (spec_.type == "dynamic") {
    int64_t seq_len = position_ids.numel() ? position_ids.max().item<int64_t>() + 1 : 0;
    if (seq_len > spec_.max_position_embeddings) inv = compute_inv_freq(seq_len, &scaling);
  }
  at::Tensor freqs = position_ids.to(at::kFloat).unsqueeze(-1) * inv.to(position_ids.device());
  if (position_ids.dim() == 3) {  // [3, B, T] multimodal positions: section i from row i % 3
    TORCH_CHECK(!spec_.mrope_section.empty() && position_ids.size(0) == 3,
                "Rotary: [3, B, T] positions need mrope_section");
    if (spec_.mrope_interleaved) {  // transformers' Qwen3-VL recomposition
      const int64_t n = freqs.size(-1);
      at::Tensor hm = at::zeros({n}, at::kBool), wm = at::zeros({n}, at::kBool);
      for (int64_t j = 0; j < n; ++j) {
        if (j % 3 == 1 && j < 3 * spec_.mrope_section.at(1)) hm[j] = true;
        if (j % 3 == 2 && j < 3 * spec_.mrope_section.at(2)) wm[j] = true;
      }
      hm = hm.to(freqs.device());
      wm = wm.to(freqs.device());
      freqs = at::where(hm, freqs.select(0, 1), at::where(wm, freqs.select(0, 2), freqs.select(0, 0)));
      at::Tensor emb = at::cat({freqs, freqs}, -1);
      return {emb.cos() * scaling, emb.sin() * scaling};
    }
    std::vector<at::Tensor> parts;
    int64_t begin = 0;
    for (size_t i = 0; i < spec_.mrope_section.size(); ++i) {
      const int64_t n = spec_.mrope_section[i];
      parts.push_back(freqs.select(0, static_cast<int64_t>(i % 3)).narrow(-1, begin, n));
      begin += n;
    }
    freqs = at::cat(parts, -1);
  }
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos() * scaling, emb.sin() * scaling};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // The fused kernels (CUDA: kernels/cuda/rope.cu; CPU f32/f64: kernels/cpu/rope.cpp, equal to the composite bit
  // for bit) when the shapes are their [B,H,T,D] / [B or 1,T,D].
  if (cos.size(-1) < x.size(-1)) {  // partial rotary: the first cos.size(-1) features rotate, the rest pass through
    const int64_t d = cos.size(-1);
    return at::cat({apply_rotary(x.narrow(-1, 0, d), cos, sin), x.narrow(-1, d, x.size(-1) - d)}, -1);
  }
  if (x.dim() == 4 && cos.dim() == 3 && cos.size(-1) == x.size(-1)) return kernels::apply_rope(x, cos, sin);
  int64_t half = x.size(-1) / 2;
  at::Tensor c = cos.unsqueeze(1).to(x.scalar_type()), s = sin.unsqueeze(1).to(x.scalar_type());
  at::Tensor rot = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rot * s;
}

}  // namespace lf::nn

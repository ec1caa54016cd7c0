#include "loongforge/models/diffusion/embeddings.h"

#include <ATen/ATen.h>

#include <cmath>

namespace lf::models::diffusion {

at::Tensor timestep_embedding(const at::Tensor& timesteps, int64_t dim, bool flip_sin_to_cos,
                              double downscale_freq_shift, double scale, double max_period, at::ScalarType dtype) {
  const int64_t half = dim / 2;
  at::Tensor exponent = at::arange(half, timesteps.options().dtype(dtype)) * (-std::log(max_period)) /
                        (static_cast<double>(half) - downscale_freq_shift);
  at::Tensor arg = timesteps.reshape({-1, 1}).to(dtype) * at::exp(exponent).unsqueeze(0);
  if (scale != 1.0) arg = arg * scale;
  at::Tensor emb = flip_sin_to_cos ? at::cat({at::cos(arg), at::sin(arg)}, -1) : at::cat({at::sin(arg), at::cos(arg)}, -1);
  if (dim % 2 == 1) emb = at::constant_pad_nd(emb, {0, 1});
  return emb;
}

namespace {
// [M] float32 positions -> [M, dim] float32: sin(p * w_k), cos(p * w_k), w_k = 10000^(-k / (dim / 2)) in float64.
at::Tensor sincos_1d(int64_t dim, const at::Tensor& pos) {
  at::Tensor omega = at::arange(dim / 2, pos.options().dtype(at::kDouble)) / (static_cast<double>(dim) / 2.0);
  omega = 1.0 / at::pow(10000.0, omega);
  at::Tensor out = at::outer(pos.reshape(-1).to(at::kDouble), omega);
  return at::cat({at::sin(out), at::cos(out)}, 1);
}
}  // namespace

at::Tensor sincos_2d_pos_embed(int64_t dim, int64_t grid_h, int64_t grid_w, double base_size,
                               double interpolation_scale) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // float32 positions as diffusers makes them (arange / (grid / base) / scale)
  at::Tensor ph = at::arange(grid_h, f32) / (static_cast<double>(grid_h) / base_size) / interpolation_scale;
  at::Tensor pw = at::arange(grid_w, f32) / (static_cast<double>(grid_w) / base_size) / interpolation_scale;
  at::Tensor col = pw.unsqueeze(0).expand({grid_h, grid_w});  // the column's position at (h, w)
  at::Tensor row = ph.unsqueeze(1).expand({grid_h, grid_w});
  return at::cat({sincos_1d(dim / 2, col), sincos_1d(dim / 2, row)}, 1).to(at::kFloat);
}

}  // namespace lf::models::diffusion

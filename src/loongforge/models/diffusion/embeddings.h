// Position and timestep encodings the diffusion transformers share, computed as diffusers computes them.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace lf::models::diffusion {

// diffusers' get_timestep_embedding: timesteps [N] (any real or integer dtype) -> [N, dim] of sin(t * f_k) and
// cos(t * f_k), f_k = exp(-ln(max_period) * k / (dim / 2 - downscale_freq_shift)), times `scale`; cos first when
// flip_sin_to_cos; a zero column appended for odd dim. Computed in `dtype` (diffusers: float32; float64 runs of
// `dump --dtype fp64`: float64).
at::Tensor timestep_embedding(const at::Tensor& timesteps, int64_t dim, bool flip_sin_to_cos,
                              double downscale_freq_shift, double scale = 1.0, double max_period = 10000.0,
                              at::ScalarType dtype = at::kFloat);

// diffusers' get_2d_sincos_pos_embed for a grid of grid_h x grid_w patches: float32 [grid_h * grid_w, dim], row-major
// over (h, w); the first dim / 2 channels encode the column, the rest the row, each position p scaled as
// p / (grid / base_size) / interpolation_scale (frequencies in float64, as diffusers on the CPU).
at::Tensor sincos_2d_pos_embed(int64_t dim, int64_t grid_h, int64_t grid_w, double base_size,
                               double interpolation_scale);

}  // namespace lf::models::diffusion

// Fused adaptive LayerNorm (DiT's adaLN-Zero modulation): y = LayerNorm(x) * (1 + scale) + shift, the LayerNorm
// without affine parameters, shift / scale one vector per sample.
//
// The composite version runs layer_norm, then (1 + scale), a broadcast multiply and a broadcast add (four passes
// over the activations forward, more backward, with the sums of the broadcast gradients as separate reductions);
// the CPU kernel does one pass forward (statistics + output of each row) and one backward (dx of each row together
// with the per-sample sums for dshift and dscale).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lf::kernels {

// x [B, ..., N], shift / scale [B, N]. Autograd-aware (first order). CPU float32/float64 (one dtype) run the kernel
// below; anything else (CUDA, bf16, ...) goes to layer_norm_modulate_reference.
at::Tensor layer_norm_modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale, double eps);

// The composite ATen version, op for op as diffusers' AdaLayerNormZero / DiT's norm3 modulation:
// layer_norm(x, no affine) * (1 + scale[:, None]) + shift[:, None].
at::Tensor layer_norm_modulate_reference(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                                         double eps);

// Raw CPU kernels (no autograd), for tests and benchmarks. Forward returns {y (x's shape, contiguous), mean, rstd}
// (mean / rstd: one per row of N, float64 for float64 inputs, else float32); backward returns {dx, dshift, dscale}.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_modulate_forward_cpu(const at::Tensor& x,
                                                                               const at::Tensor& shift,
                                                                               const at::Tensor& scale, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_modulate_backward_cpu(const at::Tensor& dy,
                                                                                const at::Tensor& x,
                                                                                const at::Tensor& scale,
                                                                                const at::Tensor& mean,
                                                                                const at::Tensor& rstd);

}  // namespace lf::kernels

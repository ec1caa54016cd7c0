// Fused RMSNorm: y = weight * (x * rsqrt(mean(x^2, -1) + eps)), statistics in float32 (as transformers' RMSNorm).
//
// The pattern every fused op of ours follows: a torch::autograd::Function whose forward/backward dispatch to a
// device kernel (kernels/cpu/*.cpp, kernels/cuda/*.cu), plus a composite ATen version of the same math that the
// tests compare against (values and float64 gradients).
#pragma once
#include <ATen/core/Tensor.h>

namespace lf::kernels {

// Fused op (autograd-aware). x: [..., N], weight: [N]. CPU f32/f64 tensors go to the CPU kernels, CUDA
// f32/bf16/f16 tensors (weight of x's dtype) to kernels/cuda/rms_norm.cu (cuda_ops.h), anything else to the
// composite version.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The composite ATen version, op for op as transformers' LlamaRMSNorm.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

// Raw kernels (no autograd), exposed for tests and benchmarks.
// Forward returns {y, rstd}; rstd has x's leading shape and float32 (float64 for f64 inputs).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
// Residual add first: s = x + residual, y = rms_norm(s); returns {s, y, rstd} (one pass over the rows).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                                        const at::Tensor& weight, double eps);
// Backward returns {dx, dweight}; x is the normalised input (s for the residual form). A defined ds (shaped as x) is
// added to dx: the gradient that reaches s directly, as the residual stream.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& dy, const at::Tensor& x,
                                                         const at::Tensor& weight, const at::Tensor& rstd,
                                                         const at::Tensor& ds = at::Tensor());

}  // namespace lf::kernels

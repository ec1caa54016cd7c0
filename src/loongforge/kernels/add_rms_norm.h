// Fused residual add + RMSNorm: s = x + residual; y = rms_norm(s, weight, eps). The pre-norm decoder does this twice
// per layer (the sum is the new residual stream, y feeds attention/MLP).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lf::kernels {

// Returns {s, y}. Autograd-aware; CUDA tensors go to the fused kernel (kernels/cuda/rms_norm.cu), CPU f32/f64 ones
// (x, residual and weight of one dtype) to the fused CPU kernel (kernels/cpu/add_rms_norm.cpp), others to
// x + residual followed by kernels::rms_norm.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);

// The composite ATen version: s = x + residual, y = rms_norm_reference(s).
std::tuple<at::Tensor, at::Tensor> add_rms_norm_reference(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps);

}  // namespace lf::kernels

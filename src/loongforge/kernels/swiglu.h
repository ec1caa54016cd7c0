// Fused SwiGLU: y = silu(g) * u = g * sigmoid(g) * u, computed in float32 (float64 for f64 inputs).
//
// Forward is one pass over g and u; backward computes dg and du in one pass from dy, g and u (sigmoid recomputed from
// g, so nothing beyond the inputs is saved). Follows the pattern of rms_norm.h: an autograd Function over device
// kernels plus a composite ATen version of the same math for tests.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lf::kernels {

// Fused op (autograd-aware). g, u: same shape and dtype (f32, bf16 or f64; bf16 computes in f32). Other inputs
// (other devices until the CUDA kernels land, other dtypes, mismatched shapes) use the composite version.
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u);

// The composite ATen version: at::silu(g) * u (as transformers' LlamaMLP).
at::Tensor swiglu_reference(const at::Tensor& g, const at::Tensor& u);

// Raw kernels (no autograd), exposed for tests and benchmarks. Results are contiguous, in the inputs' dtype.
at::Tensor swiglu_forward_cpu(const at::Tensor& g, const at::Tensor& u);
// Returns {dg, du}.
std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u);

}  // namespace lf::kernels

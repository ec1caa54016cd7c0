// Fused SwiGLU: y = silu(g) * u (and GeGLU below) = g * sigmoid(g) * u, computed in float32 (float64 for f64 inputs).
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

// Fused GeGLU with GELU's tanh form (Gemma's MLP, gelu_pytorch_tanh): y = gelu_tanh(g) * u, same contract as swiglu
// (gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), the same function as 0.5 g (1 + tanh(...))). The
// CPU computes it fused; other devices use the composite.
at::Tensor geglu_tanh(const at::Tensor& g, const at::Tensor& u);
// The same GELU without a gate (ViT / SigLIP MLPs, DiT's feed-forward): at::gelu(x, "tanh") fused on the CPU (one
// pass each way, the derivative from x alone), ATen's elsewhere.
at::Tensor gelu_tanh(const at::Tensor& x);
// The composite ATen version: at::gelu(g, "tanh") * u (transformers' GemmaMLP).
at::Tensor geglu_tanh_reference(const at::Tensor& g, const at::Tensor& u);
at::Tensor geglu_tanh_forward_cpu(const at::Tensor& g, const at::Tensor& u);
std::tuple<at::Tensor, at::Tensor> geglu_tanh_backward_cpu(const at::Tensor& dy, const at::Tensor& g,
                                                           const at::Tensor& u);

}  // namespace lf::kernels

// Fused causal depthwise convolution + SiLU over time (the short convolution of Gated DeltaNet / KDA layers):
//   y[b, t, c] = silu(sum_j w[c, j] * x[b, t + j - o, c]),  j < K,  o = K - 1 when `pad` (x before the start is 0;
//   T outputs) else 0 (the first K - 1 rows are the past; T - K + 1 outputs).
//
// Forward is one pass over x; backward recomputes the pre-activation from x and gives dx and dw in two passes (dw
// summed per fixed block of rows, then over the blocks in order: the result does not depend on the thread count).
// Follows the pattern of swiglu.h: an autograd Function over the CPU kernels, and the composite ATen version (K
// shifted multiply-adds, then at::silu) for tests and for what the kernel does not take.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lf::kernels {

// Fused op (autograd-aware). x [B, T, C], weight [C, 1, K] (torch.nn.Conv1d's depthwise layout) of x's dtype. CPU
// float32 / float64 run the kernel; anything else (bf16, CUDA) runs the composite version.
at::Tensor causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight, bool pad);

// The composite ATen version of the same math.
at::Tensor causal_conv1d_silu_reference(const at::Tensor& x, const at::Tensor& weight, bool pad);

// Raw kernels (no autograd), exposed for tests and benchmarks; contiguous results in x's dtype. Backward returns
// {dx, dweight}.
at::Tensor causal_conv1d_silu_forward_cpu(const at::Tensor& x, const at::Tensor& weight, bool pad);
std::tuple<at::Tensor, at::Tensor> causal_conv1d_silu_backward_cpu(const at::Tensor& dy, const at::Tensor& x,
                                                                   const at::Tensor& weight, bool pad);

}  // namespace lf::kernels

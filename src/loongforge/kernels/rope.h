// Rotary position embedding applied to queries/keys, rotate-half layout (as nn::apply_rotary, transformers'
// apply_rotary_pos_emb): y = x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1).
#pragma once
#include <ATen/core/Tensor.h>

namespace lf::kernels {

// x [B, H, T, D], cos/sin [B (or 1), T, D] (float32 as nn::Rotary gives them). Autograd-aware; CUDA tensors of
// float32/bfloat16/float16 go to the fused kernel (kernels/cuda/rope.cu: no gradient for cos/sin), CPU f32/f64 x
// (last dim contiguous, any other strides; cos/sin not requiring grad) to the CPU kernels (kernels/cpu/rope.cpp:
// one pass forward, one backward, results equal to the composite's bit for bit), anything else to the composite.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The composite ATen version, op for op as nn::apply_rotary (cos/sin cast to x's dtype, broadcast over heads).
at::Tensor apply_rope_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Raw CPU kernels (no autograd), for tests and benchmarks: forward y = x*c + rotate_half(x)*s, backward
// dx = dy*c + rotate_half^T(dy*s). Output in x's (dy's) layout when dense.
at::Tensor rope_forward_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rope_backward_cpu(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace lf::kernels

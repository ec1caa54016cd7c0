// Rotary position embedding applied to queries/keys, rotate-half layout (as nn::apply_rotary, transformers'
// apply_rotary_pos_emb): y = x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1).
#pragma once
#include <ATen/core/Tensor.h>

namespace lf::kernels {

// x [B, H, T, D], cos/sin [B (or 1), T, D] (float32 as nn::Rotary gives them). Autograd-aware; CUDA tensors of
// float32/bfloat16/float16 go to the fused kernel (kernels/cuda/rope.cu: no gradient for cos/sin), anything else to
// the composite version.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The composite ATen version, op for op as nn::apply_rotary (cos/sin cast to x's dtype, broadcast over heads).
at::Tensor apply_rope_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace lf::kernels

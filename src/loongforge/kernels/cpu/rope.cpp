// RoPE: the device dispatch, the composite reference and the CPU kernels (forward and backward in one pass each).
//
// CPU f32/f64: y = x*c + rotate_half(x)*s row by row (float32 8 lanes at a time with AVX2) in x's own memory layout
// (the attention passes q/k as [B,H,T,D] views of [B,T,H,D] memory; no copy), mul, mul, add in x's dtype as the
// composite version does, so the results equal it bit for bit. Backward: dx = dy*c + rotate_half^T(dy*s), rotate_half^T(z) = cat(z2, -z1).
#include "loongforge/kernels/rope.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "loongforge/kernels/cpu/vec_math.h"
#include "loongforge/kernels/cuda_ops.h"

namespace lf::kernels {

namespace {

// One row of D values: forward y = x*c + rot(x)*s, backward y = x*c + rot^T(x*s) (x = dy). No fused multiply-adds
// anywhere (the AVX path is built for AVX2 without FMA), so every element is the composite's mul, mul, add.
template <typename T, bool Backward>
void rope_row(const T* __restrict xr, const T* __restrict c, const T* __restrict s, T* __restrict yr, int64_t half) {
  const int64_t D = 2 * half;
  if constexpr (!Backward) {
    for (int64_t j = 0; j < half; ++j) yr[j] = xr[j] * c[j] + (-xr[j + half]) * s[j];
    for (int64_t j = half; j < D; ++j) yr[j] = xr[j] * c[j] + xr[j - half] * s[j];
  } else {
    for (int64_t j = 0; j < half; ++j) yr[j] = xr[j] * c[j] + xr[j + half] * s[j + half];
    for (int64_t j = half; j < D; ++j) yr[j] = xr[j] * c[j] + (-(xr[j - half] * s[j - half]));
  }
}

#if defined(__x86_64__)
// float rows with half a multiple of 8.
template <bool Backward>
__attribute__((target("avx2"))) void rope_row_avx2(const float* xr, const float* c, const float* s, float* yr,
                                                    int64_t half) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t j = 0; j < half; j += 8) {
    const __m256 x1 = _mm256_loadu_ps(xr + j), x2 = _mm256_loadu_ps(xr + j + half);
    const __m256 c1 = _mm256_loadu_ps(c + j), c2 = _mm256_loadu_ps(c + j + half);
    const __m256 s1 = _mm256_loadu_ps(s + j), s2 = _mm256_loadu_ps(s + j + half);
    __m256 y1, y2;
    if constexpr (!Backward) {
      y1 = _mm256_add_ps(_mm256_mul_ps(x1, c1), _mm256_mul_ps(_mm256_xor_ps(x2, sign), s1));
      y2 = _mm256_add_ps(_mm256_mul_ps(x2, c2), _mm256_mul_ps(x1, s2));
    } else {
      y1 = _mm256_add_ps(_mm256_mul_ps(x1, c1), _mm256_mul_ps(x2, s2));
      y2 = _mm256_add_ps(_mm256_mul_ps(x2, c2), _mm256_xor_ps(_mm256_mul_ps(x1, s1), sign));
    }
    _mm256_storeu_ps(yr + j, y1);
    _mm256_storeu_ps(yr + j + half, y2);
  }
}
#endif

// One pass over the rows (b, h, t) of x [B,H,T,D] (last stride 1); cos/sin contiguous [Bc,T,D] of x's dtype,
// Bc 1 or B. Forward: out = x*c + rot(x)*s. Backward: out = x*c + rot^T(x*s) (x = dy).
template <typename T, bool Backward>
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t H = x.size(1), Tn = x.size(2), D = x.size(3), half = D / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const int64_t cs0 = cos.size(0) == 1 ? 0 : Tn * D;
  const T* xp = x.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  void (*row)(const T*, const T*, const T*, T*, int64_t) = rope_row<T, Backward>;
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>)
    if (half % 8 == 0 && cpu::has_avx2_fma()) row = rope_row_avx2<Backward>;
#endif
  at::parallel_for(0, x.size(0) * H * Tn, 64, [&](int64_t begin, int64_t end) {
    int64_t b = begin / (H * Tn), h = (begin / Tn) % H, t = begin % Tn;  // then stepped, no division per row
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + b * xs0 + h * xs1 + t * xs2;
      T* yr = op + b * os0 + h * os1 + t * os2;
      const T* c = cp + b * cs0 + t * D;
      const T* s = sp + b * cs0 + t * D;
      row(xr, c, s, yr, half);
      if (++t == Tn) {
        t = 0;
        if (++h == H) {
          h = 0;
          ++b;
        }
      }
    }
  });
}

// Output in x's layout when x is dense (as the composite's TensorIterator does), contiguous otherwise.
at::Tensor like(const at::Tensor& x) {
  return x.is_non_overlapping_and_dense() ? at::empty_like(x) : at::empty(x.sizes(), x.options());
}

at::Tensor run(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  at::Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  at::Tensor c = cos.to(x.scalar_type()).contiguous(), s = sin.to(x.scalar_type()).contiguous();
  at::Tensor out = like(x);
  if (x.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rope_cpu", [&] {
    if (backward) rope_rows<scalar_t, true>(x, c, s, out);
    else rope_rows<scalar_t, false>(x, c, s, out);
  });
  return out;
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return run(x, cos, sin, false);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    return {run(grads[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

bool cpu_supported(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (!x.device().is_cpu() || !cos.device().is_cpu() || !sin.device().is_cpu()) return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble) return false;
  if (cos.scalar_type() != sin.scalar_type()) return false;
  if (cos.scalar_type() != x.scalar_type() && cos.scalar_type() != at::kFloat) return false;
  if (cos.requires_grad() || sin.requires_grad()) return false;  // the kernel gives no gradient for cos/sin
  if (x.dim() != 4 || cos.dim() != 3 || cos.sizes() != sin.sizes()) return false;
  const int64_t B = x.size(0), Tn = x.size(2), D = x.size(3);
  return D % 2 == 0 && cos.size(2) == D && cos.size(1) == Tn && (cos.size(0) == 1 || cos.size(0) == B);
}

}  // namespace

at::Tensor apply_rope_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor c = cos.unsqueeze(1).to(x.scalar_type()), s = sin.unsqueeze(1).to(x.scalar_type());
  at::Tensor rot = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rot * s;
}

at::Tensor rope_forward_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cpu_supported(x, cos, sin), "rope_forward_cpu: f32/f64 CPU x [B,H,T,D], cos/sin [1 or B,T,D]");
  return run(x, cos, sin, false);
}

at::Tensor rope_backward_cpu(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cpu_supported(dy, cos, sin), "rope_backward_cpu: f32/f64 CPU dy [B,H,T,D], cos/sin [1 or B,T,D]");
  return run(dy, cos, sin, true);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const bool cs_dtype = cos.scalar_type() == sin.scalar_type() &&
                        (cos.scalar_type() == at::kFloat || cos.scalar_type() == x.scalar_type());
  if (cuda::supported(x) && cuda::supported(cos) && cuda::supported(sin) && cs_dtype && x.dim() == 4 &&
      cos.dim() == 3)
    return cuda::rope(x, cos, sin);
  if (cpu_supported(x, cos, sin)) return RopeFunction::apply(x, cos, sin);
  return apply_rope_reference(x, cos, sin);
}

}  // namespace lf::kernels

// CPU kernels of the fused SwiGLU and GeGLU (tanh GELU), and their autograd Functions.
//
// float32 runs an AVX2+FMA path (selected at run time; the library is built without -mavx2) with a Cephes-style
// expf (~1 ulp, NaN propagating); other CPUs and float64 use plain loops over std::exp. bf16 converts blocks to
// float32, runs the same code and rounds back.
#include "loongforge/kernels/swiglu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

#include "loongforge/kernels/cpu/vec_math.h"
#include "loongforge/kernels/cuda_ops.h"

namespace lf::kernels {
namespace {
#if defined(__x86_64__)
using cpu::exp8;
#endif

constexpr int64_t kBlock = 1024;  // elements per conversion block (bf16) and the parallel grain unit

// The two gated activations: y = act(g) * u with act = SiLU (g * sigmoid(g)) or GELU's tanh form, written
// g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3) (0.5 (1 + tanh z) = sigmoid(2 z)). Backward:
// du = dy * act(g), dg = dy * u * act'(g) with
//   SiLU: act' = s (1 + g (1 - s)), s = sigmoid(g)
//   GELU: act' = s + g s (1 - s) * 2 sqrt(2 / pi) (1 + 3 * 0.044715 g^2), s = sigmoid(2 z)
enum class Act { kSilu, kGeluTanh };
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;

// ---- generic (scalar) float/double math -------------------------------------------------------------------
template <Act A, typename T>
inline T gate_arg(T g) {  // the argument of the sigmoid
  if constexpr (A == Act::kSilu) return g;
  else return T(2 * kGeluC) * (g + T(kGeluA) * g * g * g);
}
template <Act A, typename T>
void fwd_generic(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T s = T(1) / (T(1) + std::exp(-gate_arg<A>(g[i])));
    y[i] = u ? g[i] * s * u[i] : g[i] * s;
  }
}
template <Act A, typename T>
void bwd_generic(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T s = T(1) / (T(1) + std::exp(-gate_arg<A>(g[i])));
    if (du) du[i] = dy[i] * g[i] * s;
    T d;
    if constexpr (A == Act::kSilu) d = s * (T(1) + g[i] * (T(1) - s));
    else d = s + g[i] * s * (T(1) - s) * T(2 * kGeluC) * (T(1) + T(3 * kGeluA) * g[i] * g[i]);
    dg[i] = u ? dy[i] * u[i] * d : dy[i] * d;
  }
}

#if defined(__x86_64__)
LF_AVX2 inline __m256 sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}
template <Act A>
LF_AVX2 inline __m256 gate_arg8(__m256 g) {
  if constexpr (A == Act::kSilu) return g;
  else {
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    return _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(2 * kGeluC)),
                         _mm256_fmadd_ps(_mm256_set1_ps(static_cast<float>(kGeluA)), g3, g));
  }
}
template <Act A>
LF_AVX2 inline __m256 fwd8(__m256 g, __m256 u) {
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(gate_arg8<A>(g))), u);
}
template <Act A>
LF_AVX2 void fwd_avx2(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, fwd8<A>(_mm256_loadu_ps(g + i), u ? _mm256_loadu_ps(u + i) : one));
  if (i < n) {  // tail through a padded register so results do not depend on the position in the block
    alignas(32) float gb[8] = {}, ub[8] = {1, 1, 1, 1, 1, 1, 1, 1}, yb[8];
    for (int64_t j = i; j < n; ++j) gb[j - i] = g[j], ub[j - i] = u ? u[j] : 1.0f;
    _mm256_store_ps(yb, fwd8<A>(_mm256_load_ps(gb), _mm256_load_ps(ub)));
    for (int64_t j = i; j < n; ++j) y[j] = yb[j - i];
  }
}
template <Act A>
LF_AVX2 inline void bwd8(__m256 dy, __m256 g, __m256 u, __m256& dg, __m256& du) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 s = sigmoid8(gate_arg8<A>(g));
  du = _mm256_mul_ps(dy, _mm256_mul_ps(g, s));
  __m256 d;
  if constexpr (A == Act::kSilu) {
    d = _mm256_mul_ps(s, _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one));  // s (1 + g (1 - s))
  } else {
    // s + g s (1 - s) 2c (1 + 3a g^2)
    const __m256 poly = _mm256_fmadd_ps(_mm256_set1_ps(static_cast<float>(3 * kGeluA)), _mm256_mul_ps(g, g), one);
    const __m256 k = _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(2 * kGeluC)), poly);
    d = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_sub_ps(one, s)), k, s);
  }
  dg = _mm256_mul_ps(_mm256_mul_ps(dy, u), d);
}
template <Act A>
LF_AVX2 void bwd_avx2(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a, b;
    bwd8<A>(_mm256_loadu_ps(dy + i), _mm256_loadu_ps(g + i), u ? _mm256_loadu_ps(u + i) : one, a, b);
    _mm256_storeu_ps(dg + i, a);
    if (du) _mm256_storeu_ps(du + i, b);
  }
  if (i < n) {
    alignas(32) float db[8] = {}, gb[8] = {}, ub[8] = {1, 1, 1, 1, 1, 1, 1, 1}, ab[8], bb[8];
    for (int64_t j = i; j < n; ++j) db[j - i] = dy[j], gb[j - i] = g[j], ub[j - i] = u ? u[j] : 1.0f;
    __m256 a, b;
    bwd8<A>(_mm256_load_ps(db), _mm256_load_ps(gb), _mm256_load_ps(ub), a, b);
    _mm256_store_ps(ab, a);
    _mm256_store_ps(bb, b);
    for (int64_t j = i; j < n; ++j) {
      dg[j] = ab[j - i];
      if (du) du[j] = bb[j - i];
    }
  }
}
bool use_avx2() { return cpu::has_avx2_fma(); }
#else
bool use_avx2() { return false; }
#endif

template <Act A>
void fwd_f32(const float* g, const float* u, float* y, int64_t n) {
#if defined(__x86_64__)
  if (use_avx2()) return fwd_avx2<A>(g, u, y, n);
#endif
  fwd_generic<A>(g, u, y, n);
}
template <Act A>
void bwd_f32(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n) {
#if defined(__x86_64__)
  if (use_avx2()) return bwd_avx2<A>(dy, g, u, dg, du, n);
#endif
  bwd_generic<A>(dy, g, u, dg, du, n);
}

template <typename T>
void to_f32(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <typename T>
void from_f32(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

bool fused_supported(const at::Tensor& g, const at::Tensor& u) {
  auto t = g.scalar_type();
  return g.device().is_cpu() && u.device().is_cpu() && t == u.scalar_type() && g.sizes() == u.sizes() &&
         (t == at::kFloat || t == at::kDouble || t == at::kBFloat16);
}

// p + off, or null for an absent operand
template <typename P>
P* at_or_null(P* p, int64_t off) { return p ? p + off : nullptr; }

// The passes over whole tensors, for one activation; an undefined u: the activation alone (no gate, no du).
template <Act A>
at::Tensor forward_cpu(const at::Tensor& g_in, const at::Tensor& u_in) {
  at::Tensor g = g_in.contiguous(), u = u_in.defined() ? u_in.contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(g, at::MemoryFormat::Contiguous);
  const int64_t n = g.numel();
  const int64_t grain = 32 * kBlock;
  switch (g.scalar_type()) {
    case at::kFloat: {
      const float *gp = g.const_data_ptr<float>(), *up = u.defined() ? u.const_data_ptr<float>() : nullptr;
      float* yp = y.data_ptr<float>();
      at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) { fwd_f32<A>(gp + b, at_or_null(up, b), yp + b, e - b); });
      break;
    }
    case at::kDouble: {
      const double *gp = g.const_data_ptr<double>(), *up = u.defined() ? u.const_data_ptr<double>() : nullptr;
      double* yp = y.data_ptr<double>();
      at::parallel_for(0, n, grain,
                       [&](int64_t b, int64_t e) { fwd_generic<A>(gp + b, at_or_null(up, b), yp + b, e - b); });
      break;
    }
    default: {
      using BF = c10::BFloat16;
      const BF *gp = g.const_data_ptr<BF>(), *up = u.defined() ? u.const_data_ptr<BF>() : nullptr;
      BF* yp = y.data_ptr<BF>();
      at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
        float gb[kBlock], ub[kBlock], yb[kBlock];
        for (int64_t i = b; i < e; i += kBlock) {
          int64_t m = std::min(kBlock, e - i);
          to_f32(gp + i, gb, m);
          if (up) to_f32(up + i, ub, m);
          fwd_f32<A>(gb, up ? ub : nullptr, yb, m);
          from_f32(yb, yp + i, m);
        }
      });
    }
  }
  return y;
}

template <Act A>
std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& dy_in, const at::Tensor& g_in,
                                                const at::Tensor& u_in) {
  at::Tensor g = g_in.contiguous(), u = u_in.defined() ? u_in.contiguous() : at::Tensor();
  at::Tensor dy = dy_in.to(g.scalar_type()).contiguous();
  at::Tensor dg = at::empty_like(g, at::MemoryFormat::Contiguous);
  at::Tensor du = u.defined() ? at::empty_like(u, at::MemoryFormat::Contiguous) : at::Tensor();
  const int64_t n = g.numel();
  const int64_t grain = 32 * kBlock;
  switch (g.scalar_type()) {
    case at::kFloat: {
      const float *dyp = dy.const_data_ptr<float>(), *gp = g.const_data_ptr<float>();
      const float* up = u.defined() ? u.const_data_ptr<float>() : nullptr;
      float *dgp = dg.data_ptr<float>(), *dup = du.defined() ? du.data_ptr<float>() : nullptr;
      at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
        bwd_f32<A>(dyp + b, gp + b, at_or_null(up, b), dgp + b, at_or_null(dup, b), e - b);
      });
      break;
    }
    case at::kDouble: {
      const double *dyp = dy.const_data_ptr<double>(), *gp = g.const_data_ptr<double>();
      const double* up = u.defined() ? u.const_data_ptr<double>() : nullptr;
      double *dgp = dg.data_ptr<double>(), *dup = du.defined() ? du.data_ptr<double>() : nullptr;
      at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
        bwd_generic<A>(dyp + b, gp + b, at_or_null(up, b), dgp + b, at_or_null(dup, b), e - b);
      });
      break;
    }
    default: {
      using BF = c10::BFloat16;
      const BF *dyp = dy.const_data_ptr<BF>(), *gp = g.const_data_ptr<BF>();
      const BF* up = u.defined() ? u.const_data_ptr<BF>() : nullptr;
      BF *dgp = dg.data_ptr<BF>(), *dup = du.defined() ? du.data_ptr<BF>() : nullptr;
      at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
        float db[kBlock], gb[kBlock], ub[kBlock], ab[kBlock], bb[kBlock];
        for (int64_t i = b; i < e; i += kBlock) {
          int64_t m = std::min(kBlock, e - i);
          to_f32(dyp + i, db, m);
          to_f32(gp + i, gb, m);
          if (up) to_f32(up + i, ub, m);
          bwd_f32<A>(db, gb, up ? ub : nullptr, ab, up ? bb : nullptr, m);
          from_f32(ab, dgp + i, m);
          if (dup) from_f32(bb, dup + i, m);
        }
      });
    }
  }
  return {dg, du};
}

template <Act A>
class GatedFunction : public torch::autograd::Function<GatedFunction<A>> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    ctx->save_for_backward({g, u});
    return forward_cpu<A>(g, u);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto [dg, du] = backward_cpu<A>(grads[0], saved[0], saved[1]);
    return {dg, du};
  }
};
// GELU (tanh form) alone.
class GeluTanhFunction : public torch::autograd::Function<GeluTanhFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return forward_cpu<Act::kGeluTanh>(x, at::Tensor());
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    return {std::get<0>(backward_cpu<Act::kGeluTanh>(grads[0], ctx->get_saved_variables()[0], at::Tensor()))};
  }
};
using SwiGLUFunction = GatedFunction<Act::kSilu>;
using GeGLUFunction = GatedFunction<Act::kGeluTanh>;

}  // namespace

at::Tensor swiglu_forward_cpu(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(fused_supported(g, u), "swiglu_forward_cpu: CPU f32/bf16/f64 tensors of one shape and dtype expected");
  return forward_cpu<Act::kSilu>(g, u);
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(fused_supported(g, u) && dy.sizes() == g.sizes(), "swiglu_backward_cpu: shapes differ");
  return backward_cpu<Act::kSilu>(dy, g, u);
}

at::Tensor geglu_tanh_forward_cpu(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(fused_supported(g, u), "geglu_tanh_forward_cpu: CPU f32/bf16/f64 tensors of one shape and dtype expected");
  return forward_cpu<Act::kGeluTanh>(g, u);
}

std::tuple<at::Tensor, at::Tensor> geglu_tanh_backward_cpu(const at::Tensor& dy, const at::Tensor& g,
                                                           const at::Tensor& u) {
  TORCH_CHECK(fused_supported(g, u) && dy.sizes() == g.sizes(), "geglu_tanh_backward_cpu: shapes differ");
  return backward_cpu<Act::kGeluTanh>(dy, g, u);
}

at::Tensor swiglu_reference(const at::Tensor& g, const at::Tensor& u) { return at::silu(g) * u; }

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u) {
  if (cuda::supported(g) && g.dim() >= 1 && g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type() &&
      g.device() == u.device())
    return cuda::swiglu(g, u);  // kernels/cuda/swiglu.cu
  if (!fused_supported(g, u)) return swiglu_reference(g, u);
  return SwiGLUFunction::apply(g, u);
}

at::Tensor geglu_tanh_reference(const at::Tensor& g, const at::Tensor& u) { return at::gelu(g, "tanh") * u; }

at::Tensor gelu_tanh(const at::Tensor& x) {
  const auto t = x.scalar_type();
  if (!x.device().is_cpu() || !(t == at::kFloat || t == at::kDouble || t == at::kBFloat16)) return at::gelu(x, "tanh");
  return GeluTanhFunction::apply(x);
}

at::Tensor geglu_tanh(const at::Tensor& g, const at::Tensor& u) {
  if (!fused_supported(g, u)) return geglu_tanh_reference(g, u);
  return GeGLUFunction::apply(g, u);
}

}  // namespace lf::kernels

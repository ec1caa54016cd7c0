// CPU kernels of the fused causal depthwise convolution + SiLU (kernels/causal_conv.h), and its autograd Function.
//
// x [B, T, C] is read a row (one time step, C contiguous channels) at a time; the weight is transposed to [K, C] so
// the K taps of a row are contiguous too. float32 runs AVX2+FMA paths (chosen at run time: the library is built
// without -mavx2; the SiLU's exp is vec_math.h's exp8), float64 and CPUs without AVX2 run the same loops in plain
// C++. Every output row is independent (parallel over rows); dw sums its rows in fixed blocks of kDwRows, then the
// blocks in order.
#include "loongforge/kernels/causal_conv.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "loongforge/kernels/cpu/vec_math.h"

namespace lf::kernels {
namespace {

constexpr int64_t kMaxTaps = 64;  // longer kernels run the composite version
constexpr int64_t kDwRows = 64;   // rows per dw partial sum
constexpr int64_t kRowGrain = 8;  // rows per parallel task at least

struct Dims {
  int64_t b = 0, tin = 0, tout = 0, c = 0, k = 0, o = 0;  // o: the rows before the start (K - 1 when padded)
};

Dims dims_of(const at::Tensor& x, const at::Tensor& w, bool pad) {
  Dims d;
  d.b = x.size(0);
  d.tin = x.size(1);
  d.c = x.size(2);
  d.k = w.size(2);
  d.o = pad ? d.k - 1 : 0;
  d.tout = pad ? d.tin : std::max<int64_t>(d.tin - d.k + 1, 0);
  return d;
}

// Input row r of batch row xb (nullptr outside [0, T): the zeros before the start).
template <typename T>
inline const T* in_row(const T* xb, const Dims& d, int64_t r) {
  return r >= 0 && r < d.tin ? xb + r * d.c : nullptr;
}

// ---- generic loops (float64; float32 without AVX2) ------------------------------------------------------------------

// The pre-activation of output row t: z[c] = sum_j w[j, c] x[t + j - o, c], taps in order (the composite's order).
template <typename T>
inline __attribute__((always_inline)) void z_row(const T* xb, const T* wt, const Dims& d, int64_t t, T* z) {
  std::fill(z, z + d.c, T(0));
  for (int64_t j = 0; j < d.k; ++j) {
    const T* r = in_row(xb, d, t + j - d.o);
    if (!r) continue;
    const T* w = wt + j * d.c;
    for (int64_t c = 0; c < d.c; ++c) z[c] += w[c] * r[c];
  }
}

template <typename T>
void forward_rows_generic(const T* xb, const T* wt, const Dims& d, int64_t t0, int64_t t1, T* yb) {
  for (int64_t t = t0; t < t1; ++t) {
    T* y = yb + t * d.c;
    z_row(xb, wt, d, t, y);
    for (int64_t c = 0; c < d.c; ++c) y[c] = y[c] / (T(1) + std::exp(-y[c]));
  }
}

// dz = dy * silu'(z), silu'(z) = s (1 + z (1 - s)), s = sigmoid(z).
template <typename T>
void dz_rows_generic(const T* xb, const T* wt, const Dims& d, int64_t t0, int64_t t1, const T* dyb, T* dzb) {
  for (int64_t t = t0; t < t1; ++t) {
    T* dz = dzb + t * d.c;
    const T* dy = dyb + t * d.c;
    z_row(xb, wt, d, t, dz);
    for (int64_t c = 0; c < d.c; ++c) {
      const T z = dz[c], s = T(1) / (T(1) + std::exp(-z));
      dz[c] = dy[c] * s * (T(1) + z * (T(1) - s));
    }
  }
}

// dx[s, c] = sum_j w[j, c] dz[s - j + o, c] over the output rows that exist.
template <typename T>
inline __attribute__((always_inline)) void dx_rows_body(const T* dzb, const T* wt, const Dims& d, int64_t s0,
                                                        int64_t s1, T* dxb) {
  for (int64_t s = s0; s < s1; ++s) {
    T* dx = dxb + s * d.c;
    std::fill(dx, dx + d.c, T(0));
    for (int64_t j = 0; j < d.k; ++j) {
      const int64_t t = s - j + d.o;
      if (t < 0 || t >= d.tout) continue;
      const T* dz = dzb + t * d.c;
      const T* w = wt + j * d.c;
      for (int64_t c = 0; c < d.c; ++c) dx[c] += w[c] * dz[c];
    }
  }
}

// part[j, c] = sum over output rows t in [t0, t1) of dz[t, c] x[t + j - o, c].
template <typename T>
inline __attribute__((always_inline)) void dw_rows_body(const T* xb, const T* dzb, const Dims& d, int64_t t0,
                                                        int64_t t1, T* part) {
  std::fill(part, part + d.k * d.c, T(0));
  for (int64_t t = t0; t < t1; ++t) {
    const T* dz = dzb + t * d.c;
    for (int64_t j = 0; j < d.k; ++j) {
      const T* r = in_row(xb, d, t + j - d.o);
      if (!r) continue;
      T* p = part + j * d.c;
      for (int64_t c = 0; c < d.c; ++c) p[c] += dz[c] * r[c];
    }
  }
}

// ---- float32 with AVX2 + FMA ----------------------------------------------------------------------------------------

#if defined(__x86_64__)
using cpu::exp8;

// The pre-activation of 8 channels from c of output row t (rows: the K input rows, nullptr for the zeros).
LF_AVX2 inline __m256 z8(const float* const* rows, const float* wt, const Dims& d, int64_t c) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < d.k; ++j)
    if (rows[j]) acc = _mm256_fmadd_ps(_mm256_loadu_ps(wt + j * d.c + c), _mm256_loadu_ps(rows[j] + c), acc);
  return acc;
}
LF_AVX2 inline __m256 sigmoid8(__m256 z) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
}
inline float z1(const float* const* rows, const float* wt, const Dims& d, int64_t c) {
  float acc = 0.0f;
  for (int64_t j = 0; j < d.k; ++j)
    if (rows[j]) acc = std::fma(wt[j * d.c + c], rows[j][c], acc);
  return acc;
}

LF_AVX2 void forward_rows_avx2(const float* xb, const float* wt, const Dims& d, int64_t t0, int64_t t1, float* yb) {
  const float* rows[kMaxTaps];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < d.k; ++j) rows[j] = in_row(xb, d, t + j - d.o);
    float* y = yb + t * d.c;
    int64_t c = 0;
    for (; c + 8 <= d.c; c += 8) {
      __m256 z = z8(rows, wt, d, c);
      _mm256_storeu_ps(y + c, _mm256_mul_ps(z, sigmoid8(z)));
    }
    for (; c < d.c; ++c) {
      const float z = z1(rows, wt, d, c);
      y[c] = z / (1.0f + std::exp(-z));
    }
  }
}

LF_AVX2 void dz_rows_avx2(const float* xb, const float* wt, const Dims& d, int64_t t0, int64_t t1, const float* dyb,
                          float* dzb) {
  const float* rows[kMaxTaps];
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < d.k; ++j) rows[j] = in_row(xb, d, t + j - d.o);
    const float* dy = dyb + t * d.c;
    float* dz = dzb + t * d.c;
    int64_t c = 0;
    for (; c + 8 <= d.c; c += 8) {
      __m256 z = z8(rows, wt, d, c), s = sigmoid8(z);
      __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(z, _mm256_sub_ps(one, s), one));
      _mm256_storeu_ps(dz + c, _mm256_mul_ps(_mm256_loadu_ps(dy + c), slope));
    }
    for (; c < d.c; ++c) {
      const float z = z1(rows, wt, d, c), s = 1.0f / (1.0f + std::exp(-z));
      dz[c] = dy[c] * s * (1.0f + z * (1.0f - s));
    }
  }
}

LF_AVX2 void dx_rows_avx2(const float* dzb, const float* wt, const Dims& d, int64_t s0, int64_t s1, float* dxb) {
  dx_rows_body(dzb, wt, d, s0, s1, dxb);
}
LF_AVX2 void dw_rows_avx2(const float* xb, const float* dzb, const Dims& d, int64_t t0, int64_t t1, float* part) {
  dw_rows_body(xb, dzb, d, t0, t1, part);
}
bool use_avx2() { return cpu::has_avx2_fma(); }
#else
bool use_avx2() { return false; }
#endif

// ---- dispatch ----------------------------------------------------------------------------------------------------

template <typename T>
void forward_rows(const T* xb, const T* wt, const Dims& d, int64_t t0, int64_t t1, T* yb) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>)
    if (use_avx2()) return forward_rows_avx2(xb, wt, d, t0, t1, yb);
#endif
  forward_rows_generic(xb, wt, d, t0, t1, yb);
}
template <typename T>
void dz_rows(const T* xb, const T* wt, const Dims& d, int64_t t0, int64_t t1, const T* dyb, T* dzb) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>)
    if (use_avx2()) return dz_rows_avx2(xb, wt, d, t0, t1, dyb, dzb);
#endif
  dz_rows_generic(xb, wt, d, t0, t1, dyb, dzb);
}
template <typename T>
void dx_rows(const T* dzb, const T* wt, const Dims& d, int64_t s0, int64_t s1, T* dxb) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>)
    if (use_avx2()) return dx_rows_avx2(dzb, wt, d, s0, s1, dxb);
#endif
  dx_rows_body(dzb, wt, d, s0, s1, dxb);
}
template <typename T>
void dw_rows(const T* xb, const T* dzb, const Dims& d, int64_t t0, int64_t t1, T* part) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>)
    if (use_avx2()) return dw_rows_avx2(xb, dzb, d, t0, t1, part);
#endif
  dw_rows_body(xb, dzb, d, t0, t1, part);
}

bool kernel_supported(const at::Tensor& x, const at::Tensor& w) {
  const auto t = x.scalar_type();
  return x.device().is_cpu() && w.device().is_cpu() && (t == at::kFloat || t == at::kDouble) &&
         w.scalar_type() == t && x.dim() == 3 && w.dim() == 3 && w.size(0) == x.size(2) && w.size(1) == 1 &&
         w.size(2) >= 1 && w.size(2) <= kMaxTaps;
}

// Parallel over (batch row, block of time rows): f(b, t0, t1).
template <typename F>
void for_row_blocks(const Dims& d, int64_t rows, int64_t block, F&& f) {
  const int64_t per = (rows + block - 1) / block, tasks = d.b * per;
  at::parallel_for(0, tasks, std::max<int64_t>(1, kRowGrain / block), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / per, t0 = (i % per) * block;
      f(b, t0, std::min(rows, t0 + block));
    }
  });
}

class CausalConvSiluFunction : public torch::autograd::Function<CausalConvSiluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, bool pad) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["pad"] = pad;
    return causal_conv1d_silu_forward_cpu(x, w, pad);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto [dx, dw] = causal_conv1d_silu_backward_cpu(grads[0], saved[0], saved[1], ctx->saved_data["pad"].toBool());
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

at::Tensor causal_conv1d_silu_reference(const at::Tensor& x, const at::Tensor& weight, bool pad) {
  const int64_t kernel = weight.size(2);
  at::Tensor xp = pad ? at::constant_pad_nd(x, {0, 0, kernel - 1, 0}) : x;
  const int64_t t = xp.size(1) - kernel + 1;
  at::Tensor taps = weight.select(1, 0).t();  // [K, C]
  at::Tensor y;
  for (int64_t j = 0; j < kernel; ++j) {
    at::Tensor term = xp.narrow(1, j, t) * taps[j];
    y = j ? y + term : term;
  }
  return at::silu(y);
}

at::Tensor causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight, bool pad) {
  if (!kernel_supported(x, weight)) return causal_conv1d_silu_reference(x, weight, pad);
  return CausalConvSiluFunction::apply(x, weight, pad);
}

at::Tensor causal_conv1d_silu_forward_cpu(const at::Tensor& x_in, const at::Tensor& w_in, bool pad) {
  TORCH_CHECK(kernel_supported(x_in, w_in), "causal_conv1d_silu_forward_cpu: CPU f32/f64 x [B, T, C], w [C, 1, K]");
  at::Tensor x = x_in.contiguous();
  at::Tensor wt = w_in.select(1, 0).t().contiguous();  // [K, C]
  const Dims d = dims_of(x, w_in, pad);
  at::Tensor y = at::empty({d.b, d.tout, d.c}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "causal_conv1d_silu_forward_cpu", [&] {
    const scalar_t *xp = x.const_data_ptr<scalar_t>(), *wp = wt.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_row_blocks(d, d.tout, kRowGrain, [&](int64_t b, int64_t t0, int64_t t1) {
      forward_rows(xp + b * d.tin * d.c, wp, d, t0, t1, yp + b * d.tout * d.c);
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> causal_conv1d_silu_backward_cpu(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                                   const at::Tensor& w_in, bool pad) {
  TORCH_CHECK(kernel_supported(x_in, w_in), "causal_conv1d_silu_backward_cpu: CPU f32/f64 x [B, T, C], w [C, 1, K]");
  at::Tensor x = x_in.contiguous();
  at::Tensor wt = w_in.select(1, 0).t().contiguous();
  const Dims d = dims_of(x, w_in, pad);
  TORCH_CHECK(dy_in.dim() == 3 && dy_in.size(0) == d.b && dy_in.size(1) == d.tout && dy_in.size(2) == d.c,
              "causal_conv1d_silu_backward_cpu: dy must be [B, outputs, C]");
  at::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  at::Tensor dz = at::empty_like(dy), dx = at::empty_like(x);
  const int64_t per = (d.tout + kDwRows - 1) / kDwRows;
  at::Tensor parts = at::empty({d.b * per, d.k, d.c}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "causal_conv1d_silu_backward_cpu", [&] {
    const scalar_t *xp = x.const_data_ptr<scalar_t>(), *wp = wt.const_data_ptr<scalar_t>(),
                   *dyp = dy.const_data_ptr<scalar_t>();
    scalar_t *dzp = dz.data_ptr<scalar_t>(), *dxp = dx.data_ptr<scalar_t>(), *pp = parts.data_ptr<scalar_t>();
    for_row_blocks(d, d.tout, kRowGrain, [&](int64_t b, int64_t t0, int64_t t1) {
      dz_rows(xp + b * d.tin * d.c, wp, d, t0, t1, dyp + b * d.tout * d.c, dzp + b * d.tout * d.c);
    });
    for_row_blocks(d, d.tin, kRowGrain, [&](int64_t b, int64_t s0, int64_t s1) {
      dx_rows(dzp + b * d.tout * d.c, wp, d, s0, s1, dxp + b * d.tin * d.c);
    });
    for_row_blocks(d, d.tout, kDwRows, [&](int64_t b, int64_t t0, int64_t t1) {
      dw_rows(xp + b * d.tin * d.c, dzp + b * d.tout * d.c, d, t0, t1, pp + (b * per + t0 / kDwRows) * d.k * d.c);
    });
  });
  // the blocks' partial sums in order, [K, C] -> [C, 1, K]
  at::Tensor dw = at::zeros({d.c, 1, d.k}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "causal_conv1d_silu_backward_cpu", [&] {
    const scalar_t* pp = parts.const_data_ptr<scalar_t>();
    scalar_t* out = dw.data_ptr<scalar_t>();
    for (int64_t blk = 0; blk < d.b * per; ++blk)
      for (int64_t j = 0; j < d.k; ++j)
        for (int64_t c = 0; c < d.c; ++c) out[c * d.k + j] += pp[(blk * d.k + j) * d.c + c];
  });
  return {dx, dw};
}

}  // namespace lf::kernels

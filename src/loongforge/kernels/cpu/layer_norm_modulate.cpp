// CPU kernels of the fused adaptive LayerNorm (kernels/layer_norm_modulate.h), its autograd Function and the
// composite reference.
//
// Rows of N: row r of x belongs to sample b = r / T (T rows per sample). With xh = (x - mean) rstd, s1 = 1 + scale_b:
//   forward   y = xh s1 + shift_b                                   (statistics: two passes over the row in cache)
//   backward  g = dy s1;  dx = rstd (g - mean(g) - xh mean(g xh));  dshift_b += dy, dscale_b += dy xh
// The backward runs one task per (sample, chunk of its rows), each with its own dshift / dscale partial sums (summed
// afterwards when a sample has several chunks), so no two threads write one sum. float32 rows run AVX2+FMA where the
// CPU has it.
#include "loongforge/kernels/layer_norm_modulate.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

#include "loongforge/kernels/cpu/vec_math.h"

namespace lf::kernels {
namespace {

// ---- rows, generic (float64, and float32 without AVX2: sums in double) ------------------------------------------
template <typename T>
void stats_generic(const T* x, int64_t n, double eps, T* mean, T* rstd) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  const double m = s / static_cast<double>(n);
  double v = 0;
  for (int64_t i = 0; i < n; ++i) v += (x[i] - m) * (x[i] - m);
  *mean = static_cast<T>(m);
  *rstd = static_cast<T>(1.0 / std::sqrt(v / static_cast<double>(n) + eps));
}

template <typename T>
void forward_row_generic(const T* x, const T* shift, const T* scale, T m, T r, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - m) * r * (T(1) + scale[i]) + shift[i];
}

template <typename T>
void backward_row_generic(const T* dy, const T* x, const T* scale, T m, T r, T* dx, T* dsh, T* dsc, int64_t n) {
  double c1 = 0, c2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T xh = (x[i] - m) * r, g = dy[i] * (T(1) + scale[i]);
    c1 += static_cast<double>(g) * xh;
    c2 += g;
    dsh[i] += dy[i];
    dsc[i] += dy[i] * xh;
  }
  const T a = static_cast<T>(c1 / static_cast<double>(n)), b = static_cast<T>(c2 / static_cast<double>(n));
  for (int64_t i = 0; i < n; ++i) {
    const T xh = (x[i] - m) * r, g = dy[i] * (T(1) + scale[i]);
    dx[i] = r * (g - b - xh * a);
  }
}

// ---- rows, AVX2 (float32) -----------------------------------------------------------------------------------------
#if defined(__x86_64__)
using cpu::hsum8;

LF_AVX2 void stats_avx2(const float* x, int64_t n, double eps, float* mean, float* rstd) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
  float s = hsum8(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += x[i];
  const float m = s / static_cast<float>(n);
  const __m256 mv = _mm256_set1_ps(m);
  a0 = _mm256_setzero_ps();
  a1 = a0;
  for (i = 0; i + 16 <= n; i += 16) {
    const __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + i), mv), d1 = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv);
    a0 = _mm256_fmadd_ps(d0, d0, a0);
    a1 = _mm256_fmadd_ps(d1, d1, a1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), mv);
    a0 = _mm256_fmadd_ps(d, d, a0);
  }
  float v = hsum8(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) v += (x[i] - m) * (x[i] - m);
  *mean = m;
  *rstd = static_cast<float>(1.0 / std::sqrt(static_cast<double>(v) / static_cast<double>(n) + eps));
}

LF_AVX2 void forward_row_avx2(const float* x, const float* shift, const float* scale, float m, float r, float* y,
                              int64_t n) {
  const __m256 mv = _mm256_set1_ps(m), rv = _mm256_set1_ps(r), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), rv);
    const __m256 s1 = _mm256_add_ps(one, _mm256_loadu_ps(scale + i));
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(xh, s1, _mm256_loadu_ps(shift + i)));
  }
  for (; i < n; ++i) y[i] = (x[i] - m) * r * (1.0f + scale[i]) + shift[i];
}

LF_AVX2 void backward_row_avx2(const float* dy, const float* x, const float* scale, float m, float r, float* dx,
                               float* dsh, float* dsc, int64_t n) {
  const __m256 mv = _mm256_set1_ps(m), rv = _mm256_set1_ps(r), one = _mm256_set1_ps(1.0f);
  __m256 c1v = _mm256_setzero_ps(), c2v = c1v;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_loadu_ps(dy + i);
    const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), rv);
    const __m256 g = _mm256_mul_ps(d, _mm256_add_ps(one, _mm256_loadu_ps(scale + i)));
    c1v = _mm256_fmadd_ps(g, xh, c1v);
    c2v = _mm256_add_ps(c2v, g);
    _mm256_storeu_ps(dsh + i, _mm256_add_ps(_mm256_loadu_ps(dsh + i), d));
    _mm256_storeu_ps(dsc + i, _mm256_fmadd_ps(d, xh, _mm256_loadu_ps(dsc + i)));
  }
  float c1 = hsum8(c1v), c2 = hsum8(c2v);
  for (int64_t j = i; j < n; ++j) {
    const float xh = (x[j] - m) * r, g = dy[j] * (1.0f + scale[j]);
    c1 += g * xh;
    c2 += g;
    dsh[j] += dy[j];
    dsc[j] += dy[j] * xh;
  }
  const float a = c1 / static_cast<float>(n), b = c2 / static_cast<float>(n);
  const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), rv);
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_add_ps(one, _mm256_loadu_ps(scale + i)));
    _mm256_storeu_ps(dx + i, _mm256_mul_ps(rv, _mm256_sub_ps(_mm256_sub_ps(g, bv), _mm256_mul_ps(xh, av))));
  }
  for (; i < n; ++i) {
    const float xh = (x[i] - m) * r, g = dy[i] * (1.0f + scale[i]);
    dx[i] = r * (g - b - xh * a);
  }
}
#endif

template <typename T>
bool use_avx2() {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) return cpu::has_avx2_fma();
#endif
  return false;
}

template <typename T>
void forward_impl(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale, double eps, at::Tensor& y,
                  at::Tensor& mean, at::Tensor& rstd) {
  const int64_t B = shift.size(0), N = shift.size(1), rows = x.numel() / N, per = B ? rows / B : 0;
  const T* xp = x.const_data_ptr<T>();
  const T* shp = shift.const_data_ptr<T>();
  const T* scp = scale.const_data_ptr<T>();
  const int64_t lsh = shift.stride(0), lsc = scale.stride(0);
  T* yp = y.mutable_data_ptr<T>();
  T* mp = mean.mutable_data_ptr<T>();
  T* rp = rstd.mutable_data_ptr<T>();
  const bool avx2 = use_avx2<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / per;
      const T* xr = xp + r * N;
#if defined(__x86_64__)
      if constexpr (std::is_same_v<T, float>) {
        if (avx2) {
          stats_avx2(xr, N, eps, mp + r, rp + r);
          forward_row_avx2(xr, shp + b * lsh, scp + b * lsc, mp[r], rp[r], yp + r * N, N);
          continue;
        }
      }
#endif
      stats_generic(xr, N, eps, mp + r, rp + r);
      forward_row_generic(xr, shp + b * lsh, scp + b * lsc, mp[r], rp[r], yp + r * N, N);
    }
  });
}

template <typename T>
void backward_impl(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale, const at::Tensor& mean,
                   const at::Tensor& rstd, int64_t chunks, at::Tensor& dx, at::Tensor& dsh, at::Tensor& dsc) {
  const int64_t B = scale.size(0), N = scale.size(1), rows = x.numel() / N, per = B ? rows / B : 0;
  const int64_t step = (per + chunks - 1) / chunks;
  const T* gp = dy.const_data_ptr<T>();
  const T* xp = x.const_data_ptr<T>();
  const T* scp = scale.const_data_ptr<T>();
  const T* mp = mean.const_data_ptr<T>();
  const T* rp = rstd.const_data_ptr<T>();
  const int64_t lsc = scale.stride(0);
  T* dxp = dx.mutable_data_ptr<T>();
  T* dshp = dsh.mutable_data_ptr<T>();  // [B, chunks, N], zeroed
  T* dscp = dsc.mutable_data_ptr<T>();
  const bool avx2 = use_avx2<T>();
  at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, c = task % chunks;
      const T* sc = scp + b * lsc;
      T* psh = dshp + task * N;
      T* psc = dscp + task * N;
      for (int64_t r = b * per + c * step; r < std::min(b * per + (c + 1) * step, (b + 1) * per); ++r) {
#if defined(__x86_64__)
        if constexpr (std::is_same_v<T, float>) {
          if (avx2) {
            backward_row_avx2(gp + r * N, xp + r * N, sc, mp[r], rp[r], dxp + r * N, psh, psc, N);
            continue;
          }
        }
#endif
        backward_row_generic(gp + r * N, xp + r * N, sc, mp[r], rp[r], dxp + r * N, psh, psc, N);
      }
    }
  });
}

bool kernel_supported(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale) {
  const auto dt = x.scalar_type();
  if (!(dt == at::kFloat || dt == at::kDouble) || shift.scalar_type() != dt || scale.scalar_type() != dt) return false;
  if (!x.device().is_cpu() || !shift.device().is_cpu() || !scale.device().is_cpu()) return false;
  if (x.dim() < 2 || shift.dim() != 2 || scale.sizes() != shift.sizes()) return false;
  return x.size(0) == shift.size(0) && x.size(-1) == shift.size(1) && x.size(-1) > 0;
}

at::Tensor last_dim_dense(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

class LayerNormModulateFunction : public torch::autograd::Function<LayerNormModulateFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& shift,
                            const at::Tensor& scale, double eps) {
    auto [y, mean, rstd] = layer_norm_modulate_forward_cpu(x, shift, scale, eps);
    ctx->save_for_backward({x, scale, mean, rstd});
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto s = ctx->get_saved_variables();
    auto [dx, dshift, dscale] = layer_norm_modulate_backward_cpu(grads[0], s[0], s[1], s[2], s[3]);
    return {dx, dshift, dscale, at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_modulate_forward_cpu(const at::Tensor& x_in,
                                                                               const at::Tensor& shift_in,
                                                                               const at::Tensor& scale_in,
                                                                               double eps) {
  TORCH_CHECK(kernel_supported(x_in, shift_in, scale_in),
              "layer_norm_modulate_forward_cpu: x [B, ..., N], shift / scale [B, N], one dtype (float32/float64) on "
              "the CPU");
  at::NoGradGuard ng;
  const at::Tensor x = x_in.contiguous(), shift = last_dim_dense(shift_in), scale = last_dim_dense(scale_in);
  at::Tensor y = at::empty(x.sizes(), x.options());
  std::vector<int64_t> stat_shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor mean = at::empty(stat_shape, x.options()), rstd = at::empty(stat_shape, x.options());
  if (x.numel() > 0) {
    if (x.scalar_type() == at::kFloat) forward_impl<float>(x, shift, scale, eps, y, mean, rstd);
    else forward_impl<double>(x, shift, scale, eps, y, mean, rstd);
  }
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_modulate_backward_cpu(const at::Tensor& dy_in,
                                                                                const at::Tensor& x_in,
                                                                                const at::Tensor& scale_in,
                                                                                const at::Tensor& mean_in,
                                                                                const at::Tensor& rstd_in) {
  TORCH_CHECK(kernel_supported(x_in, scale_in, scale_in) && dy_in.sizes() == x_in.sizes() &&
                  dy_in.scalar_type() == x_in.scalar_type() && mean_in.numel() * x_in.size(-1) == x_in.numel() &&
                  rstd_in.numel() == mean_in.numel(),
              "layer_norm_modulate_backward_cpu: dy shaped as x, scale [B, N], mean / rstd as the forward gives");
  at::NoGradGuard ng;
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), scale = last_dim_dense(scale_in);
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const int64_t B = scale.size(0), N = scale.size(1), per = B ? x.numel() / N / B : 0;
  // Enough tasks for every thread when there are few samples; one chunk per sample otherwise.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(per, (2 * threads + B - 1) / std::max<int64_t>(B, 1)));
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dsh = at::zeros({B, chunks, N}, x.options()), dsc = at::zeros({B, chunks, N}, x.options());
  if (x.numel() > 0) {
    if (x.scalar_type() == at::kFloat) backward_impl<float>(dy, x, scale, mean, rstd, chunks, dx, dsh, dsc);
    else backward_impl<double>(dy, x, scale, mean, rstd, chunks, dx, dsh, dsc);
  }
  if (chunks == 1) return {dx, dsh.squeeze(1), dsc.squeeze(1)};
  return {dx, dsh.sum(1), dsc.sum(1)};
}

at::Tensor layer_norm_modulate_reference(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                                         double eps) {
  std::vector<int64_t> bcast(static_cast<size_t>(x.dim()), 1);
  bcast[0] = shift.size(0);
  bcast.back() = shift.size(1);
  return at::layer_norm(x, {x.size(-1)}, {}, {}, eps) * (1 + scale.reshape(bcast)) + shift.reshape(bcast);
}

at::Tensor layer_norm_modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale, double eps) {
  if (!kernel_supported(x, shift, scale)) return layer_norm_modulate_reference(x, shift, scale, eps);
  return LayerNormModulateFunction::apply(x, shift, scale, eps);
}

}  // namespace lf::kernels

// CPU kernels of the fused RMSNorm, and its autograd Function.
#include "loongforge/kernels/rms_norm.h"
#include "loongforge/kernels/cpu/vec_math.h"
#include "loongforge/kernels/cuda_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

namespace lf::kernels {
namespace {

// Rows are independent: one row = one normalised vector of length n. Accumulate in Acc (double for f64, float
// otherwise, as transformers computes the variance in float32). With a residual r, the row is s = x + r (written
// to s) and s is normalised. float32 rows run AVX2+FMA where the CPU has it (sums of squares in 4 lanes x 8
// accumulators; the output is w * (s * rstd), two roundings as the composite's).
template <typename T, typename Acc>
Acc row_sumsq(const T* x, int64_t n) {
  Acc ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<Acc>(x[i]) * static_cast<Acc>(x[i]);
  return ss;
}
template <typename T, typename Acc>
void row_scale(const T* x, const T* w, Acc inv, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(w[i] * static_cast<T>(static_cast<Acc>(x[i]) * inv));
}

#if defined(__x86_64__)
using cpu::hsum8;
// x[j..j+8) (+ r, stored to s when r is given)
LF_AVX2 inline __m256 load_sum(const float* x, const float* r, float* s, int64_t j) {
  if (!r) return _mm256_loadu_ps(x + j);
  __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(r + j));
  _mm256_storeu_ps(s + j, v);
  return v;
}
// sum of squares of s = x (+ r, stored to s when r is given)
LF_AVX2 float sumsq_avx2(const float* x, const float* r, float* s, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 v0 = load_sum(x, r, s, i), v1 = load_sum(x, r, s, i + 8), v2 = load_sum(x, r, s, i + 16),
           v3 = load_sum(x, r, s, i + 24);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
    a2 = _mm256_fmadd_ps(v2, v2, a2);
    a3 = _mm256_fmadd_ps(v3, v3, a3);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 v = load_sum(x, r, s, i);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  float ss = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) {
    const float v = r ? (s[i] = x[i] + r[i]) : x[i];
    ss += v * v;
  }
  return ss;
}
LF_AVX2 void scale_avx2(const float* x, const float* w, float inv, float* y, int64_t n) {
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), iv)));
  for (; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}
// sum_i dy_i w_i x_i
LF_AVX2 float dot3_avx2(const float* dy, const float* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_loadu_ps(w + i)), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dy + i + 8), _mm256_loadu_ps(w + i + 8)),
                         _mm256_loadu_ps(x + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8)
    a0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_loadu_ps(w + i)), _mm256_loadu_ps(x + i), a0);
  float d = hsum8(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) d += dy[i] * w[i] * x[i];
  return d;
}
// dx = dy w inv - x k (+ ds), dwc += dy x inv
LF_AVX2 void bwd_row_avx2(const float* dy, const float* x, const float* w, const float* ds, float inv, float k,
                          float* dx, float* dwc, int64_t n) {
  const __m256 iv = _mm256_set1_ps(inv), kv = _mm256_set1_ps(k);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_loadu_ps(dy + i), xv = _mm256_loadu_ps(x + i);
    __m256 v = _mm256_fnmadd_ps(xv, kv, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(w + i)), iv));
    if (ds) v = _mm256_add_ps(v, _mm256_loadu_ps(ds + i));
    _mm256_storeu_ps(dx + i, v);
    _mm256_storeu_ps(dwc + i, _mm256_fmadd_ps(_mm256_mul_ps(d, xv), iv, _mm256_loadu_ps(dwc + i)));
  }
  for (; i < n; ++i) {
    dx[i] = dy[i] * w[i] * inv - x[i] * k + (ds ? ds[i] : 0.0f);
    dwc[i] += dy[i] * x[i] * inv;
  }
}
#endif

template <typename T, typename Acc>
void forward_rows(const T* x, const T* res, const T* w, T* s, T* y, Acc* rstd, int64_t rows, int64_t n, double eps) {
  bool avx2 = false;
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) avx2 = cpu::has_avx2_fma();
#endif
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      Acc ss;
      const T* in = xr;  // the row that is normalised: x, or s = x + residual
#if defined(__x86_64__)
      if constexpr (std::is_same_v<T, float>) {
        if (avx2) {
          ss = sumsq_avx2(xr, res ? res + r * n : nullptr, res ? s + r * n : nullptr, n);
          if (res) in = s + r * n;
          const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
          rstd[r] = inv;
          scale_avx2(in, w, inv, yr, n);
          continue;
        }
      }
#endif
      if (res) {
        T* sr = s + r * n;
        const T* rr = res + r * n;
        for (int64_t i = 0; i < n; ++i) sr[i] = xr[i] + rr[i];
        in = sr;
      }
      ss = row_sumsq<T, Acc>(in, n);
      const Acc inv = Acc(1) / std::sqrt(ss / static_cast<Acc>(n) + static_cast<Acc>(eps));
      rstd[r] = inv;
      row_scale<T, Acc>(in, w, inv, yr, n);
    }
  });
}

// dx_i = r * g_i - x_i * r^3 * mean_j(g_j x_j) (+ ds_i), with g = dy * w;   dw_i = sum_rows dy_i * x_i * r.
template <typename T, typename Acc>
void backward_rows(const T* dy, const T* x, const T* w, const Acc* rstd, const T* ds, T* dx, Acc* dw_partial,
                   int64_t rows, int64_t n, int64_t chunks) {
  bool avx2 = false;
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) avx2 = cpu::has_avx2_fma();
#endif
  // dw is reduced over rows: each chunk of rows accumulates its own partial sum, summed afterwards.
  int64_t per = (rows + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      Acc* dwc = dw_partial + c * n;
      for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        const T* dyr = dy + r * n;
        const T* xr = x + r * n;
        const T* dsr = ds ? ds + r * n : nullptr;
        T* dxr = dx + r * n;
        Acc inv = rstd[r];
#if defined(__x86_64__)
        if constexpr (std::is_same_v<T, float>) {
          if (avx2) {
            const float k = dot3_avx2(dyr, w, xr, n) * inv * inv * inv / static_cast<float>(n);
            bwd_row_avx2(dyr, xr, w, dsr, inv, k, dxr, dwc, n);
            continue;
          }
        }
#endif
        Acc dot = 0;
        for (int64_t i = 0; i < n; ++i) dot += static_cast<Acc>(dyr[i]) * static_cast<Acc>(w[i]) * static_cast<Acc>(xr[i]);
        Acc k = dot * inv * inv * inv / static_cast<Acc>(n);
        for (int64_t i = 0; i < n; ++i) {
          Acc g = static_cast<Acc>(dyr[i]) * static_cast<Acc>(w[i]);
          Acc v = g * inv - static_cast<Acc>(xr[i]) * k;
          if (dsr) v += static_cast<Acc>(dsr[i]);
          dxr[i] = static_cast<T>(v);
          dwc[i] += static_cast<Acc>(dyr[i]) * static_cast<Acc>(xr[i]) * inv;
        }
      }
    }
  });
}

bool fused_supported(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && w.device().is_cpu() && x.scalar_type() == w.scalar_type() &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble);
}

class RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    auto [y, rstd] = rms_norm_forward_cpu(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto [dx, dw] = rms_norm_backward_cpu(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

namespace {
// {s (residual given: x + residual; else undefined), y, rstd}
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cpu(const at::Tensor& x_in, const at::Tensor& r_in,
                                                           const at::Tensor& w_in, double eps) {
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), r = r_in.defined() ? r_in.contiguous() : r_in;
  int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor sum = r.defined() ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
  auto lead = x.sizes().vec();
  lead.pop_back();
  at::Tensor rstd = at::empty(lead, x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_cpu", [&] {
    forward_rows<scalar_t, scalar_t>(x.const_data_ptr<scalar_t>(), r.defined() ? r.const_data_ptr<scalar_t>() : nullptr,
                                     w.const_data_ptr<scalar_t>(),
                                     sum.defined() ? sum.mutable_data_ptr<scalar_t>() : nullptr,
                                     y.mutable_data_ptr<scalar_t>(), rstd.mutable_data_ptr<scalar_t>(), rows, n, eps);
  });
  return {sum, y, rstd};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(fused_supported(x, w), "rms_norm_forward_cpu: f32/f64 CPU tensors of one dtype expected");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: weight must be [x.size(-1)]");
  auto [s, y, rstd] = forward_cpu(x, at::Tensor(), w, eps);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                                        const at::Tensor& w, double eps) {
  TORCH_CHECK(fused_supported(x, w) && fused_supported(residual, w) && residual.sizes() == x.sizes(),
              "add_rms_norm_forward_cpu: x and residual of one shape, f32/f64 CPU tensors of one dtype expected");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: weight must be [x.size(-1)]");
  return forward_cpu(x, residual, w, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                         const at::Tensor& w_in, const at::Tensor& rstd_in,
                                                         const at::Tensor& ds_in) {
  at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous(), rstd = rstd_in.contiguous();
  at::Tensor ds = ds_in.defined() ? ds_in.contiguous() : ds_in;
  TORCH_CHECK(!ds.defined() || (ds.sizes() == x.sizes() && ds.scalar_type() == x.scalar_type()),
              "rms_norm_backward_cpu: ds must be shaped as x");
  int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads() * 4));
  at::Tensor dx = at::empty_like(x);
  at::Tensor part = at::zeros({chunks, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_backward_cpu", [&] {
    backward_rows<scalar_t, scalar_t>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                      w.const_data_ptr<scalar_t>(), rstd.const_data_ptr<scalar_t>(),
                                      ds.defined() ? ds.const_data_ptr<scalar_t>() : nullptr,
                                      dx.mutable_data_ptr<scalar_t>(), part.mutable_data_ptr<scalar_t>(), rows, n,
                                      chunks);
  });
  return {dx, part.sum(0)};
}

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto in_dtype = x.scalar_type();
  at::Tensor h = x.to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor var = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(var + eps);
  return weight * h.to(in_dtype);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (cuda::supported(x) && weight.scalar_type() == x.scalar_type() && weight.device() == x.device())
    return cuda::rms_norm(x, weight, eps);  // kernels/cuda/rms_norm.cu
  if (!fused_supported(x, weight)) return rms_norm_reference(x, weight, eps);
  return RMSNormFunction::apply(x, weight, eps);
}

}  // namespace lf::kernels

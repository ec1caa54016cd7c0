// CPU causal self-attention (kernels/attention.h): forward, backward, the autograd Function and the composite
// reference.
//
// One task per (batch, head) in the forward and per (batch, key/value head) in the backward (so the GQA group's
// dK/dV sums stay in one thread). Each task walks blocks of R query rows; a block [r0, r1) needs the keys
// [lo, r1), lo the smallest first-visible key of its rows (0 without window or segments):
//   forward   S = scale Q_b K^T, row softmax over each row's visible keys (P, zero elsewhere; lse saved), O_b = P V
//   backward  S, P recomputed from lse; dP = dO_b V^T; dS = P (dP - rowsum(dO_b O_b)); dV += P^T dO_b,
//             dQ_b = scale dS K, dK += scale dS^T Q_b
// The products go straight to the BLAS that LibTorch carries (kernels/cpu/blas.h: MKL's sgemm_/dgemm_, single-threaded
// inside our parallel region, as ATen's own CPU flash attention calls it; at::addmm_ on views where LibTorch exports no
// such symbol). The row passes run AVX2+FMA for float32 where the CPU has it.
#include "loongforge/kernels/attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <unordered_map>
#include <vector>

#include "loongforge/kernels/cpu/blas.h"
#include "loongforge/kernels/cpu/vec_math.h"

namespace lf::kernels {
namespace {

// Query rows per block. BM_Attention, split over 2 threads: T 256 D 32: 64 rows 9.8 ms, 128: 11.2, 256: 12.6;
// T 512 D 64: 64 rows 32.0-32.8 ms, 128: 32.3-32.4, 256: 35.7-36.8 (SDPA: 14.1 / 50.9 ms).
constexpr int64_t kDefaultBlockRows = 64;

using cpu::gemm;

// ---- row passes --------------------------------------------------------------------------------------------
// Forward: s[0..n) scores of one query; visible keys [a, b). P in place (zero outside [a, b)); returns the lse.
template <typename T>
T softmax_row_generic(T* s, int64_t n, int64_t a, int64_t b) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = a; j < b; ++j) m = s[j] > m ? s[j] : m;
  T sum = 0;
  for (int64_t j = a; j < b; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  const T inv = T(1) / sum;
  for (int64_t j = 0; j < a; ++j) s[j] = 0;
  for (int64_t j = a; j < b; ++j) s[j] *= inv;
  for (int64_t j = b; j < n; ++j) s[j] = 0;
  return m + std::log(sum);
}

// Backward: s scores, dp = dO V^T of one query. s becomes P = exp(s - lse), dp becomes dS = P (dp - di); both zero
// outside [a, b).
template <typename T>
void grad_row_generic(T* s, T* dp, int64_t n, int64_t a, int64_t b, T lse, T di) {
  for (int64_t j = 0; j < a; ++j) s[j] = dp[j] = 0;
  for (int64_t j = a; j < b; ++j) {
    const T p = std::exp(s[j] - lse);
    s[j] = p;
    dp[j] = p * (dp[j] - di);
  }
  for (int64_t j = b; j < n; ++j) s[j] = dp[j] = 0;
}

template <typename T>
T dot(const T* x, const T* y, int64_t n) {
  T acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * y[i];
  return acc;
}

#if defined(__x86_64__)
using cpu::exp8;
using cpu::hmax8;
using cpu::hsum8;
// Lanes j < cnt of a partial vector (cnt in 0..8).
LF_AVX2 inline __m256i lanes(int64_t cnt) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cnt)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

LF_AVX2 float softmax_row_avx2(float* s, int64_t n, int64_t a, int64_t b) {
  const float ninf = -std::numeric_limits<float>::infinity();
  __m256 mv = _mm256_set1_ps(ninf);
  int64_t j = a;
  for (; j + 8 <= b; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  float m = hmax8(mv);
  for (int64_t i = j; i < b; ++i) m = s[i] > m ? s[i] : m;
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (j = a; j + 8 <= b; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
    _mm256_storeu_ps(s + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  if (j < b) {
    const __m256i k = lanes(b - j);
    __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, k), mb));
    e = _mm256_and_ps(e, _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(s + j, k, e);
    sv = _mm256_add_ps(sv, e);
  }
  const float sum = hsum8(sv);
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (j = a; j + 8 <= b; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
  for (; j < b; ++j) s[j] *= 1.0f / sum;
  for (j = 0; j < a; ++j) s[j] = 0.0f;
  for (j = b; j < n; ++j) s[j] = 0.0f;
  return m + std::log(sum);
}

LF_AVX2 void grad_row_avx2(float* s, float* dp, int64_t n, int64_t a, int64_t b, float lse, float di) {
  for (int64_t j = 0; j < a; ++j) s[j] = dp[j] = 0.0f;
  const __m256 lv = _mm256_set1_ps(lse), dv = _mm256_set1_ps(di);
  int64_t j = a;
  for (; j + 8 <= b; j += 8) {
    __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), lv));
    _mm256_storeu_ps(s + j, p);
    _mm256_storeu_ps(dp + j, _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dp + j), dv)));
  }
  if (j < b) {
    const __m256i k = lanes(b - j);
    __m256 p = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, k), lv));
    _mm256_maskstore_ps(s + j, k, p);
    _mm256_maskstore_ps(dp + j, k, _mm256_mul_ps(p, _mm256_sub_ps(_mm256_maskload_ps(dp + j, k), dv)));
  }
  for (j = b; j < n; ++j) s[j] = dp[j] = 0.0f;
}

LF_AVX2 float dot_avx2(const float* x, const float* y, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
  float r = hsum8(acc);
  for (; i < n; ++i) r += x[i] * y[i];
  return r;
}

#endif

template <typename T>
T softmax_row(T* s, int64_t n, int64_t a, int64_t b) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>)
    if (cpu::has_avx2_fma()) return softmax_row_avx2(s, n, a, b);
#endif
  return softmax_row_generic(s, n, a, b);
}
template <typename T>
void grad_row(T* s, T* dp, int64_t n, int64_t a, int64_t b, T lse, T di) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>)
    if (cpu::has_avx2_fma()) return grad_row_avx2(s, dp, n, a, b, lse, di);
#endif
  grad_row_generic(s, dp, n, a, b, lse, di);
}
template <typename T>
T row_dot(const T* x, const T* y, int64_t n) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>)
    if (cpu::has_avx2_fma()) return dot_avx2(x, y, n);
#endif
  return dot(x, y, n);
}

// ---- visibility ----------------------------------------------------------------------------------------------
// Per batch row: query t sees keys of [first[t], end[t]) (end = t + 1 when causal, else the end of its segment or
// T); seg = the row's segment ids where a segment's positions are not one contiguous run (then visibility inside
// that range is checked key by key), else null. With an explicit mask (masked_attention) [first, end) spans the
// query's first to last allowed key, mask[b] points at the row's [T, S] mask where some range has holes, and a
// query that sees no key has first = S, end = 0 (empty: zero output, no gradient).
struct Visibility {
  std::vector<int64_t> first, end;
  std::vector<const int64_t*> seg;  // per batch row
  std::vector<const bool*> mask;    // per batch row ([T, S] row-major), explicit masks only
  at::Tensor held;                  // the explicit mask the pointers point into
  int64_t T = 0, S = 0;

  Visibility(const at::Tensor& segment_ids, int64_t B, int64_t T_, int64_t window, bool causal)
      : first(B * T_), end(B * T_), seg(B), mask(B), T(T_), S(T_) {
    const int64_t* sp = segment_ids.defined() ? segment_ids.const_data_ptr<int64_t>() : nullptr;
    for (int64_t b = 0; b < B; ++b) {
      int64_t* f = first.data() + b * T;
      int64_t* e = end.data() + b * T;
      bool runs = true;
      if (sp) {
        const int64_t* s = sp + b * T;
        std::unordered_map<int64_t, std::pair<int64_t, int64_t>> range;  // segment -> first, last position + 1
        for (int64_t t = 0; t < T; ++t) {
          auto [it, fresh] = range.emplace(s[t], std::pair<int64_t, int64_t>{t, t + 1});
          if (!fresh && t > 0 && s[t - 1] != s[t]) runs = false;  // a segment that comes back after another
          it->second.second = t + 1;
        }
        for (int64_t t = 0; t < T; ++t) {
          const auto& r = range[s[t]];
          f[t] = r.first;
          e[t] = causal ? t + 1 : r.second;
        }
        if (!runs) seg[b] = s;
      } else {
        std::fill(f, f + T, 0);
        for (int64_t t = 0; t < T; ++t) e[t] = causal ? t + 1 : T;
      }
      if (window > 0)
        for (int64_t t = 0; t < T; ++t) f[t] = std::max(f[t], t - window + 1);
    }
  }

  // allowed: bool [B, T_, S_], contiguous.
  Visibility(const at::Tensor& allowed, int64_t B, int64_t T_, int64_t S_)
      : first(B * T_), end(B * T_), seg(B), mask(B), held(allowed), T(T_), S(S_) {
    const bool* ap = held.const_data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      bool holes = false;
      for (int64_t t = 0; t < T; ++t) {
        const bool* row = ap + (b * T + t) * S;
        int64_t f = 0, e = S;
        while (f < S && !row[f]) ++f;
        while (e > f && !row[e - 1]) --e;
        if (f == e) f = S, e = 0;
        for (int64_t j = f; j < e && !holes; ++j) holes = !row[j];
        first[b * T + t] = f;
        end[b * T + t] = e;
      }
      if (holes) mask[b] = ap + b * T * S;
    }
  }
  // The first key any row of [r0, r1) needs.
  int64_t block_lo(int64_t b, int64_t r0, int64_t r1) const {
    const int64_t* f = first.data() + b * T;
    int64_t lo = f[r0];
    for (int64_t t = r0 + 1; t < r1; ++t) lo = std::min(lo, f[t]);
    return lo;
  }
  // One past the last key any row of [r0, r1) needs.
  int64_t block_hi(int64_t b, int64_t r0, int64_t r1) const {
    const int64_t* e = end.data() + b * T;
    int64_t hi = e[r0];
    for (int64_t t = r0 + 1; t < r1; ++t) hi = std::max(hi, e[t]);
    return hi;
  }
};

// Keys of [lo, lo + n) that query t may not see inside its range [first, end) are set to -inf (segments that are not
// contiguous runs, and explicit masks with holes, only).
template <typename T>
void mask_foreign(T* s, const Visibility& vis, int64_t b, int64_t lo, int64_t a, int64_t e, int64_t t) {
  const T ninf = -std::numeric_limits<T>::infinity();
  if (const int64_t* seg = vis.seg[b]) {
    for (int64_t j = a; j < e; ++j)
      if (seg[lo + j] != seg[t]) s[j] = ninf;
  } else if (const bool* m = vis.mask[b]) {
    const bool* row = m + t * vis.S + lo;
    for (int64_t j = a; j < e; ++j)
      if (!row[j]) s[j] = ninf;
  }
}

struct Shape {
  int64_t B, H, Hkv, T, D, G;
};
Shape shape_of(const at::Tensor& q, const at::Tensor& k) {
  return {q.size(0), q.size(1), k.size(1), q.size(2), q.size(3), q.size(1) / k.size(1)};
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale_d,
                  const Visibility& vis, int64_t R, at::Tensor& out, at::Tensor& lse) {
  const Shape sh = shape_of(q, k);
  const int64_t S = vis.S;
  const T scale = static_cast<T>(scale_d);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();  // [B,T,H,D]
  T* lp = lse.mutable_data_ptr<T>();  // [B,H,T]
  const int64_t ldq = q.stride(2), ldk = k.stride(2), ldv = v.stride(2), ldo = sh.H * sh.D;
  at::parallel_for(0, sh.B * sh.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> sbuf(static_cast<size_t>(std::min(R, sh.T) * S));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / sh.H, h = task % sh.H, kh = h / sh.G;
      const T* Q = qp + b * q.stride(0) + h * q.stride(1);
      const T* K = kp + b * k.stride(0) + kh * k.stride(1);
      const T* V = vp + b * v.stride(0) + kh * v.stride(1);
      T* O = op + b * sh.T * ldo + h * sh.D;
      T* L = lp + (b * sh.H + h) * sh.T;
      const int64_t* f = vis.first.data() + b * sh.T;
      const int64_t* e = vis.end.data() + b * sh.T;
      for (int64_t r0 = 0; r0 < sh.T; r0 += R) {
        const int64_t r1 = std::min(sh.T, r0 + R), rows = r1 - r0;
        const int64_t lo = vis.block_lo(b, r0, r1), n = vis.block_hi(b, r0, r1) - lo;
        if (n <= 0) {  // no row of the block sees a key
          for (int64_t t = r0; t < r1; ++t) {
            std::fill(O + t * ldo, O + t * ldo + sh.D, T(0));
            L[t] = std::numeric_limits<T>::infinity();
          }
          continue;
        }
        T* Sc = sbuf.data();
        gemm<T>(false, true, rows, n, sh.D, scale, Q + r0 * ldq, ldq, K + lo * ldk, ldk, T(0), Sc, n);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t t = r0 + i;
          T* s = Sc + i * n;
          if (e[t] <= f[t]) {  // sees no key: a zero row of P, lse +inf (no gradient)
            std::fill(s, s + n, T(0));
            L[t] = std::numeric_limits<T>::infinity();
            continue;
          }
          mask_foreign(s, vis, b, lo, f[t] - lo, e[t] - lo, t);
          L[t] = softmax_row(s, n, f[t] - lo, e[t] - lo);
        }
        gemm<T>(false, false, rows, sh.D, n, T(1), Sc, n, V + lo * ldv, ldv, T(0), O + r0 * ldo, ldo);
      }
    }
  });
}

template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, double scale_d, const Visibility& vis, int64_t R,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const Shape sh = shape_of(q, k);
  const int64_t S = vis.S;
  const T scale = static_cast<T>(scale_d);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const T* op = out.const_data_ptr<T>();
  const T* gp = dout.const_data_ptr<T>();
  const T* lp = lse.const_data_ptr<T>();
  T* dqp = dq.mutable_data_ptr<T>();  // [B,T,H,D]
  T* dkp = dk.mutable_data_ptr<T>();  // [B,S,Hkv,D], zeroed
  T* dvp = dv.mutable_data_ptr<T>();
  const int64_t ldq = q.stride(2), ldk = k.stride(2), ldv = v.stride(2), ldo = out.stride(2), ldg = dout.stride(2);
  const int64_t lddq = sh.H * sh.D, lddk = sh.Hkv * sh.D;
  at::parallel_for(0, sh.B * sh.Hkv, 1, [&](int64_t begin, int64_t end) {
    const size_t cap = static_cast<size_t>(std::min(R, sh.T) * S);
    std::vector<T> sbuf(cap), pbuf(cap);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / sh.Hkv, kh = task % sh.Hkv;
      const T* K = kp + b * k.stride(0) + kh * k.stride(1);
      const T* V = vp + b * v.stride(0) + kh * v.stride(1);
      T* dK = dkp + b * S * lddk + kh * sh.D;
      T* dV = dvp + b * S * lddk + kh * sh.D;
      const int64_t* f = vis.first.data() + b * sh.T;
      const int64_t* e = vis.end.data() + b * sh.T;
      for (int64_t h = kh * sh.G; h < (kh + 1) * sh.G; ++h) {
        const T* Q = qp + b * q.stride(0) + h * q.stride(1);
        const T* O = op + b * out.stride(0) + h * out.stride(1);
        const T* dO = gp + b * dout.stride(0) + h * dout.stride(1);
        const T* L = lp + (b * sh.H + h) * sh.T;
        T* dQ = dqp + b * sh.T * lddq + h * sh.D;
        for (int64_t r0 = 0; r0 < sh.T; r0 += R) {
          const int64_t r1 = std::min(sh.T, r0 + R), rows = r1 - r0;
          const int64_t lo = vis.block_lo(b, r0, r1), n = vis.block_hi(b, r0, r1) - lo;
          if (n <= 0) {
            for (int64_t t = r0; t < r1; ++t) std::fill(dQ + t * lddq, dQ + t * lddq + sh.D, T(0));
            continue;
          }
          T* Sc = sbuf.data();
          T* P = pbuf.data();
          gemm<T>(false, true, rows, n, sh.D, scale, Q + r0 * ldq, ldq, K + lo * ldk, ldk, T(0), Sc, n);
          gemm<T>(false, true, rows, n, sh.D, T(1), dO + r0 * ldg, ldg, V + lo * ldv, ldv, T(0), P, n);
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t t = r0 + i;
            T* s = Sc + i * n;
            if (e[t] <= f[t]) {
              std::fill(s, s + n, T(0));
              std::fill(P + i * n, P + i * n + n, T(0));
              continue;
            }
            mask_foreign(s, vis, b, lo, f[t] - lo, e[t] - lo, t);
            const T di = row_dot(dO + t * ldg, O + t * ldo, sh.D);
            grad_row(s, P + i * n, n, f[t] - lo, e[t] - lo, L[t], di);
          }
          gemm<T>(true, false, n, sh.D, rows, T(1), Sc, n, dO + r0 * ldg, ldg, T(1), dV + lo * lddk, lddk);
          gemm<T>(false, false, rows, sh.D, n, scale, P, n, K + lo * ldk, ldk, T(0), dQ + r0 * lddq, lddq);
          gemm<T>(true, false, n, sh.D, rows, scale, P, n, Q + r0 * ldq, ldq, T(1), dK + lo * lddk, lddk);
        }
      }
    }
  });
}

bool kernel_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seg) {
  const auto dt = q.scalar_type();
  if (!(dt == at::kFloat || dt == at::kDouble) || k.scalar_type() != dt || v.scalar_type() != dt) return false;
  if (!q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu()) return false;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || k.sizes() != v.sizes()) return false;
  if (q.size(0) != k.size(0) || q.size(2) != k.size(2) || q.size(3) != k.size(3) || k.size(1) == 0 ||
      q.size(1) % k.size(1) != 0)
    return false;
  if (seg.defined() && (seg.dim() != 2 || seg.size(0) != q.size(0) || seg.size(1) != q.size(2) ||
                        at::isFloatingType(seg.scalar_type()) || !seg.device().is_cpu()))
    return false;
  return true;
}

// masked_attention's inputs: q [B,H,T,D], k/v [B,Hkv,S,D], allowed bool [B,T,S] (or [B,1,T,S]), one float dtype, CPU.
bool masked_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed) {
  const auto dt = q.scalar_type();
  if (!(dt == at::kFloat || dt == at::kDouble) || k.scalar_type() != dt || v.scalar_type() != dt) return false;
  if (!q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu() || !allowed.device().is_cpu()) return false;
  if (q.dim() != 4 || k.dim() != 4 || k.sizes() != v.sizes()) return false;
  if (q.size(0) != k.size(0) || q.size(3) != k.size(3) || k.size(1) == 0 || q.size(1) % k.size(1) != 0) return false;
  if (allowed.scalar_type() != at::kBool) return false;
  const at::Tensor m = allowed.dim() == 4 && allowed.size(1) == 1 ? allowed.squeeze(1) : allowed;
  return m.dim() == 3 && m.size(0) == q.size(0) && m.size(1) == q.size(2) && m.size(2) == k.size(2);
}

at::Tensor mask3(const at::Tensor& allowed) {
  return (allowed.dim() == 4 ? allowed.squeeze(1) : allowed).contiguous();
}

at::Tensor last_dim_dense(const at::Tensor& x) { return x.stride(-1) == 1 || x.size(-1) == 1 ? x : x.contiguous(); }

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, double scale, int64_t window, const std::optional<at::Tensor>& seg,
                            bool causal) {
    at::Tensor s = seg.has_value() ? *seg : at::Tensor();
    auto [out, lse] = causal_attention_forward_cpu(q, k, v, scale, window, s, 0, causal);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    ctx->saved_data["causal"] = causal;
    if (s.defined()) ctx->saved_data["seg"] = s;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto sv = ctx->get_saved_variables();
    at::Tensor seg = ctx->saved_data.count("seg") ? ctx->saved_data["seg"].toTensor() : at::Tensor();
    auto [dq, dk, dv] = causal_attention_backward_cpu(grads[0], sv[0], sv[1], sv[2], sv[3], sv[4],
                                                      ctx->saved_data["scale"].toDouble(),
                                                      ctx->saved_data["window"].toInt(), seg, 0,
                                                      ctx->saved_data["causal"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class MaskedAttentionFunction : public torch::autograd::Function<MaskedAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, double scale, const at::Tensor& allowed) {
    auto [out, lse] = masked_attention_forward_cpu(q, k, v, scale, allowed);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["allowed"] = allowed;
    return out;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto sv = ctx->get_saved_variables();
    auto [dq, dk, dv] = masked_attention_backward_cpu(grads[0], sv[0], sv[1], sv[2], sv[3], sv[4],
                                                      ctx->saved_data["scale"].toDouble(),
                                                      ctx->saved_data["allowed"].toTensor());
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

// The forward / backward passes over a visibility (both entry points below).
std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               double scale, const Visibility& vis, int64_t block_rows) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  at::Tensor lse = at::empty({B, H, T}, q.options());
  if (q.numel() > 0) {
    const int64_t R = block_rows > 0 ? block_rows : kDefaultBlockRows;
    if (q.scalar_type() == at::kFloat) forward_impl<float>(q, k, v, scale, vis, R, out, lse);
    else forward_impl<double>(q, k, v, scale, vis, R, out, lse);
  }
  return {out.transpose(1, 2), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const at::Tensor& dout, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            const at::Tensor& out, const at::Tensor& lse, double scale,
                                                            const Visibility& vis, int64_t block_rows) {
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), T = q.size(2), S = k.size(2), D = q.size(3);
  at::Tensor dq = at::empty({B, T, H, D}, q.options());
  at::Tensor dk = at::zeros({B, S, Hkv, D}, q.options()), dv = at::zeros({B, S, Hkv, D}, q.options());
  if (q.numel() > 0) {
    const int64_t R = block_rows > 0 ? block_rows : kDefaultBlockRows;
    if (q.scalar_type() == at::kFloat) backward_impl<float>(dout, q, k, v, out, lse, scale, vis, R, dq, dk, dv);
    else backward_impl<double>(dout, q, k, v, out, lse, scale, vis, R, dq, dk, dv);
  }
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_attention_forward_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                const at::Tensor& v_in, double scale, int64_t window,
                                                                const at::Tensor& segment_ids, int64_t block_rows,
                                                                bool causal) {
  TORCH_CHECK(kernel_supported(q_in, k_in, v_in, segment_ids),
              "causal_attention_forward_cpu: q [B,H,T,D], k/v [B,Hkv,T,D] (H a multiple of Hkv), one dtype "
              "(float32/float64) on the CPU, segment_ids integer [B,T]");
  at::NoGradGuard ng;
  at::Tensor q = last_dim_dense(q_in), k = last_dim_dense(k_in), v = last_dim_dense(v_in);
  at::Tensor seg = segment_ids.defined() ? segment_ids.to(at::kLong).contiguous() : at::Tensor();
  const Visibility vis(seg, q.size(0), q.size(2), causal ? window : 0, causal);
  return run_forward(q, k, v, scale, vis, block_rows);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, double scale, int64_t window, const at::Tensor& segment_ids,
    int64_t block_rows, bool causal) {
  TORCH_CHECK(kernel_supported(q_in, k_in, v_in, segment_ids) && dout_in.sizes() == q_in.sizes() &&
                  out_in.sizes() == q_in.sizes() && lse.is_contiguous() && lse.scalar_type() == q_in.scalar_type(),
              "causal_attention_backward_cpu: dout/out shaped as q, lse [B,H,T] contiguous, as the forward gives");
  at::NoGradGuard ng;
  at::Tensor q = last_dim_dense(q_in), k = last_dim_dense(k_in), v = last_dim_dense(v_in);
  at::Tensor out = last_dim_dense(out_in), dout = last_dim_dense(dout_in);
  at::Tensor seg = segment_ids.defined() ? segment_ids.to(at::kLong).contiguous() : at::Tensor();
  const Visibility vis(seg, q.size(0), q.size(2), causal ? window : 0, causal);
  return run_backward(dout, q, k, v, out, lse, scale, vis, block_rows);
}

std::tuple<at::Tensor, at::Tensor> masked_attention_forward_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                const at::Tensor& v_in, double scale,
                                                                const at::Tensor& allowed, int64_t block_rows) {
  TORCH_CHECK(masked_supported(q_in, k_in, v_in, allowed),
              "masked_attention_forward_cpu: q [B,H,T,D], k/v [B,Hkv,S,D] (H a multiple of Hkv), one dtype "
              "(float32/float64) on the CPU, allowed bool [B,T,S]");
  at::NoGradGuard ng;
  at::Tensor q = last_dim_dense(q_in), k = last_dim_dense(k_in), v = last_dim_dense(v_in);
  const Visibility vis(mask3(allowed), q.size(0), q.size(2), k.size(2));
  return run_forward(q, k, v, scale, vis, block_rows);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_attention_backward_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, double scale, const at::Tensor& allowed, int64_t block_rows) {
  TORCH_CHECK(masked_supported(q_in, k_in, v_in, allowed) && dout_in.sizes() == q_in.sizes() &&
                  out_in.sizes() == q_in.sizes() && lse.is_contiguous() && lse.scalar_type() == q_in.scalar_type(),
              "masked_attention_backward_cpu: dout/out shaped as q, lse [B,H,T] contiguous, as the forward gives");
  at::NoGradGuard ng;
  at::Tensor q = last_dim_dense(q_in), k = last_dim_dense(k_in), v = last_dim_dense(v_in);
  at::Tensor out = last_dim_dense(out_in), dout = last_dim_dense(dout_in);
  const Visibility vis(mask3(allowed), q.size(0), q.size(2), k.size(2));
  return run_backward(dout, q, k, v, out, lse, scale, vis, block_rows);
}

at::Tensor causal_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                      int64_t window, const at::Tensor& segment_ids) {
  const int64_t t = q.size(2);
  auto opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  at::Tensor pos = at::arange(t, opts);
  at::Tensor allowed = pos.unsqueeze(0) <= pos.unsqueeze(1);  // [Tq, Tk]
  if (window > 0) allowed = allowed.logical_and(pos.unsqueeze(0) > pos.unsqueeze(1) - window);
  if (segment_ids.defined())
    allowed = allowed.unsqueeze(0).logical_and(segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1);
  return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, scale, q.size(1) != k.size(1));
}

bool causal_attention_kernel_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& segment_ids) {
  return kernel_supported(q, k, v, segment_ids);
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t window, const at::Tensor& segment_ids) {
  if (!kernel_supported(q, k, v, segment_ids)) return causal_attention_reference(q, k, v, scale, window, segment_ids);
  std::optional<at::Tensor> seg;
  if (segment_ids.defined()) seg = segment_ids;
  return AttentionFunction::apply(q, k, v, scale, window, seg, true);
}

at::Tensor full_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                    const at::Tensor& segment_ids) {
  std::optional<at::Tensor> allowed;
  if (segment_ids.defined()) allowed = (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1);
  return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, scale, q.size(1) != k.size(1));
}

at::Tensor full_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          const at::Tensor& segment_ids) {
  if (!kernel_supported(q, k, v, segment_ids)) return full_attention_reference(q, k, v, scale, segment_ids);
  std::optional<at::Tensor> seg;
  if (segment_ids.defined()) seg = segment_ids;
  return AttentionFunction::apply(q, k, v, scale, int64_t{0}, seg, false);
}


bool masked_attention_kernel_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& allowed) {
  return masked_supported(q, k, v, allowed);
}

at::Tensor masked_attention_reference(const at::Tensor& q, at::Tensor k, at::Tensor v, double scale,
                                      const at::Tensor& allowed) {
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), S = k.size(2), D = q.size(3);
  if (H != Hkv) {
    k = k.unsqueeze(2).expand({B, Hkv, H / Hkv, S, D}).reshape({B, H, S, D});
    v = v.unsqueeze(2).expand({B, Hkv, H / Hkv, S, D}).reshape({B, H, S, D});
  }
  const at::Tensor m = allowed.dim() == 4 ? allowed : allowed.unsqueeze(1);  // [B,1,T,S]
  at::Tensor w = at::matmul(q, k.transpose(2, 3)) * scale;
  w = w.masked_fill(m.logical_not(), -std::numeric_limits<double>::infinity());
  // rows that see no key: softmax over -inf gives NaN; those rows are zero (as the kernel gives)
  const at::Tensor none = m.logical_not().all(-1, true);
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // float32 or better, as transformers
  w = at::softmax(w.masked_fill(none, 0.0), -1, acc).to(q.scalar_type()).masked_fill(none, 0.0);
  return at::matmul(w, v);
}

at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const at::Tensor& allowed) {
  if (!masked_supported(q, k, v, allowed)) return masked_attention_reference(q, k, v, scale, allowed);
  return MaskedAttentionFunction::apply(q, k, v, scale, allowed);
}

}  // namespace lf::kernels

// CPU kernels of the fused gated delta rule (kernels/gated_delta.h), and its autograd Function.
//
// Per token, forward (rows i of the state, a_i the row's decay):
//   pass 1: S[i,:] *= a_i;  r += k_i S[i,:]           then u = v - r, d = beta u
//   pass 2: S[i,:] += k_i d; o += q_i S[i,:]
// Backward of token t, dS holding the gradient of S_t from the tokens after it (S_t, S_{t-1} from the recomputed chunk):
//   pass A: dS[i,:] += q_i do;  dd += k_i dS[i,:];  dk_i = dS[i,:] . d
//           dv = beta dd, dbeta = dd . u, dr = -beta dd
//   pass B: dq_i = S_t[i,:] . do;  dk_i += S_t[i,:] . dr - k_i (d . dr);  dS[i,:] += k_i dr;
//           da_i = dS[i,:] . S_{t-1}[i,:];  dS[i,:] *= a_i
//   dg = a da (summed over the rows for a per-head decay).
#include "loongforge/kernels/gated_delta.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/kernels/cpu/row_ops.h"

namespace lf::kernels {
namespace {

struct Dims {
  int64_t b = 0, h = 0, t = 0, dk = 0, dv = 0, chunk = 0, n = 0;
  bool channel = false;  // per-channel decays g [B, H, T, Dk]
};

Dims check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
           int64_t chunk) {
  auto fail = [](const std::string& why) { return Error("gated_delta_rule: " + why); };
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) throw fail("q, k, v must be [B, heads, T, dim]");
  if (q.sizes() != k.sizes()) throw fail("q and k shapes differ");
  Dims d{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3), chunk, 0, g.dim() == 4};
  if (v.size(0) != d.b || v.size(1) != d.h || v.size(2) != d.t) throw fail("v's batch / heads / time differ from q's");
  if (beta.dim() != 3 || beta.size(0) != d.b || beta.size(1) != d.h || beta.size(2) != d.t) throw fail("beta must be [B, H, T]");
  if (g.dim() < 3 || g.dim() > 4 || g.size(0) != d.b || g.size(1) != d.h || g.size(2) != d.t ||
      (d.channel && g.size(3) != d.dk))
    throw fail("g must be [B, H, T] or [B, H, T, Dk]");
  if (chunk <= 0) throw fail("chunk must be positive");
  d.n = (d.t + chunk - 1) / chunk;
  return d;
}

// The decays of token t (one per row): a[i] = exp(g).
template <typename T>
inline void decays(const Dims& d, const T* gb, int64_t t, T* a) {
  if (d.channel) {
    for (int64_t i = 0; i < d.dk; ++i) a[i] = std::exp(gb[t * d.dk + i]);
  } else {
    std::fill(a, a + d.dk, std::exp(gb[t]));
  }
}

// Row operations, each one loop over a state row: plain loops (float64, CPUs without AVX2, rows whose length is no
// multiple of 8) or AVX2 + FMA intrinsics, inlined into the tasks below (whose float32 versions are compiled for AVX2).
template <typename T>
struct PlainOps : cpu::PlainRowOps<T> {
  // forward pass 1: row *= a; r += k row
  static inline void decay_read(T* row, T a, T k, T* r, int64_t n) {
    for (int64_t x = 0; x < n; ++x) {
      row[x] *= a;
      r[x] += k * row[x];
    }
  }
  // forward pass 2: row += k w; o += q row (o may be null)
  static inline void write_read(T* row, T k, const T* w, T q, T* o, int64_t n) {
    for (int64_t x = 0; x < n; ++x) {
      row[x] += k * w[x];
      if (o) o[x] += q * row[x];
    }
  }
  // backward pass A: row += q do; dd += k row; returns row . wr
  static inline T pass_a(T* row, T q, const T* dov, T k, T* dd, const T* wr, int64_t n) {
    T acc = 0;
    for (int64_t x = 0; x < n; ++x) {
      row[x] += q * dov[x];
      dd[x] += k * row[x];
      acc += row[x] * wr[x];
    }
    return acc;
  }
  // backward pass B: dq = st . do, dkr = st . dr; row += k dr; da = row . sp; row *= a
  static inline void pass_b(const T* st, const T* sp, T* row, const T* dov, const T* dr, T k, T a, int64_t n, T& dq,
                            T& dkr, T& da) {
    T q = 0, kr = 0, aa = 0;
    for (int64_t x = 0; x < n; ++x) {
      q += st[x] * dov[x];
      kr += st[x] * dr[x];
      row[x] += k * dr[x];
      aa += row[x] * sp[x];
      row[x] *= a;
    }
    dq = q, dkr = kr, da = aa;
  }
};
#if defined(__x86_64__)
struct AvxOps : cpu::AvxRowOps {
  using P = PlainOps<float>;
  LF_AVX2 static inline void decay_read(float* row, float a, float k, float* r, int64_t n) {
    if (n % 8) return P::decay_read(row, a, k, r, n);
    const __m256 va = _mm256_set1_ps(a), vk = _mm256_set1_ps(k);
    for (int64_t x = 0; x < n; x += 8) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + x), va);
      _mm256_storeu_ps(row + x, s);
      _mm256_storeu_ps(r + x, _mm256_fmadd_ps(vk, s, _mm256_loadu_ps(r + x)));
    }
  }
  LF_AVX2 static inline void write_read(float* row, float k, const float* w, float q, float* o, int64_t n) {
    if (n % 8) return P::write_read(row, k, w, q, o, n);
    const __m256 vk = _mm256_set1_ps(k), vq = _mm256_set1_ps(q);
    for (int64_t x = 0; x < n; x += 8) {
      const __m256 s = _mm256_fmadd_ps(vk, _mm256_loadu_ps(w + x), _mm256_loadu_ps(row + x));
      _mm256_storeu_ps(row + x, s);
      if (o) _mm256_storeu_ps(o + x, _mm256_fmadd_ps(vq, s, _mm256_loadu_ps(o + x)));
    }
  }
  LF_AVX2 static inline float pass_a(float* row, float q, const float* dov, float k, float* dd, const float* wr,
                                     int64_t n) {
    if (n % 8) return P::pass_a(row, q, dov, k, dd, wr, n);
    const __m256 vq = _mm256_set1_ps(q), vk = _mm256_set1_ps(k);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t x = 0; x < n; x += 8) {
      const __m256 s = _mm256_fmadd_ps(vq, _mm256_loadu_ps(dov + x), _mm256_loadu_ps(row + x));
      _mm256_storeu_ps(row + x, s);
      _mm256_storeu_ps(dd + x, _mm256_fmadd_ps(vk, s, _mm256_loadu_ps(dd + x)));
      acc = _mm256_fmadd_ps(s, _mm256_loadu_ps(wr + x), acc);
    }
    return cpu::hsum8(acc);
  }
  LF_AVX2 static inline void pass_b(const float* st, const float* sp, float* row, const float* dov, const float* dr,
                                    float k, float a, int64_t n, float& dq, float& dkr, float& da) {
    if (n % 8) return P::pass_b(st, sp, row, dov, dr, k, a, n, dq, dkr, da);
    const __m256 vk = _mm256_set1_ps(k), va = _mm256_set1_ps(a);
    __m256 aq = _mm256_setzero_ps(), ak = _mm256_setzero_ps(), aa = _mm256_setzero_ps();
    for (int64_t x = 0; x < n; x += 8) {
      const __m256 sv = _mm256_loadu_ps(st + x), vdr = _mm256_loadu_ps(dr + x);
      aq = _mm256_fmadd_ps(sv, _mm256_loadu_ps(dov + x), aq);
      ak = _mm256_fmadd_ps(sv, vdr, ak);
      const __m256 s = _mm256_fmadd_ps(vk, vdr, _mm256_loadu_ps(row + x));
      aa = _mm256_fmadd_ps(s, _mm256_loadu_ps(sp + x), aa);
      _mm256_storeu_ps(row + x, _mm256_mul_ps(s, va));
    }
    dq = cpu::hsum8(aq), dkr = cpu::hsum8(ak), da = cpu::hsum8(aa);
  }
};
#endif

// Scratch of a task: decays, the read / write row, and (backward) the chunk's states and u rows.
template <typename T>
struct Scratch {
  std::vector<T> a, r, dd, dr, wr, da, states, us;
  Scratch(const Dims& d, bool backward)
      : a(static_cast<size_t>(d.dk)), r(static_cast<size_t>(d.dv)), dd(static_cast<size_t>(d.dv)),
        dr(static_cast<size_t>(d.dv)), wr(static_cast<size_t>(d.dv)), da(static_cast<size_t>(d.dk)),
        states(backward ? static_cast<size_t>((d.chunk + 1) * d.dk * d.dv) : 0),
        us(backward ? static_cast<size_t>(d.chunk * d.dv) : 0) {}
};

// One token's forward on the state S [Dk, Dv] (in place); u (may be null) gets v - S'^T k, o (may be null) the output.
template <typename T, class Op>
inline __attribute__((always_inline)) void step(const Dims& d, T* S, const T* a, const T* qt, const T* kt,
                                                const T* vt, T beta, T* r, T* u, T* o) {
  std::fill(r, r + d.dv, T(0));
  for (int64_t i = 0; i < d.dk; ++i) Op::decay_read(S + i * d.dv, a[i], kt[i], r, d.dv);
  for (int64_t j = 0; j < d.dv; ++j) r[j] = vt[j] - r[j];  // u
  if (u) std::copy(r, r + d.dv, u);
  for (int64_t j = 0; j < d.dv; ++j) r[j] *= beta;  // the write beta u
  if (o) std::fill(o, o + d.dv, T(0));
  for (int64_t i = 0; i < d.dk; ++i) Op::write_read(S + i * d.dv, kt[i], r, o ? qt[i] : T(0), o, d.dv);
}

struct Ptrs {  // the operands and results of one call (raw pointers, contiguous)
  const void *q, *k, *v, *g, *beta, *s0, *dout, *dfin, *ckpt_in;
  void *out, *fin, *ckpt, *dq, *dk, *dv, *dg, *dbeta, *ds0;
};

template <typename T, class Op>
inline __attribute__((always_inline)) void forward_task(const Dims& d, const Ptrs& p, int64_t task, Scratch<T>& w) {
  const int64_t state = d.dk * d.dv, gw = d.channel ? d.dk : 1;
  const T *q = static_cast<const T*>(p.q), *k = static_cast<const T*>(p.k), *v = static_cast<const T*>(p.v);
  const T *g = static_cast<const T*>(p.g), *beta = static_cast<const T*>(p.beta), *s0 = static_cast<const T*>(p.s0);
  T* S = static_cast<T*>(p.fin) + task * state;  // the running state, left as the final one
  if (s0) std::copy(s0 + task * state, s0 + (task + 1) * state, S);
  else std::fill(S, S + state, T(0));
  const T *qb = q + task * d.t * d.dk, *kb = k + task * d.t * d.dk, *vb = v + task * d.t * d.dv;
  const T *gb = g + task * d.t * gw, *bb = beta + task * d.t;
  T* ob = static_cast<T*>(p.out) + task * d.t * d.dv;
  T* ckpt = static_cast<T*>(p.ckpt);
  for (int64_t t = 0; t < d.t; ++t) {
    if (t % d.chunk == 0) std::copy(S, S + state, ckpt + (task * d.n + t / d.chunk) * state);
    decays(d, gb, t, w.a.data());
    step<T, Op>(d, S, w.a.data(), qb + t * d.dk, kb + t * d.dk, vb + t * d.dv, bb[t], w.r.data(),
                static_cast<T*>(nullptr), ob + t * d.dv);
  }
}

template <typename T, class Op>
inline __attribute__((always_inline)) void backward_task(const Dims& d, const Ptrs& p, int64_t task, Scratch<T>& w) {
  const int64_t state = d.dk * d.dv, gw = d.channel ? d.dk : 1;
  const T *q = static_cast<const T*>(p.q), *k = static_cast<const T*>(p.k), *v = static_cast<const T*>(p.v);
  const T *g = static_cast<const T*>(p.g), *beta = static_cast<const T*>(p.beta);
  const T *dout = static_cast<const T*>(p.dout), *dfin = static_cast<const T*>(p.dfin);
  const T* ckpt = static_cast<const T*>(p.ckpt_in);
  T* dS = static_cast<T*>(p.ds0) + task * state;  // the running state gradient, left as the start state's
  if (dfin) std::copy(dfin + task * state, dfin + (task + 1) * state, dS);
  else std::fill(dS, dS + state, T(0));
  const T *qb = q + task * d.t * d.dk, *kb = k + task * d.t * d.dk, *vb = v + task * d.t * d.dv;
  const T *gb = g + task * d.t * gw, *bb = beta + task * d.t, *dob = dout + task * d.t * d.dv;
  T *dqb = static_cast<T*>(p.dq) + task * d.t * d.dk, *dkb = static_cast<T*>(p.dk) + task * d.t * d.dk;
  T *dvb = static_cast<T*>(p.dv) + task * d.t * d.dv, *dgb = static_cast<T*>(p.dg) + task * d.t * gw;
  T* dbb = static_cast<T*>(p.dbeta) + task * d.t;
  T *a = w.a.data(), *dd = w.dd.data(), *dr = w.dr.data(), *wr = w.wr.data(), *da = w.da.data();
  for (int64_t c = d.n - 1; c >= 0; --c) {
    const int64_t begin = c * d.chunk, len = std::min(d.chunk, d.t - begin);
    // the chunk's states: states[j] = S before token begin + j, states[len] after the last
    std::copy(ckpt + (task * d.n + c) * state, ckpt + (task * d.n + c + 1) * state, w.states.data());
    for (int64_t j = 0; j < len; ++j) {
      const int64_t t = begin + j;
      T* S = w.states.data() + (j + 1) * state;
      std::copy(S - state, S, S);
      decays(d, gb, t, a);
      step<T, Op>(d, S, a, qb + t * d.dk, kb + t * d.dk, vb + t * d.dv, bb[t], w.r.data(), w.us.data() + j * d.dv,
                  static_cast<T*>(nullptr));
    }
    for (int64_t j = len - 1; j >= 0; --j) {
      const int64_t t = begin + j;
      const T *St = w.states.data() + (j + 1) * state, *Sp = w.states.data() + j * state;
      const T *qt = qb + t * d.dk, *kt = kb + t * d.dk, *dot = dob + t * d.dv, *u = w.us.data() + j * d.dv;
      const T bt = bb[t];
      T *dqt = dqb + t * d.dk, *dkt = dkb + t * d.dk, *dvt = dvb + t * d.dv;
      decays(d, gb, t, a);
      for (int64_t x = 0; x < d.dv; ++x) wr[x] = bt * u[x];  // the write d = beta u
      // pass A
      std::fill(dd, dd + d.dv, T(0));
      for (int64_t i = 0; i < d.dk; ++i) dkt[i] = Op::pass_a(dS + i * d.dv, qt[i], dot, kt[i], dd, wr, d.dv);
      for (int64_t x = 0; x < d.dv; ++x) {
        dvt[x] = bt * dd[x];
        dr[x] = -bt * dd[x];
      }
      dbb[t] = Op::dot(dd, u, d.dv);
      const T wdr = Op::dot(wr, dr, d.dv);
      // pass B
      for (int64_t i = 0; i < d.dk; ++i) {
        T dkr;
        Op::pass_b(St + i * d.dv, Sp + i * d.dv, dS + i * d.dv, dot, dr, kt[i], a[i], d.dv, dqt[i], dkr, da[i]);
        dkt[i] += dkr - kt[i] * wdr;
      }
      if (d.channel) {
        for (int64_t i = 0; i < d.dk; ++i) dgb[t * d.dk + i] = a[i] * da[i];
      } else {
        T s = 0;
        for (int64_t i = 0; i < d.dk; ++i) s += da[i];
        dgb[t] = a[0] * s;
      }
    }
  }
}

#if defined(__x86_64__)
LF_AVX2 void forward_task_avx2(const Dims& d, const Ptrs& p, int64_t task, Scratch<float>& w) {
  forward_task<float, AvxOps>(d, p, task, w);
}
LF_AVX2 void backward_task_avx2(const Dims& d, const Ptrs& p, int64_t task, Scratch<float>& w) {
  backward_task<float, AvxOps>(d, p, task, w);
}
#endif

// Every (batch row, head) task over the threads; float32 on AVX2 CPUs through the AVX2 tasks.
template <typename T>
void run_tasks(const Dims& d, const Ptrs& p, bool backward) {
  at::parallel_for(0, d.b * d.h, 1, [&](int64_t t0, int64_t t1) {
    Scratch<T> w(d, backward);
    for (int64_t task = t0; task < t1; ++task) {
#if defined(__x86_64__)
      if constexpr (std::is_same_v<T, float>) {
        if (cpu::has_avx2_fma()) {
          backward ? backward_task_avx2(d, p, task, w) : forward_task_avx2(d, p, task, w);
          continue;
        }
      }
#endif
      backward ? backward_task<T, PlainOps<T>>(d, p, task, w) : forward_task<T, PlainOps<T>>(d, p, task, w);
    }
  });
}

class GatedDeltaFunction : public torch::autograd::Function<GatedDeltaFunction> {
 public:
  static torch::autograd::tensor_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                              const at::Tensor& beta, const at::Tensor& s0, int64_t chunk) {
    auto [out, fin, ckpt] = gated_delta_forward_cpu(q, k, v, g, beta, s0, chunk);
    ctx->save_for_backward({q, k, v, g, beta, ckpt});
    ctx->saved_data["chunk"] = chunk;
    return {out, fin};
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto s = ctx->get_saved_variables();
    auto [dq, dk, dv, dg, db, ds0] = gated_delta_backward_cpu(grads[0], grads[1], s[0], s[1], s[2], s[3], s[4], s[5],
                                                              ctx->saved_data["chunk"].toInt());
    return {dq, dk, dv, dg, db, ds0, at::Tensor()};
  }
};

}  // namespace

bool gated_delta_kernel_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                              const at::Tensor& beta) {
  const auto st = q.scalar_type();
  if (st != at::kFloat && st != at::kDouble) return false;
  for (const at::Tensor* x : {&q, &k, &v, &g, &beta})
    if (!x->device().is_cpu() || x->scalar_type() != st) return false;
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_forward_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                       const at::Tensor& v_in, const at::Tensor& g_in,
                                                                       const at::Tensor& beta_in, const at::Tensor& s0_in,
                                                                       int64_t chunk) {
  const Dims d = check(q_in, k_in, v_in, g_in, beta_in, chunk);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous();
  const at::Tensor beta = beta_in.contiguous();
  at::Tensor s0;
  if (s0_in.defined()) {
    if (s0_in.dim() != 4 || s0_in.size(0) != d.b || s0_in.size(1) != d.h || s0_in.size(2) != d.dk || s0_in.size(3) != d.dv)
      throw Error("gated_delta_rule: the start state must be [B, H, Dk, Dv]");
    s0 = s0_in.to(q.scalar_type()).contiguous();
  }
  at::Tensor out = at::empty({d.b, d.h, d.t, d.dv}, v.options());
  at::Tensor fin = at::empty({d.b, d.h, d.dk, d.dv}, v.options());
  at::Tensor ckpt = at::empty({d.b, d.h, d.n, d.dk, d.dv}, v.options());
  Ptrs p{};
  p.q = q.const_data_ptr(), p.k = k.const_data_ptr(), p.v = v.const_data_ptr(), p.g = g.const_data_ptr();
  p.beta = beta.const_data_ptr(), p.s0 = s0.defined() ? s0.const_data_ptr() : nullptr;
  p.out = out.mutable_data_ptr(), p.fin = fin.mutable_data_ptr(), p.ckpt = ckpt.mutable_data_ptr();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_forward_cpu", [&] { run_tasks<scalar_t>(d, p, false); });
  return {out, fin, ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_backward_cpu(
    const at::Tensor& dout_in, const at::Tensor& dfin_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& g_in, const at::Tensor& beta_in, const at::Tensor& ckpt_in,
    int64_t chunk) {
  const Dims d = check(q_in, k_in, v_in, g_in, beta_in, chunk);
  const auto st = q_in.scalar_type();
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous();
  const at::Tensor beta = beta_in.contiguous(), ckpt = ckpt_in.contiguous();
  const at::Tensor dout = dout_in.defined() ? dout_in.to(st).contiguous() : at::zeros({d.b, d.h, d.t, d.dv}, v.options());
  const at::Tensor dfin = dfin_in.defined() ? dfin_in.to(st).contiguous() : at::Tensor();
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v), dg = at::empty_like(g);
  at::Tensor db = at::empty_like(beta), ds0 = at::empty({d.b, d.h, d.dk, d.dv}, v.options());
  Ptrs p{};
  p.q = q.const_data_ptr(), p.k = k.const_data_ptr(), p.v = v.const_data_ptr(), p.g = g.const_data_ptr();
  p.beta = beta.const_data_ptr(), p.dout = dout.const_data_ptr(), p.dfin = dfin.defined() ? dfin.const_data_ptr() : nullptr;
  p.ckpt_in = ckpt.const_data_ptr();
  p.dq = dq.mutable_data_ptr(), p.dk = dk.mutable_data_ptr(), p.dv = dv.mutable_data_ptr(), p.dg = dg.mutable_data_ptr();
  p.dbeta = db.mutable_data_ptr(), p.ds0 = ds0.mutable_data_ptr();
  AT_DISPATCH_FLOATING_TYPES(st, "gated_delta_backward_cpu", [&] { run_tasks<scalar_t>(d, p, true); });
  return {dq, dk, dv, dg, db, ds0};
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& g, const at::Tensor& beta, const at::Tensor& s0,
                                                    int64_t chunk) {
  if (!gated_delta_kernel_takes(q, k, v, g, beta))
    throw Error("gated_delta_rule: the fused kernel takes CPU float32 / float64 operands of one dtype");
  // an undefined start state: zeros that take no gradient
  const at::Tensor start = s0.defined() ? s0.to(q.scalar_type())
                                        : at::zeros({q.size(0), q.size(1), q.size(3), v.size(3)}, v.options());
  auto res = GatedDeltaFunction::apply(q, k, v, g, beta, start, chunk);
  return {res[0], res[1]};
}

}  // namespace lf::kernels

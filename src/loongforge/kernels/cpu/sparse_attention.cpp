// CPU kernels of the fused top-k sparse attention (kernels/sparse_attention.h), and its autograd Function.
//
// Forward: one task per block of query rows; per row the K picked keys' scores, their softmax and the weighted sum of
// the picked values, with the log-sum-exp kept. Backward: one task per (batch row, key/value head), which owns that
// head's dk / dv and runs every query of its head group in order: the probabilities recomputed from the
// log-sum-exp, dp_j = do . v_j, ds_j = p_j (dp_j - sum_j p_j dp_j), dq = scale sum_j ds_j k_j, dk_j += scale ds_j q,
// dv_j += p_j do. float32 runs AVX2+FMA dot products and axpys (chosen at run time), float64 plain loops.
#include "loongforge/kernels/sparse_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/kernels/cpu/row_ops.h"

namespace lf::kernels {
namespace {

struct Dims {
  int64_t b = 0, h = 0, hk = 0, tq = 0, tk = 0, d = 0, dv = 0, k = 0;
};

Dims check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx) {
  auto fail = [](const std::string& why) { return Error("sparse_attention: " + why); };
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || idx.dim() != 3)
    throw fail("q, k, v must be [B, heads, T, dim] and idx [B, Tq, K]");
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), idx.size(2)};
  if (k.size(0) != d.b || v.size(0) != d.b || idx.size(0) != d.b) throw fail("batch sizes differ");
  if (k.size(3) != d.d) throw fail("q and k head dims differ");
  if (v.size(1) != d.hk || v.size(2) != d.tk) throw fail("k and v heads / lengths differ");
  if (d.hk <= 0 || d.h % d.hk) throw fail("key/value heads must divide query heads");
  if (idx.size(1) != d.tq) throw fail("idx [B, Tq, K] does not match q's queries");
  if (idx.scalar_type() != at::kLong) throw fail("idx must be int64");
  return d;
}

struct Ptrs {  // the operands and results of one call (contiguous)
  const void *q, *k, *v, *dout, *lse_in;
  const int64_t* idx;
  double scale;
  void *out, *lse, *dq, *dk, *dv;
};

// ---- forward: rows r0 .. r1 of [B, H, Tq] -------------------------------------------------------------------------

template <typename T, class Op>
inline __attribute__((always_inline)) void forward_rows(const Dims& d, const Ptrs& p, int64_t r0, int64_t r1, T* s) {
  const T *q = static_cast<const T*>(p.q), *k = static_cast<const T*>(p.k), *v = static_cast<const T*>(p.v);
  T *out = static_cast<T*>(p.out), *lse = static_cast<T*>(p.lse);
  const T scale = static_cast<T>(p.scale), ninf = -std::numeric_limits<T>::infinity();
  const int64_t group = d.h / d.hk;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r % d.tq, bh = r / d.tq, h = bh % d.h, b = bh / d.h;
    const int64_t kvh = b * d.hk + h / group;
    const T* qr = q + r * d.d;
    const T* kb = k + kvh * d.tk * d.d;
    const T* vb = v + kvh * d.tk * d.dv;
    const int64_t* ir = p.idx + (b * d.tq + i) * d.k;
    T m = ninf;
    for (int64_t j = 0; j < d.k; ++j) {
      s[j] = ir[j] < 0 ? ninf : scale * Op::dot(qr, kb + ir[j] * d.d, d.d);
      if (s[j] > m) m = s[j];
    }
    T* o = out + r * d.dv;
    std::fill(o, o + d.dv, T(0));
    if (m == ninf) {  // no key picked
      lse[r] = ninf;
      continue;
    }
    T l = 0;
    for (int64_t j = 0; j < d.k; ++j) {
      s[j] = ir[j] < 0 ? T(0) : std::exp(s[j] - m);
      l += s[j];
    }
    for (int64_t j = 0; j < d.k; ++j)
      if (ir[j] >= 0) Op::axpy(s[j] / l, vb + ir[j] * d.dv, o, d.dv);
    lse[r] = m + std::log(l);
  }
}

// ---- backward: one (batch row, key/value head) task ---------------------------------------------------------------

template <typename T, class Op>
inline __attribute__((always_inline)) void backward_task(const Dims& d, const Ptrs& p, int64_t task, T* pr, T* dp) {
  const T *q = static_cast<const T*>(p.q), *k = static_cast<const T*>(p.k), *v = static_cast<const T*>(p.v);
  const T *dout = static_cast<const T*>(p.dout), *lse = static_cast<const T*>(p.lse_in);
  const T scale = static_cast<T>(p.scale);
  const int64_t group = d.h / d.hk, b = task / d.hk;
  const T* kb = k + task * d.tk * d.d;
  const T* vb = v + task * d.tk * d.dv;
  T* dkb = static_cast<T*>(p.dk) + task * d.tk * d.d;
  T* dvb = static_cast<T*>(p.dv) + task * d.tk * d.dv;
  for (int64_t h = (task % d.hk) * group; h < (task % d.hk + 1) * group; ++h) {
    for (int64_t i = 0; i < d.tq; ++i) {
      const int64_t r = (b * d.h + h) * d.tq + i;
      if (std::isinf(lse[r])) continue;  // no key picked: no gradient
      const T* qr = q + r * d.d;
      const T* dor = dout + r * d.dv;
      const int64_t* ir = p.idx + (b * d.tq + i) * d.k;
      T delta = 0;
      for (int64_t j = 0; j < d.k; ++j) {
        if (ir[j] < 0) {
          pr[j] = dp[j] = 0;
          continue;
        }
        pr[j] = std::exp(scale * Op::dot(qr, kb + ir[j] * d.d, d.d) - lse[r]);
        dp[j] = Op::dot(dor, vb + ir[j] * d.dv, d.dv);
        delta += pr[j] * dp[j];
      }
      T* dqr = static_cast<T*>(p.dq) + r * d.d;
      for (int64_t j = 0; j < d.k; ++j) {
        if (ir[j] < 0) continue;
        const T ds = scale * pr[j] * (dp[j] - delta);
        Op::axpy(ds, kb + ir[j] * d.d, dqr, d.d);
        Op::axpy(ds, qr, dkb + ir[j] * d.d, d.d);
        Op::axpy(pr[j], dor, dvb + ir[j] * d.dv, d.dv);
      }
    }
  }
}

#if defined(__x86_64__)
LF_AVX2 void forward_rows_avx2(const Dims& d, const Ptrs& p, int64_t r0, int64_t r1, float* s) {
  forward_rows<float, cpu::AvxRowOps>(d, p, r0, r1, s);
}
LF_AVX2 void backward_task_avx2(const Dims& d, const Ptrs& p, int64_t task, float* pr, float* dp) {
  backward_task<float, cpu::AvxRowOps>(d, p, task, pr, dp);
}
#endif

// Forward over blocks of query rows, backward one task per (batch row, key/value head); float32 on AVX2 CPUs through
// the AVX2 functions.
template <typename T>
void run(const Dims& d, const Ptrs& p, bool backward) {
  [[maybe_unused]] const bool avx2 = std::is_same_v<T, float> && cpu::has_avx2_fma();
  at::parallel_for(0, backward ? d.b * d.hk : d.b * d.h * d.tq, backward ? 1 : 16, [&](int64_t t0, int64_t t1) {
    std::vector<T> a(static_cast<size_t>(d.k)), c(static_cast<size_t>(d.k));
#if defined(__x86_64__)
    if constexpr (std::is_same_v<T, float>) {
      if (avx2) {
        if (!backward) return forward_rows_avx2(d, p, t0, t1, a.data());
        for (int64_t task = t0; task < t1; ++task) backward_task_avx2(d, p, task, a.data(), c.data());
        return;
      }
    }
#endif
    if (!backward) return forward_rows<T, cpu::PlainRowOps<T>>(d, p, t0, t1, a.data());
    for (int64_t task = t0; task < t1; ++task) backward_task<T, cpu::PlainRowOps<T>>(d, p, task, a.data(), c.data());
  });
}

}  // namespace

bool sparse_attention_kernel_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto st = q.scalar_type();
  return q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && (st == at::kFloat || st == at::kDouble) &&
         k.scalar_type() == st && v.scalar_type() == st;
}

namespace {

void check_range(const at::Tensor& idx, int64_t tk) {
  if (idx.numel() && idx.max().item<int64_t>() >= tk)
    throw Error("sparse_attention: a picked key position is past the keys (" + std::to_string(tk) + ")");
}

class SparseAttentionFunction : public torch::autograd::Function<SparseAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& idx, double scale) {
    auto [out, lse] = sparse_attention_forward_cpu(q, k, v, idx, scale);
    ctx->save_for_backward({q, k, v, idx, lse});
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = sparse_attention_backward_cpu(grads[0], s[0], s[1], s[2], s[3], s[4],
                                                      ctx->saved_data["scale"].toDouble());
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> sparse_attention_forward_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                const at::Tensor& v_in, const at::Tensor& idx_in,
                                                                double scale) {
  const Dims d = check(q_in, k_in, v_in, idx_in);
  check_range(idx_in, d.tk);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), idx = idx_in.contiguous();
  at::Tensor out = at::empty({d.b, d.h, d.tq, d.dv}, q.options());
  at::Tensor lse = at::empty({d.b, d.h, d.tq}, q.options());
  Ptrs p{};
  p.q = q.const_data_ptr(), p.k = k.const_data_ptr(), p.v = v.const_data_ptr(), p.idx = idx.const_data_ptr<int64_t>();
  p.scale = scale, p.out = out.mutable_data_ptr(), p.lse = lse.mutable_data_ptr();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sparse_attention_forward_cpu", [&] { run<scalar_t>(d, p, false); });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_backward_cpu(const at::Tensor& dout_in,
                                                                             const at::Tensor& q_in,
                                                                             const at::Tensor& k_in,
                                                                             const at::Tensor& v_in,
                                                                             const at::Tensor& idx_in,
                                                                             const at::Tensor& lse_in, double scale) {
  const Dims d = check(q_in, k_in, v_in, idx_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), idx = idx_in.contiguous();
  const at::Tensor dout = dout_in.to(q.scalar_type()).contiguous(), lse = lse_in.contiguous();
  at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  Ptrs p{};
  p.q = q.const_data_ptr(), p.k = k.const_data_ptr(), p.v = v.const_data_ptr(), p.idx = idx.const_data_ptr<int64_t>();
  p.dout = dout.const_data_ptr(), p.lse_in = lse.const_data_ptr(), p.scale = scale;
  p.dq = dq.mutable_data_ptr(), p.dk = dk.mutable_data_ptr(), p.dv = dv.mutable_data_ptr();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sparse_attention_backward_cpu", [&] { run<scalar_t>(d, p, true); });
  return {dq, dk, dv};
}

at::Tensor sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
                            double scale) {
  if (!sparse_attention_kernel_takes(q, k, v) || !idx.device().is_cpu()) return sparse_attention_reference(q, k, v, idx, scale);
  return SparseAttentionFunction::apply(q, k, v, idx, scale);
}

at::Tensor sparse_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& idx, double scale) {
  const Dims d = check(q, k, v, idx);
  const at::Tensor safe = idx.clamp_min(0);
  std::vector<at::Tensor> kg, vg;  // per batch row: the picked keys / values [Hk, Tq, K, dim]
  for (int64_t b = 0; b < d.b; ++b) {
    const at::Tensor flat = safe.select(0, b).reshape({-1});
    kg.push_back(k.select(0, b).index_select(1, flat).view({d.hk, d.tq, d.k, d.d}));
    vg.push_back(v.select(0, b).index_select(1, flat).view({d.hk, d.tq, d.k, d.dv}));
  }
  const int64_t group = d.h / d.hk;
  at::Tensor ks = at::stack(kg), vs = at::stack(vg);  // [B, Hk, Tq, K, dim]
  if (group > 1) {
    ks = ks.repeat_interleave(group, 1);
    vs = vs.repeat_interleave(group, 1);
  }
  at::Tensor s = at::matmul(q.unsqueeze(-2), ks.transpose(-1, -2)).squeeze(-2) * scale;  // [B, H, Tq, K]
  s = s.masked_fill((idx < 0).unsqueeze(1), -std::numeric_limits<double>::infinity());
  const at::Tensor p = at::softmax(s, -1, at::promote_types(q.scalar_type(), at::kFloat)).to(q.scalar_type());
  return at::matmul(p.unsqueeze(-2), vs).squeeze(-2);
}

at::Tensor keep_to_index(const at::Tensor& keep) {
  const int64_t kmax = keep.numel() ? keep.sum(-1).max().item<int64_t>() : 0;
  // the kept keys first, in key order (a stable sort of the flags, descending)
  auto [flags, order] = at::sort(keep.to(at::kInt), /*stable=*/true, /*dim=*/-1, /*descending=*/true);
  const at::Tensor k = order.narrow(-1, 0, kmax);
  return at::where(flags.narrow(-1, 0, kmax) > 0, k, at::full_like(k, -1));
}

}  // namespace lf::kernels

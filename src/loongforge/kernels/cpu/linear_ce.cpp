// CPU kernel of the fused linear + cross-entropy, and its autograd Function.
//
// Per chunk of rows: logits = x_c W^T (MKL; in float32 against one packed copy of W^T for all chunks,
// kernels/cpu/blas.h), then one fused pass per row (max, sum of exp stored in place,
// log-sum-exp, target logit, softmax - onehot), then dX_c = G W and dW += G^T x_c. The per-row pass runs an
// AVX2+FMA path when the CPU has it (chosen at run time; the library is built without -mavx2), plain loops otherwise
// and for float64.
#include "loongforge/kernels/linear_ce.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <optional>

#include "loongforge/kernels/cpu/blas.h"
#include "loongforge/kernels/cpu/gemm.h"
#include "loongforge/kernels/cpu/vec_math.h"
#include "loongforge/kernels/cuda_ops.h"

namespace lf::kernels {
namespace {
#if defined(__x86_64__)
using cpu::exp8;
using cpu::hmax8;
using cpu::hsum8;
#endif

// One row of logits L[0..v): returns lse(L) - L[t]; with grad, L becomes softmax(L) - onehot(t).
template <typename T>
T row_generic(T* L, int64_t v, int64_t t, bool grad) {
  const T xt = L[t];
  T m = -std::numeric_limits<T>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < v; ++i) {
    nan |= std::isnan(L[i]);
    m = L[i] > m ? L[i] : m;
  }
  if (nan) {
    if (grad) std::fill(L, L + v, std::numeric_limits<T>::quiet_NaN());
    return std::numeric_limits<T>::quiet_NaN();
  }
  T s = 0;
  for (int64_t i = 0; i < v; ++i) {
    T e = std::exp(L[i] - m);
    if (grad) L[i] = e;
    s += e;
  }
  if (grad) {
    T inv = T(1) / s;
    for (int64_t i = 0; i < v; ++i) L[i] *= inv;
    L[t] -= T(1);
  }
  return m + std::log(s) - xt;
}

#if defined(__x86_64__)
LF_AVX2 float row_avx2(float* L, int64_t v, int64_t t, bool grad) {
  const float xt = L[t];
  const int64_t vv = v & ~int64_t(7);
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), bad = _mm256_setzero_ps();
  for (int64_t i = 0; i < vv; i += 8) {
    __m256 x = _mm256_loadu_ps(L + i);
    mv = _mm256_max_ps(mv, x);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float m = hmax8(mv);
  bool nan = _mm256_movemask_ps(bad) != 0;
  for (int64_t i = vv; i < v; ++i) {
    nan |= std::isnan(L[i]);
    m = L[i] > m ? L[i] : m;
  }
  if (nan) {
    if (grad) std::fill(L, L + v, std::numeric_limits<float>::quiet_NaN());
    return std::numeric_limits<float>::quiet_NaN();
  }
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (int64_t i = 0; i < vv; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(L + i), mb));
    if (grad) _mm256_storeu_ps(L + i, e);
    sv = _mm256_add_ps(sv, e);
  }
  if (vv < v) {  // the tail through a padded register (padding -inf gives exp 0)
    alignas(32) float b[8];
    for (int j = 0; j < 8; ++j) b[j] = vv + j < v ? L[vv + j] : -std::numeric_limits<float>::infinity();
    __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(b), mb));
    _mm256_store_ps(b, e);
    if (grad)
      for (int64_t j = vv; j < v; ++j) L[j] = b[j - vv];
    sv = _mm256_add_ps(sv, e);
  }
  const float s = hsum8(sv);
  if (grad) {
    const __m256 inv = _mm256_set1_ps(1.0f / s);
    for (int64_t i = 0; i < vv; i += 8) _mm256_storeu_ps(L + i, _mm256_mul_ps(_mm256_loadu_ps(L + i), inv));
    for (int64_t i = vv; i < v; ++i) L[i] *= 1.0f / s;
    L[t] -= 1.0f;
  }
  return m + std::log(s) - xt;
}
#endif

float row_f32(float* L, int64_t v, int64_t t, bool grad) {
#if defined(__x86_64__)
  if (cpu::has_avx2_fma()) return row_avx2(L, v, t, grad);
#endif
  return row_generic<float>(L, v, t, grad);
}

bool fused_supported(const at::Tensor& x, const at::Tensor& w, const at::Tensor& t) {
  auto d = x.scalar_type();
  return x.device().is_cpu() && w.device().is_cpu() && t.device().is_cpu() && d == w.scalar_type() &&
         (d == at::kFloat || d == at::kDouble || d == at::kBFloat16) && x.dim() >= 1 && w.dim() == 2 &&
         x.size(-1) == w.size(1) && !at::isFloatingType(t.scalar_type()) && t.numel() * x.size(-1) == x.numel();
}

class LinearCEFunction : public torch::autograd::Function<LinearCEFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& w, const at::Tensor& target, int64_t ignore_index,
                                                int64_t chunk_rows, bool need_dx, bool need_dw) {
    auto [loss, count, dx, dw] = linear_cross_entropy_cpu(x, w, target, ignore_index, chunk_rows, need_dx, need_dw);
    ctx->save_for_backward({dx, dw});
    ctx->mark_non_differentiable({count});
    return {loss, count};
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& go = grads[0];
    // Scaled in place: the saved gradients exist only for this backward (a second backward through the same graph
    // then stops with autograd's "modified by an inplace operation" error instead of reading scaled values).
    at::Tensor dx = saved[0].defined() ? saved[0].mul_(go.to(saved[0].scalar_type())) : at::Tensor();
    at::Tensor dw = saved[1].defined() ? saved[1].mul_(go.to(saved[1].scalar_type())) : at::Tensor();
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t linear_cross_entropy_default_chunk(int64_t v, int64_t h) {
  // h / 2 rows, at most 8M logits (32 MB in float32) per chunk. Measured per training thread (1024 rows, one
  // thread each, both threads busy; BM_LinearCE): h 256, V 8192: 128 rows 108 ms, 256: 124, 512: 125-133, 1024:
  // 139-159; h 512, V 16384: 128 rows 535-547 ms, 256: 474, 512: 492-512. Smaller chunks re-read dW (V x h) more
  // often, larger ones stream a logits block that no cache holds.
  return std::clamp<int64_t>(std::min(h / 2, (int64_t(1) << 23) / std::max<int64_t>(1, v)), 64, 4096);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_cpu(
    const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& t_in, int64_t ignore_index, int64_t chunk_rows,
    bool need_dx, bool need_dw) {
  TORCH_CHECK(x_in.dim() == 2 && fused_supported(x_in, w_in, t_in) && t_in.dim() == 1,
              "linear_cross_entropy_cpu: x [N,H], weight [V,H] (one dtype: f32/bf16/f64), integer target [N] on the CPU "
              "expected");
  // A raw kernel: no autograd recording inside, and no autocast re-casting of the GEMMs.
  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto dt = x_in.scalar_type();
  const bool bf16 = dt == at::kBFloat16;
  const auto acc = dt == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), t = t_in.to(at::kLong).contiguous();
  const int64_t n = x.size(0), h = x.size(1), v = w.size(0);

  int64_t count = 0;
  const int64_t* tp = t.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (tp[i] == ignore_index) continue;
    TORCH_CHECK(tp[i] >= 0 && tp[i] < v, "linear_cross_entropy: target ", tp[i], " out of range [0, ", v, ")");
    ++count;
  }
  // Ignored rows contribute nothing: compute only the counted ones.
  at::Tensor idx, xs = x, ts = t;
  if (count < n) {
    idx = at::nonzero(t != ignore_index).view({-1});
    xs = x.index_select(0, idx);
    ts = t.index_select(0, idx);
  }
  at::Tensor dxs = need_dx ? at::empty({count, h}, x.options()) : at::Tensor();
  at::Tensor dw;
  if (need_dw) dw = bf16 ? at::zeros({v, h}, w.options().dtype(at::kFloat)) : at::zeros({v, h}, w.options());
  const int64_t chunk = chunk_rows > 0 ? chunk_rows : linear_cross_entropy_default_chunk(v, h);
  const bool grad = need_dx || need_dw;
  at::Tensor losses = at::empty({count}, x.options().dtype(acc));
  at::Tensor buf = at::empty({std::min(chunk, count), v}, x.options());
  const int64_t* tsp = ts.const_data_ptr<int64_t>();
  // float32 on one thread: W^T packed once for every chunk's logits (kernels/cpu/blas.h)
  std::optional<cpu::PackedB> wt;
  if (dt == at::kFloat && cpu::use_packed(count, v, h) && cpu::split_parts(std::min(chunk, count), h, v) <= 1)
    wt.emplace(true, std::min(chunk, count), v, h, w.const_data_ptr<float>(), h);
  for (int64_t r0 = 0; r0 < count; r0 += chunk) {
    const int64_t c = std::min(chunk, count - r0);
    at::Tensor xc = xs.narrow(0, r0, c);
    at::Tensor logits = buf.narrow(0, 0, c);
    const int64_t parts = cpu::split_parts(c, h, v);  // row-split GEMMs (kernels/cpu/gemm.h)
    if (wt) wt->compute(c, xc.const_data_ptr<float>(), h, 0.0f, logits.mutable_data_ptr<float>(), v);
    else cpu::mm_rows(logits, xc, w.t(), parts);
    at::Tensor lf = bf16 ? logits.to(at::kFloat) : logits;
    if (acc == at::kDouble) {
      double* L = lf.data_ptr<double>();
      double* lo = losses.data_ptr<double>() + r0;
      at::parallel_for(0, c, 4, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) lo[r] = row_generic<double>(L + r * v, v, tsp[r0 + r], grad);
      });
    } else {
      float* L = lf.data_ptr<float>();
      float* lo = losses.data_ptr<float>() + r0;
      at::parallel_for(0, c, 4, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) lo[r] = row_f32(L + r * v, v, tsp[r0 + r], grad);
      });
    }
    if (!grad) continue;
    at::Tensor g = bf16 ? lf.to(at::kBFloat16) : lf;
    if (need_dx) {
      at::Tensor dxc = dxs.narrow(0, r0, c);
      cpu::mm_rows(dxc, g, w, parts);
    }
    if (need_dw) {
      if (bf16) dw.add_(at::mm(g.t(), xc));
      else cpu::mm_rows(dw, g.t(), xc, parts, /*accumulate=*/r0 > 0);
    }
  }
  at::Tensor loss = losses.sum(at::kDouble).to(acc);
  at::Tensor dx;
  if (need_dx) {
    if (count < n) dx = at::zeros_like(x).index_copy_(0, idx, dxs);
    else dx = dxs;
  }
  if (need_dw && bf16) dw = dw.to(at::kBFloat16);
  return {loss, at::scalar_tensor(count, at::kLong), dx, dw};
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_reference(const at::Tensor& x, const at::Tensor& weight,
                                                                  const at::Tensor& target, int64_t ignore_index) {
  at::Tensor logits = at::linear(x, weight);
  logits = logits.to(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor t = target.reshape({-1});
  at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), t, {}, at::Reduction::Sum,
                                           ignore_index);
  return {loss, (t != ignore_index).sum()};
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight,
                                                        const at::Tensor& target, int64_t ignore_index,
                                                        int64_t chunk_rows) {
  if (cuda::supported(x) && weight.scalar_type() == x.scalar_type() && weight.device() == x.device() &&
      weight.dim() == 2 && x.size(-1) == weight.size(1) && target.device() == x.device() &&
      target.scalar_type() == at::kLong && target.numel() * x.size(-1) == x.numel()) {
    // kernels/cuda/linear_ce.cu: its loss is the mean over counted rows; the sum is mean * count (0 when none count).
    at::Tensor t = target.reshape({-1});
    at::Tensor count = t.ne(ignore_index).sum();
    at::Tensor mean = cuda::linear_cross_entropy(x.reshape({-1, x.size(-1)}), weight, t, ignore_index, 0);
    at::Tensor loss = at::where(count > 0, mean * count.to(at::kFloat), at::zeros({}, mean.options()));
    return {loss, count};
  }
  if (!fused_supported(x, weight, target)) return linear_cross_entropy_reference(x, weight, target, ignore_index);
  const bool grad_mode = at::GradMode::is_enabled();
  const bool need_dx = grad_mode && x.requires_grad(), need_dw = grad_mode && weight.requires_grad();
  at::Tensor x2 = x.reshape({-1, x.size(-1)}), t = target.reshape({-1});
  if (!need_dx && !need_dw) {
    auto [loss, count, dx, dw] = linear_cross_entropy_cpu(x2, weight, t, ignore_index, chunk_rows, false, false);
    return {loss, count};
  }
  auto out = LinearCEFunction::apply(x2, weight, t, ignore_index, chunk_rows, need_dx, need_dw);
  return {out[0], out[1]};
}

}  // namespace lf::kernels

#include "loongforge/nn/gated_delta.h"

#include <ATen/ATen.h>

#include <limits>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/kernels/causal_conv.h"
#include "loongforge/kernels/gated_delta.h"
#include "loongforge/kernels/rms_norm.h"

namespace lf::nn {

namespace {

at::ScalarType compute_type(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// The operands in the compute dtype with heads before time: q/k [B, Hv, T, Dk] (key heads repeated for their value
// heads), v [B, Hv, T, Dv], beta [B, Hv, T], g [B, Hv, T] or per channel [B, Hv, T, Dk].
struct Operands {
  at::Tensor q, k, v, g, beta;
  int64_t b = 0, t = 0, h = 0, dk = 0, dv = 0;
  at::ScalarType dtype = at::kFloat;
};

Operands prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                 const at::Tensor& beta, const char* op) {
  auto fail = [op](const std::string& why) { return Error(std::string(op) + ": " + why); };
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) throw fail("q, k, v must be [B, T, heads, dim]");
  if (q.sizes() != k.sizes()) throw fail("q and k shapes differ");
  Operands o;
  o.b = k.size(0);
  o.t = k.size(1);
  o.h = v.size(2);
  o.dk = k.size(3);
  o.dv = v.size(3);
  const int64_t hk = k.size(2);
  if (v.size(0) != o.b || v.size(1) != o.t) throw fail("v's batch / time differ from k's");
  if (hk <= 0 || o.h % hk) throw fail("key heads " + std::to_string(hk) + " do not divide value heads " + std::to_string(o.h));
  for (const at::Tensor* s : {&g, &beta})
    if (s->dim() < 3 || s->size(0) != o.b || s->size(1) != o.t || s->size(2) != o.h) throw fail("g and beta must be [B, T, value heads]");
  if (beta.dim() != 3 || (g.dim() == 4 && g.size(3) != o.dk) || g.dim() > 4)
    throw fail("beta must be [B, T, value heads] and g [B, T, value heads] or [B, T, value heads, Dk]");
  o.dtype = compute_type(v);
  const int64_t rep = o.h / hk;
  auto heads_first = [&](const at::Tensor& x, int64_t r) {
    at::Tensor y = r > 1 ? x.repeat_interleave(r, 2) : x;
    return y.transpose(1, 2).to(o.dtype).contiguous();
  };
  o.q = heads_first(q, rep);
  o.k = heads_first(k, rep);
  o.v = heads_first(v, 1);
  o.g = g.transpose(1, 2).to(o.dtype).contiguous();
  o.beta = beta.transpose(1, 2).to(o.dtype).contiguous();
  return o;
}

// (I + L)^-1 for strictly lower-triangular L [..., c, c] by recursive 2 x 2 block inversion,
//   [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]],
// doubling the diagonal blocks from 1 x 1 to c x c: 2 log2(c) batched GEMMs, differentiable as GEMMs, and every
// intermediate is a block of the inverse itself (no power series that could overflow). A batched triangular solve
// instead runs one small LAPACK call per matrix, forward and again backward: transformers' torch path spends ~20% of
// its CPU step there. c not a power of two: the solve.
at::Tensor unit_lower_inverse(const at::Tensor& lower) {
  const int64_t c = lower.size(-1);
  at::Tensor eye = at::eye(c, lower.options());
  if (c & (c - 1)) return at::linalg_solve_triangular(eye + lower, eye.expand_as(lower), false, true, true);
  std::vector<int64_t> shape(lower.sizes().begin(), lower.sizes().end() - 2);
  shape.insert(shape.end(), {c, 1, 1});
  at::Tensor inv = at::ones(shape, lower.options());  // the inverses of the 1 x 1 diagonal blocks
  for (int64_t s = 1; s < c; s *= 2) {
    const int64_t p = c / (2 * s);
    // L's diagonal blocks of size 2s, [..., p, 2s, 2s], and their lower-left quarters C
    at::Tensor blocks = at::diagonal(lower.unflatten(-2, {p, 2 * s}).unflatten(-1, {p, 2 * s}), 0, -4, -2).movedim(-1, -3);
    at::Tensor low = blocks.narrow(-2, s, s).narrow(-1, 0, s);
    at::Tensor pairs = inv.unflatten(-3, {p, 2});
    at::Tensor a = pairs.select(-3, 0), b = pairs.select(-3, 1);
    at::Tensor x = -at::matmul(b, at::matmul(low, a));
    inv = at::cat({at::cat({a, at::zeros_like(a)}, -1), at::cat({x, b}, -1)}, -2);
  }
  return inv.squeeze(-3);
}

// sum_d x_i[d] y_j[d] exp(gc_i[d] - gc_j[d]) for j <= i (0 above the diagonal) within each chunk: x, y, gc
// [..., c, dk] -> [..., c, c]. Split into sub-chunks of s tokens: the pairs inside a sub-chunk as an explicit
// [s, s, dk] product; the pairs (i in sub-chunk a, j before it) as one GEMM per a, exp(gc_i - gc_j) factored through
// gc at the end of sub-chunk a - 1 (r_a) into exp(gc_i - r_a) exp(r_a - gc_j), both <= 1 since gc only decreases.
// Memory per chunk c s dk + c (c / s) dk instead of c c dk.
at::Tensor decayed_products(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gc) {
  const int64_t c = x.size(-2), dk = x.size(-1), s = c > 16 && c % 16 == 0 ? 16 : c, m = c / s;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<int64_t> blocks(x.sizes().begin(), x.sizes().end() - 2);
  blocks.insert(blocks.end(), {m, s, dk});
  at::Tensor xb = x.reshape(blocks), yb = y.reshape(blocks), gb = gc.reshape(blocks);
  at::Tensor upper = at::ones({s, s}, x.options().dtype(at::kBool)).triu(1).unsqueeze(-1);
  at::Tensor inside = (xb.unsqueeze(-2) * yb.unsqueeze(-3) *
                       (gb.unsqueeze(-2) - gb.unsqueeze(-3)).masked_fill(upper, -inf).exp()).sum(-1);  // [..., m, s, s]
  if (m == 1) return inside.squeeze(-3);
  // r_a = gc at the end of sub-chunk a - 1 (a = 0: 0, its rows have no earlier pairs)
  at::Tensor r = at::cat({at::zeros_like(gb.select(-3, 0).narrow(-2, 0, 1)), gb.narrow(-3, 0, m - 1).select(-2, s - 1)}, -2);
  at::Tensor xs = xb * (gb - r.unsqueeze(-2)).exp();                                       // [..., m, s, dk]
  at::Tensor later = at::arange(c, x.options().dtype(at::kLong)).unsqueeze(0) >=
                     (at::arange(m, x.options().dtype(at::kLong)) * s).unsqueeze(1);      // [m, c]: j >= a s
  at::Tensor ys = y.unsqueeze(-3) *
                  (r.unsqueeze(-2) - gc.unsqueeze(-3)).masked_fill(later.unsqueeze(-1), -inf).exp();  // [..., m, c, dk]
  std::vector<int64_t> grid(x.sizes().begin(), x.sizes().end() - 2);
  grid.insert(grid.end(), {m, s, m, s});
  at::Tensor eye = at::eye(m, x.options()).view({m, 1, m, 1});
  at::Tensor out = at::matmul(xs, ys.transpose(-1, -2)).view(grid) + inside.unsqueeze(-2) * eye;
  std::vector<int64_t> square(x.sizes().begin(), x.sizes().end() - 2);
  square.insert(square.end(), {c, c});
  return out.view(square);
}

at::Tensor start_state(const Operands& o, const at::Tensor& initial) {
  if (!initial.defined()) return at::zeros({o.b, o.h, o.dk, o.dv}, o.v.options());
  if (initial.dim() != 4 || initial.size(0) != o.b || initial.size(1) != o.h || initial.size(2) != o.dk || initial.size(3) != o.dv)
    throw Error("gated delta rule: initial state must be [B, value heads, Dk, Dv]");
  return initial.to(o.dtype);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule(const at::Tensor& q_in, const at::Tensor& k_in,
                                                         const at::Tensor& v_in, const at::Tensor& g_in,
                                                         const at::Tensor& beta_in, const at::Tensor& initial_state,
                                                         int64_t chunk, bool final_state) {
  if (chunk <= 0) throw Error("chunk_gated_delta_rule: chunk must be positive");
  if (!q_in.device().is_cpu())
    return chunk_gated_delta_rule_reference(q_in, k_in, v_in, g_in, beta_in, initial_state, chunk, final_state);
  Operands o = prepare(q_in, k_in, v_in, g_in, beta_in, "chunk_gated_delta_rule");  // float32 / float64
  // the fused CPU kernel (kernels/gated_delta.h): the state token by token, checkpointed every chunk
  const at::Tensor start = initial_state.defined() ? start_state(o, initial_state) : at::Tensor();
  auto [out, fin] = kernels::gated_delta_rule(o.q, o.k, o.v, o.g, o.beta, start, chunk);
  return {out.transpose(1, 2).to(v_in.scalar_type()).contiguous(), final_state ? fin : at::Tensor()};
}

std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule_reference(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                   const at::Tensor& v_in, const at::Tensor& g_in,
                                                                   const at::Tensor& beta_in,
                                                                   const at::Tensor& initial_state, int64_t chunk,
                                                                   bool final_state) {
  if (chunk <= 0) throw Error("chunk_gated_delta_rule: chunk must be positive");
  Operands o = prepare(q_in, k_in, v_in, g_in, beta_in, "chunk_gated_delta_rule");
  const int64_t b = o.b, h = o.h, t = o.t, dk = o.dk, dv = o.dv, c = chunk;
  const int64_t pad = (c - t % c) % c, n = (t + pad) / c;
  at::Tensor q = o.q, k = o.k, v = o.v, g = o.g, beta = o.beta;
  const bool channel = g.dim() == 4;  // KDA's per-channel decay
  if (pad) {  // padded tokens: g = 0 (no decay), beta = 0 (no update); their outputs are dropped
    q = at::constant_pad_nd(q, {0, 0, 0, pad});
    k = at::constant_pad_nd(k, {0, 0, 0, pad});
    v = at::constant_pad_nd(v, {0, 0, 0, pad});
    g = at::constant_pad_nd(g, channel ? std::vector<int64_t>{0, 0, 0, pad} : std::vector<int64_t>{0, pad});
    beta = at::constant_pad_nd(beta, {0, pad});
  }
  at::Tensor bt = beta.unsqueeze(-1);
  at::Tensor kb = (k * bt).view({b, h, n, c, dk}), vb = (v * bt).view({b, h, n, c, dv});
  q = q.view({b, h, n, c, dk});
  k = k.view({b, h, n, c, dk});
  // cumulative log decay inside each chunk; decay[i, j] = exp(gc_i - gc_j) for j <= i, 0 above the diagonal (per
  // channel: [.., c, c, dk])
  const double inf = std::numeric_limits<double>::infinity();
  at::Tensor upper = at::ones({c, c}, q.options().dtype(at::kBool)).triu(1);
  at::Tensor gc, lower, intra, egc, kd, chunk_decay;
  if (channel) {
    gc = g.view({b, h, n, c, dk}).cumsum(-2);
    lower = decayed_products(kb, k, gc).masked_fill(at::eye(c, upper.options()), 0.0);
    intra = decayed_products(q, k, gc);
    egc = gc.exp();
    at::Tensor last = gc.narrow(-2, c - 1, 1);  // [b,h,n,1,dk]
    kd = k * (last - gc).exp();
    chunk_decay = last.exp().transpose(-1, -2);  // [b,h,n,dk,1]
  } else {
    gc = g.view({b, h, n, c}).cumsum(-1);
    at::Tensor decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(upper, -inf).exp();
    at::Tensor kt = k.transpose(-1, -2);
    lower = at::matmul(kb, kt) * decay.masked_fill(at::eye(c, upper.options()), 0.0);
    intra = at::matmul(q, kt) * decay;
    egc = gc.exp().unsqueeze(-1);
    kd = k * (gc.narrow(-1, c - 1, 1) - gc).exp().unsqueeze(-1);
    chunk_decay = gc.select(-1, c - 1).exp().unsqueeze(-1).unsqueeze(-1);  // [b,h,n,1,1]
  }
  // Within a chunk the updates chain through (I + L), L = strictly-lower(beta_i k_i.k_j decay_ij); its inverse
  // applied to [beta v | beta k e^gc] gives the pseudo-values u (what each token writes) and w (the decayed keys that
  // read the chunk's start state), both for the whole chunk at once. intra [b,h,n,c,c]: the decayed q_i.k_j
  // (diagonal included); qg: the queries reading the start state; kd: the keys decayed to the chunk's end.
  at::Tensor solved = at::matmul(unit_lower_inverse(lower), at::cat({vb, kb * egc}, -1));
  at::Tensor u = solved.narrow(-1, 0, dv), w = solved.narrow(-1, dv, dk);
  at::Tensor qg = q * egc;
  // The sequential part: only the state passes from chunk to chunk; the outputs are batched afterwards.
  at::Tensor s = start_state(o, initial_state);
  std::vector<at::Tensor> starts, news;
  starts.reserve(n);
  news.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor vn = u.select(2, i) - at::matmul(w.select(2, i), s);  // the chunk's writes, net of what S predicts
    starts.push_back(s);
    news.push_back(vn);
    s = s * chunk_decay.select(2, i) + at::matmul(kd.select(2, i).transpose(-1, -2), vn);
  }
  at::Tensor vnew = n == 1 ? news[0].unsqueeze(2) : at::stack(news, 2);
  at::Tensor st = n == 1 ? starts[0].unsqueeze(2) : at::stack(starts, 2);
  at::Tensor out = at::matmul(qg, st) + at::matmul(intra, vnew);  // [b,h,n,c,dv]
  out = out.view({b, h, n * c, dv});
  if (pad) out = out.narrow(2, 0, t);
  out = out.transpose(1, 2).to(v_in.scalar_type()).contiguous();
  return {out, final_state ? s : at::Tensor()};
}

std::pair<at::Tensor, at::Tensor> recurrent_gated_delta_rule(const at::Tensor& q_in, const at::Tensor& k_in,
                                                             const at::Tensor& v_in, const at::Tensor& g_in,
                                                             const at::Tensor& beta_in, const at::Tensor& initial_state) {
  Operands o = prepare(q_in, k_in, v_in, g_in, beta_in, "recurrent_gated_delta_rule");
  at::Tensor s = start_state(o, initial_state);
  std::vector<at::Tensor> outs;
  outs.reserve(o.t);
  for (int64_t i = 0; i < o.t; ++i) {
    at::Tensor qi = o.q.select(2, i), ki = o.k.select(2, i).unsqueeze(-1);  // [b,h,dk], [b,h,dk,1]
    at::Tensor decay = o.g.select(2, i).exp().unsqueeze(-1);  // [b,h,1] or per channel [b,h,dk,1]
    s = s * (decay.dim() == 3 ? decay.unsqueeze(-1) : decay);
    at::Tensor read = (s * ki).sum(-2);                                                 // S^T k  [b,h,dv]
    at::Tensor delta = (o.v.select(2, i) - read) * o.beta.select(2, i).unsqueeze(-1);  // [b,h,dv]
    s = s + ki * delta.unsqueeze(-2);
    outs.push_back((s * qi.unsqueeze(-1)).sum(-2));
  }
  at::Tensor out = o.t == 0 ? at::zeros({o.b, o.h, 0, o.dv}, o.v.options()) : at::stack(outs, 2);
  return {out.transpose(1, 2).to(v_in.scalar_type()).contiguous(), s};
}

at::Tensor l2_normalize(const at::Tensor& x, double eps) { return x * at::rsqrt((x * x).sum(-1, true) + eps); }

std::pair<at::Tensor, at::Tensor> causal_depthwise_conv_silu(const at::Tensor& x, const at::Tensor& weight,
                                                             const at::Tensor& past) {
  if (x.dim() != 3 || weight.dim() != 3 || weight.size(0) != x.size(2) || weight.size(1) != 1)
    throw Error("causal_depthwise_conv_silu: x must be [B, T, C] and weight [C, 1, K]");
  const int64_t keep = weight.size(2) - 1, t = x.size(1);
  if (past.defined()) {  // continued: the past rows lead the input, the fused kernel runs unpadded
    at::Tensor xp = at::cat({past.to(x.scalar_type()), x}, 1);
    return {kernels::causal_conv1d_silu(xp, weight, false), xp.narrow(1, t, keep)};
  }
  at::Tensor last = t >= keep ? x.narrow(1, t - keep, keep) : at::constant_pad_nd(x, {0, 0, keep - t, 0});
  return {kernels::causal_conv1d_silu(x, weight, true), last};
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps,
                          bool sigmoid_gate) {
  const at::ScalarType dt = compute_type(x);
  at::Tensor y = kernels::rms_norm(x, weight.to(x.scalar_type()), eps);
  return (y.to(dt) * (sigmoid_gate ? at::sigmoid(gate.to(dt)) : at::silu(gate.to(dt)))).to(x.scalar_type());
}

}  // namespace lf::nn

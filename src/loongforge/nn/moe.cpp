#include "loongforge/nn/moe.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "loongforge/core/error.h"
#include "loongforge/kernels/swiglu.h"

namespace lf::nn {

namespace {

at::Tensor activate(const at::Tensor& g_in, const at::Tensor& u_in, const std::string& act, double limit = 0.0) {
  const at::Tensor g = limit > 0 ? g_in.clamp_max(limit) : g_in, u = limit > 0 ? u_in.clamp(-limit, limit) : u_in;
  if (act == "silu") return kernels::swiglu(g, u);
  if (act == "gelu") return at::gelu(g) * u;
  if (act == "gelu_pytorch_tanh") return at::gelu(g, "tanh") * u;
  if (act == "relu") return at::relu(g) * u;
  throw Error("moe: unsupported activation '" + act + "'");
}

// at::_grouped_mm's autograd fails on an expanded (stride 0) incoming gradient: make it contiguous first.
at::Tensor contiguous_grad(at::Tensor y) {
  if (y.requires_grad()) y.register_hook([](const at::Tensor& g) { return g.contiguous(); });
  return y;
}

// Group-limited routing: [N,E] mask (1 = selectable) of the experts in the topk_group best of n_group groups, a
// group's score being the sum of its 2 best scores.
at::Tensor group_mask(const at::Tensor& scores, const MoEOptions& o) {
  const int64_t n = scores.size(0), e = scores.size(1), per = e / o.n_group;
  at::Tensor v = scores.view({n, o.n_group, per});
  at::Tensor group_scores = std::get<0>(at::topk(v, std::min<int64_t>(2, per), -1)).sum(-1);
  at::Tensor group_idx = std::get<1>(at::topk(group_scores, o.topk_group, -1, true, false));
  at::Tensor groups = at::zeros_like(group_scores).scatter_(1, group_idx, 1.0);
  return groups.unsqueeze(-1).expand({n, o.n_group, per}).reshape({n, e}).to(at::kBool);
}

// Router math runs in float32 (float64 stays float64, for gradient checks).
at::ScalarType router_dtype(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

bool grouped_mm_ok(const at::Tensor& x, int64_t d, int64_t ffn) {
  auto dt = x.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) return false;
  const int64_t es = static_cast<int64_t>(x.element_size());
  // row strides of every operand must be multiples of 16 bytes
  return (d * es) % 16 == 0 && (ffn * es) % 16 == 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Routing

Routing route(const at::Tensor& logits, const MoEOptions& o, const at::Tensor& bias, const at::Tensor& fixed_ids) {
  Routing r;
  r.logits = logits;
  const int64_t k = o.top_k;
  if (o.scoring == "softmax") {
    r.probs = at::softmax(logits, -1, router_dtype(logits));
    if (o.n_group > 1) {  // group-limited (Mistral 4): the experts outside the chosen groups score 0
      at::Tensor idx = std::get<1>(at::topk(r.probs.masked_fill(group_mask(r.probs, o).logical_not(), 0.0), k, -1, true, false));
      at::Tensor w = r.probs.gather(1, idx);
      if (o.norm_topk_prob) w = w / (w.sum(-1, true) + 1e-20);
      r.weights = w.to(logits.scalar_type());
      r.expert_ids = idx;
      if (o.routed_scaling_factor != 1.0) r.weights = r.weights * o.routed_scaling_factor;
      return r;
    }
    auto [val, idx] = at::topk(r.probs, k, -1);
    if (o.norm_topk_prob) val = val / val.sum(-1, true);
    r.weights = val.to(logits.scalar_type());
    r.expert_ids = idx;
  } else if (o.scoring == "sigmoid" || o.scoring == "sqrtsoftplus") {
    // sqrtsoftplus (DeepSeek-V4): in the logits' dtype, as transformers
    r.probs = o.scoring == "sigmoid" ? at::sigmoid(logits.to(router_dtype(logits))) : at::softplus(logits).sqrt();
    at::Tensor idx = fixed_ids;
    if (!idx.defined()) {
      at::Tensor choice = bias.defined() ? r.probs + bias.to(r.probs.scalar_type()) : r.probs;
      if (o.n_group > 1) choice = choice.masked_fill(group_mask(choice, o).logical_not(), -std::numeric_limits<double>::infinity());
      idx = std::get<1>(at::topk(choice, k, -1, true, false));
    }
    at::Tensor w = r.probs.gather(1, idx);
    if (o.norm_topk_prob) w = w / (w.sum(-1, true) + 1e-20);
    r.weights = w;
    r.expert_ids = idx;
  } else {
    throw Error("moe: unsupported scoring '" + o.scoring + "' (softmax, sigmoid, sqrtsoftplus)");
  }
  if (o.routed_scaling_factor != 1.0) r.weights = r.weights * o.routed_scaling_factor;
  return r;
}

namespace {
// Occurrences of each value 0..bins-1 in ids (int64 [bins]). at::bincount would do, but on CUDA it reads the largest
// id back to the host first (a device synchronisation per call); an index_add of ones does not.
at::Tensor count_ids(const at::Tensor& ids, int64_t bins) {
  const at::Tensor flat = ids.reshape({-1});
  return at::zeros({bins}, flat.options().dtype(at::kLong)).index_add_(0, flat, at::ones_like(flat, at::kLong));
}
}  // namespace

int64_t expert_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts, double capacity_factor) {
  return static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(num_tokens * top_k) /
                                        static_cast<double>(num_experts)));
}

std::pair<at::Tensor, at::Tensor> apply_capacity(const at::Tensor& expert_ids, const at::Tensor& weights,
                                                 int64_t num_experts, double capacity_factor) {
  if (capacity_factor <= 0) return {expert_ids, weights};
  const int64_t n = expert_ids.size(0), k = expert_ids.size(1);
  const int64_t cap = expert_capacity(n, k, num_experts, capacity_factor);
  at::Tensor flat = expert_ids.reshape({-1});
  at::Tensor key = at::where(flat >= 0, flat, at::full_like(flat, num_experts));
  // stable sort by expert: within an expert, assignments stay in flat (token, slot) order
  at::Tensor order = std::get<1>(at::sort(key, /*stable=*/true, 0, false));
  at::Tensor counts = count_ids(key, num_experts + 1);
  at::Tensor starts = at::cumsum(counts, 0) - counts;
  at::Tensor sorted_key = key.index_select(0, order);
  at::Tensor rank = at::arange(flat.numel(), flat.options()) - starts.index_select(0, sorted_key);
  at::Tensor keep_sorted = rank < cap;
  at::Tensor keep = at::empty_like(keep_sorted).index_copy_(0, order, keep_sorted).logical_and(flat >= 0);
  at::Tensor ids = at::where(keep, flat, at::full_like(flat, -1)).view({n, k});
  at::Tensor w = weights * keep.view({n, k}).to(weights.scalar_type());
  return {ids, w};
}

// ---------------------------------------------------------------------------------------------------------------
// Permutation, grouped experts, unpermutation

Permutation permute(const at::Tensor& x, const at::Tensor& expert_ids, int64_t num_experts, bool may_drop) {
  Permutation p;
  p.num_tokens = expert_ids.size(0);
  p.top_k = expert_ids.size(1);
  at::Tensor flat = expert_ids.reshape({-1});
  at::Tensor key = at::where(flat >= 0, flat, at::full_like(flat, num_experts));  // dropped last
  at::Tensor order = std::get<1>(at::sort(key, /*stable=*/true, 0, false));
  at::Tensor counts_all = count_ids(key, num_experts + 1);
  p.counts = counts_all.slice(0, 0, num_experts);
  // kept rows: all of them when nothing can be dropped (no read-back from the device)
  const int64_t m = may_drop ? flat.numel() - counts_all[num_experts].item<int64_t>() : flat.numel();
  p.slots = order.slice(0, 0, m);
  p.tokens = at::floor_divide(p.slots, p.top_k);
  p.offsets = at::cumsum(p.counts, 0).to(at::kInt);
  p.x = x.index_select(0, p.tokens);
  return p;
}

at::Tensor grouped_expert_ffn(const at::Tensor& x_in, const at::Tensor& gate_up_in, const at::Tensor& down_in,
                              const at::Tensor& offsets, const std::string& act, double limit) {
  // Under autocast (bf16 training) the experts' GEMMs run in the autocast dtype like every Linear: x and the fp32
  // master weights are cast (differentiably) here, since at::_grouped_mm has no autocast rule of its own.
  at::Tensor x = x_in, gate_up = gate_up_in, down = down_in;
  const auto dev = x.device().type();
  if (at::autocast::is_autocast_enabled(dev) && at::isFloatingType(x.scalar_type()) && x.scalar_type() != at::kDouble) {
    const auto dt = at::autocast::get_autocast_dtype(dev);
    if (x.scalar_type() != dt) x = x.to(dt);
    if (gate_up.scalar_type() != dt) gate_up = gate_up.to(dt);
    if (down.scalar_type() != dt) down = down.to(dt);
  }
  const int64_t e = gate_up.size(0), ffn = gate_up.size(1) / 2, d = gate_up.size(2);
  if (grouped_mm_ok(x, d, ffn) && gate_up.scalar_type() == x.scalar_type() && down.scalar_type() == x.scalar_type()) {
    // CPU bf16/fp16: the products in float32 on the 16-bit values (exact widening), rounded back: what a bf16 GEMM
    // with float32 accumulation gives, up to the order of the sums. ATen's CPU grouped GEMM runs every group as a
    // oneDNN matmul whose primitive is built (JIT-compiled) anew for each group's row count, every step.
    const auto dt = x.scalar_type();
    const bool widen = dev == at::kCPU && dt != at::kFloat;
    auto mm_in = [&](const at::Tensor& t) { return widen ? t.to(at::kFloat) : t; };
    at::Tensor h = contiguous_grad(at::_grouped_mm(mm_in(x).contiguous(), mm_in(gate_up).transpose(1, 2), offsets));
    if (widen) h = h.to(dt);  // [M, 2*ffn]
    at::Tensor a = activate(h.slice(1, 0, ffn), h.slice(1, ffn, 2 * ffn), act, limit);
    at::Tensor y = contiguous_grad(at::_grouped_mm(mm_in(a).contiguous(), mm_in(down).transpose(1, 2), offsets));
    return widen ? y.to(dt) : y;  // [M, d]
  }
  // Other dtypes (float64 for gradient checks) and unaligned shapes: one GEMM per expert over its contiguous rows.
  at::Tensor ends = offsets.to(at::kCPU, at::kLong);
  const int64_t* end = ends.data_ptr<int64_t>();
  std::vector<at::Tensor> outs;
  int64_t begin = 0;
  for (int64_t i = 0; i < e; ++i) {
    if (end[i] > begin) {
      at::Tensor xi = x.slice(0, begin, end[i]);
      at::Tensor h = at::linear(xi, gate_up[i]);
      outs.push_back(at::linear(activate(h.slice(1, 0, ffn), h.slice(1, ffn, 2 * ffn), act, limit), down[i]));
    }
    begin = end[i];
  }
  if (outs.empty()) return at::zeros({0, d}, x.options());
  return at::cat(outs, 0);
}

at::Tensor unpermute(const at::Tensor& y, const Permutation& p, const at::Tensor& weights) {
  at::Tensor w = weights.reshape({-1}).index_select(0, p.slots).to(y.scalar_type()).unsqueeze(1);
  at::Tensor out = at::zeros({p.num_tokens, y.size(1)}, y.options());
  return out.index_add(0, p.tokens, y * w);
}

at::Tensor experts_reference(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                             const at::Tensor& gate_up, const at::Tensor& down, const std::string& act) {
  const int64_t ffn = gate_up.size(1) / 2;
  at::Tensor out = at::zeros_like(x);
  for (int64_t i = 0; i < gate_up.size(0); ++i) {
    auto where = at::where(expert_ids == i);
    at::Tensor tok = where[0], pos = where[1];
    if (tok.numel() == 0) continue;
    at::Tensor h = at::linear(x.index_select(0, tok), gate_up[i]);
    at::Tensor g = h.slice(1, 0, ffn), u = h.slice(1, ffn, 2 * ffn);
    at::Tensor a = act == "silu" ? at::silu(g) * u : activate(g, u, act);
    at::Tensor wi = weights.reshape({-1}).index_select(0, tok * expert_ids.size(1) + pos);
    at::Tensor yi = at::linear(a, down[i]) * wi.unsqueeze(1).to(x.scalar_type());
    out = out.index_add(0, tok, yi);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Modules

MoEGateImpl::MoEGateImpl(int64_t num_experts, int64_t hidden, bool correction_bias, int64_t hash_vocab, int64_t top_k) {
  weight = register_parameter("weight", at::zeros({num_experts, hidden}));
  if (correction_bias) e_score_correction_bias = register_buffer("e_score_correction_bias", at::zeros({num_experts}));
  if (hash_vocab > 0) tid2eid = register_buffer("tid2eid", at::zeros({hash_vocab, top_k}, at::kLong));
}

void MoEGateImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  const at::Tensor keep = tid2eid.defined() ? tid2eid.detach().clone() : at::Tensor();
  torch::nn::Module::to(device, dtype, non_blocking);
  if (keep.defined()) tid2eid.set_data(keep.to(device));
}

void MoEGateImpl::to(torch::Dtype dtype, bool non_blocking) {
  const at::Tensor keep = tid2eid.defined() ? tid2eid.detach().clone() : at::Tensor();
  torch::nn::Module::to(dtype, non_blocking);
  if (keep.defined()) tid2eid.set_data(keep);
}

MoEExpertsImpl::MoEExpertsImpl(int64_t num_experts, int64_t hidden, int64_t ffn) {
  gate_up_proj = register_parameter("gate_up_proj", at::zeros({num_experts, 2 * ffn, hidden}));
  down_proj = register_parameter("down_proj", at::zeros({num_experts, hidden, ffn}));
}

SharedExpertImpl::SharedExpertImpl(int64_t hidden, int64_t ffn, std::string a, double swiglu_limit)
    : act(std::move(a)), limit(swiglu_limit) {
  gate_proj = register_module("gate_proj", Linear(hidden, ffn, false));
  up_proj = register_module("up_proj", Linear(hidden, ffn, false));
  down_proj = register_module("down_proj", Linear(ffn, hidden, false));
}

at::Tensor SharedExpertImpl::forward(const at::Tensor& x) {
  return down_proj->forward(activate(gate_proj->forward(x), up_proj->forward(x), act, limit));
}

MoEImpl::MoEImpl(MoEOptions o) : options(std::move(o)) {
  const auto& op = options;
  if (op.num_experts <= 0 || op.top_k <= 0 || op.top_k > op.num_experts || op.hidden <= 0 || op.expert_ffn <= 0)
    throw Error("moe: need num_experts > 0, 0 < top_k <= num_experts, hidden > 0, expert_ffn > 0");
  if (op.n_group < 1 || op.num_experts % op.n_group || op.topk_group < 1 || op.topk_group > op.n_group)
    throw Error("moe: n_group must divide num_experts and 1 <= topk_group <= n_group");
  if (op.bias_update_rate > 0 && !op.score_correction_bias)
    throw Error("moe: bias_update_rate needs score_correction_bias");
  if (op.hash_vocab > 0 && op.scoring == "softmax") throw Error("moe: hash routing needs sigmoid or sqrtsoftplus scoring");
  gate = register_module("gate", MoEGate(op.num_experts, op.hidden, op.score_correction_bias, op.hash_vocab, op.top_k));
  experts = register_module("experts", MoEExperts(op.num_experts, op.hidden, op.expert_ffn));
  if (op.shared_ffn > 0)
    shared_experts = register_module("shared_experts", SharedExpert(op.hidden, op.shared_ffn, op.act, op.swiglu_limit));
}

at::Tensor MoEImpl::router_logits(const at::Tensor& x) const {
  if (options.scoring == "sigmoid") {
    const auto dt = router_dtype(x);
    return at::linear(x.to(dt), gate->weight.to(dt));
  }
  return at::linear(x, gate->weight);
}

at::Tensor MoEImpl::forward(const at::Tensor& input, const at::Tensor& token_ids) {
  const at::Tensor x = input_fn ? input_fn(input) : input;
  const auto& o = options;
  const int64_t d = x.size(-1);
  at::Tensor xf = x.reshape({-1, d});
  const int64_t n = xf.size(0), e = o.num_experts, k = o.top_k;
  at::Tensor fixed;  // hash routing: the token's row of tid2eid
  if (o.hash_vocab > 0) {
    if (!token_ids.defined()) throw Error("moe: hash-routed MoE layers need the input token ids");
    if (token_ids.numel() != n) throw Error("moe: hash routing got " + std::to_string(token_ids.numel()) + " token ids for " + std::to_string(n) + " tokens");
    fixed = gate->tid2eid.index_select(0, token_ids.reshape({-1}).to(gate->tid2eid.device(), at::kLong)).to(at::kLong);
  }
  Routing r = route(router_logits(xf), o, gate->e_score_correction_bias, fixed);
  const bool lb_stats = o.hash_vocab == 0;  // (hash routers make no load-balancing statistics, as transformers)

  // Training statistics and losses (only when gradients are being computed, i.e. training).
  aux_loss = lb_loss = extra_loss = seq_loss = z_loss = at::Tensor();
  tokens_seen = n;
  sequences_seen = x.dim() == 3 ? x.size(0) : 1;
  sequence_parts = 1;
  lb_counts = at::Tensor();
  lb_prob_sum = at::Tensor();
  lb_rows = 0;
  // Statistics and losses are made in training forwards (grad mode), or in every forward with force_stats (a
  // forward without a graph that is recomputed with one in backward, as FSDP does): the expert loads for bias
  // updates are then counted in the first forward only.
  const bool forced = force_stats && is_training();  // not in evaluation
  const bool grad = at::GradMode::is_enabled() || forced;
  const bool count_load = forced ? !at::GradMode::is_enabled() : at::GradMode::is_enabled();
  // lb_softmax_topk: the balancing statistics of softmax(logits) and its own top-k (MiniMax-M2 in transformers)
  const at::Tensor lb_p = grad && o.lb_softmax_topk ? at::softmax(r.logits, -1, router_dtype(r.logits)) : at::Tensor();
  if (grad && ((lb_stats && o.aux_loss_coef > 0) || o.bias_update_rate > 0 || o.seq_aux_loss_coef > 0)) {
    at::NoGradGuard ng;
    const at::Tensor chosen = count_ids(r.expert_ids, e).to(at::kFloat);
    lb_counts = lb_p.defined() ? count_ids(std::get<1>(at::topk(lb_p, k, -1)), e).to(at::kFloat) : chosen;
    if (o.bias_update_rate > 0 && count_load)
      load_since_update = load_since_update.defined() ? load_since_update + chosen : chosen.clone();
  }
  if (grad) {
    at::Tensor p = o.scoring == "softmax" ? r.probs : r.probs / r.probs.sum(-1, true);
    if (lb_stats && o.aux_loss_coef > 0) {
      lb_prob_sum = (lb_p.defined() ? lb_p : p).sum(0);
      lb_rows = n;
      lb_loss = o.aux_loss_coef * static_cast<double>(e) *
                (lb_counts.to(p.scalar_type()) / static_cast<double>(n) * (lb_prob_sum / static_cast<double>(n))).sum();
    }
    if (o.seq_aux_loss_coef > 0) {
      const int64_t b = x.dim() == 3 ? x.size(0) : 1, t = n / b;
      at::Tensor cnt;
      {
        at::NoGradGuard ng;
        cnt = at::zeros({b, e}, p.options())
                  .scatter_add_(1, r.expert_ids.view({b, t * k}), at::ones({b, t * k}, p.options()));
        if (sequence_reduce) sequence_parts = sequence_reduce(cnt);  // whole sequences' counts (context parallel)
      }
      // Tokens of a whole sequence: the ranks sharing it hold equal parts.
      const double t_all = static_cast<double>(t * sequence_parts);
      at::Tensor f = cnt * (static_cast<double>(e) / (static_cast<double>(k) * t_all));
      // The mean of p over the sequence; with parts, this rank's tokens' part of it.
      at::Tensor pm = sequence_parts == 1 ? p.view({b, t, e}).mean(1) : p.view({b, t, e}).sum(1) / t_all;
      extra_loss = seq_loss = o.seq_aux_loss_coef * (f * pm).sum(1).mean();
    }
    if (o.z_loss_coef > 0) {
      at::Tensor z = at::logsumexp(r.logits.to(router_dtype(r.logits)), -1);
      at::Tensor zl = z_loss = o.z_loss_coef * (z * z).mean();
      extra_loss = extra_loss.defined() ? extra_loss + zl : zl;
    }
    if (lb_loss.defined()) aux_loss = lb_loss;
    if (extra_loss.defined()) aux_loss = aux_loss.defined() ? aux_loss + extra_loss : extra_loss;
  }

  at::Tensor ids = r.expert_ids, w = r.weights;
  if (o.capacity_factor > 0) std::tie(ids, w) = apply_capacity(ids, w, e, o.capacity_factor);

  at::Tensor out;
  if (experts_fn) {
    out = experts_fn(xf, ids, w);
  } else {
    Permutation p = permute(xf, ids, e, /*may_drop=*/o.capacity_factor > 0);
    at::Tensor y = grouped_expert_ffn(p.x, experts->gate_up_proj, experts->down_proj, p.offsets, o.act, o.swiglu_limit);
    out = unpermute(y, p, w);
  }
  out = out.view(x.sizes());
  if (shared_experts) out = out + shared_experts->forward(x);
  return output_fn ? output_fn(out) : out;
}

void MoEImpl::update_bias() {
  if (options.bias_update_rate <= 0 || !load_since_update.defined()) return;
  at::NoGradGuard ng;
  at::Tensor load = load_since_update;
  at::Tensor delta = at::sign(load.mean() - load) * options.bias_update_rate;
  gate->e_score_correction_bias.add_(delta.to(gate->e_score_correction_bias.scalar_type()));
  load_since_update = at::Tensor();
}

at::Tensor load_balancing_loss(const std::vector<const MoEImpl*>& layers) {
  at::Tensor counts, probs;
  int64_t rows = 0, e = 0;
  for (const MoEImpl* l : layers) {
    if (!l->lb_prob_sum.defined()) continue;
    counts = counts.defined() ? counts + l->lb_counts : l->lb_counts;
    probs = probs.defined() ? probs + l->lb_prob_sum : l->lb_prob_sum;
    rows += l->lb_rows;
    e = l->options.num_experts;
  }
  if (!counts.defined()) return {};
  const double r = static_cast<double>(rows);
  return static_cast<double>(e) * (counts.to(probs.scalar_type()) / r * (probs / r)).sum();
}

}  // namespace lf::nn

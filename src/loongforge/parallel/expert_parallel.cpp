#include "loongforge/parallel/expert_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <set>

#include "loongforge/core/error.h"

namespace lf::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AllToAllV : torch::autograd::Function<AllToAllV> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g, std::vector<int64_t> send,
                            std::vector<int64_t> recv) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return reinterpret_cast<const Group*>(g)->all_to_all_v(x.contiguous(), send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group& g = *reinterpret_cast<const Group*>(ctx->saved_data["group"].toInt());
    std::vector<int64_t> send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    return {g.all_to_all_v(grads[0].contiguous(), recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::vector<int64_t> to_vec(const at::Tensor& t) {
  at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

}  // namespace

bool ExpertParallelPlan::is_expert_param(const std::string& name) const {
  for (const auto& n : expert_params)
    if (n == name) return true;
  return false;
}

void check_expert_parallel(int64_t num_experts, int ep) {
  if (ep < 1) throw OptionError("ep", "must be >= 1, got " + std::to_string(ep));
  if (num_experts <= 0)
    throw OptionError("ep", std::to_string(ep) + " needs a mixture-of-experts model (no experts)");
  if (num_experts % ep != 0)
    throw OptionError("ep", std::to_string(ep) + " does not divide num_experts " +
                std::to_string(num_experts));
}

void check_guest_options(const moe::GuestOptions& guests, int ep) {
  if (guests.guest_slots < 0)
    throw OptionError("guest_slots", std::to_string(guests.guest_slots) + " is negative");
  if (guests.ranks_per_node < 0 || (guests.ranks_per_node > 0 && ep % guests.ranks_per_node != 0))
    throw OptionError("ranks_per_node", std::to_string(guests.ranks_per_node) +
                " does not divide parallel.ep " + std::to_string(ep) +
                " (the expert-parallel ranks of a group, node by node)");
}

at::Tensor all_to_all_v(const at::Tensor& x, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts, const Group& g) {
  if (g.size() == 1) return x;
  return AllToAllV::apply(x, reinterpret_cast<int64_t>(&g), send_counts, recv_counts);
}

at::Tensor ep_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                      const at::Tensor& gate_up, const at::Tensor& down, int64_t num_experts, const std::string& act,
                      const Group& ep, const moe::GuestOptions& guests, ExpertParallelPlan::Stats* stats,
                      double swiglu_limit) {
  const int P = ep.size(), me = ep.rank();
  const int64_t L = gate_up.size(0), E = num_experts;
  TORCH_CHECK(L * P == E, "ep_experts: ", L, " local experts x ep ", P, " != num_experts ", E);
  const auto dev = x.device();
  auto cpu_long = [](const std::vector<int64_t>& v) {
    return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions(at::kLong));
  };
  // 1. local permutation by global expert (rows of an expert contiguous, in token order)
  nn::Permutation p = nn::permute(x, expert_ids, E);
  // 2. every rank's tokens per expert -> the plan (identical on every rank)
  at::Tensor counts = p.counts.to(at::kLong).contiguous().view({1, E});
  std::vector<int64_t> all = to_vec(P == 1 ? counts : ep.all_gather(counts, 0));
  std::vector<std::vector<int64_t>> C(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) C[static_cast<size_t>(j)].assign(all.begin() + j * E, all.begin() + (j + 1) * E);
  const moe::GuestPlan plan = moe::plan_guests(C, static_cast<int>(L), guests);
  // Local slots of rank r: its L home experts, then its kept guests (plan_guests puts them first).
  const int64_t K = L + guests.guest_slots;  // slots per rank, for keys
  auto slot_of = [&](int64_t e, int r) -> int64_t {
    if (e / L == r) return e - r * L;
    const auto& g = plan.guests[static_cast<size_t>(r)];
    for (size_t i = 0; i < g.size(); ++i)
      if (g[i] == e) return L + static_cast<int64_t>(i);
    TORCH_CHECK(false, "ep_experts: plan routes expert ", e, " to rank ", r, ", which does not hold it");
  };
  std::vector<int> kept(static_cast<size_t>(P), 0);
  bool any_guest = false;
  for (int r = 0; r < P; ++r)
    for (int e : plan.guests[static_cast<size_t>(r)])
      if (e >= 0) ++kept[static_cast<size_t>(r)], any_guest = true;
  const int64_t G = L + kept[static_cast<size_t>(me)];  // this rank's groups
  // 3. send side: our rows of expert e split, in route order, into consecutive chunks per computing rank
  std::vector<int64_t> key_vals, key_lens, send(static_cast<size_t>(P), 0), recv(static_cast<size_t>(P), 0);
  std::vector<int64_t> rc(static_cast<size_t>(P * G), 0);  // [src][slot] rows this rank computes
  int64_t replica_tokens = 0;
  for (int64_t e = 0; e < E; ++e)
    for (const auto& r : plan.routes[static_cast<size_t>(e)]) {
      if (r.dst != e / L) replica_tokens += r.tokens;
      if (r.src == me) {
        key_vals.push_back(r.dst * K + slot_of(e, r.dst));
        key_lens.push_back(r.tokens);
        send[static_cast<size_t>(r.dst)] += r.tokens;
      }
      if (r.dst == me) {
        rc[static_cast<size_t>(r.src * G + slot_of(e, me))] += r.tokens;
        recv[static_cast<size_t>(r.src)] += r.tokens;
      }
    }
  if (stats && at::GradMode::is_enabled()) {  // training forwards only
    ++stats->plans;
    stats->overload += plan.overload;
    stats->home_overload += plan.home_overload;
    stats->replica_tokens += replica_tokens;
  }
  // rows sorted by (computing rank, its slot), stable: token order within a chunk
  at::Tensor row_key = at::repeat_interleave(cpu_long(key_vals), cpu_long(key_lens));
  TORCH_CHECK(row_key.numel() == p.x.size(0), "ep_experts: plan covers ", row_key.numel(), " of ", p.x.size(0), " rows");
  at::Tensor sorder = std::get<1>(at::sort(row_key, /*stable=*/true, 0, false));
  at::Tensor xsend = p.x.index_select(0, sorder.to(dev));
  // 4. dispatch: received rows grouped by source rank, then slot
  at::Tensor xr = all_to_all_v(xsend, send, recv, ep);
  // 5. regroup by slot (stable: source rank order within a slot)
  std::vector<int64_t> seg_keys;
  for (int j = 0; j < P; ++j)
    for (int64_t sl = 0; sl < G; ++sl) seg_keys.push_back(sl * P + j);
  at::Tensor rkey = at::repeat_interleave(cpu_long(seg_keys), cpu_long(rc));
  at::Tensor order = std::get<1>(at::sort(rkey, /*stable=*/true, 0, false));
  at::Tensor xs = xr.index_select(0, order.to(dev));
  at::Tensor offsets = at::cumsum(cpu_long(rc).view({P, G}).sum(0), 0).to(at::kInt).to(dev);
  // 6. weights: home experts, then the guests' copies from their home ranks (differentiable: the replicas'
  //    gradients return to the home expert through the reverse exchange and the index_select)
  at::Tensor gu = gate_up, dn = down;
  if (any_guest) {
    std::vector<int64_t> idx, wsend(static_cast<size_t>(P), 0), wrecv(static_cast<size_t>(P), 0);
    for (int r = 0; r < P; ++r)
      for (int e : plan.guests[static_cast<size_t>(r)])
        if (e >= 0 && e / L == me) idx.push_back(e - me * L), ++wsend[static_cast<size_t>(r)];
    const auto& mine = plan.guests[static_cast<size_t>(me)];
    std::vector<std::pair<int64_t, int64_t>> by_home;  // (home rank, guest slot) in received order
    for (int64_t i = 0; i < kept[static_cast<size_t>(me)]; ++i) by_home.emplace_back(mine[static_cast<size_t>(i)] / L, i);
    for (auto& [h, i] : by_home) ++wrecv[static_cast<size_t>(h)];
    std::stable_sort(by_home.begin(), by_home.end(), [](auto& a, auto& b) { return a.first < b.first; });
    std::vector<int64_t> perm(by_home.size());
    for (size_t k = 0; k < by_home.size(); ++k) perm[static_cast<size_t>(by_home[k].second)] = static_cast<int64_t>(k);
    at::Tensor sel = cpu_long(idx).to(dev), pm = cpu_long(perm).to(dev);
    auto copies = [&](const at::Tensor& w) {
      const int64_t row = w.numel() / std::max<int64_t>(1, w.size(0));
      at::Tensor out = all_to_all_v(w.index_select(0, sel).reshape({static_cast<int64_t>(idx.size()), row}), wsend,
                                    wrecv, ep);
      std::vector<int64_t> shape = w.sizes().vec();
      shape[0] = static_cast<int64_t>(by_home.size());
      return out.view(shape).index_select(0, pm);
    };
    gu = at::cat({gate_up, copies(gate_up)}, 0);
    dn = at::cat({down, copies(down)}, 0);
  }
  // 7. local experts and guests
  at::Tensor ys = nn::grouped_expert_ffn(xs, gu, dn, offsets, act, swiglu_limit);
  // 8. back to the received order, to the source ranks, to the permuted order; combine
  at::Tensor inv = at::empty_like(order);
  if (order.numel() > 0) inv.index_copy_(0, order, at::arange(order.numel(), order.options()));
  at::Tensor yr = ys.index_select(0, inv.to(dev));
  at::Tensor yb = all_to_all_v(yr, recv, send, ep);
  at::Tensor sinv = at::empty_like(sorder);
  if (sorder.numel() > 0) sinv.index_copy_(0, sorder, at::arange(sorder.numel(), sorder.options()));
  return nn::unpermute(yb.index_select(0, sinv.to(dev)), p, weights);
}

void apply_expert_parallel(nn::MoEImpl& block, const Group& ep, const moe::GuestOptions& guests,
                           std::shared_ptr<ExpertParallelPlan::Stats> stats) {
  if (block.experts_fn) throw Error("apply_expert_parallel: the MoE block already has an experts_fn (applied twice?)");
  const int64_t e = block.options.num_experts;
  check_expert_parallel(e, ep.size());
  const int64_t l = e / ep.size(), first = l * ep.rank();
  {
    at::NoGradGuard ng;
    at::Tensor& gu = block.experts->gate_up_proj;
    at::Tensor& dn = block.experts->down_proj;
    gu.set_data(gu.narrow(0, first, l).clone());
    dn.set_data(dn.narrow(0, first, l).clone());
    gu.mutable_grad() = at::Tensor();
    dn.mutable_grad() = at::Tensor();
  }
  nn::MoEImpl* b = &block;
  const Group* g = &ep;
  block.experts_fn = [b, g, guests, stats](const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w) {
    return ep_experts(x, ids, w, b->experts->gate_up_proj, b->experts->down_proj, b->options.num_experts,
                      b->options.act, *g, guests, stats.get(), b->options.swiglu_limit);
  };
}

ExpertParallelPlan apply_expert_parallel(models::Model& m, const Group& ep, const moe::GuestOptions& guests) {
  auto blocks = m.moe_blocks();
  if (blocks.empty())
    throw OptionError("ep", std::to_string(ep.size()) +
                " needs a mixture-of-experts model (this model has no MoE layers)");
  for (auto* b : blocks) {
    check_expert_parallel(b->options.num_experts, ep.size());
    if (b->experts_fn) throw Error("apply_expert_parallel: the model is already expert-parallel");
  }
  // Under pipeline parallelism only this stage's blocks hold their parameters (the others were released: empty).
  std::vector<nn::MoEImpl*> held;
  for (auto* b : blocks)
    if (b->experts->gate_up_proj.numel() > 0) held.push_back(b);
  blocks = held;
  ExpertParallelPlan plan;
  plan.ep_size = ep.size();
  plan.ep_rank = ep.rank();
  plan.num_experts = blocks.front()->options.num_experts;
  plan.local_experts = plan.num_experts / ep.size();
  plan.first_expert = plan.local_experts * ep.rank();
  std::set<const void*> impls;
  for (auto* b : blocks) {
    impls.insert(b->experts->gate_up_proj.unsafeGetTensorImpl());
    impls.insert(b->experts->down_proj.unsafeGetTensorImpl());
  }
  for (const auto& item : m.named_parameters(true))
    if (impls.count(item.value().unsafeGetTensorImpl())) plan.expert_params.push_back(item.key());
  check_guest_options(guests, ep.size());
  for (auto* b : blocks) apply_expert_parallel(*b, ep, guests, plan.stats);
  return plan;
}

void sync_non_expert_grads(models::Model& m, const ExpertParallelPlan& plan, const Group& ep) {
  if (ep.size() == 1) return;
  for (auto& item : m.named_parameters(true)) {
    if (plan.is_expert_param(item.key())) continue;
    at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    at::Tensor gr = p.mutable_grad();
    ep.all_reduce(gr);
  }
}

std::map<std::string, at::Tensor> gather_expert_params(models::Model& m, const ExpertParallelPlan& plan,
                                                       const Group& ep) {
  std::map<std::string, at::Tensor> out;
  auto params = m.named_parameters(true);
  for (const auto& name : plan.expert_params) {
    at::NoGradGuard ng;
    out[name] = ep.size() == 1 ? params[name].detach().clone() : ep.all_gather(params[name].detach().contiguous(), 0);
  }
  return out;
}

at::Tensor expert_shard_of(const at::Tensor& full, const Group& ep) {
  if (full.size(0) % ep.size() != 0)
    throw Error("expert_shard_of: ep " + std::to_string(ep.size()) + " does not divide dim 0 of size " +
                std::to_string(full.size(0)));
  const int64_t l = full.size(0) / ep.size();
  return full.narrow(0, l * ep.rank(), l).clone();
}

}  // namespace lf::parallel

#include "loongforge/parallel/expert_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

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

// The expert parameters' TensorImpls of the model's blocks -> whether `t` is one of them.
std::set<const void*> expert_impls(models::llama::CausalLMImpl& m) {
  std::set<const void*> s;
  for (auto* b : m.moe_blocks()) {
    s.insert(b->experts->gate_up_proj.unsafeGetTensorImpl());
    s.insert(b->experts->down_proj.unsafeGetTensorImpl());
  }
  return s;
}

}  // namespace

bool ExpertParallelPlan::is_expert_param(const std::string& name) const {
  for (const auto& n : expert_params)
    if (n == name) return true;
  return false;
}

void check_expert_parallel(int64_t num_experts, int ep) {
  if (ep < 1) throw Error("recipe: field 'parallel.ep': must be >= 1, got " + std::to_string(ep));
  if (num_experts <= 0)
    throw Error("recipe: field 'parallel.ep': " + std::to_string(ep) + " needs a mixture-of-experts model (no experts)");
  if (num_experts % ep != 0)
    throw Error("recipe: field 'parallel.ep': " + std::to_string(ep) + " does not divide num_experts " +
                std::to_string(num_experts));
}

at::Tensor all_to_all_v(const at::Tensor& x, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts, const Group& g) {
  if (g.size() == 1) return x;
  return AllToAllV::apply(x, reinterpret_cast<int64_t>(&g), send_counts, recv_counts);
}

at::Tensor ep_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                      const at::Tensor& gate_up, const at::Tensor& down, int64_t num_experts, const std::string& act,
                      const Group& ep) {
  const int64_t P = ep.size(), L = gate_up.size(0);
  TORCH_CHECK(L * P == num_experts, "ep_experts: ", L, " local experts x ep ", P, " != num_experts ", num_experts);
  // 1. local permutation by global expert: rows for rank j's experts are contiguous, in rank order
  nn::Permutation p = nn::permute(x, expert_ids, num_experts);
  // 2. counts: counts[j*L + l] rows for expert l of rank j; rank j gets our block j of L counts
  at::Tensor counts = p.counts.to(at::kLong).contiguous();
  std::vector<int64_t> send = to_vec(counts.view({P, L}).sum(1));
  at::Tensor rcounts = P == 1 ? counts : ep.all_to_all(counts);  // [P*L]: block i = rank i's rows per local expert
  at::Tensor rc2 = rcounts.view({P, L});
  std::vector<int64_t> recv = to_vec(rc2.sum(1));
  // 3. dispatch
  at::Tensor xr = all_to_all_v(p.x, send, recv, ep);  // grouped by source rank, then local expert
  // 4. regroup by local expert (stable: source rank order within an expert)
  at::Tensor seg_key = (at::arange(L, at::kLong).unsqueeze(0) * P + at::arange(P, at::kLong).unsqueeze(1)).reshape({-1});
  at::Tensor row_key = at::repeat_interleave(seg_key, rc2.reshape({-1}));
  at::Tensor order = std::get<1>(at::sort(row_key, /*stable=*/true, 0, false)).to(x.device());
  at::Tensor xs = xr.index_select(0, order);
  at::Tensor offsets = at::cumsum(rc2.sum(0), 0).to(at::kInt).to(x.device());
  // 5. local experts
  at::Tensor ys = nn::grouped_expert_ffn(xs, gate_up, down, offsets, act);
  // 6. back to the received order, then to the source ranks
  at::Tensor inv = at::empty_like(order);
  if (order.numel() > 0) inv.index_copy_(0, order, at::arange(order.numel(), order.options()));
  at::Tensor yr = ys.index_select(0, inv);
  at::Tensor yb = all_to_all_v(yr, recv, send, ep);
  // 7. combine
  return nn::unpermute(yb, p, weights);
}

void apply_expert_parallel(nn::MoEImpl& block, const Group& ep) {
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
  block.experts_fn = [b, g](const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w) {
    return ep_experts(x, ids, w, b->experts->gate_up_proj, b->experts->down_proj, b->options.num_experts,
                      b->options.act, *g);
  };
}

ExpertParallelPlan apply_expert_parallel(models::llama::CausalLMImpl& m, const Group& ep) {
  auto blocks = m.moe_blocks();
  if (blocks.empty())
    throw Error("recipe: field 'parallel.ep': " + std::to_string(ep.size()) +
                " needs a mixture-of-experts model (this model has no MoE layers)");
  for (auto* b : blocks) {
    check_expert_parallel(b->options.num_experts, ep.size());
    if (b->experts_fn) throw Error("apply_expert_parallel: the model is already expert-parallel");
  }
  ExpertParallelPlan plan;
  plan.ep_size = ep.size();
  plan.ep_rank = ep.rank();
  plan.num_experts = blocks.front()->options.num_experts;
  plan.local_experts = plan.num_experts / ep.size();
  plan.first_expert = plan.local_experts * ep.rank();
  auto impls = expert_impls(m);
  for (const auto& item : m.named_parameters(true))
    if (impls.count(item.value().unsafeGetTensorImpl())) plan.expert_params.push_back(item.key());
  for (auto* b : blocks) apply_expert_parallel(*b, ep);
  return plan;
}

void sync_non_expert_grads(models::llama::CausalLMImpl& m, const ExpertParallelPlan& plan, const Group& ep) {
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

std::map<std::string, at::Tensor> gather_expert_params(models::llama::CausalLMImpl& m, const ExpertParallelPlan& plan,
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

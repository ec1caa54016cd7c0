// Expert parallelism (issue 6) as a layout applied from outside to a plain MoE model whose full weights every rank
// holds (same seed, or loaded from HF before applying), in the style of tensor_parallel.h.
//
// Layout over the ep group of size P (E experts, L = E / P): rank r keeps experts [r*L, (r+1)*L) of every MoE
// block: the stacked parameters experts.gate_up_proj [E,2f,d] and experts.down_proj [E,d,f] are replaced in place
// (set_data: same tensor identity and names, so optimizers and checkpoint code still find them) by their rows
// [r*L, (r+1)*L) along dim 0. The router (gate.*), shared experts, attention, norms, embeddings: replicated.
//
// Tokens differ per ep rank: the ep ranks are data-parallel ranks for everything but the experts. Each block's
// MoEImpl::experts_fn is installed and does, on the block's local tokens x [N,d] (routing already computed
// locally):
//   permute locally by destination expert (nn::permute over all E experts) -> exchange the per-expert counts with
//   one all-to-all -> all-to-all-v the token rows to the experts' home ranks (differentiable: the backward is the
//   reverse all-to-all-v) -> regroup the received rows by local expert -> nn::grouped_expert_ffn on the L local
//   experts -> restore the received order -> all-to-all-v back -> nn::unpermute with the routing weights.
// Every rank must call forward (and backward) of every MoE block the same number of times, in the same order
// (the collectives are blocking and matched by order), even with zero local tokens routed anywhere.
//
// Gradients:
//   - expert parameters (plan.expert_params): after backward each rank holds the COMPLETE gradient of its local
//     slice, summed over the tokens of every ep rank. They must NOT be all-reduced over the ep group (with an
//     outer data-parallel dimension "dp" of replicas of the whole ep group, they are all-reduced over dp only).
//   - every other parameter only holds the gradient of this rank's tokens: a data-parallel all-reduce (sum, or
//     mean with the same divisor as the loss) over the ep group (and dp, if any) is still needed, exactly as for
//     plain data parallelism over the ep x dp ranks. sync_non_expert_grads does the ep part.
//   - grad-norm clipping: expert parameters are counted once per ep rank (sum of squares over ep), non-expert ones
//     once (after their all-reduce, on any single rank).
// Router losses (aux / seq / z-loss) are computed by each block on its local tokens; the trainer combines them into
// the losses of the global micro-batch with CausalLM::aux_stats / aux_share (statistics summed over the data ranks).
//
// Capacity (capacity_factor > 0): nn::MoEImpl applies it before experts_fn, on the block's LOCAL tokens, so under
// EP the capacity is per rank: C = ceil(capacity_factor * N_local * k / E) assignments per expert per source
// rank (the home rank of an expert receives at most P*C rows). The result equals running each rank's rows
// through the one-process model separately, not the global batch at once.
//
// Hot-expert replication (guest slots; recipe moe.guest_slots S > 0): each rank also has S guest slots. Every
// forward of every block, the ranks all-gather their per-expert token counts and run moe::plan_guests (parallel/
// moe_guest_plan.h; identical input -> identical plan on every rank), which puts replicas of overloaded experts into guest
// slots of underloaded ranks (home node first) and says how many of each source rank's tokens of an expert each copy
// computes. The replica weights are copied from the home rank with a differentiable all-to-all-v (its backward
// returns the replicas' gradients, which autograd adds into the home expert's gradient), the tokens go to the copy
// the plan names, and the results come back to their source: routing never changes, so losses and gradients equal
// the run without replication (up to float rounding). Without guest slots the plan routes every token home.
//
// Checkpoints: gather_expert_params all-gathers every expert parameter along dim 0 (every rank gets the whole
// [E,...] tensor); expert_shard_of cuts a whole tensor back to this rank's slice (for loading). The Group must
// outlive the model.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/nn/moe.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/moe_guest_plan.h"

namespace lf::parallel {

struct ExpertParallelPlan {
  int ep_size = 1, ep_rank = 0;
  int64_t num_experts = 0, local_experts = 0, first_expert = 0;  // local experts [first, first + local)
  // HF names (model.named_parameters()) of the sliced expert parameters.
  std::vector<std::string> expert_params;
  bool is_expert_param(const std::string& name) const;
  // Replication statistics of the training forwards (grad mode) since the engine last read them (every block);
  // the plans are identical on the ep ranks of a group.
  struct Stats {
    int64_t plans = 0;
    double overload = 0, home_overload = 0;  // sums of the plans' max/mean rank loads, with and without guests
    int64_t replica_tokens = 0;              // token rows computed by guest copies
  };
  std::shared_ptr<Stats> stats = std::make_shared<Stats>();
};

// Throws lf::Error ("recipe: field 'parallel.ep': 3 does not divide num_experts 8") unless ep >= 1 divides the
// number of experts.
void check_expert_parallel(int64_t num_experts, int ep);

// Throws lf::Error naming 'moe.guest_slots' / 'moe.ranks_per_node' unless guest_slots >= 0 and ranks_per_node is 0
// or divides the ep size.
void check_guest_options(const moe::GuestOptions& guests, int ep);

// Guest options without guest slots (plain expert parallelism).
inline moe::GuestOptions guest_free() {
  moe::GuestOptions o;
  o.guest_slots = 0;
  return o;
}

// Slices one MoE block's experts to this rank's share and installs its experts_fn (with `guests.guest_slots`
// guest slots per rank; 0: none). `ep` must outlive the block; `stats` (may be null) collects replication figures.
void apply_expert_parallel(nn::MoEImpl& block, const Group& ep, const moe::GuestOptions& guests,
                           std::shared_ptr<ExpertParallelPlan::Stats> stats = nullptr);

// Every MoE block of the model this rank holds (CausalLMImpl::moe_blocks(); under pipeline parallelism the blocks
// of other stages, whose parameters were released, are skipped). Errors: a dense model, ep not dividing
// num_experts (recipe field 'parallel.ep'), a block already expert-parallel, bad guest options (recipe fields
// 'moe.guest_slots', 'moe.ranks_per_node'). Once per model.
ExpertParallelPlan apply_expert_parallel(models::Model& m, const Group& ep,
                                         const moe::GuestOptions& guests = guest_free());

// The expert computation of one block under EP (what apply_expert_parallel installs as experts_fn): x [N,d] this
// rank's tokens, expert_ids [N,k] global expert ids (-1 = dropped), weights [N,k]; gate_up/down: this rank's local
// slices [L,...]; guests: the replication options (guest_slots 0: every token computed by its home expert).
// swiglu_limit: nn::MoEOptions::swiglu_limit. Returns [N,d]. Collective over ep. `stats` (may be null) accumulates this call's plan figures.
at::Tensor ep_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                      const at::Tensor& gate_up, const at::Tensor& down, int64_t num_experts, const std::string& act,
                      const Group& ep, const moe::GuestOptions& guests = guest_free(),
                      ExpertParallelPlan::Stats* stats = nullptr, double swiglu_limit = 0.0);

// Differentiable uneven all-to-all: rows of dim 0, send_counts[j] rows to rank j, recv_counts[i] from rank i;
// the backward is the reverse exchange.
at::Tensor all_to_all_v(const at::Tensor& x, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts, const Group& g);

// Sums the gradients of every non-expert parameter over ep (one all-reduce each; undefined grads count as zeros).
// The data-parallel reduction over the ep ranks; with an outer dp dimension, reduce over the group of ep x dp.
void sync_non_expert_grads(models::Model& m, const ExpertParallelPlan& plan, const Group& ep);

// Whole expert tensors by HF name, all-gathered along dim 0 over ep (every rank gets all; checkpoints, export).
std::map<std::string, at::Tensor> gather_expert_params(models::Model& m, const ExpertParallelPlan& plan,
                                                       const Group& ep);
// This rank's slice along dim 0 of a whole expert tensor (a copy).
at::Tensor expert_shard_of(const at::Tensor& full, const Group& ep);

}  // namespace lf::parallel

// Run-time hot-expert replication for the trainer's expert parallelism (issue 6; docs/moe_plan.md): plan_guests,
// called for every MoE layer on every forward (parallel/expert_parallel.cpp). Torch-free. The offline planners of
// `loongforge moe-plan` are in moe_plan.h.
//
// Setting: R ep ranks with FIXED home experts (rank r holds experts [r*L, (r+1)*L), L = E/R) and S guest slots per
// rank. Every forward of every MoE block, all ranks all-gather counts[j][e] (tokens source rank j routes to expert
// e) and call plan_guests with identical input; the plan says which expert each guest slot holds (weights copied
// from the home rank, gradients summed back) and how many of each source's tokens each copy computes. Routing never
// changes; only which rank computes which token.
//
// Algorithm (integer arithmetic except the optional cost model's doubles, computed identically from identical input;
// fixed iteration orders, total orders or stable sorts, no randomness: bit-identical on every rank):
//  1. Start from the homes-only plan; its min rank-load cap C is the largest home load.
//  2. Greedy replicas, one guest slot at a time. A max-flow at cap C-1 (experts -> ranks holding them -> sink with
//     capacity C-1; home edges filled first) leaves a deficit D of tokens that do not fit. Its minimal min cut names
//     the bottleneck: experts T whose tokens do not fit and the saturated ranks N(T) that hold them. Candidates, in
//     order: experts of T by decreasing load per copy, each onto ranks outside N(T) with a free guest slot that do not
//     hold it, the least loaded first; ranks on the expert's home node come first when their load is within 2% of C
//     of the least loaded candidate (weight copy and gradient return stay intra-node). With a cost model
//     (hidden_size or expert_params > 0), candidates within that window are ordered by cost instead: weight copy +
//     gradient return (2*expert_params*bytes_per_element over the link to the home) minus the inter-node token bytes
//     a first copy on the candidate's node saves (its node's tokens of the expert, at most the rank's free capacity).
//     The first candidate that makes C-1 feasible or lowers D is kept; C becomes the new minimum cap, found exactly by
//     raising a lower bound with min cuts (the ranks Q of a cut must take every token of the experts held only on Q,
//     so C >= ceil(that load / |Q|)); the first bound, the largest over each rank alone and each replicated expert's
//     holders, is usually exact. The greedy stops when no candidate helps, C reaches ceil(total/R), or the slots run
//     out.
//  3. Routing at the final cap C: tokens of experts without a guest go home; a max-flow from the replicated experts'
//     sources to the ranks holding them (rank capacity C less the rank's other tokens) in three phases that open
//     edges same-rank, then same-node, then anywhere (locality first; the phases are a heuristic for locality, the
//     total is exact). An expert's sources that do not hold it are pooled per node (they have the same edges) and
//     the pool's flow is handed to them in rank order.
//  4. Guest slots that take no tokens become -1.
// Guarantees (tests/cpp/test_moe_guest_plan.cpp): tokens of every (expert, source) conserved; routes only to ranks
// holding the expert; no rank holds an expert twice, no guest holds a home expert; max(rank_loads) is the smallest
// cap feasible for the chosen guests and <= max(home_loads), so overload <= home_overload; identical input gives an
// identical plan. Cost per call on one CPU core (bench/moe_plan_bench.cpp, bench/results/moe_plan_guests.md): E=64,
// R=8, S=2 about 0.02 ms; E=256, R=32, S=2 about 0.3 ms; E=256, R=64 about 1 ms.
// Kept guests come first in guests[r], in placement order, then the -1 slots.
#pragma once
#include <cstdint>
#include <vector>

namespace lf::parallel::moe {

struct GuestRoute {
  int src = 0, dst = 0;  // source rank of the tokens, rank that computes them
  int64_t tokens = 0;
};
struct GuestPlan {
  std::vector<std::vector<int>> guests;         // [R][S]: logical expert in each guest slot of rank r, -1 = empty
  std::vector<std::vector<GuestRoute>> routes;  // [E]: routes of expert e, sorted by (src, dst); tokens > 0 only
  std::vector<int64_t> rank_loads;              // [R] tokens each rank computes with the plan
  std::vector<int64_t> home_loads;              // [R] tokens each rank would compute without replication
  double overload = 1, home_overload = 1;       // max / mean of rank_loads and of home_loads (1 when no tokens)
  double inter_node_tokens = 0;                 // tokens whose source and computing rank are on different nodes
};
struct GuestOptions {
  int guest_slots = 1;     // S >= 0 per rank (0: plan == homes only)  (recipe 'moe.guest_slots')
  int ranks_per_node = 0;  // G; 0 = all R ranks on one node; R % G == 0  (recipe 'moe.ranks_per_node')
  double intra_node_gbps = 450, inter_node_gbps = 50;
  int64_t hidden_size = 0, bytes_per_element = 2, expert_params = 0;  // cost model as in the offline planners
};
// counts[j][e]: tokens source rank j routes to expert e (R rows of E = local_experts * R). Homes fixed: expert e
// lives on rank e / local_experts. Bad input (no ranks, ragged rows, E != local_experts * R, negative counts,
// S < 0, G < 0 or R % G != 0, bandwidths <= 0, negative cost-model sizes) throws a one-line lf::Error.
GuestPlan plan_guests(const std::vector<std::vector<int64_t>>& counts, int local_experts, const GuestOptions& o);

}  // namespace lf::parallel::moe

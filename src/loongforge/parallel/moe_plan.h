// Hot-expert replication planning for expert parallelism (issue 6): the offline planners and simulator behind
// `loongforge moe-plan` (docs/moe_plan.md). Torch-free. The run-time planner of the trainer's guest slots is
// plan_guests (moe_guest_plan.h); both use the max-flow solver of max_flow.h.
//
// Setting: R expert-parallel ranks, G ranks per node (N = R / G nodes), S expert slots per rank (R*S physical slots).
// A plan puts a logical expert (or nothing, -1) into every slot and says how many tokens each slot takes; every
// expert's tokens are conserved (the sum over its slots is its load) and every expert has at least one slot.
//
// Two planners:
//  - plan_eplb: DeepSeek's EPLB (hierarchical when num_groups % N == 0, else global): pack expert groups to nodes,
//    replicate the expert with the largest load per replica into each free slot of the node, pack the physical
//    experts to the node's ranks balanced by load (S per rank); an expert's tokens are split evenly over its replicas
//    (integers: the first `load % k` replicas take one more). Ties go to the lowest index (stable sorts).
//  - plan_topology_aware: the idea of Baidu's TAOT paper: every expert has a home slot, replicas of hot experts take
//    guest slots, the planner decides how many tokens each replica takes (not an even split):
//      1. replica counts: the expert with the largest load per replica gets the next slot (at most R per expert);
//      2. nodes: replicas in decreasing load per replica go to the node that the cost model (below) finds cheapest
//         among nodes that stay within 2% of a balanced node load (else the least loaded node): a replica on a node
//         that has none of its expert serves that node's own tokens locally (saves inter-node token bytes), a
//         replica off its home node costs a weight copy and a gradient return (when expert_params > 0);
//      3. ranks: within the node, to the least loaded rank with a free slot that does not hold the expert;
//      4. tokens: the smallest rank-load cap C for which a max-flow (experts -> slots -> ranks, rank capacity C)
//         carries every token, found by bisection; at that C the flow is routed first from each node's own tokens
//         to replicas on that node, then anywhere (two-phase Dinic), so replicas take their node's tokens;
//      5. replicas left with 0 tokens are dropped (slot -1).
//    Steps 4-5 run on three placements (single-slot experts first, keeping a slot per rank for replicas; all in
//    decreasing load per replica; EPLB's own slots), and EPLB's plan itself is a fourth candidate: among those within
//    1% of the most balanced and no less balanced than EPLB's even split, the one with the lowest cost_ms wins. So
//    it is never less balanced than plan_eplb.
//
// Traffic model (the same simulator scores both planners; docs/moe_plan.md):
//  - Token origin: the tokens of expert e originate evenly on all R ranks (load/R each: data-parallel attention
//    before the MoE layer). Each source sends its tokens to the nearest slot of e that still has quota: same rank
//    (free), then same node (intra-node), then another node (inter-node) — bottom-up matching, which is optimal for
//    this rank < node < cluster hierarchy. Each token that moves costs dispatch + combine:
//    2 * hidden_size * bytes_per_element bytes on that link class.
//  - Replica weights (only when expert_params > 0): each expert's primary slot is on the node holding most of its
//    slots (lowest rank among them); every other slot costs a weight copy from the primary and a gradient return,
//    2 * expert_params * bytes_per_element bytes, intra-node if on the primary's node, else inter-node.
//  - cost_ms = intra_node_bytes / intra bandwidth + inter_node_bytes / inter bandwidth (the cost model's figure, a
//    relative measure, not a step time).
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace lf::parallel::moe {

struct PlanInput {
  std::vector<std::vector<int64_t>> loads;  // [layer][logical expert]: tokens routed to the expert
  int ranks = 0;                            // R
  int ranks_per_node = 0;                   // G (R % G == 0)
  int slots_per_rank = 0;                   // S (R * S >= number of experts)
  double intra_node_gbps = 450;             // GB/s per link class (NVLink)
  double inter_node_gbps = 50;              // (InfiniBand)
  int64_t hidden_size = 4096;               // token bytes = hidden_size * bytes_per_element
  int64_t bytes_per_element = 2;
  int64_t expert_params = 0;                // parameters per expert; 0: replica weight traffic is not counted
  int num_groups = 0;                       // EPLB expert groups; 0: one group per expert

  int nodes() const { return ranks / ranks_per_node; }
  int experts() const { return loads.empty() ? 0 : static_cast<int>(loads[0].size()); }
};

// One layer's plan and its simulated cost.
struct LayerPlan {
  std::string planner;          // "eplb" | "topology_aware"
  std::vector<int> slots;       // [R*S] logical expert of each physical slot, rank by rank; -1: empty
  std::vector<int64_t> tokens;  // [R*S] tokens each slot takes (0 for an empty slot)
  // Filled by evaluate():
  std::vector<int64_t> rank_loads;  // [R]
  double overload = 0;              // max rank load / mean rank load (1 when there are no tokens)
  double token_intra_bytes = 0, token_inter_bytes = 0, weight_intra_bytes = 0, weight_inter_bytes = 0;
  int replicas = 0;  // occupied slots beyond one per expert
  double cost_ms = 0;
  double planner_ms = 0;  // wall time of the planner (set by the planners)

  double intra_node_bytes() const { return token_intra_bytes + weight_intra_bytes; }
  double inter_node_bytes() const { return token_inter_bytes + weight_inter_bytes; }
};

// Reads and validates the moe-plan input; errors are one-line lf::Errors naming FILE and the field
// ("IN.json: field 'loads[1][3]': -5 is negative").
PlanInput parse_plan_input(const nlohmann::json& j, const std::string& file);

// Checks the sizes (R % G, R*S >= experts, equal layer lengths, non-negative loads); FILE names the source.
void validate(const PlanInput& in, const std::string& file);

// The planners (one layer); the result is evaluated.
LayerPlan plan_eplb(const std::vector<int64_t>& loads, const PlanInput& in);
LayerPlan plan_topology_aware(const std::vector<int64_t>& loads, const PlanInput& in);

// Fills rank_loads, overload, bytes, replicas and cost_ms of PLAN from its slots/tokens with the traffic model above;
// throws lf::Error if the plan is malformed (wrong sizes, an expert without a slot, tokens not conserved).
void evaluate(const std::vector<int64_t>& loads, const PlanInput& in, LayerPlan& plan);

// The JSON object of one layer's plan (docs/moe_plan.md).
nlohmann::json to_json(const LayerPlan& plan);

// Runs the chosen planners on every layer: the output document of `loongforge moe-plan` (docs/moe_plan.md).
nlohmann::json run_plans(const PlanInput& in, bool eplb, bool topology_aware);

}  // namespace lf::parallel::moe

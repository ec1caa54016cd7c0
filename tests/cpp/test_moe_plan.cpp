// The hot-expert replication planners (parallel/moe_plan.h): plan invariants recomputed here from slots/tokens,
// EPLB's algorithm on its published case, the topology-aware planner's balance, and input validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "loongforge/core/error.h"
#include "loongforge/parallel/moe_plan.h"

namespace {

using lf::parallel::moe::LayerPlan;
using lf::parallel::moe::PlanInput;

PlanInput make_input(std::vector<int64_t> loads, int R, int G, int S) {
  PlanInput in;
  in.loads = {std::move(loads)};
  in.ranks = R;
  in.ranks_per_node = G;
  in.slots_per_rank = S;
  return in;
}

// Checks a plan against the definitions, independently of evaluate(): slot counts, conservation, one slot at least
// per expert, and the reported overload recomputed from slots/tokens. Returns the recomputed overload.
double check_plan(const std::vector<int64_t>& loads, const PlanInput& in, const LayerPlan& p) {
  const int R = in.ranks, S = in.slots_per_rank, E = static_cast<int>(loads.size());
  EXPECT_EQ(p.slots.size(), static_cast<size_t>(R * S));
  EXPECT_EQ(p.tokens.size(), static_cast<size_t>(R * S));
  std::vector<int64_t> per_expert(E, 0), per_rank(R, 0);
  std::vector<int> nslots(E, 0);
  for (int i = 0; i < R * S; ++i) {
    int e = p.slots[i];
    EXPECT_GE(e, -1);
    EXPECT_LT(e, E);
    EXPECT_GE(p.tokens[i], 0);
    if (e < 0) {
      EXPECT_EQ(p.tokens[i], 0) << "empty slot " << i << " takes tokens";
      continue;
    }
    per_expert[e] += p.tokens[i];
    ++nslots[e];
    per_rank[i / S] += p.tokens[i];
  }
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(per_expert[e], loads[e]) << "expert " << e << " tokens not conserved (" << p.planner << ")";
    EXPECT_GE(nslots[e], 1) << "expert " << e << " has no slot (" << p.planner << ")";
  }
  int64_t total = std::accumulate(loads.begin(), loads.end(), int64_t{0});
  double overload = total > 0 ? static_cast<double>(*std::max_element(per_rank.begin(), per_rank.end())) /
                                    (static_cast<double>(total) / R)
                              : 1.0;
  EXPECT_NEAR(p.overload, overload, 1e-12) << p.planner;
  EXPECT_EQ(p.rank_loads, per_rank);
  return overload;
}

const std::vector<int64_t> kEplbCase = {600, 560, 120, 120, 20, 10, 10, 10};

}  // namespace

// EPLB's algorithm on the case (8 ranks x 2 slots, one node): replicate the heaviest-per-replica expert into
// each of the 8 free slots (e0 and e1 get 5 replicas: 120 and 112 tokens each), pack 16 physical experts 2 per rank
// heaviest-first into the lightest rank: one rank gets 112 + 112 + ... = 232 tokens; mean 1450/8 = 181.25.
TEST(MoePlan, EplbReproducesPublishedCase) {
  auto in = make_input(kEplbCase, 8, 8, 2);
  auto p = lf::parallel::moe::plan_eplb(kEplbCase, in);
  double o = check_plan(kEplbCase, in, p);
  EXPECT_NEAR(o, 232.0 / 181.25, 1e-9);
  EXPECT_NEAR(p.overload, 1.28, 0.01);
  // Replica counts follow EPLB's replication rule.
  std::vector<int> cnt(8, 0);
  for (int e : p.slots) ++cnt[e];
  EXPECT_EQ(cnt, (std::vector<int>{5, 5, 1, 1, 1, 1, 1, 1}));
  // Every replica of an expert takes an even share.
  for (int i = 0; i < 16; ++i) EXPECT_EQ(p.tokens[i], kEplbCase[p.slots[i]] / cnt[p.slots[i]]);
}

TEST(MoePlan, TopologyAwareBalancesEplbCase) {
  auto in = make_input(kEplbCase, 8, 8, 2);
  auto p = lf::parallel::moe::plan_topology_aware(kEplbCase, in);
  double o = check_plan(kEplbCase, in, p);
  EXPECT_LE(o, 1.05);
  // One node: nothing crosses nodes.
  EXPECT_EQ(p.inter_node_bytes(), 0.0);
}

// The traffic model on a hand-computed case: 2 nodes x 2 ranks, one slot each, experts on ranks 0..3.
// Expert e's tokens (load L) come L/4 from each rank: L/4 stay on the rank, L/4 cross within the node, L/2 cross
// nodes; each token moved costs 2 * hidden * bytes.
TEST(MoePlan, TrafficModelByHand) {
  std::vector<int64_t> loads = {400, 800, 40, 4};
  auto in = make_input(loads, 4, 2, 1);
  in.hidden_size = 10;
  in.bytes_per_element = 2;
  LayerPlan p;
  p.planner = "by_hand";
  p.slots = {0, 1, 2, 3};
  p.tokens = {400, 800, 40, 4};
  lf::parallel::moe::evaluate(loads, in, p);
  double tok = 400 + 800 + 40 + 4;
  EXPECT_DOUBLE_EQ(p.token_intra_bytes, tok / 4 * 40);
  EXPECT_DOUBLE_EQ(p.token_inter_bytes, tok / 2 * 40);
  EXPECT_DOUBLE_EQ(p.overload, 800.0 / (tok / 4));
  EXPECT_EQ(p.replicas, 0);
  // A replica of expert 1 on the other node taking that node's half: its tokens no longer cross nodes (half stays on
  // the two slots' ranks, half crosses within a node); the weight copy (+ gradient back) crosses once.
  in.slots_per_rank = 2;
  in.expert_params = 1000;
  p.slots = {0, -1, 1, -1, 2, 1, 3, -1};
  p.tokens = {400, 0, 400, 0, 40, 400, 4, 0};
  lf::parallel::moe::evaluate(loads, in, p);
  EXPECT_DOUBLE_EQ(p.token_inter_bytes, (400.0 / 2 + 0 + 40.0 / 2 + 4.0 / 2) * 40);
  EXPECT_DOUBLE_EQ(p.token_intra_bytes, (400.0 / 4 + 800.0 / 2 + 40.0 / 4 + 4.0 / 4) * 40);
  EXPECT_DOUBLE_EQ(p.weight_inter_bytes, 2.0 * 1000 * 2);
  EXPECT_DOUBLE_EQ(p.weight_intra_bytes, 0.0);
  EXPECT_EQ(p.replicas, 1);
  // A plan that loses tokens is rejected.
  p.tokens[2] = 399;
  EXPECT_THROW(lf::parallel::moe::evaluate(loads, in, p), lf::Error);
}

// Random loads (Zipf-like, some zero experts) on random cluster shapes: both planners' plans are valid and the
// topology-aware planner is at least as balanced as EPLB.
TEST(MoePlan, RandomLoadsTopologyAwareNoWorseThanEplb) {
  std::mt19937_64 rng(7);
  int better_inter = 0, cases = 0;
  for (int trial = 0; trial < 60; ++trial) {
    int N = 1 + static_cast<int>(rng() % 4), G = 1 + static_cast<int>(rng() % 8);
    int R = N * G;
    int E = 1 + static_cast<int>(rng() % 64);
    int S = (E + R - 1) / R + static_cast<int>(rng() % 3);
    std::vector<int64_t> loads(E);
    double s = 0.5 + static_cast<double>(rng() % 100) / 100.0;
    for (int e = 0; e < E; ++e)
      loads[e] = rng() % 10 == 0 ? 0 : static_cast<int64_t>(1e5 / std::pow(1 + rng() % E, s));
    auto in = make_input(loads, R, G, S);
    if (trial % 3 == 0) in.expert_params = 100000;
    auto b = lf::parallel::moe::plan_eplb(loads, in);
    auto t = lf::parallel::moe::plan_topology_aware(loads, in);
    double ob = check_plan(loads, in, b), ot = check_plan(loads, in, t);
    EXPECT_LE(ot, ob + 1e-12) << "trial " << trial << ": N" << N << " G" << G << " S" << S << " E" << E;
    if (N > 1) {
      ++cases;
      better_inter += t.inter_node_bytes() <= b.inter_node_bytes();
    }
  }
  // Not a hard guarantee per case, but the point of the planner: fewer inter-node bytes in most multi-node cases.
  EXPECT_GE(better_inter * 4, cases * 3) << better_inter << " of " << cases;
}

TEST(MoePlan, ZeroLoadsAndSingleSlot) {
  std::vector<int64_t> loads = {0, 0, 0, 0};
  auto in = make_input(loads, 2, 2, 2);
  for (auto p : {lf::parallel::moe::plan_eplb(loads, in), lf::parallel::moe::plan_topology_aware(loads, in)})
    EXPECT_EQ(check_plan(loads, in, p), 1.0);
  // No spare slots: every expert exactly once, nothing to balance.
  loads = {5, 1, 7, 3};
  in = make_input(loads, 4, 2, 1);
  auto t = lf::parallel::moe::plan_topology_aware(loads, in);
  check_plan(loads, in, t);
  EXPECT_DOUBLE_EQ(t.overload, 7.0 / 4.0);
}

TEST(MoePlan, ParseErrorsNameTheField) {
  auto err = [](const nlohmann::json& j) {
    try {
      lf::parallel::moe::parse_plan_input(j, "IN.json");
    } catch (const lf::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json ok = {{"loads", {{1, 2, 3, 4}}}, {"ranks", 2}, {"ranks_per_node", 2}, {"slots_per_rank", 2}};
  EXPECT_EQ(lf::parallel::moe::parse_plan_input(ok, "IN.json").experts(), 4);
  auto j = ok;
  j.erase("loads");
  EXPECT_EQ(err(j), "IN.json: field 'loads': missing (tokens per expert, one array per layer)");
  j = ok;
  j["loads"] = {{1, 2, -3, 4}};
  EXPECT_EQ(err(j), "IN.json: field 'loads[0][2]': -3 is negative");
  j = ok;
  j["loads"] = {{1, 2, 3, 4}, {1, 2, 3}};
  EXPECT_EQ(err(j), "IN.json: field 'loads[1]': 3 experts, but layer 0 has 4");
  j = ok;
  j["slots_per_rank"] = 1;
  EXPECT_EQ(err(j), "IN.json: field 'slots_per_rank': ranks*slots_per_rank = 2*1 = 2 < 4 experts");
  j = ok;
  j["ranks"] = 3;
  EXPECT_EQ(err(j), "IN.json: field 'ranks_per_node': ranks 3 is not a multiple of ranks_per_node 2");
  j = ok;
  j["loads"] = {{1, 2.5, 3, 4}};
  EXPECT_EQ(err(j), "IN.json: field 'loads[0][1]': expected an integer token count, got 2.5");
  j = ok;
  j["bogus"] = 1;
  EXPECT_NE(err(j).find("IN.json: field 'bogus': unknown field"), std::string::npos);
}

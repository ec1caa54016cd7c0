// The max-flow solver of the hot-expert planners (parallel/max_flow.h): flow values and minimal min cuts on graphs
// small enough to check by hand, and the warm starts the run-time planner relies on (a flow given with the edges, a
// flow set in place, capacities raised after a run, edges added after a run) against fresh solves.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "loongforge/parallel/max_flow.h"

namespace {

using lf::parallel::moe::kInfCap;
using lf::parallel::moe::MaxFlow;

// s=0, t=1; a=2, b=3. s->a 3, s->b 2, a->b 1, a->t 2, b->t 3: max flow 5 (s's edges are the min cut).
TEST(MaxFlow, SmallGraphValueAndFlows) {
  MaxFlow f(4);
  const int sa = f.add(0, 2, 3), sb = f.add(0, 3, 2), ab = f.add(2, 3, 1), at = f.add(2, 1, 2), bt = f.add(3, 1, 3);
  EXPECT_EQ(f.run(0, 1), 5);
  EXPECT_EQ(f.flow(sa), 3);
  EXPECT_EQ(f.flow(sb), 2);
  EXPECT_EQ(f.flow(ab), 1);
  EXPECT_EQ(f.flow(at), 2);
  EXPECT_EQ(f.flow(bt), 3);
  EXPECT_EQ(f.run(0, 1), 0);  // already maximum
  EXPECT_TRUE(f.reached(0));
  EXPECT_FALSE(f.reached(2));
  EXPECT_FALSE(f.reached(1));
}

// The minimal min cut: s->a 5, a->t 1, s->b 1, b->t 5. Max flow 2; the source still reaches a only.
TEST(MaxFlow, MinimalMinCut) {
  MaxFlow f(4);
  f.add(0, 2, 5), f.add(2, 1, 1), f.add(0, 3, 1), f.add(3, 1, 5);
  EXPECT_EQ(f.run(0, 1), 2);
  EXPECT_TRUE(f.reached(2));
  EXPECT_FALSE(f.reached(3));
  EXPECT_FALSE(f.reached(1));
}

// Bipartite supply -> holders -> sink graphs like the planner's, random: a flow raised step by step, warm-started
// from a given flow, re-set in place, or extended by an edge added after a run always reaches the fresh solve's value.
TEST(MaxFlow, WarmStartsMatchFreshSolves) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int experts = 2 + static_cast<int>(rng() % 6), ranks = 2 + static_cast<int>(rng() % 5);
    std::vector<int64_t> supply(experts);
    std::vector<std::vector<int>> holds(experts);
    for (int e = 0; e < experts; ++e) {
      supply[e] = rng() % 50;
      for (int r = 0; r < ranks; ++r)
        if (r == e % ranks || rng() % 3 == 0) holds[e].push_back(r);
    }
    const int64_t cap = 1 + rng() % 40, extra = rng() % 20;
    // Node ids: s 0, t 1, expert e 2 + e, rank r 2 + experts + r.
    auto build = [&](MaxFlow& f, int64_t c, std::vector<int>* sink) {
      f.reset(2 + experts + ranks);
      for (int e = 0; e < experts; ++e) {
        f.add(0, 2 + e, supply[e]);
        for (int r : holds[e]) f.add(2 + e, 2 + experts + r, kInfCap);
      }
      for (int r = 0; r < ranks; ++r) {
        const int id = f.add(2 + experts + r, 1, c);
        if (sink) sink->push_back(id);
      }
    };
    MaxFlow fresh, warm;
    build(fresh, cap + extra, nullptr);
    const int64_t want = fresh.run(0, 1);
    std::vector<int> sink;
    build(warm, cap, &sink);
    int64_t got = warm.run(0, 1);
    for (int id : sink) warm.raise(id, extra);
    got += warm.run(0, 1);
    EXPECT_EQ(got, want) << "raise and continue, trial " << trial;

    // The same graph with every edge's flow set in place to the homes-first flow (each expert on its first holder
    // up to the cap), then completed.
    std::vector<int64_t> load(ranks, 0), first(experts, 0);
    for (int e = 0; e < experts; ++e) {
      first[e] = std::min(supply[e], cap + extra - load[holds[e][0]]);
      load[holds[e][0]] += first[e];
    }
    MaxFlow given;
    given.reset(2 + experts + ranks);
    for (int e = 0; e < experts; ++e) {
      given.add(0, 2 + e, supply[e], first[e]);
      for (size_t k = 0; k < holds[e].size(); ++k)
        given.add(2 + e, 2 + experts + holds[e][k], kInfCap, k == 0 ? first[e] : 0);
    }
    for (int r = 0; r < ranks; ++r) given.add(2 + experts + r, 1, cap + extra, load[r]);
    int64_t start = 0;
    for (int e = 0; e < experts; ++e) start += first[e];
    EXPECT_EQ(start + given.run(0, 1), want) << "flow given with the edges, trial " << trial;
    int id = 0;  // set() the same starting flow on the solved graph (ids in the order of addition)
    for (int e = 0; e < experts; ++e) {
      given.set(id++, supply[e], first[e]);
      for (size_t k = 0; k < holds[e].size(); ++k) given.set(id++, kInfCap, k == 0 ? first[e] : 0);
    }
    for (int r = 0; r < ranks; ++r) given.set(id++, cap + extra, load[r]);
    EXPECT_EQ(start + given.run(0, 1), want) << "flow set in place, trial " << trial;

    // An edge added after a run (a new holder) keeps the flow found and continues from it.
    const int e_new = static_cast<int>(rng() % experts), r_new = static_cast<int>(rng() % ranks);
    MaxFlow grown;
    build(grown, cap + extra, nullptr);
    int64_t total = grown.run(0, 1);
    grown.add(2 + e_new, 2 + experts + r_new, kInfCap);
    total += grown.run(0, 1);
    holds[e_new].push_back(r_new);
    build(fresh, cap + extra, nullptr);
    EXPECT_EQ(total, fresh.run(0, 1)) << "edge added after a run, trial " << trial;
  }
}

}  // namespace

// Maximum flow (Dinic) for the hot-expert planners: the offline ones (moe_plan) and the run-time plan_guests
// (moe_guest_plan). Torch-free, integer capacities, deterministic: the arcs of a node are tried in the order their
// edges were added, so the same graph built in the same order gives the same flow.
//
// run() augments the current flow to a maximum one, so raising capacities (raise()) and running again continues
// from the flow already found. After a run, mark_reachable(s) marks the nodes the source still reaches in the
// residual graph: the source side of the minimal minimum cut (the same set for every maximum flow).
#pragma once
#include <cstdint>
#include <limits>
#include <vector>

namespace lf::parallel::moe {

inline constexpr int64_t kInfCap = std::numeric_limits<int64_t>::max() / 4;  // an uncuttable edge

class MaxFlow {
 public:
  explicit MaxFlow(int nodes = 0) : adj_(nodes), level_(nodes), it_(nodes) {}

  // Adds u -> v with capacity CAP (and its residual twin); returns the edge id for raise() and flow().
  int add(int u, int v, int64_t cap);
  void raise(int id, int64_t extra) {
    edges_[id].cap += extra;
    orig_[id] += extra;
  }
  int64_t flow(int id) const { return orig_[id] - edges_[id].cap; }

  // Augments the current flow from S to T to a maximum flow; returns the flow added.
  int64_t run(int s, int t);

  // Marks the nodes reachable from S over edges with residual capacity; reached(v) reads the mark.
  void mark_reachable(int s) { levels(s, -1); }
  bool reached(int v) const { return level_[v] >= 0; }

 private:
  struct Edge {
    int to;
    int64_t cap;  // residual capacity
  };
  bool levels(int s, int t);  // BFS levels from s over residual edges; whether t is reached (t < 0: none)
  int64_t augment(int u, int t, int64_t f);

  std::vector<Edge> edges_;    // edge 2k: as added; 2k+1: its reverse
  std::vector<int64_t> orig_;  // capacity as set (flow = orig - cap on an added edge)
  std::vector<std::vector<int>> adj_;
  std::vector<int> level_, it_;
};

}  // namespace lf::parallel::moe

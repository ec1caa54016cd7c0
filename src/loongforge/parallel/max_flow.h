// Maximum flow (Dinic) for the hot-expert planners: the offline ones (moe_plan) and the run-time plan_guests
// (moe_guest_plan). Torch-free, integer capacities, deterministic: the arcs of a node are tried in the order their
// edges were added, so the same graph built in the same order gives the same flow.
//
// The run-time planner solves many flows on small graphs per call, so the solver avoids rebuilding: reset() keeps
// the memory; run() augments the current flow to a maximum one, so raising capacities (raise()) and running again
// continues from the flow found; set() gives an edge a new capacity and flow in place (the same graph with another
// starting flow: the caller keeps the flow conserved), and an edge may be added with a flow on it. After a run,
// reached(v) tells whether the source still reaches v in the residual graph: the source side of the minimal minimum
// cut (the same set for every maximum flow).
#pragma once
#include <cstdint>
#include <limits>
#include <vector>

namespace lf::parallel::moe {

inline constexpr int64_t kInfCap = std::numeric_limits<int64_t>::max() / 4;  // an uncuttable edge

class MaxFlow {
 public:
  explicit MaxFlow(int nodes = 0) { reset(nodes); }

  // NODES nodes, no edges; keeps the allocated memory.
  void reset(int nodes);

  // Adds u -> v with capacity CAP carrying FLOW (0 <= FLOW <= CAP); returns the edge id (0, 1, 2, ... in the order
  // of addition) for raise(), set() and flow().
  int add(int u, int v, int64_t cap, int64_t flow = 0);
  void raise(int id, int64_t extra);
  void set(int id, int64_t cap, int64_t flow);
  int64_t flow(int id) const;

  // Augments the current flow from S to T to a maximum flow; returns the flow added.
  int64_t run(int s, int t);

  // After run(s, t): whether s reaches V over edges with residual capacity.
  bool reached(int v) const { return level_[v] >= 0; }

 private:
  struct Edge {
    int u, v;
    int64_t cap, flow;
  };
  struct Arc {
    int to, rev;   // head node; index of the reverse arc
    int64_t cap;   // residual capacity
  };
  void lay_out();  // edges_ -> arcs grouped by tail node
  bool levels(int s, int t);
  int64_t push(int u, int t, int64_t f);

  std::vector<Edge> edges_;  // as added; authoritative until lay_out(), then the arcs are
  std::vector<int> pos_;     // [edge id] index of its forward arc
  std::vector<Arc> arcs_;    // the arcs of node u: arcs_[start_[u] .. start_[u+1]), in the order of addition
  std::vector<int> start_;
  bool laid_out_ = false;
  std::vector<int> level_, it_, queue_;
};

}  // namespace lf::parallel::moe

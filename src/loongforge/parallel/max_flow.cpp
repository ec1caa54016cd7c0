#include "loongforge/parallel/max_flow.h"

#include <algorithm>

namespace lf::parallel::moe {

void MaxFlow::reset(int nodes) {
  edges_.clear();
  start_.assign(nodes + 1, 0);
  level_.assign(nodes, -1);
  it_.assign(nodes, 0);
  queue_.resize(nodes);
  laid_out_ = false;
}

int MaxFlow::add(int u, int v, int64_t cap, int64_t flow) {
  if (laid_out_) {  // back to the edge list, with the flow found so far
    for (size_t id = 0; id < edges_.size(); ++id) edges_[id].flow = MaxFlow::flow(static_cast<int>(id));
    laid_out_ = false;
  }
  edges_.push_back({u, v, cap, flow});
  return static_cast<int>(edges_.size()) - 1;
}

void MaxFlow::raise(int id, int64_t extra) {
  edges_[id].cap += extra;
  if (laid_out_) arcs_[pos_[id]].cap += extra;
}

void MaxFlow::set(int id, int64_t cap, int64_t flow) {
  edges_[id].cap = cap;
  if (laid_out_) {
    Arc& a = arcs_[pos_[id]];
    a.cap = cap - flow;
    arcs_[a.rev].cap = flow;
  } else {
    edges_[id].flow = flow;
  }
}

int64_t MaxFlow::flow(int id) const {
  return laid_out_ ? edges_[id].cap - arcs_[pos_[id]].cap : edges_[id].flow;
}

// Arcs grouped by tail node (a counting sort of the edges, so each node keeps the order of addition: an edge's
// forward arc at its tail, its reverse arc at its head).
void MaxFlow::lay_out() {
  const int n = static_cast<int>(level_.size());
  std::fill(start_.begin(), start_.end(), 0);
  for (const Edge& e : edges_) ++start_[e.u + 1], ++start_[e.v + 1];
  for (int u = 0; u < n; ++u) start_[u + 1] += start_[u];
  arcs_.resize(2 * edges_.size());
  pos_.resize(edges_.size());
  std::copy(start_.begin(), start_.end() - 1, it_.begin());
  for (size_t id = 0; id < edges_.size(); ++id) {
    const Edge& e = edges_[id];
    const int a = it_[e.u]++, b = it_[e.v]++;
    arcs_[a] = {e.v, b, e.cap - e.flow};
    arcs_[b] = {e.u, a, e.flow};
    pos_[id] = a;
  }
  laid_out_ = true;
}

// BFS levels from s over arcs with residual capacity. It stops once the level of t is settled (nodes at that level
// or deeper lead nowhere in the level graph), so the levels are complete exactly when t is not reached.
bool MaxFlow::levels(int s, int t) {
  std::fill(level_.begin(), level_.end(), -1);
  int* q = queue_.data();
  int head = 0, tail = 0;
  q[tail++] = s;
  level_[s] = 0;
  while (head < tail) {
    const int u = q[head++];
    if (level_[t] >= 0 && level_[u] >= level_[t]) break;
    for (int a = start_[u], end = start_[u + 1]; a < end; ++a) {
      const Arc& arc = arcs_[a];
      if (arc.cap > 0 && level_[arc.to] < 0) {
        level_[arc.to] = level_[u] + 1;
        q[tail++] = arc.to;
      }
    }
  }
  return level_[t] >= 0;
}

// Pushes up to F from U towards T along the level graph (blocking flow with current arcs).
int64_t MaxFlow::push(int u, int t, int64_t f) {
  if (u == t) return f;
  int64_t pushed = 0;
  for (int& a = it_[u]; a < start_[u + 1]; ++a) {
    Arc& arc = arcs_[a];
    if (arc.cap <= 0 || level_[arc.to] != level_[u] + 1) continue;
    const int64_t got = push(arc.to, t, std::min(f - pushed, arc.cap));
    if (got > 0) {
      arc.cap -= got;
      arcs_[arc.rev].cap += got;
      pushed += got;
      if (pushed == f) return pushed;  // the arc may have room left: keep it current
    }
  }
  return pushed;
}

int64_t MaxFlow::run(int s, int t) {
  if (!laid_out_) lay_out();
  int64_t total = 0;
  while (levels(s, t)) {
    std::copy(start_.begin(), start_.end() - 1, it_.begin());
    total += push(s, t, kInfCap);
  }
  return total;
}

}  // namespace lf::parallel::moe

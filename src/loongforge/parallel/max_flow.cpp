#include "loongforge/parallel/max_flow.h"

#include <algorithm>

namespace lf::parallel::moe {

int MaxFlow::add(int u, int v, int64_t cap) {
  const int id = static_cast<int>(edges_.size());
  edges_.push_back({v, cap});
  orig_.push_back(cap);
  adj_[u].push_back(id);
  edges_.push_back({u, 0});
  orig_.push_back(0);
  adj_[v].push_back(id + 1);
  return id;
}

bool MaxFlow::levels(int s, int t) {
  std::fill(level_.begin(), level_.end(), -1);
  std::vector<int> q{s};
  level_[s] = 0;
  for (size_t h = 0; h < q.size(); ++h) {
    const int u = q[h];
    for (int id : adj_[u])
      if (edges_[id].cap > 0 && level_[edges_[id].to] < 0) {
        level_[edges_[id].to] = level_[u] + 1;
        q.push_back(edges_[id].to);
      }
  }
  return t >= 0 && level_[t] >= 0;
}

// One augmenting path of at most F from U to T along the level graph (current arcs skip dead ends).
int64_t MaxFlow::augment(int u, int t, int64_t f) {
  if (u == t) return f;
  for (int& i = it_[u]; i < static_cast<int>(adj_[u].size()); ++i) {
    const int id = adj_[u][i];
    Edge& e = edges_[id];
    if (e.cap <= 0 || level_[e.to] != level_[u] + 1) continue;
    const int64_t got = augment(e.to, t, std::min(f, e.cap));
    if (got > 0) {
      e.cap -= got;
      edges_[id ^ 1].cap += got;
      return got;
    }
  }
  return 0;
}

int64_t MaxFlow::run(int s, int t) {
  int64_t total = 0;
  while (levels(s, t)) {
    std::fill(it_.begin(), it_.end(), 0);
    while (const int64_t f = augment(s, t, kInfCap)) total += f;
  }
  return total;
}

}  // namespace lf::parallel::moe

// The run-time guest-slot planner, plan_guests (moe_guest_plan.h): called by expert parallelism for every MoE layer
// on every forward, with identical input on every ep rank.
#include "loongforge/parallel/moe_guest_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/parallel/max_flow.h"

namespace lf::parallel::moe {

namespace {

struct GuestState {
  int R = 0, E = 0, L = 0, S = 0, G = 0;
  std::vector<int64_t> load;               // [E] tokens routed to each expert
  std::vector<std::vector<int>> guests;    // [R] guest experts in placement order
  int64_t total = 0;
  int home(int e) const { return e / L; }
  bool holds(int r, int e) const {
    return home(e) == r || std::find(guests[r].begin(), guests[r].end(), e) != guests[r].end();
  }
};

// Expert-level flow (s -> expert -> ranks holding it -> t, rank capacity CAP); HOME_FIRST: home edges are filled
// first, then guest edges opened (so rank loads show homes plus the overflow each guest absorbs).
// Node ids: s 0, t 1, expert e 2+e, rank r 2+E+r.
struct AggFlow {
  MaxFlow f;
  std::vector<int> sink_edge;  // [R]
  int64_t flowed = 0;
};

AggFlow agg_flow(const GuestState& st, int64_t cap, bool home_first) {
  const int E = st.E, R = st.R;
  AggFlow a;
  a.f = MaxFlow(2 + E + R);
  for (int e = 0; e < E; ++e)
    if (st.load[e] > 0) {
      a.f.add(0, 2 + e, st.load[e]);
      a.f.add(2 + e, 2 + E + st.home(e), kInfCap);
    }
  std::vector<int> guest_edges;
  for (int r = 0; r < R; ++r)
    for (int e : st.guests[r])
      if (st.load[e] > 0) guest_edges.push_back(a.f.add(2 + e, 2 + E + r, home_first ? 0 : kInfCap));
  a.sink_edge.resize(R);
  for (int r = 0; r < R; ++r) a.sink_edge[r] = a.f.add(2 + E + r, 1, cap);
  a.flowed = a.f.run(0, 1);
  if (home_first && !guest_edges.empty()) {
    for (int id : guest_edges) a.f.raise(id, kInfCap);
    a.flowed += a.f.run(0, 1);
  }
  return a;
}

// The smallest cap >= LO for which every token fits. Each infeasible cap c gives a better lower bound from the
// minimal min cut: the experts T the source still reaches must put load(T) tokens on the ranks N(T) holding them,
// so the cap is at least ceil(load(T) / |N(T)|) (> c, as the cut is below the total); iterate until feasible
// (Dinkelbach-style; exact, and a few flows instead of a bisection's dozens).
int64_t guest_min_cap(const GuestState& st, int64_t lo) {
  int64_t c = lo;
  for (;;) {
    AggFlow a = agg_flow(st, c, false);
    if (a.flowed == st.total) return c;
    a.f.mark_reachable(0);
    int64_t load_t = 0, ranks_t = 0;
    for (int e = 0; e < st.E; ++e)
      if (st.load[e] > 0 && a.f.reached(2 + e)) load_t += st.load[e];
    for (int r = 0; r < st.R; ++r) ranks_t += a.f.reached(2 + st.E + r);
    if (ranks_t == 0) throw Error("moe guest plan: internal error: empty min cut at cap " + std::to_string(c));
    c = std::max(c + 1, (load_t + ranks_t - 1) / ranks_t);
  }
}

constexpr int64_t kMaxTokens = int64_t{1} << 40;  // per expert: products with copy counts cannot overflow

[[noreturn]] void guest_error(const std::string& what) { throw Error("moe guest plan: " + what); }

}  // namespace

GuestPlan plan_guests(const std::vector<std::vector<int64_t>>& counts, int local_experts, const GuestOptions& o) {
  // ---- validation ----
  const int R = static_cast<int>(counts.size());
  if (R == 0) guest_error("no ep ranks (counts has no rows)");
  const int E = static_cast<int>(counts[0].size());
  for (int j = 1; j < R; ++j)
    if (static_cast<int>(counts[j].size()) != E)
      guest_error("counts row " + std::to_string(j) + " has " + std::to_string(counts[j].size()) +
                  " experts, row 0 has " + std::to_string(E));
  if (local_experts <= 0 || static_cast<int64_t>(local_experts) * R != E)
    guest_error("local_experts " + std::to_string(local_experts) + " * ranks " + std::to_string(R) + " != " +
                std::to_string(E) + " experts in counts");
  if (o.guest_slots < 0) guest_error("field 'moe.guest_slots': " + std::to_string(o.guest_slots) + " must be >= 0");
  if (o.ranks_per_node < 0)
    guest_error("field 'moe.ranks_per_node': " + std::to_string(o.ranks_per_node) + " must be >= 0");
  if (o.ranks_per_node > 0 && R % o.ranks_per_node != 0)
    guest_error("field 'moe.ranks_per_node': " + std::to_string(R) + " ep ranks are not a multiple of " +
                std::to_string(o.ranks_per_node));
  if (!(o.intra_node_gbps > 0) || !(o.inter_node_gbps > 0) || !std::isfinite(o.intra_node_gbps) ||
      !std::isfinite(o.inter_node_gbps))
    guest_error("bandwidths must be > 0 (intra " + std::to_string(o.intra_node_gbps) + ", inter " +
                std::to_string(o.inter_node_gbps) + " GB/s)");
  if (o.hidden_size < 0 || o.bytes_per_element < 0 || o.expert_params < 0)
    guest_error("hidden_size, bytes_per_element and expert_params must be >= 0");
  GuestState st;
  st.R = R, st.E = E, st.L = local_experts, st.S = o.guest_slots, st.G = o.ranks_per_node > 0 ? o.ranks_per_node : R;
  const int L = st.L, S = st.S, G = st.G;
  st.load.assign(E, 0);
  for (int j = 0; j < R; ++j)
    for (int e = 0; e < E; ++e) {
      const int64_t c = counts[j][e];
      if (c < 0)
        guest_error("counts[" + std::to_string(j) + "][" + std::to_string(e) + "] = " + std::to_string(c) +
                    " is negative");
      if (c > kMaxTokens || st.load[e] > kMaxTokens - c)
        guest_error("counts[.][" + std::to_string(e) + "]: more than 2^40 tokens for one expert");
      st.load[e] += c;
    }
  st.total = std::accumulate(st.load.begin(), st.load.end(), int64_t{0});
  st.guests.assign(R, {});

  GuestPlan p;
  p.home_loads.assign(R, 0);
  for (int e = 0; e < E; ++e) p.home_loads[e / L] += st.load[e];
  const int64_t total = st.total;
  const int64_t lb = (total + R - 1) / R;
  int64_t C = *std::max_element(p.home_loads.begin(), p.home_loads.end());

  // ---- greedy replicas ----
  const double token_bytes = 2.0 * static_cast<double>(o.hidden_size) * static_cast<double>(o.bytes_per_element);
  const double weight_bytes = 2.0 * static_cast<double>(o.expert_params) * static_cast<double>(o.bytes_per_element);
  const bool cost_model = token_bytes > 0 || weight_bytes > 0;
  const double intra_bw = o.intra_node_gbps * 1e9, inter_bw = o.inter_node_gbps * 1e9;
  const int N = R / G;
  std::vector<std::vector<int64_t>> node_tokens;  // [E][N] tokens of e from each node's sources (cost model)
  if (cost_model) {
    node_tokens.assign(E, std::vector<int64_t>(N, 0));
    for (int j = 0; j < R; ++j)
      for (int e = 0; e < E; ++e) node_tokens[e][j / G] += counts[j][e];
  }
  std::vector<int> copies(E, 1);
  while (S > 0 && total > 0 && C > lb) {
    AggFlow a = agg_flow(st, C - 1, true);
    const int64_t deficit = total - a.flowed;  // > 0: C is the minimum cap
    a.f.mark_reachable(0);                              // the minimal min cut: what the source still reaches
    std::vector<int> bottleneck;
    for (int e = 0; e < E; ++e)
      if (st.load[e] > 0 && a.f.reached(2 + e)) bottleneck.push_back(e);
    std::stable_sort(bottleneck.begin(), bottleneck.end(), [&](int x, int y) {
      return st.load[x] * copies[y] > st.load[y] * copies[x];  // load per copy, decreasing (ties: lower index)
    });
    std::vector<int64_t> rank_load(R);
    for (int r = 0; r < R; ++r) rank_load[r] = a.f.flow(a.sink_edge[r]);
    bool placed = false;
    for (int e : bottleneck) {
      struct Cand {
        int r;
        bool window, home_node;
        double cost;
      };
      std::vector<Cand> cands;
      int64_t best_load = kInfCap;
      for (int r = 0; r < R; ++r) {
        if (a.f.reached(2 + E + r) || static_cast<int>(st.guests[r].size()) >= S || st.holds(r, e)) continue;
        cands.push_back({r, false, r / G == st.home(e) / G, 0.0});
        best_load = std::min(best_load, rank_load[r]);
      }
      if (cands.empty()) continue;
      const int64_t window = best_load + (2 * C) / 100;  // balance tolerance: 2% of the cap
      for (auto& c : cands) {
        c.window = rank_load[c.r] <= window;
        if (!cost_model || !c.window) continue;
        const int n = c.r / G;
        if (weight_bytes > 0) c.cost += weight_bytes / (c.home_node ? intra_bw : inter_bw);
        bool node_has = st.home(e) / G == n;
        for (int r2 = n * G; r2 < (n + 1) * G && !node_has; ++r2) node_has = st.holds(r2, e);
        if (!node_has)
          c.cost -= static_cast<double>(std::min(node_tokens[e][n], C - rank_load[c.r])) * token_bytes / inter_bw;
      }
      std::stable_sort(cands.begin(), cands.end(), [&](const Cand& x, const Cand& y) {
        if (x.window != y.window) return x.window;
        if (x.window && x.cost != y.cost) return x.cost < y.cost;
        if (x.window && x.home_node != y.home_node) return x.home_node;
        if (rank_load[x.r] != rank_load[y.r]) return rank_load[x.r] < rank_load[y.r];
        return x.r < y.r;
      });
      for (const auto& c : cands) {
        MaxFlow g = a.f;
        g.add(2 + e, 2 + E + c.r, kInfCap);
        const int64_t got = a.flowed + g.run(0, 1);
        if (got < total && total - got >= deficit) continue;
        st.guests[c.r].push_back(e);
        ++copies[e];
        if (got == total) {
          int64_t lo = lb;  // no cap below any expert's load per copy
          for (int x = 0; x < E; ++x) lo = std::max(lo, (st.load[x] + copies[x] - 1) / copies[x]);
          C = guest_min_cap(st, std::min(lo, C - 1));
        }
        placed = true;
        break;
      }
      if (placed) break;
    }
    if (!placed) break;
  }

  // ---- routing at cap C: (expert, source) -> ranks holding the expert, locality first ----
  p.routes.assign(E, {});
  p.rank_loads.assign(R, 0);
  std::vector<std::vector<int64_t>> guest_tokens(R);
  for (int r = 0; r < R; ++r) guest_tokens[r].assign(st.guests[r].size(), 0);
  bool any_guest = false;
  for (const auto& g : st.guests) any_guest = any_guest || !g.empty();
  if (total > 0 && !any_guest) {  // every expert has one holder (no guest slots, or none helped): tokens go home
    for (int e = 0; e < E; ++e)
      for (int j = 0; j < R; ++j)
        if (counts[j][e] > 0) {
          p.routes[e].push_back({j, st.home(e), counts[j][e]});
          if (j / G != st.home(e) / G) p.inter_node_tokens += static_cast<double>(counts[j][e]);
        }
    p.rank_loads = p.home_loads;
  } else if (total > 0) {
    struct RouteEdge {
      int e, j, r, id, phase;
      int64_t cap;
    };
    std::vector<RouteEdge> redges;
    int nsrc = 0;
    for (int e = 0; e < E; ++e)
      for (int j = 0; j < R; ++j) nsrc += counts[j][e] > 0;
    const int rk0 = 2 + nsrc;
    MaxFlow f(rk0 + R);
    int node = 2;
    for (int e = 0; e < E; ++e) {
      std::vector<int> holders{st.home(e)};
      for (int r = 0; r < R; ++r)
        if (r != st.home(e) && st.holds(r, e)) holders.push_back(r);
      std::sort(holders.begin(), holders.end());
      for (int j = 0; j < R; ++j) {
        const int64_t c = counts[j][e];
        if (c == 0) continue;
        f.add(0, node, c);
        for (int r : holders) {
          const int phase = r == j ? 0 : (r / G == j / G ? 1 : 2);
          redges.push_back({e, j, r, f.add(node, rk0 + r, 0), phase, c});
        }
        ++node;
      }
    }
    for (int r = 0; r < R; ++r) f.add(rk0 + r, 1, C);
    int64_t flowed = 0;
    for (int phase = 0; phase < 3; ++phase) {
      for (const auto& re : redges)
        if (re.phase == phase) f.raise(re.id, re.cap);
      flowed += f.run(0, 1);
    }
    if (flowed != total)
      throw Error("moe guest plan: internal error: flow " + std::to_string(flowed) + " of " + std::to_string(total) +
                  " tokens at cap " + std::to_string(C));
    for (const auto& re : redges) {
      const int64_t t = f.flow(re.id);
      if (t <= 0) continue;
      p.routes[re.e].push_back({re.j, re.r, t});
      p.rank_loads[re.r] += t;
      if (re.r != st.home(re.e)) {
        auto& g = st.guests[re.r];
        guest_tokens[re.r][std::find(g.begin(), g.end(), re.e) - g.begin()] += t;
      }
      if (re.j / G != re.r / G) p.inter_node_tokens += static_cast<double>(t);
    }
    for (auto& rs : p.routes)
      std::sort(rs.begin(), rs.end(), [](const GuestRoute& x, const GuestRoute& y) {
        return x.src != y.src ? x.src < y.src : x.dst < y.dst;
      });
  }

  // ---- guest slots: those without tokens become -1 (kept ones first, in placement order) ----
  p.guests.assign(R, std::vector<int>(S, -1));
  for (int r = 0; r < R; ++r) {
    int k = 0;
    for (size_t i = 0; i < st.guests[r].size(); ++i)
      if (guest_tokens[r][i] > 0) p.guests[r][k++] = st.guests[r][i];
  }
  if (total > 0) {
    const double mean = static_cast<double>(total) / R;
    p.overload = static_cast<double>(*std::max_element(p.rank_loads.begin(), p.rank_loads.end())) / mean;
    p.home_overload = static_cast<double>(*std::max_element(p.home_loads.begin(), p.home_loads.end())) / mean;
  }
  return p;
}

}  // namespace lf::parallel::moe

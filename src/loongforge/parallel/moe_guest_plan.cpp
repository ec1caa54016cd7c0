// The run-time guest-slot planner, plan_guests (moe_guest_plan.h): called by expert parallelism for every MoE layer
// on every forward, with identical input on every ep rank, so it must be cheap (bench/moe_plan_bench.cpp).
//
// What keeps it cheap: experts without a guest compute all their tokens on their home rank, so the flow networks
// hold them as one edge source -> rank per rank (the rank's "single" load) and only the replicated experts as nodes;
// the routing flow pools each replicated expert's sources that are not holders by node (they have the same edges).
// The minimal min cut, the max-flow values and hence the minimum caps are the same as in the network with one node
// per expert and one per (expert, source).
#include "loongforge/parallel/moe_guest_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/parallel/max_flow.h"

namespace lf::parallel::moe {

namespace {

constexpr int64_t kMaxTokens = int64_t{1} << 40;  // per expert: products with copy counts cannot overflow

[[noreturn]] void guest_error(const std::string& what) { throw Error("moe guest plan: " + what); }

// The guests placed so far and the expert-level flow network they give: s -> rank r (the rank's single load), s ->
// each replicated expert (its load) -> every rank holding it, rank -> t (the cap). Node ids: s 0, t 1, rank r 2 + r,
// the replicated experts after the ranks in expert order. The network is built when the guests change; a flow at
// another cap only sets its capacities and starting flow.
struct GuestState {
  int R = 0, E = 0, L = 0, S = 0, G = 0;
  std::vector<int64_t> load;                  // [E] tokens routed to each expert
  int64_t total = 0;
  std::vector<std::vector<int>> guests;       // [R] guest experts in placement order
  std::vector<std::vector<int>> guest_ranks;  // [E] ranks holding e as a guest, in placement order
  std::vector<char> held;                     // [R * E] rank r holds expert e (home or guest)
  std::vector<int64_t> single_load;           // [R] loads of the rank's home experts that have no guest
  std::vector<int> reps;                      // the replicated experts (with a guest), ascending

  std::vector<int> home_of, node_of;          // [E] home rank of each expert, [R] node of each rank

  MaxFlow f;
  bool built = false;                       // f is the network of the current guests
  std::vector<int> sink_edge, single_edge;  // [R]
  std::vector<int> node, expert_edge;       // [E] flow node of a replicated expert and its edge from s
  std::vector<int> hold_edge;               // the replicated experts' edges to their holders: home, then guests
  std::vector<int64_t> rank_flow;           // scratch [R]
  std::vector<char> cut_q;                  // scratch [R]

  int home(int e) const { return home_of[e]; }
  bool holds(int r, int e) const { return held[static_cast<size_t>(r) * E + e] != 0; }
  bool replicated(int e) const { return !guest_ranks[e].empty(); }

  void add_guest(int e, int r) {
    if (guest_ranks[e].empty()) {
      single_load[home(e)] -= load[e];
      reps.insert(std::lower_bound(reps.begin(), reps.end(), e), e);
    }
    guests[r].push_back(e);
    guest_ranks[e].push_back(r);
    held[static_cast<size_t>(r) * E + e] = 1;
    built = false;
  }
  void remove_last_guest(int e, int r) {  // undoes add_guest(e, r)
    guests[r].pop_back();
    guest_ranks[e].pop_back();
    held[static_cast<size_t>(r) * E + e] = 0;
    if (guest_ranks[e].empty()) {
      single_load[home(e)] += load[e];
      reps.erase(std::lower_bound(reps.begin(), reps.end(), e));
    }
    built = false;
  }

  void build() {
    int n = 2 + R;
    for (int e : reps) node[e] = n++;
    f.reset(n);
    for (int r = 0; r < R; ++r) single_edge[r] = single_load[r] > 0 ? f.add(0, 2 + r, single_load[r]) : -1;
    hold_edge.clear();
    for (int e : reps) {
      expert_edge[e] = f.add(0, node[e], load[e]);
      hold_edge.push_back(f.add(node[e], 2 + home(e), kInfCap));
      for (int r : guest_ranks[e]) hold_edge.push_back(f.add(node[e], 2 + r, kInfCap));
    }
    for (int r = 0; r < R; ++r) sink_edge[r] = f.add(2 + r, 1, 0);
    built = true;
  }

  // A maximum flow at rank capacity CAP, home edges first: it starts from the flow that fills each rank up to CAP
  // with its home tokens (single ones first, then the replicated experts' in expert order) and sends each replicated
  // expert's overflow to its guests with room, in placement order; the max-flow then moves the rest. Returns its
  // value; f.reached() then gives the minimal min cut.
  int64_t run(int64_t cap) {
    if (!built) build();
    int64_t value = 0;
    for (int r = 0; r < R; ++r) {
      rank_flow[r] = std::min(single_load[r], cap);
      if (single_edge[r] >= 0) f.set(single_edge[r], single_load[r], rank_flow[r]);
      value += rank_flow[r];
    }
    size_t i = 0;
    for (int e : reps) {
      const int64_t x = std::min(load[e], cap - rank_flow[home(e)]);
      rank_flow[home(e)] += x;
      value += x;
      f.set(hold_edge[i++], kInfCap, x);
      int64_t sent = x;
      for (int r : guest_ranks[e]) {  // the overflow straight to the guests with room
        const int64_t y = std::min(load[e] - sent, cap - rank_flow[r]);
        rank_flow[r] += y, sent += y;
        f.set(hold_edge[i++], kInfCap, y);
      }
      value += sent - x;
      f.set(expert_edge[e], load[e], sent);
    }
    for (int r = 0; r < R; ++r) f.set(sink_edge[r], cap, rank_flow[r]);
    return value + f.run(0, 1);
  }

  // A lower bound on the cap from a set Q of ranks ([R] flags): the experts held only on Q must fit there,
  // ceil(their load / |Q|).
  int64_t bound(const std::vector<char>& q) const {
    int64_t in = 0, n = 0;
    for (int r = 0; r < R; ++r)
      if (q[r]) in += single_load[r], ++n;
    if (n == 0) return 0;
    for (int e : reps) {
      bool inside = q[home(e)] != 0;
      for (size_t k = 0; inside && k < guest_ranks[e].size(); ++k) inside = q[guest_ranks[e][k]] != 0;
      if (inside) in += load[e];
    }
    return (in + n - 1) / n;
  }

  // The tightest of the bounds of the small rank sets most likely to bind: each rank alone (its single load) and
  // each replicated expert's holders. Usually the minimum cap itself, so min_cap() needs a single flow.
  int64_t holder_bound() {
    int64_t best = *std::max_element(single_load.begin(), single_load.end());
    std::fill(cut_q.begin(), cut_q.end(), 0);
    for (int e : reps) {
      cut_q[home(e)] = 1;
      for (int r : guest_ranks[e]) cut_q[r] = 1;
      best = std::max(best, bound(cut_q));
      cut_q[home(e)] = 0;
      for (int r : guest_ranks[e]) cut_q[r] = 0;
    }
    return best;
  }

  // The smallest cap in [LO, HI] at which every token fits, or HI + 1 when none is (*AT_HI: the flow at HI). Each
  // infeasible cap c gives a better lower bound from its minimal min cut: the ranks Q the source still reaches must
  // take every token of the experts held only there, so the cap is at least bound(Q) (> c, as the cut is below the
  // total); iterate until feasible (Dinkelbach-style; exact, and a few flows instead of a bisection's dozens).
  int64_t min_cap(int64_t lo, int64_t hi, int64_t* at_hi) {
    int64_t c = std::min(lo, hi);
    for (;;) {
      const int64_t flowed = run(c);
      if (flowed == total) return c;
      if (c == hi) {
        *at_hi = flowed;
        return hi + 1;
      }
      for (int r = 0; r < R; ++r) cut_q[r] = f.reached(2 + r);
      c = std::min(hi, std::max(c + 1, bound(cut_q)));
    }
  }
};

struct CostModel {
  double token_bytes = 0, weight_bytes = 0, intra_bw = 0, inter_bw = 0;
  int N = 1;
  std::vector<int64_t> node_tokens;  // [E * N] tokens of e from each node's sources
  bool on() const { return token_bytes > 0 || weight_bytes > 0; }
};

// Step 2 of the algorithm (moe_guest_plan.h): places guests one at a time while one lowers the cap (or the deficit
// at the cap below it); returns the final minimum cap.
int64_t place_guests(GuestState& st, const CostModel& cm, int64_t C) {
  const int R = st.R, E = st.E, S = st.S, G = st.G;
  const int64_t total = st.total, lb = (total + R - 1) / R;
  std::vector<int> copies(E, 1), bottleneck, by_load(E);
  std::iota(by_load.begin(), by_load.end(), 0);
  std::stable_sort(by_load.begin(), by_load.end(), [&](int x, int y) { return st.load[x] > st.load[y]; });
  std::vector<int64_t> rank_load(R);
  std::vector<char> cut_rank(R), with_guest(R);
  struct Cand {
    int r;
    bool window, home_node;
    double cost;
  };
  std::vector<Cand> cands;
  // Bottleneck experts go by load per copy, decreasing, ties to the lower index (a total order).
  auto before = [&](int x, int y) {
    const int64_t a = st.load[x] * copies[y], b = st.load[y] * copies[x];
    return a != b ? a > b : x < y;
  };
  while (S > 0 && total > 0 && C > lb) {
    const int64_t deficit = total - st.run(C - 1);  // > 0: C is the minimum cap
    // The minimal min cut, what the source still reaches: its ranks, their experts without a guest and the
    // replicated experts it reaches.
    bottleneck.clear();
    for (int r = 0; r < R; ++r) {
      rank_load[r] = st.f.flow(st.sink_edge[r]);
      cut_rank[r] = st.f.reached(2 + r);
      if (cut_rank[r])
        for (int e = r * st.L; e < (r + 1) * st.L; ++e)
          if (st.load[e] > 0 && !st.replicated(e)) bottleneck.push_back(e);
    }
    for (int e : st.reps)
      if (st.f.reached(st.node[e])) bottleneck.push_back(e);
    // No cap is below an expert's load per copy: the two largest (a guest changes one expert's), from the two
    // largest unreplicated experts and the replicated ones.
    int64_t per_copy[2] = {lb, lb};
    int per_copy_expert = -1;
    auto consider = [&](int x, int64_t v) {
      if (v > per_copy[0])
        per_copy[1] = per_copy[0], per_copy[0] = v, per_copy_expert = x;
      else
        per_copy[1] = std::max(per_copy[1], v);
    };
    for (int x : st.reps) consider(x, (st.load[x] + copies[x] - 1) / copies[x]);
    for (int k = 0, seen = 0; k < E && seen < 2; ++k)
      if (!st.replicated(by_load[k])) consider(by_load[k], st.load[by_load[k]]), ++seen;
    bool placed = false;
    // The experts in order, picked one at a time (the first usually takes the slot).
    for (auto next = bottleneck.begin(); next != bottleneck.end() && !placed; ++next) {
      std::iter_swap(next, std::min_element(next, bottleneck.end(), before));
      const int e = *next;
      cands.clear();
      int64_t best_load = kInfCap;
      for (int r = 0; r < R; ++r) {
        if (cut_rank[r] || static_cast<int>(st.guests[r].size()) >= S || st.holds(r, e)) continue;
        cands.push_back({r, false, st.node_of[r] == st.node_of[st.home(e)], 0.0});
        best_load = std::min(best_load, rank_load[r]);
      }
      if (cands.empty()) continue;
      const int64_t window = best_load + (2 * C) / 100;  // balance tolerance: 2% of the cap
      for (auto& c : cands) {
        c.window = rank_load[c.r] <= window;
        if (!cm.on() || !c.window) continue;
        const int n = st.node_of[c.r];
        if (cm.weight_bytes > 0) c.cost += cm.weight_bytes / (c.home_node ? cm.intra_bw : cm.inter_bw);
        bool node_has = st.node_of[st.home(e)] == n;
        for (int r2 = n * G; r2 < (n + 1) * G && !node_has; ++r2) node_has = st.holds(r2, e);
        const int64_t saved = std::min(cm.node_tokens[static_cast<size_t>(e) * cm.N + n], C - rank_load[c.r]);
        if (!node_has) c.cost -= static_cast<double>(saved) * cm.token_bytes / cm.inter_bw;
      }
      std::stable_sort(cands.begin(), cands.end(), [&](const Cand& x, const Cand& y) {
        if (x.window != y.window) return x.window;
        if (x.window && x.cost != y.cost) return x.cost < y.cost;
        if (x.window && x.home_node != y.home_node) return x.home_node;
        if (rank_load[x.r] != rank_load[y.r]) return rank_load[x.r] < rank_load[y.r];
        return x.r < y.r;
      });
      // The first candidate that makes C - 1 feasible or lowers the deficit there is kept. With it, the cap is
      // at least the expert's load per copy and what the cut's experts put on the cut's ranks plus the guest's.
      for (const auto& c : cands) {
        st.add_guest(e, c.r);
        ++copies[e];
        with_guest = cut_rank;
        with_guest[c.r] = 1;
        const int64_t lo = std::max({per_copy[e == per_copy_expert ? 1 : 0], (st.load[e] + copies[e] - 1) / copies[e],
                                     st.bound(with_guest), st.holder_bound()});
        int64_t at_hi = total;
        const int64_t cap = st.min_cap(lo, C - 1, &at_hi);
        if (cap == C && total - at_hi >= deficit) {
          st.remove_last_guest(e, c.r);
          --copies[e];
          continue;
        }
        C = cap < C ? cap : C;
        placed = true;
        break;
      }
    }
    if (!placed) break;
  }
  return C;
}

// Step 3: routes at cap C. Experts without a guest: every token home. Replicated experts: a max-flow from their
// sources to the ranks holding them, rank capacity C minus the rank's single load, in three phases that open the
// edges same-rank, then same-node, then anywhere. A source that holds the expert is a node of its own; the other
// sources of the expert are pooled per node (same edges, same phases) and the pool's flow to each holder is handed
// out to its sources in rank order.
void route(const std::vector<std::vector<int64_t>>& counts, GuestState& st, int64_t C, GuestPlan& p,
           std::vector<std::vector<int64_t>>& guest_tokens) {
  const int R = st.R, E = st.E, G = st.G, N = R / G, M = static_cast<int>(st.reps.size());
  std::vector<int> rep_index(E, -1);  // [e] index in st.reps
  for (int i = 0; i < M; ++i) rep_index[st.reps[i]] = i;
  std::vector<int> nonzero(E, 0);
  for (const auto& row : counts)
    for (int e = 0; e < E; ++e) nonzero[e] += row[e] > 0;
  p.routes.assign(E, {});
  for (int e = 0; e < E; ++e)
    if (nonzero[e] > 0) p.routes[e].reserve(nonzero[e] + (rep_index[e] >= 0 ? st.guest_ranks[e].size() + 1 : 0));
  p.rank_loads = st.single_load;  // experts without a guest: every token home
  for (int j = 0; j < R; ++j)
    for (int e = 0; e < E; ++e) {
      const int64_t c = counts[j][e];
      if (c == 0 || rep_index[e] >= 0) continue;
      p.routes[e].push_back({j, st.home(e), c});
      if (st.node_of[j] != st.node_of[st.home(e)]) p.inter_node_tokens += static_cast<double>(c);
    }
  if (M == 0) return;

  struct Pool {
    int first_edge, edges;  // its edges to the holders (ascending rank) are pool_edges[first_edge, +edges)
  };
  struct PoolEdge {
    int r, id, phase;
  };
  std::vector<Pool> pools;
  std::vector<PoolEdge> pool_edges;
  std::vector<int> pool_of(static_cast<size_t>(M) * (R + N), -1);  // [rep][source rank | R + node]: flow node
  auto pool_key = [&](int e, int j) {
    return static_cast<size_t>(rep_index[e]) * (R + N) + (st.holds(j, e) ? j : R + st.node_of[j]);
  };
  int nodes = 2 + R;
  for (int e : st.reps)
    for (int j = 0; j < R; ++j)
      if (counts[j][e] > 0 && pool_of[pool_key(e, j)] < 0) pool_of[pool_key(e, j)] = nodes++;
  MaxFlow f(nodes);
  std::vector<int64_t> supply(nodes, 0);
  std::vector<int> holders;
  int64_t replicated_total = 0;
  for (int e : st.reps) {
    replicated_total += st.load[e];
    holders = st.guest_ranks[e];
    holders.push_back(st.home(e));
    std::sort(holders.begin(), holders.end());
    for (int j = 0; j < R; ++j) {
      if (counts[j][e] == 0) continue;
      const int v = pool_of[pool_key(e, j)];
      if (supply[v] == 0) {  // the pool's first source: create its edges
        pools.push_back({static_cast<int>(pool_edges.size()), static_cast<int>(holders.size())});
        for (int r : holders) {
          const int phase = r == j ? 0 : (st.node_of[r] == st.node_of[j] ? 1 : 2);  // r == j: a holder's own pool
          pool_edges.push_back({r, f.add(v, 2 + r, 0), phase});
        }
      }
      supply[v] += counts[j][e];
    }
  }
  for (int v = 2 + R; v < nodes; ++v) f.add(0, v, supply[v]);
  for (int r = 0; r < R; ++r) {
    if (p.rank_loads[r] > C)
      throw Error("moe guest plan: internal error: rank " + std::to_string(r) + " has " +
                  std::to_string(p.rank_loads[r]) + " tokens of unreplicated experts, above the cap " +
                  std::to_string(C));
    f.add(2 + r, 1, C - p.rank_loads[r]);
  }
  int64_t flowed = 0;
  for (int phase = 0; phase < 3; ++phase) {
    for (const auto& pe : pool_edges)
      if (pe.phase == phase) f.raise(pe.id, kInfCap);
    flowed += f.run(0, 1);
  }
  if (flowed != replicated_total)
    throw Error("moe guest plan: internal error: flow " + std::to_string(flowed) + " of " +
                std::to_string(replicated_total) + " replicated tokens at cap " + std::to_string(C));

  // Hand each pool's flow to its sources, in rank order, holders in rank order (so routes come sorted).
  std::vector<int64_t> left(pool_edges.size());
  for (size_t k = 0; k < pool_edges.size(); ++k) left[k] = f.flow(pool_edges[k].id);
  std::vector<int> cursor(pools.size());  // [pool] next edge with flow left
  for (size_t q = 0; q < pools.size(); ++q) cursor[q] = pools[q].first_edge;
  for (int e : st.reps)
    for (int j = 0; j < R; ++j) {
      int64_t c = counts[j][e];
      if (c == 0) continue;
      const int q = pool_of[pool_key(e, j)] - 2 - R;
      const int end = pools[q].first_edge + pools[q].edges;
      int& k = cursor[q];
      while (c > 0) {
        while (k < end && left[k] == 0) ++k;
        if (k == end) throw Error("moe guest plan: internal error: a pool's flow is short");
        const int r = pool_edges[k].r;
        const int64_t t = std::min(c, left[k]);
        p.routes[e].push_back({j, r, t});
        p.rank_loads[r] += t;
        if (r != st.home(e)) {
          const auto& g = st.guests[r];
          guest_tokens[r][std::find(g.begin(), g.end(), e) - g.begin()] += t;
        }
        if (st.node_of[j] != st.node_of[r]) p.inter_node_tokens += static_cast<double>(t);
        left[k] -= t;
        c -= t;
      }
    }
}

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
  if (o.guest_slots < 0) throw OptionError("guest_slots", std::to_string(o.guest_slots) + " must be >= 0");
  if (o.ranks_per_node < 0)
    throw OptionError("ranks_per_node", std::to_string(o.ranks_per_node) + " must be >= 0");
  if (o.ranks_per_node > 0 && R % o.ranks_per_node != 0)
    throw OptionError("ranks_per_node", std::to_string(R) + " ep ranks are not a multiple of " +
                                            std::to_string(o.ranks_per_node));
  if (!(o.intra_node_gbps > 0) || !(o.inter_node_gbps > 0) || !std::isfinite(o.intra_node_gbps) ||
      !std::isfinite(o.inter_node_gbps))
    guest_error("bandwidths must be > 0 (intra " + std::to_string(o.intra_node_gbps) + ", inter " +
                std::to_string(o.inter_node_gbps) + " GB/s)");
  if (o.hidden_size < 0 || o.bytes_per_element < 0 || o.expert_params < 0)
    guest_error("hidden_size, bytes_per_element and expert_params must be >= 0");
  GuestState st;
  st.R = R, st.E = E, st.L = local_experts, st.S = o.guest_slots, st.G = o.ranks_per_node > 0 ? o.ranks_per_node : R;
  const int L = st.L, S = st.S, G = st.G, N = R / G;
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
  st.guest_ranks.assign(E, {});
  st.home_of.resize(E);
  for (int e = 0; e < E; ++e) st.home_of[e] = e / L;
  st.node_of.resize(R);
  for (int r = 0; r < R; ++r) st.node_of[r] = r / G;
  st.held.assign(static_cast<size_t>(R) * E, 0);
  for (int e = 0; e < E; ++e) st.held[static_cast<size_t>(st.home(e)) * E + e] = 1;
  st.sink_edge.assign(R, -1);
  st.single_edge.assign(R, -1);
  st.node.assign(E, -1);
  st.expert_edge.assign(E, -1);
  st.rank_flow.assign(R, 0);
  st.cut_q.assign(R, 0);

  GuestPlan p;
  p.home_loads.assign(R, 0);
  for (int e = 0; e < E; ++e) p.home_loads[e / L] += st.load[e];
  st.single_load = p.home_loads;

  CostModel cm;
  cm.token_bytes = 2.0 * static_cast<double>(o.hidden_size) * static_cast<double>(o.bytes_per_element);
  cm.weight_bytes = 2.0 * static_cast<double>(o.expert_params) * static_cast<double>(o.bytes_per_element);
  cm.intra_bw = o.intra_node_gbps * 1e9, cm.inter_bw = o.inter_node_gbps * 1e9;
  cm.N = N;
  if (cm.on()) {
    cm.node_tokens.assign(static_cast<size_t>(E) * N, 0);
    for (int j = 0; j < R; ++j)
      for (int e = 0; e < E; ++e) cm.node_tokens[static_cast<size_t>(e) * N + st.node_of[j]] += counts[j][e];
  }

  const int64_t C = place_guests(st, cm, *std::max_element(p.home_loads.begin(), p.home_loads.end()));

  std::vector<std::vector<int64_t>> guest_tokens(R);
  for (int r = 0; r < R; ++r) guest_tokens[r].assign(st.guests[r].size(), 0);
  route(counts, st, C, p, guest_tokens);

  // ---- guest slots: those without tokens become -1 (kept ones first, in placement order) ----
  p.guests.assign(R, std::vector<int>(S, -1));
  for (int r = 0; r < R; ++r) {
    int k = 0;
    for (size_t i = 0; i < st.guests[r].size(); ++i)
      if (guest_tokens[r][i] > 0) p.guests[r][k++] = st.guests[r][i];
  }
  if (st.total > 0) {
    const double mean = static_cast<double>(st.total) / R;
    p.overload = static_cast<double>(*std::max_element(p.rank_loads.begin(), p.rank_loads.end())) / mean;
    p.home_overload = static_cast<double>(*std::max_element(p.home_loads.begin(), p.home_loads.end())) / mean;
  }
  return p;
}

}  // namespace lf::parallel::moe

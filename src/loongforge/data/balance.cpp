#include "loongforge/data/balance.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "loongforge/core/error.h"

namespace lf::data {

double row_cost(const RowShape& row, const CostModel& m) {
  double c = 0;
  for (int64_t len : row.documents) {
    const double n = static_cast<double>(len);
    c += n + m.token_pair * n * n;
  }
  for (int64_t t : row.image_tokens) {
    const double p = static_cast<double>(m.fixed_image_patches > 0 ? m.fixed_image_patches : t * m.patches_per_image_token);
    c += m.patch * p + m.patch_pair * p * p;
  }
  return c;
}

namespace {

void check_sizes(int64_t ranks, int64_t micros, int64_t rows_per_slot) {
  if (ranks < 1 || micros < 1 || rows_per_slot < 1)
    throw Error("load balancing: " + std::to_string(ranks) + " ranks x " + std::to_string(micros) + " micro-batches x " +
                std::to_string(rows_per_slot) + " rows: each must be >= 1");
}

// Longest processing time first: rows (by decreasing cost, ties by index) each to the bin with the smallest sum
// among those with room (ties: the lower bin); each bin takes `capacity` rows.
std::vector<std::vector<int64_t>> greedy(const std::vector<double>& costs, const std::vector<int64_t>& rows,
                                         int64_t bins, int64_t capacity) {
  std::vector<int64_t> order = rows;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(bins));
  std::vector<double> sum(static_cast<size_t>(bins), 0.0);
  for (int64_t r : order) {
    size_t best = out.size();
    for (size_t b = 0; b < out.size(); ++b)
      if (static_cast<int64_t>(out[b].size()) < capacity && (best == out.size() || sum[b] < sum[best])) best = b;
    out[best].push_back(r);
    sum[best] += costs[r];
  }
  return out;
}

double total(const std::vector<double>& costs, const std::vector<int64_t>& rows) {
  double s = 0;
  for (int64_t r : rows) s += costs[r];
  return s;
}

// Swaps one row of the dearest bin with one of the cheapest while that lowers the dearest bin's sum below where it
// was (the pair that brings the two closest), at most `rounds` times.
void improve(const std::vector<double>& costs, std::vector<std::vector<int64_t>>& bins, int rounds) {
  for (int round = 0; round < rounds && bins.size() > 1; ++round) {
    std::vector<double> sum(bins.size());
    for (size_t b = 0; b < bins.size(); ++b) sum[b] = total(costs, bins[b]);
    const size_t hi = static_cast<size_t>(std::max_element(sum.begin(), sum.end()) - sum.begin());
    const size_t lo = static_cast<size_t>(std::min_element(sum.begin(), sum.end()) - sum.begin());
    const double gap = sum[hi] - sum[lo];
    if (gap <= 0) return;
    // moving d = cost(a) - cost(b) from hi to lo leaves the pair at sum[hi] - d and sum[lo] + d: best d is gap / 2,
    // and any 0 < d < gap lowers the larger of the two
    double best_err = gap;
    size_t ba = 0, bb = 0;
    bool found = false;
    for (size_t i = 0; i < bins[hi].size(); ++i)
      for (size_t j = 0; j < bins[lo].size(); ++j) {
        const double d = costs[bins[hi][i]] - costs[bins[lo][j]];
        if (d <= 0 || d >= gap) continue;
        const double err = std::abs(gap / 2 - d);
        if (err < best_err) {
          best_err = err;
          ba = i;
          bb = j;
          found = true;
        }
      }
    if (!found) return;
    std::swap(bins[hi][ba], bins[lo][bb]);
  }
}

double max_rank_cost(const std::vector<double>& costs, const Placement& p) {
  const auto c = rank_costs(costs, p);
  return c.empty() ? 0 : *std::max_element(c.begin(), c.end());
}

}  // namespace

Placement contiguous_placement(int64_t ranks, int64_t micros, int64_t rows_per_slot) {
  check_sizes(ranks, micros, rows_per_slot);
  Placement p(static_cast<size_t>(ranks), std::vector<std::vector<int64_t>>(static_cast<size_t>(micros)));
  for (int64_t m = 0; m < micros; ++m)
    for (int64_t r = 0; r < ranks; ++r) {
      auto& slot = p[static_cast<size_t>(r)][static_cast<size_t>(m)];
      for (int64_t i = 0; i < rows_per_slot; ++i) slot.push_back((m * ranks + r) * rows_per_slot + i);
    }
  return p;
}

Placement balanced_placement(const std::vector<double>& costs, int64_t ranks, int64_t micros, int64_t rows_per_slot) {
  check_sizes(ranks, micros, rows_per_slot);
  if (static_cast<int64_t>(costs.size()) != ranks * micros * rows_per_slot)
    throw Error("load balancing: " + std::to_string(costs.size()) + " row costs for " + std::to_string(ranks) +
                " ranks x " + std::to_string(micros) + " micro-batches x " + std::to_string(rows_per_slot) + " rows");
  Placement contiguous = contiguous_placement(ranks, micros, rows_per_slot);
  std::vector<int64_t> all(costs.size());
  std::iota(all.begin(), all.end(), int64_t{0});
  auto per_rank = greedy(costs, all, ranks, micros * rows_per_slot);
  improve(costs, per_rank, static_cast<int>(costs.size()));
  Placement p(static_cast<size_t>(ranks));
  for (size_t r = 0; r < per_rank.size(); ++r) {
    std::sort(per_rank[r].begin(), per_rank[r].end());
    auto slots = greedy(costs, per_rank[r], micros, rows_per_slot);
    improve(costs, slots, static_cast<int>(per_rank[r].size()));
    for (auto& s : slots) std::sort(s.begin(), s.end());
    p[r] = std::move(slots);
  }
  // The heuristic is no worse than today's placement in practice; keep today's where it is not.
  if (max_rank_cost(costs, p) > max_rank_cost(costs, contiguous)) return contiguous;
  return p;
}

std::vector<double> rank_costs(const std::vector<double>& costs, const Placement& placement) {
  std::vector<double> out;
  for (const auto& rank : placement) {
    double s = 0;
    for (const auto& slot : rank) s += total(costs, slot);
    out.push_back(s);
  }
  return out;
}

double imbalance(const std::vector<double>& costs, const Placement& placement) {
  const auto c = rank_costs(costs, placement);
  if (c.empty()) return 1;
  const double mean = std::accumulate(c.begin(), c.end(), 0.0) / static_cast<double>(c.size());
  if (mean <= 0) return 1;
  return *std::max_element(c.begin(), c.end()) / mean;
}

}  // namespace lf::data

// Data-parallel load balancing (data/balance.h): the row cost model, today's contiguous placement, the balanced
// placement's invariants (every row once, equal rows per slot, deterministic, never worse than contiguous, near the
// mean on skewed mixes), and the batch sources' draw / take (train/batch.h) against next_rows.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "loongforge/core/error.h"
#include "loongforge/data/balance.h"
#include "loongforge/train/batch.h"

namespace {

using lf::data::balanced_placement;
using lf::data::contiguous_placement;
using lf::data::CostModel;
using lf::data::imbalance;
using lf::data::Placement;
using lf::data::rank_costs;
using lf::data::row_cost;
using lf::data::RowShape;

// Every row index in [0, n) exactly once, `rows_per_slot` per slot, each slot sorted.
void expect_partition(const Placement& p, int64_t ranks, int64_t micros, int64_t rows_per_slot) {
  ASSERT_EQ(static_cast<int64_t>(p.size()), ranks);
  std::vector<int64_t> seen;
  for (const auto& rank : p) {
    ASSERT_EQ(static_cast<int64_t>(rank.size()), micros);
    for (const auto& slot : rank) {
      ASSERT_EQ(static_cast<int64_t>(slot.size()), rows_per_slot);
      EXPECT_TRUE(std::is_sorted(slot.begin(), slot.end()));
      seen.insert(seen.end(), slot.begin(), slot.end());
    }
  }
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(static_cast<size_t>(ranks * micros * rows_per_slot));
  std::iota(all.begin(), all.end(), int64_t{0});
  EXPECT_EQ(seen, all);
}

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

}  // namespace

TEST(Balance, RowCost) {
  CostModel m;
  RowShape text{{10, 4}, {}};
  EXPECT_DOUBLE_EQ(row_cost(text, m), 14.0);  // linear terms only
  m.token_pair = 0.5;
  EXPECT_DOUBLE_EQ(row_cost(text, m), 14.0 + 0.5 * (100 + 16));
  // images: patches from image tokens (merge 2 x 2), or a fixed grid
  m.patch = 2;
  m.patch_pair = 0.25;
  m.patches_per_image_token = 4;
  RowShape img{{20}, {3, 1}};  // 12 and 4 patches
  EXPECT_DOUBLE_EQ(row_cost(img, m), 20 + 0.5 * 400 + (2 * 12 + 0.25 * 144) + (2 * 4 + 0.25 * 16));
  m.fixed_image_patches = 10;
  EXPECT_DOUBLE_EQ(row_cost(img, m), 20 + 0.5 * 400 + 2 * (2 * 10 + 0.25 * 100));
  EXPECT_DOUBLE_EQ(row_cost(RowShape{}, m), 0.0);  // a row of padding
}

TEST(Balance, ContiguousIsTodaysSlices) {
  // micro-batch m holds global rows [m * 6, m * 6 + 6); rank r takes rows [r * 2, r * 2 + 2) of it
  Placement p = contiguous_placement(3, 2, 2);
  expect_partition(p, 3, 2, 2);
  EXPECT_EQ(p[0][0], (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(p[2][0], (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(p[1][1], (std::vector<int64_t>{8, 9}));
  EXPECT_THROW(contiguous_placement(0, 1, 1), lf::Error);
  EXPECT_THROW(contiguous_placement(2, 1, 0), lf::Error);
}

TEST(Balance, SmallCaseReachesTheOptimum) {
  // contiguous: rank 0 rows {0, 2} = 17, rank 1 rows {1, 3} = 3
  const std::vector<double> c{9, 1, 8, 2};
  EXPECT_DOUBLE_EQ(imbalance(c, contiguous_placement(2, 2, 1)), 17.0 / 10.0);
  Placement p = balanced_placement(c, 2, 2, 1);
  expect_partition(p, 2, 2, 1);
  EXPECT_DOUBLE_EQ(imbalance(c, p), 1.0);  // {9, 1} and {8, 2}
  EXPECT_THROW(balanced_placement(c, 2, 1, 1), lf::Error);  // 4 costs for 2 slots of one row
}

TEST(Balance, SkewedMixesBalanceDeterministically) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t ranks = 2 + trial % 4, micros = 1 + trial % 3, rows = 1 + trial % 4;
    const int64_t n = ranks * micros * rows;
    // many cheap text rows, a few dear ones with images (one dear row may exceed the mean rank cost)
    std::vector<double> c(static_cast<size_t>(n));
    std::uniform_real_distribution<double> u(0, 1);
    for (auto& x : c) x = u(rng) < 0.2 ? 2000 + 6000 * u(rng) : 100 + 200 * u(rng);
    const Placement before = contiguous_placement(ranks, micros, rows);
    const Placement p = balanced_placement(c, ranks, micros, rows);
    expect_partition(p, ranks, micros, rows);
    EXPECT_EQ(p, balanced_placement(c, ranks, micros, rows));  // every rank computes the same placement
    const double b = imbalance(c, before), a = imbalance(c, p);
    EXPECT_GE(a, 1.0);
    EXPECT_LE(a, b + 1e-12);
    // no better is possible than the mean or the largest row; LPT with swaps comes close to that bound
    const auto rc = rank_costs(c, p);
    const double mean = std::accumulate(rc.begin(), rc.end(), 0.0) / static_cast<double>(ranks);
    const double bound = std::max(mean, max_of(c));
    if (rows * micros >= 4) {
      EXPECT_LE(max_of(rc), 1.25 * bound) << "trial " << trial;
    }
  }
  // a large step: within 2 % of the mean
  std::vector<double> c(256);
  std::lognormal_distribution<double> ln(0, 1);
  for (auto& x : c) x = 100 * ln(rng);
  const Placement p = balanced_placement(c, 4, 8, 8);
  EXPECT_LT(imbalance(c, p), 1.02);
  EXPECT_GT(imbalance(c, contiguous_placement(4, 8, 8)), imbalance(c, p));
}

namespace {

// Rows 0, 1, 2, ... of input_ids = the row number, with two documents of (1 + row % 3) and the rest of the row.
class CountingSource : public lf::train::BatchSource {
 public:
  lf::train::Batch next(int64_t b) override {
    at::Tensor ids = at::arange(pos_, pos_ + b, at::kLong).unsqueeze(1).repeat({1, 6});
    at::Tensor seg = at::ones({b, 6}, at::kLong);
    for (int64_t i = 0; i < b; ++i) seg[i].slice(0, 0, 1 + (pos_ + i) % 3).fill_(0);
    pos_ += b;
    return lf::train::token_batch(ids, ids.clone(), {}, seg);
  }
  nlohmann::json state() const override { return pos_; }
  void restore(const nlohmann::json& s) override { pos_ = s.get<int64_t>(); }

 private:
  int64_t pos_ = 0;
};

}  // namespace

TEST(Balance, DefaultDrawAndTake) {
  CountingSource a, b;
  auto shapes = a.draw(6);
  ASSERT_EQ(shapes.size(), 6u);
  EXPECT_EQ(shapes[0].documents, (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(shapes[2].documents, (std::vector<int64_t>{3, 3}));
  EXPECT_TRUE(shapes[4].image_tokens.empty());
  EXPECT_EQ(a.state(), 6);  // the position moved past the whole draw, as next_rows does
  lf::train::Batch contiguous = a.take({2, 3});
  lf::train::Batch ref = b.next_rows(6, 2, 2);
  EXPECT_TRUE(at::equal(contiguous.at("input_ids"), ref.at("input_ids")));
  EXPECT_TRUE(at::equal(contiguous.at("segment_ids"), ref.at("segment_ids")));
  lf::train::Batch picked = a.take({5, 0, 1});
  EXPECT_TRUE(at::equal(picked.at("input_ids").select(1, 0), at::tensor(std::vector<int64_t>{5, 0, 1})));
  EXPECT_THROW(a.take({6}), lf::Error);
}

// Data-parallel load balancing of packed samples (data.balance: cost), torch-free: what a row costs to train, and a
// placement of a step's rows on (data-parallel rank, micro-batch) slots that evens out the ranks' summed cost.
//
// A row's cost, in units of one language-model token through the linear layers:
//   sum over its documents d:  len_d + token_pair * len_d^2            (attention within a packed document)
//   sum over its images i:     patch * P_i + patch_pair * P_i^2        (the vision tower over the image's patches)
// where P_i = image_tokens_i * patches_per_image_token, or fixed_image_patches when that is > 0 (every image the
// same grid). The factors are FLOPs ratios taken from the model (models::TrainWork), so the terms share one unit.
#pragma once
#include <cstdint>
#include <vector>

namespace lf::data {

// What a row holds, as far as its cost goes.
struct RowShape {
  std::vector<int64_t> documents;     // token count of each packed document (padding left out)
  std::vector<int64_t> image_tokens;  // language-model tokens of each image (its run of image tokens)
};

struct CostModel {
  double token_pair = 0;  // attention per (query, key) pair of one document / linear work per token
  double patch = 0;       // vision tower per patch / language-model linear work per token
  double patch_pair = 0;  // vision attention per pair of patches of one image / language-model linear work per token
  int64_t patches_per_image_token = 1, fixed_image_patches = 0;
};

double row_cost(const RowShape& row, const CostModel& model);

// Where a step's rows go: slots[rank][micro] lists the indices (into the step's rows) of that slot's rows, in
// increasing order; every slot holds the same number of rows.
using Placement = std::vector<std::vector<std::vector<int64_t>>>;

// Today's placement: micro-batch m is rows [m * ranks * rows_per_slot, (m + 1) * ranks * rows_per_slot) and rank r
// takes its r-th contiguous part. lf::Error unless ranks, micros, rows_per_slot >= 1.
Placement contiguous_placement(int64_t ranks, int64_t micros, int64_t rows_per_slot);

// A placement of costs.size() == ranks * micros * rows_per_slot rows with rows_per_slot rows in every slot whose
// largest per-rank cost is no larger than the contiguous placement's: longest processing time first over the ranks
// (each row to the cheapest rank with room left), then swaps between the dearest and the cheapest rank while they
// lower the maximum; each rank's rows go over its micro-batches the same way. Deterministic (ties go to the lower
// index), so every rank computes the same placement. lf::Error when the sizes disagree.
Placement balanced_placement(const std::vector<double>& costs, int64_t ranks, int64_t micros, int64_t rows_per_slot);

// Each rank's summed cost under a placement.
std::vector<double> rank_costs(const std::vector<double>& costs, const Placement& placement);
// max / mean of rank_costs (1 when every rank costs the same, or all cost 0).
double imbalance(const std::vector<double>& costs, const Placement& placement);

}  // namespace lf::data

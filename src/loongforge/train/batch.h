// What the trainer consumes: micro-batches of token ids with shifted targets, from a resumable source.
#pragma once
#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

namespace lf::train {

struct Batch {
  at::Tensor input_ids;     // int64 [B,T]
  at::Tensor targets;       // int64 [B,T]: the token each position predicts (already shifted); -100 = not counted
  at::Tensor position_ids;  // int64 [B,T] or undefined (0..T-1)
  at::Tensor segment_ids;   // int64 [B,T] or undefined: packed documents attend only within their segment
  int64_t counted() const;  // targets != -100
  Batch rows(int64_t first, int64_t n) const;  // rows [first, first + n) of every tensor
};

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual Batch next(int64_t micro_batch_size) = 0;
  // Rows [first, first + n) of the next global batch of `global_rows` rows: the rows next(global_rows) would give
  // there, while the position moves past all global_rows rows (state() is then the same as after next()), so
  // checkpoints and resume do not depend on how the rows are split over processes. lf::Error unless
  // 0 <= first, n >= 1 and first + n <= global_rows. The default draws the whole batch and slices it; sources
  // override it to read only their rows.
  virtual Batch next_rows(int64_t global_rows, int64_t first, int64_t n);
  // Position in the data, for exact resume.
  virtual nlohmann::json state() const = 0;
  virtual void restore(const nlohmann::json& state) = 0;
};

}  // namespace lf::train

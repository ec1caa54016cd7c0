// What the trainer consumes: micro-batches of named tensors from a resumable source.
#pragma once
#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loongforge/data/balance.h"
#include "loongforge/models/batch.h"

namespace lf::train {

// A batch of named tensors (models/batch.h); the token sources below fill input_ids, targets (already shifted, -100
// not counted) and, when they have them, position_ids and segment_ids (packed documents).
using Batch = models::Batch;
inline Batch token_batch(at::Tensor input_ids, at::Tensor targets, at::Tensor position_ids = {},
                         at::Tensor segment_ids = {}) {
  return Batch{{"input_ids", std::move(input_ids)}, {"targets", std::move(targets)},
               {"position_ids", std::move(position_ids)}, {"segment_ids", std::move(segment_ids)}};
}

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
  // Load balancing (data.balance): draws the next `global_rows` rows (the position moves past them all, as
  // next_rows) and keeps them until the next draw; returns what each row holds (data/balance.h). take(which) gives
  // the drawn rows `which` (indices into them) as one batch, in that order: the same tensors next_rows gives for
  // those rows. The default draws next(global_rows) and keeps the batch (documents: segment_ids runs, or the row;
  // no images); sources override both to convert only the rows taken.
  virtual std::vector<data::RowShape> draw(int64_t global_rows);
  virtual Batch take(const std::vector<int64_t>& which);
  // Position in the data, for exact resume.
  virtual nlohmann::json state() const = 0;
  virtual void restore(const nlohmann::json& state) = 0;
  // Bad samples the source left out (data.skip_bad_samples): how many of how many read, and the first one's error.
  // nullopt: the source does not skip (every bad sample is an error).
  struct Skipped {
    int64_t skipped = 0, read = 0;
    std::string first;
  };
  virtual std::optional<Skipped> skipped_samples() const { return std::nullopt; }
  // The file whose batches this source gives as they are (data.format: batch), for a model's errors on their
  // contents; "" when batches are made from data checked on reading.
  virtual std::string origin() const { return ""; }
  // The inputs that stand for "no condition" in this data (one row each, under the model's names: a text model's
  // encoding of the empty prompt), for condition dropout and guided sample grids; empty: the model's unconditional().
  virtual std::map<std::string, at::Tensor> null_conditions() const { return {}; }
  // Files a model folder trained on this data needs besides the weights (a robot policy's processor files with the
  // statistics its inputs were normalised with): written into DIR; returns DIR, whose files every checkpoint then
  // copies (as tokenizer files), or "" when the data has none.
  virtual std::string write_model_files(const std::string& dir) const { return ""; }

 private:
  Batch drawn_;  // the default draw's rows
};

// A source whose row k is a function of k alone (image folders, latent shards): next / next_rows make only the rows
// asked for, from rows(first, n); the state is the stream position.
class IndexedSource : public BatchSource {
 public:
  Batch next(int64_t micro_batch_size) override;
  Batch next_rows(int64_t global_rows, int64_t first, int64_t n) override;
  nlohmann::json state() const override { return {{"rows", rows_}}; }
  void restore(const nlohmann::json& state) override { rows_ = state.at("rows").get<int64_t>(); }

 protected:
  // The rows with stream indices [first, first + n).
  virtual Batch rows(int64_t first, int64_t n) const = 0;

 private:
  int64_t rows_ = 0;
};

}  // namespace lf::train

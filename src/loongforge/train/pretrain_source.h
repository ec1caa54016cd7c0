// Batches for pretraining from token shards (data/pretrain_dataset.h).
#pragma once
#include <memory>

#include "loongforge/data/pretrain_dataset.h"
#include "loongforge/train/batch.h"

namespace lf::train {

class PretrainSource : public BatchSource {
 public:
  // per_document: restart position ids and attention at document starts inside a sample. vocab > 0: a token id at or
  // past it (data tokenized for another model) is a one-line error naming the shard.
  PretrainSource(data::PretrainOptions opts, bool per_document, int64_t vocab = 0);
  Batch next(int64_t micro_batch_size) override;
  Batch next_rows(int64_t global_rows, int64_t first, int64_t n) override;  // reads only rows [first, first + n)
  nlohmann::json state() const override;
  void restore(const nlohmann::json& state) override;

 private:
  Batch build(const std::vector<data::Sample>& samples) const;
  data::PretrainDataset ds_;
  bool per_document_;
  int64_t vocab_;
};

// The rows of one safetensors batch (input_ids int64 [B,T], optional labels with -100, as `loongforge dump` takes),
// served in order and repeated: for overfitting checks and for parity with `dump --steps`.
class BatchFileSource : public BatchSource {
 public:
  explicit BatchFileSource(const std::string& path);
  Batch next(int64_t micro_batch_size) override;
  nlohmann::json state() const override { return {{"row", row_}}; }
  void restore(const nlohmann::json& state) override { row_ = state.at("row").get<int64_t>(); }
  std::string origin() const override { return path_; }
  // The file's negative_<name> tensors (one row each) under <name>.
  std::map<std::string, at::Tensor> null_conditions() const override { return null_; }

 private:
  std::string path_;
  Batch all_;  // input_ids, targets and the file's other tensors (item fields where it has <name>.row)
  std::map<std::string, at::Tensor> null_;
  int64_t rows_ = 0, row_ = 0;
};

}  // namespace lf::train

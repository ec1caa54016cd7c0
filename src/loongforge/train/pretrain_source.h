// Batches for pretraining from token shards (data/pretrain_dataset.h).
#pragma once
#include <memory>

#include "loongforge/data/pretrain_dataset.h"
#include "loongforge/train/batch.h"

namespace lf::train {

class PretrainSource : public BatchSource {
 public:
  // per_document: restart position ids and attention at document starts inside a sample.
  PretrainSource(data::PretrainOptions opts, bool per_document);
  Batch next(int64_t micro_batch_size) override;
  nlohmann::json state() const override;
  void restore(const nlohmann::json& state) override;

 private:
  data::PretrainDataset ds_;
  bool per_document_;
};

}  // namespace lf::train

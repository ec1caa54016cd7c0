// Batches of encoded latents for diffusion training (data.format: latents; io/latent_shards.h): `latents` and the
// conditions the shards hold (class_labels / encoder_hidden_states), row k of the stream being the shards' stream
// index k.
#pragma once
#include "loongforge/io/latent_shards.h"
#include "loongforge/train/batch.h"

namespace lf::train {

class LatentShardSource : public BatchSource {
 public:
  explicit LatentShardSource(io::LatentShardOptions o) : ds_(std::move(o)) {}
  Batch next(int64_t micro_batch_size) override;
  Batch next_rows(int64_t global_rows, int64_t first, int64_t n) override;  // reads only rows [first, first + n)
  nlohmann::json state() const override { return {{"rows", rows_}}; }
  void restore(const nlohmann::json& state) override { rows_ = state.at("rows").get<int64_t>(); }
  // The shard last read: a model's error on a batch's contents (another VAE's channel count) names it.
  std::string origin() const override { return ds_.last_file(); }
  std::map<std::string, at::Tensor> null_conditions() const override { return ds_.null_conditions(); }

 private:
  Batch rows(int64_t first, int64_t n) const;
  io::LatentShardDataset ds_;
  int64_t rows_ = 0;
};

}  // namespace lf::train

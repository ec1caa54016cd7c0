// Batches of encoded latents for diffusion training (data.format: latents; io/latent_shards.h): `latents` and the
// conditions the shards hold (class_labels / encoder_hidden_states), row k of the stream being the shards' stream
// index k.
#pragma once
#include "loongforge/io/latent_shards.h"
#include "loongforge/train/batch.h"

namespace lf::train {

class LatentShardSource : public IndexedSource {
 public:
  explicit LatentShardSource(io::LatentShardOptions o) : ds_(std::move(o)) {}
  // The shard last read: a model's error on a batch's contents (another VAE's channel count) names it.
  std::string origin() const override { return ds_.last_file(); }
  std::map<std::string, at::Tensor> null_conditions() const override { return ds_.null_conditions(); }

 protected:
  Batch rows(int64_t first, int64_t n) const override;  // reads only these rows

 private:
  io::LatentShardDataset ds_;
};

}  // namespace lf::train

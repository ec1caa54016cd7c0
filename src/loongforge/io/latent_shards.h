// Latent shards: what `loongforge data encode` makes from image / video folders with a VAE (and a text encoder for
// captions), so diffusion training reads latents instead of running the VAE every step.
//   DIR/encode.json      what made the shards (the VAE and its latent channels / factors, the text encoder, the
//                        input folder, resolution, frames, flips) and the finished shards in order; "complete" once
//                        every item is encoded. A rerun with the same arguments continues after the last finished
//                        shard; other arguments are an error naming the field.
//   DIR/shard_NNNNN.safetensors   rows of `latents` [n, C, h, w] or [n, C, f, h, w] (the VAE's posterior mean,
//                        normalized as the denoiser sees it: LatentCodec::normalize_latents), optionally
//                        `latents_flip` (the mirrored input's) and the conditions under the denoiser's argument
//                        names: `class_labels` [n] (class folders) or `encoder_hidden_states` [n, L, D] (captions;
//                        positions past the caption's tokens are zeros, as the Wan pipeline pads them).
//   DIR/null_conditions.safetensors   (captions) the conditions of the empty prompt, one row each: what condition
//                        dropout and guided sampling use for "no caption".
// Reading: the rows as an endless stream, epoch e in an order shuffled by (seed, e) (as data/image_folder.h), with
// random_flip each row's flip drawn from (seed, k) (the low bit of SplitMix64's next() from mix(seed ^
// 0x5f1f5f1f5f1f5f1f, k)), and with crop_pixels a window of crop_pixels / spatial_factor latent pixels per side,
// at row then column offsets next() mod (room + 1) from mix(seed ^ 0x3c3c3c3c3c3c3c3c, k) (as the image folders'
// random crops).
#pragma once
#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace lf::io {

inline constexpr const char* kLatentIndex = "encode.json";
inline constexpr const char* kNullConditions = "null_conditions.safetensors";
std::string latent_shard_name(int64_t i);  // "shard_00003.safetensors"

struct LatentShardOptions {
  std::vector<std::string> dirs;  // each made by `data encode`; their latents must have the same shape
  bool random_flip = false;       // needs shards encoded with flips (latents_flip)
  int64_t crop_pixels = 0;        // random square crops of this many pixels per side (0: the whole latents)
  uint64_t seed = 0;
  double valid_fraction = 0;      // the last rows of the sorted rows are held out
  bool valid = false;             // this split: the held-out rows
};

class LatentShardDataset {
 public:
  // Reads every encode.json (one-line lf::Error naming the file and field: incomplete, another format, shapes that
  // differ between folders, random_flip without latents_flip).
  explicit LatentShardDataset(LatentShardOptions o);
  int64_t size() const { return static_cast<int64_t>(rows_.size()); }
  // The row at stream index k: its tensors (latents and conditions, first dimension dropped).
  std::map<std::string, at::Tensor> get(int64_t k) const;
  // The latent channels every folder records, and the file of the shard last read (for errors on its contents).
  int64_t latent_channels() const { return channels_; }
  std::string last_file() const;
  const nlohmann::json& index(size_t dir) const { return indexes_[dir]; }
  // The first folder's null_conditions.safetensors (empty when it has none).
  const std::map<std::string, at::Tensor>& null_conditions() const { return null_; }

 private:
  struct Row {
    int32_t dir;
    int32_t shard;
    int64_t row;
  };
  std::shared_ptr<std::map<std::string, at::Tensor>> shard(int32_t dir, int32_t shard) const;
  LatentShardOptions o_;
  std::vector<nlohmann::json> indexes_;
  std::vector<std::vector<std::string>> files_;  // per folder, its shard paths
  std::vector<Row> rows_;
  int64_t channels_ = 0, crop_ = 0;  // crop_: the latent window's side (0: none)
  std::map<std::string, at::Tensor> null_;
  mutable std::mutex mutex_;
  mutable std::vector<int64_t> order_;
  mutable int64_t order_epoch_ = -1;
  mutable std::map<std::pair<int32_t, int32_t>, std::shared_ptr<std::map<std::string, at::Tensor>>> cache_;
  mutable std::vector<std::pair<int32_t, int32_t>> cache_order_;
  mutable std::string last_file_;
};

}  // namespace lf::io

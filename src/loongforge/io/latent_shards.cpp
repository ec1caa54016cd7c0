#include "loongforge/io/latent_shards.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/io/safetensors.h"

namespace lf::io {
namespace fs = std::filesystem;

namespace {
uint64_t mix(uint64_t seed, uint64_t k) { return seed * 6364136223846793005ULL + k * 1442695040888963407ULL + 1ULL; }
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
constexpr size_t kCachedShards = 8;
}  // namespace

std::string latent_shard_name(int64_t i) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "shard_%05lld.safetensors", static_cast<long long>(i));
  return buf;
}

LatentShardDataset::LatentShardDataset(LatentShardOptions o) : o_(std::move(o)) {
  if (o_.dirs.empty()) throw Error("latent shards: no folder given");
  std::vector<int64_t> shape;
  for (size_t d = 0; d < o_.dirs.size(); ++d) {
    const std::string idx = (fs::path(o_.dirs[d]) / kLatentIndex).string();
    if (!fs::exists(idx)) throw file_error(idx, "", "missing (make the folder with `loongforge data encode`)");
    nlohmann::json j = read_json_file(idx);
    JsonReader r(j, idx);
    if (r.string("format", "") != "loongforge-latents") r.fail("format", "expected \"loongforge-latents\"");
    if (!r.boolean("complete", false))
      r.fail("complete", "false: the encoding stopped early (rerun the same `loongforge data encode` to finish)");
    const int64_t ch = r.integer("latent_channels");
    if (d == 0) channels_ = ch;
    else if (ch != channels_)
      r.fail("latent_channels", std::to_string(ch) + ", the first folder's latents have " + std::to_string(channels_));
    if (o_.random_flip && !r.boolean("flip", false))
      r.fail("flip", "false: data.random_flip needs shards encoded with --flip (latents_flip)");
    std::vector<std::string> files;
    int32_t s = 0;
    for (const auto& name : j.at("shards")) {
      const std::string path = (fs::path(o_.dirs[d]) / name.get<std::string>()).string();
      auto f = SafetensorsFile::open(path);
      std::vector<int64_t> sh;
      for (const auto& e : f->entries())
        if (e.name == "latents") sh = e.shape;
      if (sh.empty()) throw file_error(path, "latents", "missing");
      if (sh.size() < 4 || sh[1] != channels_)
        throw file_error(path, "latents", "shape does not match encode.json (latent_channels " +
                                              std::to_string(channels_) + ")");
      std::vector<int64_t> row_shape(sh.begin() + 1, sh.end());
      if (shape.empty()) shape = row_shape;
      else if (row_shape != shape) throw file_error(path, "latents", "rows of another shape than the first shard's");
      for (int64_t k = 0; k < sh[0]; ++k) rows_.push_back({static_cast<int32_t>(d), s, k});
      files.push_back(path);
      ++s;
    }
    files_.push_back(std::move(files));
    indexes_.push_back(std::move(j));
  }
  const fs::path null = fs::path(o_.dirs[0]) / kNullConditions;
  if (fs::exists(null)) {
    auto f = SafetensorsFile::open(null.string());
    for (const auto& e : f->entries()) null_[e.name] = f->tensor(e.name).clone();
  }
  if (o_.valid_fraction > 0) {
    const auto n = static_cast<int64_t>(rows_.size());
    const int64_t held = std::clamp<int64_t>(static_cast<int64_t>(std::floor(static_cast<double>(n) * o_.valid_fraction)),
                                             1, n - 1);
    if (o_.valid) rows_.erase(rows_.begin(), rows_.begin() + (n - held));
    else rows_.resize(static_cast<size_t>(n - held));
  }
  if (rows_.empty()) throw Error(o_.dirs[0] + ": no latent rows");
  if (o_.crop_pixels > 0) {
    const std::string idx = (fs::path(o_.dirs[0]) / kLatentIndex).string();
    JsonReader r(indexes_[0], idx);
    const int64_t f = r.integer("spatial_factor"), res = r.integer("resolution");
    if (o_.crop_pixels % f != 0 || o_.crop_pixels > res)
      throw file_error(idx, "resolution", "crops of " + std::to_string(o_.crop_pixels) + " pixels need a multiple of " +
                                              std::to_string(f) + " up to the encoded " + std::to_string(res));
    crop_ = o_.crop_pixels / f;
  }
}

std::shared_ptr<std::map<std::string, at::Tensor>> LatentShardDataset::shard(int32_t dir, int32_t s) const {
  const auto key = std::make_pair(dir, s);
  auto it = cache_.find(key);
  last_file_ = files_[static_cast<size_t>(dir)][static_cast<size_t>(s)];
  if (it != cache_.end()) return it->second;
  auto f = SafetensorsFile::open(last_file_);
  auto m = std::make_shared<std::map<std::string, at::Tensor>>();
  for (const auto& e : f->entries()) (*m)[e.name] = f->tensor(e.name).clone();
  cache_[key] = m;
  cache_order_.push_back(key);
  if (cache_order_.size() > kCachedShards) {
    cache_.erase(cache_order_.front());
    cache_order_.erase(cache_order_.begin());
  }
  return m;
}

std::map<std::string, at::Tensor> LatentShardDataset::get(int64_t k) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t n = size(), epoch = k / n;
  if (epoch != order_epoch_) {
    order_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order_[static_cast<size_t>(i)] = i;
    uint64_t state = mix(o_.seed, static_cast<uint64_t>(epoch));
    for (int64_t i = n - 1; i > 0; --i)
      std::swap(order_[static_cast<size_t>(i)], order_[splitmix64(state) % static_cast<uint64_t>(i + 1)]);
    order_epoch_ = epoch;
  }
  const Row& row = rows_[static_cast<size_t>(order_[static_cast<size_t>(k % n)])];
  auto sh = shard(row.dir, row.shard);
  bool flip = false;
  if (o_.random_flip) {
    uint64_t state = mix(o_.seed ^ 0x5f1f5f1f5f1f5f1fULL, static_cast<uint64_t>(k));
    flip = (splitmix64(state) & 1) != 0;
  }
  std::map<std::string, at::Tensor> out;
  auto cropped = [&](at::Tensor z) {
    if (crop_ <= 0) return z;
    const int64_t h = z.size(-2), w = z.size(-1);
    uint64_t state = mix(o_.seed ^ 0x3c3c3c3c3c3c3c3cULL, static_cast<uint64_t>(k));
    const int64_t y = static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(h - crop_ + 1));
    const int64_t x = static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(w - crop_ + 1));
    return z.narrow(-2, y, crop_).narrow(-1, x, crop_).contiguous();
  };
  for (const auto& [name, t] : *sh) {
    if (name == "latents_flip") continue;
    if (name == "latents" && flip) {
      auto it = sh->find("latents_flip");
      if (it == sh->end()) throw file_error(last_file_, "latents_flip", "missing (data.random_flip)");
      out[name] = cropped(it->second[row.row]);
      continue;
    }
    out[name] = name == "latents" ? cropped(t[row.row]) : t[row.row];
  }
  return out;
}

std::string LatentShardDataset::last_file() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_file_;
}

}  // namespace lf::io

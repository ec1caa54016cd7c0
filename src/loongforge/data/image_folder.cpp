#include "loongforge/data/image_folder.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <mutex>

#include "loongforge/core/error.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/image/resize.h"

namespace lf::data {
namespace fs = std::filesystem;

namespace {
bool is_image(const fs::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e == ".png" || e == ".jpg" || e == ".jpeg";
}

uint64_t mix(uint64_t seed, uint64_t k) {
  return seed * 6364136223846793005ULL + k * 1442695040888963407ULL + 1ULL;
}

// SplitMix64: the next value of the state x (advanced)
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
}  // namespace

ImageFolderDataset::ImageFolderDataset(ImageFolderOptions o) : o_(std::move(o)) {
  if (o_.roots.empty()) throw Error("image folders: no folder given");
  if (o_.resolution <= 0) throw Error("image folders: the resolution must be positive");
  for (size_t r = 0; r < o_.roots.size(); ++r) {
    const fs::path root(o_.roots[r]);
    if (!fs::is_directory(root)) throw Error(root.string() + ": not a folder (expected ROOT/<class>/<image>)");
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory()) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    if (names.empty()) throw Error(root.string() + ": no class folders (expected ROOT/<class>/<image>)");
    if (r == 0) classes_ = names;
    else if (names != classes_)
      throw Error(root.string() + ": its class folders differ from those of " + o_.roots[0]);
    for (size_t c = 0; c < names.size(); ++c) {
      std::vector<std::string> imgs;
      for (const auto& e : fs::directory_iterator(root / names[c]))
        if (e.is_regular_file() && is_image(e.path())) imgs.push_back(e.path().string());
      std::sort(imgs.begin(), imgs.end());
      for (auto& f : imgs) {
        image::check_image_file(f);  // "FILE: what is wrong"
        files_.emplace_back(std::move(f), static_cast<int64_t>(c));
      }
    }
  }
  if (files_.empty()) throw Error(o_.roots[0] + ": no PNG or JPEG images in its class folders");
}

std::pair<at::Tensor, int64_t> ImageFolderDataset::get(int64_t k) const {
  const int64_t n = size(), epoch = k / n, pos = k % n;
  int64_t file;
  {
    std::lock_guard<std::mutex> lock(order_mutex_);
    if (epoch != order_epoch_) {  // the epoch's order: Fisher-Yates with a generator seeded by (seed, epoch)
      order_.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) order_[static_cast<size_t>(i)] = i;
      uint64_t state = mix(o_.seed, static_cast<uint64_t>(epoch));
      for (int64_t i = n - 1; i > 0; --i)
        std::swap(order_[static_cast<size_t>(i)], order_[splitmix64(state) % static_cast<uint64_t>(i + 1)]);
      order_epoch_ = epoch;
    }
    file = order_[static_cast<size_t>(pos)];
  }
  const auto& [path, label] = files_[static_cast<size_t>(file)];
  at::Tensor img;
  if (o_.random_crop) {  // the crop's offsets from the row's own stream: next() mod (room + 1), rows then columns
    uint64_t state = mix(o_.seed ^ 0x3c3c3c3c3c3c3c3cULL, static_cast<uint64_t>(k));
    img = random_crop_arr(image::read_image(path), o_.resolution, [&](int64_t room) {
      return static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(room + 1));
    });
  } else {
    img = center_crop_arr(image::read_image(path), o_.resolution);
  }
  if (o_.random_flip) {
    uint64_t state = mix(o_.seed ^ 0x5f1f5f1f5f1f5f1fULL, static_cast<uint64_t>(k));
    if (splitmix64(state) & 1) img = img.flip({1});
  }
  at::Tensor x = img.permute({2, 0, 1}).to(at::kFloat) / 255.0;
  return {((x - 0.5) / 0.5).contiguous(), label};
}

namespace {
// center_crop_arr's resize: BOX halvings while the short side is at least twice `size`, then BICUBIC to a short side
// of `size` (each side rounded half to even, as Python's round).
at::Tensor resize_short_side(const at::Tensor& image, int64_t size) {
  at::Tensor img = image;
  while (std::min(img.size(0), img.size(1)) >= 2 * size)
    img = image::resize_pil(img, img.size(0) / 2, img.size(1) / 2, image::Filter::box);
  const double scale = static_cast<double>(size) / static_cast<double>(std::min(img.size(0), img.size(1)));
  // Python's round (half to even) of each side times the scale
  const int64_t h = static_cast<int64_t>(std::nearbyint(static_cast<double>(img.size(0)) * scale));
  const int64_t w = static_cast<int64_t>(std::nearbyint(static_cast<double>(img.size(1)) * scale));
  return image::resize_pil(img, h, w, image::Filter::bicubic);
}
}  // namespace

at::Tensor center_crop_arr(const at::Tensor& image, int64_t size) {
  const at::Tensor img = resize_short_side(image, size);
  const int64_t y = (img.size(0) - size) / 2, x = (img.size(1) - size) / 2;
  return img.narrow(0, y, size).narrow(1, x, size).contiguous();
}

at::Tensor random_crop_arr(const at::Tensor& image, int64_t size, const std::function<int64_t(int64_t)>& offset) {
  const at::Tensor img = resize_short_side(image, size);
  const int64_t y = offset(img.size(0) - size);
  const int64_t x = offset(img.size(1) - size);
  return img.narrow(0, y, size).narrow(1, x, size).contiguous();
}

}  // namespace lf::data

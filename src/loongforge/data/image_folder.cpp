#include "loongforge/data/image_folder.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <mutex>

#include "loongforge/core/error.h"
#include "loongforge/data/captions.h"
#include "loongforge/data/shuffle.h"
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

std::vector<std::string> images_in(const fs::path& dir) {
  std::vector<std::string> imgs;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && is_image(e.path())) imgs.push_back(e.path().string());
  std::sort(imgs.begin(), imgs.end());
  return imgs;
}
}  // namespace

ImageFolderDataset::ImageFolderDataset(ImageFolderOptions o) : o_(std::move(o)) {
  if (o_.roots.empty()) throw Error("image folders: no folder given");
  if (o_.resolution <= 0) throw Error("image folders: the resolution must be positive");
  const bool captioned = fs::is_directory(o_.roots[0]) && data::has_captions(o_.roots[0]);
  for (size_t r = 0; r < o_.roots.size(); ++r) {
    const fs::path root(o_.roots[r]);
    if (!fs::is_directory(root)) throw Error(root.string() + ": not a folder (expected ROOT/<class>/<image>)");
    if (data::has_captions(root.string()) != captioned)
      throw Error(root.string() + (captioned ? ": no " : ": has a ") + kCaptionFile + ", " + o_.roots[0] +
                  (captioned ? " has one" : " has none") + " (every folder or none has captions)");
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory()) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    // (path, class, path relative to the root) of this root
    std::vector<std::pair<std::string, int64_t>> found;
    std::vector<std::string> relative;
    if (names.empty() && captioned) {  // a flat folder of captioned images: no classes
      for (auto& f : images_in(root)) {
        relative.push_back(fs::path(f).filename().string());
        found.emplace_back(std::move(f), 0);
      }
    } else {
      if (names.empty()) throw Error(root.string() + ": no class folders (expected ROOT/<class>/<image>)");
      if (r == 0) classes_ = names;
      else if (names != classes_)
        throw Error(root.string() + ": its class folders differ from those of " + o_.roots[0]);
      for (size_t c = 0; c < names.size(); ++c)
        for (auto& f : images_in(root / names[c])) {
          relative.push_back(names[c] + "/" + fs::path(f).filename().string());
          found.emplace_back(std::move(f), static_cast<int64_t>(c));
        }
    }
    if (r > 0 && classes_.empty() != names.empty())
      throw Error(root.string() + ": has " + (names.empty() ? "no class folders" : "class folders") + ", " +
                  o_.roots[0] + (names.empty() ? " has" : " has none"));
    for (const auto& f : found) image::check_image_file(f.first);  // "FILE: what is wrong"
    if (captioned) {
      const auto caps = folder_captions(root.string(), relative);  // "...metadata.jsonl: no caption for FILE"
      for (const auto& rel : relative) captions_.push_back(caps.at(normalize_caption_path(rel)));
    }
    files_.insert(files_.end(), found.begin(), found.end());
  }
  if (files_.empty())
    throw Error(o_.roots[0] + (captioned ? ": no PNG or JPEG images" : ": no PNG or JPEG images in its class folders"));
}

int64_t ImageFolderDataset::file_at(int64_t k) const {
  const int64_t n = size(), epoch = k / n, pos = k % n;
  std::lock_guard<std::mutex> lock(order_mutex_);
  if (epoch != order_epoch_) {  // the epoch's order: Fisher-Yates with a generator seeded by (seed, epoch)
    order_ = epoch_order(n, o_.seed, epoch);
    order_epoch_ = epoch;
  }
  return order_[static_cast<size_t>(pos)];
}

const std::string& ImageFolderDataset::caption(int64_t k) const {
  static const std::string none;
  return captions_.empty() ? none : captions_[static_cast<size_t>(file_at(k))];
}

std::pair<at::Tensor, int64_t> ImageFolderDataset::get(int64_t k) const {
  const int64_t file = file_at(k);
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
// center_crop_arr's resize generalised to a HEIGHT x WIDTH target: BOX halvings while the image is at least twice the
// target both ways, then BICUBIC to the smallest size covering the target (each side rounded half to even, as Python's
// round). For a square target: DiT's center_crop_arr (short side = the resolution).
at::Tensor resize_cover(const at::Tensor& image, int64_t height, int64_t width) {
  at::Tensor img = image;
  while (img.size(0) >= 2 * height && img.size(1) >= 2 * width)
    img = image::resize_pil(img, img.size(0) / 2, img.size(1) / 2, image::Filter::box);
  const double scale = std::max(static_cast<double>(height) / static_cast<double>(img.size(0)),
                                static_cast<double>(width) / static_cast<double>(img.size(1)));
  const int64_t h = static_cast<int64_t>(std::nearbyint(static_cast<double>(img.size(0)) * scale));
  const int64_t w = static_cast<int64_t>(std::nearbyint(static_cast<double>(img.size(1)) * scale));
  return image::resize_pil(img, std::max(h, height), std::max(w, width), image::Filter::bicubic);
}
}  // namespace

at::Tensor center_crop_to(const at::Tensor& image, int64_t height, int64_t width) {
  const at::Tensor img = resize_cover(image, height, width);
  const int64_t y = (img.size(0) - height) / 2, x = (img.size(1) - width) / 2;
  return img.narrow(0, y, height).narrow(1, x, width).contiguous();
}

at::Tensor center_crop_arr(const at::Tensor& image, int64_t size) { return center_crop_to(image, size, size); }

at::Tensor random_crop_arr(const at::Tensor& image, int64_t size, const std::function<int64_t(int64_t)>& offset) {
  const at::Tensor img = resize_cover(image, size, size);
  const int64_t y = offset(img.size(0) - size);
  const int64_t x = offset(img.size(1) - size);
  return img.narrow(0, y, size).narrow(1, x, size).contiguous();
}

}  // namespace lf::data

// Image folders for class-conditional diffusion training, ImageNet-style: ROOT/<class>/<image> (PNG / JPEG), the
// classes numbered in sorted order of their folder names (torchvision's ImageFolder). Each image is made square as
// DiT's (ADM's) center_crop_arr does — halved with Pillow's BOX filter while its short side is at least twice the
// resolution, resized with BICUBIC so the short side is the resolution, cropped in the centre — optionally flipped
// left-right, and scaled to [-1, 1] (ToTensor + Normalize(0.5, 0.5)).
// The images are served as an endless stream: epoch e visits every image once in an order shuffled by (seed, e);
// stream index k is the (k mod N)-th image of epoch k / N, and its flip is drawn from (seed, k), so any split of the
// stream over processes gives the same samples. (Both with SplitMix64 from mix(a, b) = a * 6364136223846793005 +
// b * 1442695040888963407 + 1 mod 2^64: the shuffle is Fisher-Yates from the last position down, swapping i with
// next() mod (i + 1), state mix(seed, e); the flip is next() & 1, state mix(seed ^ 0x5f1f5f1f5f1f5f1f, k); a random
// crop's row then column offsets are next() mod (room + 1), state mix(seed ^ 0x3c3c3c3c3c3c3c3c, k); data/shuffle.h.)
// Captions (text-to-image data): a root with a metadata.jsonl (data/captions.h: {"file_name": "cat/0.png", "text":
// ...}) gives every image a caption, and then its images may also lie in the root itself, without class folders
// (no classes, every label 0). Either every root has a metadata.jsonl or none has.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace lf::data {

struct ImageFolderOptions {
  std::vector<std::string> roots;  // every root has the same class folders
  int64_t resolution = 256;
  bool random_flip = false;
  bool random_crop = false;  // the square at a random place of the resized image instead of its centre
  uint64_t seed = 0;
};

class ImageFolderDataset {
 public:
  // Lists every root and checks that each image decodes (one-line lf::Error naming the file otherwise).
  explicit ImageFolderDataset(ImageFolderOptions o);
  int64_t size() const { return static_cast<int64_t>(files_.size()); }
  const std::vector<std::string>& classes() const { return classes_; }
  // The image at stream index k: float32 [3, R, R] in [-1, 1], and its class.
  std::pair<at::Tensor, int64_t> get(int64_t k) const;
  // Whether the roots have captions (metadata.jsonl), and the caption of the image at stream index k ("" without).
  bool has_captions() const { return !captions_.empty(); }
  const std::string& caption(int64_t k) const;
  // The images in listing order (path, class), and their captions (empty without metadata.jsonl).
  const std::vector<std::pair<std::string, int64_t>>& files() const { return files_; }
  const std::vector<std::string>& captions() const { return captions_; }

 private:
  int64_t file_at(int64_t k) const;  // the file shown at stream index k
  ImageFolderOptions o_;
  std::vector<std::string> classes_;
  std::vector<std::pair<std::string, int64_t>> files_;  // (path, class), sorted
  std::vector<std::string> captions_;                   // per file, when the roots have metadata.jsonl
  // the order of the epoch last asked for (rebuilt when another epoch is)
  mutable std::mutex order_mutex_;
  mutable std::vector<int64_t> order_;
  mutable int64_t order_epoch_ = -1;
};

// ADM's center_crop_arr on a uint8 [H, W, 3] image: uint8 [size, size, 3].
at::Tensor center_crop_arr(const at::Tensor& image, int64_t size);
// The same for a HEIGHT x WIDTH target: BOX halvings while the image is at least twice the target both ways, BICUBIC
// to the smallest size covering the target (each side round(side * scale), scale = max(HEIGHT / h, WIDTH / w)), the
// centre cut out. center_crop_to(img, s, s) = center_crop_arr(img, s).
at::Tensor center_crop_to(const at::Tensor& image, int64_t height, int64_t width);
// The same resize, then the square at offset(room) rows and offset(room) columns (room: the rows / columns to spare).
at::Tensor random_crop_arr(const at::Tensor& image, int64_t size, const std::function<int64_t(int64_t)>& offset);

}  // namespace lf::data

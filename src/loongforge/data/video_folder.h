// Video folders for text-to-video diffusion training: ROOT holds videos (.mp4 .mov .m4v .mkv .webm .avi) and
// optionally images (.png .jpg .jpeg, 1-frame clips), in subfolders too (hidden files, ".*", are skipped: the
// temporary files of encode_video among them), and ROOT/metadata.jsonl gives every one of
// them a caption (data/captions.h). Each clip is decoded (data/video.h), num_frames frames every `stride` frames
// from its first frame (or from a start drawn per stream index), each frame resized and cut to height x width as the
// image folder does (center_crop_to: BOX halvings, Pillow BICUBIC to cover, centre crop), optionally flipped
// left-right, scaled to [-1, 1]: float32 [3, F, H, W] (F = 1 for images).
// The items are served as an endless stream as ImageFolderDataset's (data/shuffle.h): epoch e visits every item once
// in the order epoch_order(N, seed, e); stream index k is the (k mod N)-th item of epoch k / N; its flip is the low bit
// of next() from state mix(seed ^ 0x5f1f5f1f5f1f5f1f, k), its random start next() mod (room + 1) from
// mix(seed ^ 0x7a7a7a7a7a7a7a7a, k) (room: the clip's frames beyond the num_frames x stride window).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace lf::data {

struct VideoFolderOptions {
  std::vector<std::string> roots;
  int64_t num_frames = 16;  // frames per clip (>= 1)
  int64_t stride = 1;       // take every stride-th frame
  int64_t height = 256, width = 256;
  bool random_start = false;  // the window at a start drawn per stream index, else at the clip's first frame
  bool random_flip = false;
  bool images = true;  // also take the folders' images, as 1-frame clips
  uint64_t seed = 0;
};

struct VideoItem {
  std::string path;
  std::string caption;
  int64_t num_frames = 1;  // the clip's frame count (1 for an image)
  bool image = false;
};

struct VideoSample {
  at::Tensor pixels;  // float32 [3, F, H, W] in [-1, 1]
  std::string caption;
  int64_t item = 0;  // index into items()
};

class VideoFolderDataset {
 public:
  // Lists the roots (sorted paths), reads the captions, probes every video (a clip shorter than the window
  // (num_frames - 1) x stride + 1 is an error naming it) and checks every image decodes. One-line lf::Errors.
  explicit VideoFolderDataset(VideoFolderOptions o);
  int64_t size() const { return static_cast<int64_t>(items_.size()); }
  const std::vector<VideoItem>& items() const { return items_; }
  const VideoFolderOptions& options() const { return o_; }

  // Item I's window starting at frame START, not flipped: float32 [3, F, H, W] in [-1, 1].
  at::Tensor clip(int64_t i, int64_t start = 0) const;
  // The sample at stream index k (shuffled, random start and flip as the options say).
  VideoSample get(int64_t k) const;

 private:
  VideoFolderOptions o_;
  std::vector<VideoItem> items_;
  mutable std::mutex order_mutex_;
  mutable std::vector<int64_t> order_;
  mutable int64_t order_epoch_ = -1;
};

// Pixels of uint8 frames [F, H, W, 3] as the folders give them: each frame center_crop_to(height, width), then float32
// [3, F, height, width] in [-1, 1].
at::Tensor frames_to_pixels(const at::Tensor& frames, int64_t height, int64_t width);

}  // namespace lf::data

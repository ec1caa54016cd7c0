#include "loongforge/data/video_folder.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/data/captions.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/image_folder.h"
#include "loongforge/data/shuffle.h"
#include "loongforge/data/video.h"

namespace lf::data {
namespace fs = std::filesystem;

namespace {

std::string lower_ext(const fs::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e;
}

bool is_video_file(const fs::path& p) {
  const std::string e = lower_ext(p);
  return e == ".mp4" || e == ".mov" || e == ".m4v" || e == ".mkv" || e == ".webm" || e == ".avi";
}

bool is_image_file(const fs::path& p) {
  const std::string e = lower_ext(p);
  return e == ".png" || e == ".jpg" || e == ".jpeg";
}

}  // namespace

at::Tensor frames_to_pixels(const at::Tensor& frames, int64_t height, int64_t width) {
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(frames.size(0)));
  for (int64_t f = 0; f < frames.size(0); ++f) out.push_back(center_crop_to(frames[f], height, width));
  at::Tensor x = at::stack(out).permute({3, 0, 1, 2}).to(at::kFloat) / 255.0;  // [3, F, H, W]
  return ((x - 0.5) / 0.5).contiguous();
}

VideoFolderDataset::VideoFolderDataset(VideoFolderOptions o) : o_(std::move(o)) {
  if (o_.roots.empty()) throw Error("video folders: no folder given");
  if (o_.num_frames < 1) throw OptionError("num_frames", std::to_string(o_.num_frames) + " must be at least 1");
  if (o_.stride < 1) throw OptionError("stride", std::to_string(o_.stride) + " must be at least 1");
  if (o_.height < 1 || o_.width < 1)
    throw OptionError("resolution", std::to_string(o_.height) + "x" + std::to_string(o_.width) + " must be positive");
  const int64_t window = (o_.num_frames - 1) * o_.stride + 1;
  for (const auto& root_s : o_.roots) {
    const fs::path root(root_s);
    if (!fs::is_directory(root)) throw Error(root_s + ": not a folder (expected videos and a metadata.jsonl)");
    if (!has_captions(root_s))
      throw Error(root_s + ": no " + std::string(kCaptionFile) +
                  " (one line per video: {\"file_name\": \"a.mp4\", \"text\": \"...\"})");
    std::vector<std::string> media;  // relative to the root, sorted
    for (const auto& e : fs::recursive_directory_iterator(root, fs::directory_options::follow_directory_symlink)) {
      if (!e.is_regular_file() || e.path().filename().string().front() == '.') continue;  // hidden: skipped
      if (is_video_file(e.path()) || (o_.images && is_image_file(e.path())))
        media.push_back(fs::relative(e.path(), root).generic_string());
    }
    std::sort(media.begin(), media.end());
    const auto captions = folder_captions(root_s, media);
    for (const auto& rel : media) {
      VideoItem it;
      it.path = (root / rel).string();
      it.caption = captions.at(normalize_caption_path(rel));
      if (is_image_file(rel)) {
        image::check_image_file(it.path);  // "FILE: what is wrong"
        it.image = true;
        it.num_frames = 1;
      } else {
        it.num_frames = probe_video(it.path).num_frames;  // "FILE: what is wrong"
        if (it.num_frames < window)
          throw Error(it.path + ": has " + std::to_string(it.num_frames) + " frames, fewer than the " +
                      std::to_string(window) + " that num_frames " + std::to_string(o_.num_frames) + " x stride " +
                      std::to_string(o_.stride) + " need");
      }
      items_.push_back(std::move(it));
    }
  }
  if (items_.empty()) throw Error(o_.roots[0] + ": no videos" + (o_.images ? " or images" : ""));
}

at::Tensor VideoFolderDataset::clip(int64_t i, int64_t start) const {
  const VideoItem& it = items_.at(static_cast<size_t>(i));
  at::Tensor frames;
  if (it.image) {
    frames = image::read_image(it.path).unsqueeze(0);
  } else {
    DecodeOptions d;
    d.num_frames = o_.num_frames;
    d.stride = o_.stride;
    d.start = start;
    frames = decode_video(it.path, d).frames;
  }
  return frames_to_pixels(frames, o_.height, o_.width);
}

VideoSample VideoFolderDataset::get(int64_t k) const {
  const int64_t n = size(), epoch = k / n, pos = k % n;
  int64_t item;
  {
    std::lock_guard<std::mutex> lock(order_mutex_);
    if (epoch != order_epoch_) {
      order_ = epoch_order(n, o_.seed, epoch);
      order_epoch_ = epoch;
    }
    item = order_[static_cast<size_t>(pos)];
  }
  const VideoItem& it = items_[static_cast<size_t>(item)];
  int64_t start = 0;
  if (o_.random_start && !it.image) {
    const int64_t room = it.num_frames - ((o_.num_frames - 1) * o_.stride + 1);
    uint64_t state = mix(o_.seed ^ 0x7a7a7a7a7a7a7a7aULL, static_cast<uint64_t>(k));
    start = static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(room + 1));
  }
  at::Tensor x = clip(item, start);
  if (o_.random_flip) {
    uint64_t state = mix(o_.seed ^ 0x5f1f5f1f5f1f5f1fULL, static_cast<uint64_t>(k));
    if (splitmix64(state) & 1) x = x.flip({3}).contiguous();
  }
  return {x, it.caption, item};
}

}  // namespace lf::data

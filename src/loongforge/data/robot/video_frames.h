// Camera frames of robot datasets by timestamp, from mp4 files that many episodes share (LeRobot v3.0 concatenates
// episodes into one video file; v2.1 has one file per episode).
//
// LeRobot's rule (its pyav decoder): for each query time, the decoded frame whose presentation time is nearest;
// an error when that frame is tolerance_s or more away. Here the nearest frame is looked up in the file's timeline
// (VideoTimeline: every frame's time, read once per file by demuxing, no decoding) and only its GOP (the keyframe
// before it and the frames up to the next keyframe) is decoded. Decoded GOPs are kept in a cache keyed by
// (video file, GOP) with a byte budget and least-recently-used eviction, so sequential reads of consecutive frames
// and episodes decode each GOP once.
//
// Threads: every method may be called concurrently. Two callers wanting the same GOP share one decode (the second
// waits for the first); different GOPs decode in parallel, each caller with its own decoder (a small pool per file).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "loongforge/data/video.h"

namespace lf::data::robot {

class VideoFrameCache {
 public:
  // MAX_BYTES: the decoded frames kept (at least the GOPs in use are kept whatever the budget).
  explicit VideoFrameCache(int64_t max_bytes = int64_t{256} << 20);
  ~VideoFrameCache();
  VideoFrameCache(const VideoFrameCache&) = delete;
  VideoFrameCache& operator=(const VideoFrameCache&) = delete;

  // The frames of video PATH nearest to TIMES (seconds): uint8 [n, H, W, 3] (PIXELS gray12: int16 [n, H, W, 1],
  // a depth video's codes). When the nearest frame of a time is TOLERANCE_S or more away: one-line lf::Error
  // "PATH: WHERE: timestamp T s: ...", WHERE naming the episode and camera for the user.
  at::Tensor frames_at(const std::string& path, const std::vector<double>& times, double tolerance_s,
                       const std::string& where, FramePixels pixels = FramePixels::rgb24);

  // The file's timeline (read once, then shared).
  std::shared_ptr<const VideoTimeline> timeline(const std::string& path);

  struct Counters {
    int64_t gop_decodes = 0;  // GOPs decoded
    int64_t gop_hits = 0;     // GOP requests served from the cache (or from another caller's decode)
    int64_t frames_decoded = 0;  // frames out of the decoders (each GOP's own when seeks land on its keyframe)
    int64_t evictions = 0;
    int64_t bytes = 0;        // decoded frames held now
  };
  Counters counters() const;

 private:
  struct File;
  struct Gop;
  at::Tensor frames_at_impl(const std::string& path, const std::vector<double>& times, double tolerance_s,
                            const std::string& where, FramePixels pixels);
  at::Tensor gop(const std::shared_ptr<File>& f, int64_t g, FramePixels pixels);
  void evict_locked();

  const int64_t max_bytes_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<File>> files_;
  using Key = std::tuple<std::string, int, int64_t>;  // (path, FramePixels, GOP)
  std::list<Key> lru_;  // most recent first
  std::map<Key, std::shared_ptr<Gop>> gops_;
  Counters counters_;
};

}  // namespace lf::data::robot

// VideoFrameCache (video_frames.h): frames by timestamp through a shared, bounded cache of decoded GOPs.
#include "loongforge/data/robot/video_frames.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <sstream>

#include "loongforge/core/error.h"

namespace lf::data::robot {

struct VideoFrameCache::File {
  std::shared_future<std::shared_ptr<const VideoTimeline>> timeline;
  std::mutex mu;  // guards idle
  std::vector<std::unique_ptr<GopDecoder>> idle[2];  // decoders no caller uses now, per FramePixels
};

struct VideoFrameCache::Gop {
  std::shared_future<at::Tensor> frames;
  std::list<Key>::iterator lru;
  int64_t bytes = 0;
  bool ready = false;
};

VideoFrameCache::VideoFrameCache(int64_t max_bytes) : max_bytes_(max_bytes) {}
VideoFrameCache::~VideoFrameCache() = default;

VideoFrameCache::Counters VideoFrameCache::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

std::shared_ptr<const VideoTimeline> VideoFrameCache::timeline(const std::string& path) {
  std::shared_ptr<File> f;
  std::unique_ptr<std::promise<std::shared_ptr<const VideoTimeline>>> promise;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(path);
    if (it != files_.end()) {
      f = it->second;
    } else {
      f = std::make_shared<File>();
      promise = std::make_unique<std::promise<std::shared_ptr<const VideoTimeline>>>();
      f->timeline = promise->get_future().share();
      files_[path] = f;
    }
  }
  if (promise) {  // this caller reads it
    try {
      promise->set_value(std::make_shared<const VideoTimeline>(read_video_timeline(path)));
    } catch (...) {
      promise->set_exception(std::current_exception());
      std::lock_guard<std::mutex> lock(mu_);
      auto it = files_.find(path);
      if (it != files_.end() && it->second == f) files_.erase(it);  // a later call tries again
    }
  }
  return f->timeline.get();
}

at::Tensor VideoFrameCache::gop(const std::shared_ptr<File>& f, int64_t g, FramePixels pixels) {
  const std::shared_ptr<const VideoTimeline> tl = f->timeline.get();
  const int mode = static_cast<int>(pixels);
  const Key key{tl->path, mode, g};
  std::promise<at::Tensor> promise;
  std::shared_ptr<Gop> entry;
  std::shared_future<at::Tensor> other;  // another caller's decode of this GOP (done or running)
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = gops_.find(key);
    if (it != gops_.end()) {
      ++counters_.gop_hits;
      lru_.splice(lru_.begin(), lru_, it->second->lru);
      other = it->second->frames;
    } else {
      entry = std::make_shared<Gop>();
      entry->frames = promise.get_future().share();
      lru_.push_front(key);
      entry->lru = lru_.begin();
      gops_[key] = entry;
      ++counters_.gop_decodes;
    }
  }
  if (other.valid()) return other.get();
  try {
    std::unique_ptr<GopDecoder> dec;
    {
      std::lock_guard<std::mutex> lock(f->mu);
      if (!f->idle[mode].empty()) {
        dec = std::move(f->idle[mode].back());
        f->idle[mode].pop_back();
      }
    }
    if (!dec) dec = std::make_unique<GopDecoder>(tl, pixels);
    const int64_t before = dec->frames_decoded();
    at::Tensor frames;
    try {
      frames = dec->decode(g);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      counters_.frames_decoded += dec->frames_decoded() - before;
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      counters_.frames_decoded += dec->frames_decoded() - before;
    }
    {
      std::lock_guard<std::mutex> lock(f->mu);
      f->idle[mode].push_back(std::move(dec));
    }
    promise.set_value(frames);
    std::lock_guard<std::mutex> lock(mu_);
    entry->bytes = static_cast<int64_t>(frames.nbytes());
    entry->ready = true;
    counters_.bytes += entry->bytes;
    evict_locked();
    return frames;
  } catch (...) {
    promise.set_exception(std::current_exception());
    std::lock_guard<std::mutex> lock(mu_);
    auto it = gops_.find(key);
    if (it != gops_.end() && it->second == entry) {
      lru_.erase(entry->lru);
      gops_.erase(it);
    }
    throw;
  }
}

void VideoFrameCache::evict_locked() {
  auto it = lru_.end();
  while (counters_.bytes > max_bytes_ && it != lru_.begin()) {
    --it;
    auto g = gops_.find(*it);
    if (g == gops_.end() || !g->second->ready) continue;
    counters_.bytes -= g->second->bytes;
    ++counters_.evictions;
    gops_.erase(g);
    it = lru_.erase(it);
  }
}

namespace {

std::string seconds(double t) {
  std::ostringstream s;
  s.precision(9);
  s << t;
  return s.str();
}

}  // namespace

at::Tensor VideoFrameCache::frames_at(const std::string& path, const std::vector<double>& times, double tolerance_s,
                                      const std::string& where, FramePixels pixels) {
  try {
    return frames_at_impl(path, times, tolerance_s, where, pixels);
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.find(where) != std::string::npos) throw;
    throw Error(what + " (" + where + ")");
  }
}

at::Tensor VideoFrameCache::frames_at_impl(const std::string& path, const std::vector<double>& times,
                                           double tolerance_s, const std::string& where, FramePixels pixels) {
  const std::shared_ptr<const VideoTimeline> tl = timeline(path);
  std::shared_ptr<File> f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    f = files_.at(path);
  }
  const auto& ts = tl->times;
  const int64_t n = static_cast<int64_t>(times.size());
  std::vector<int64_t> frame(n);
  for (int64_t k = 0; k < n; ++k) {
    const double t = times[k];
    int64_t i = std::lower_bound(ts.begin(), ts.end(), t) - ts.begin();
    // the nearest of the frames either side (the earlier one on a tie)
    if (i == static_cast<int64_t>(ts.size()) || (i > 0 && std::abs(ts[i - 1] - t) <= std::abs(ts[i] - t))) --i;
    const double diff = std::abs(ts[i] - t);
    if (!(diff < tolerance_s))
      throw Error(path + ": " + where + ": timestamp " + seconds(t) + " s: the nearest frame is at " + seconds(ts[i]) +
                  " s, " + seconds(diff) + " s away (tolerance " + seconds(tolerance_s) + " s; the video's frames span " +
                  seconds(ts.front()) + " .. " + seconds(ts.back()) + " s)");
    frame[k] = i;
  }
  const bool gray = pixels == FramePixels::gray12;
  at::Tensor out = gray ? at::empty({n, tl->height, tl->width, 1}, at::kShort)
                        : at::empty({n, tl->height, tl->width, 3}, at::kByte);
  const int64_t frame_bytes = tl->height * tl->width * (gray ? 2 : 3);
  std::map<int64_t, at::Tensor> decoded;  // GOP -> its frames, each GOP fetched once per call
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t k = 0; k < n; ++k) {
    const int64_t g = tl->gop_of(frame[k]);
    auto it = decoded.find(g);
    if (it == decoded.end()) it = decoded.emplace(g, gop(f, g, pixels)).first;
    std::memcpy(dst + k * frame_bytes,
                static_cast<const uint8_t*>(it->second.data_ptr()) + (frame[k] - tl->gop_starts[g]) * frame_bytes,
                frame_bytes);
  }
  return out;
}

}  // namespace lf::data::robot

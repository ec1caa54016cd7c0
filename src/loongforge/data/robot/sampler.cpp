// Windows, episode splits and the frame sampler (sampler.h).
#include "loongforge/data/robot/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <set>

#include "loongforge/core/error.h"
#include "loongforge/data/shuffle.h"

namespace lf::data::robot {

namespace {

// The shortest of %.15g / %.17g that reads back as V (0.05, not 0.050000000000000003).
std::string show(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (auto x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

}  // namespace

std::vector<Window> delta_windows(const DeltaTimestamps& deltas, double fps, double tolerance_s,
                                  const std::string& where) {
  if (!(fps > 0)) throw file_error(where, "fps", "must be positive to use delta_timestamps, got " + show(fps));
  std::vector<Window> out;
  std::set<std::string> seen;
  for (const auto& [feature, ds] : deltas) {
    const std::string field = "delta_timestamps." + feature;
    if (!seen.insert(feature).second) throw file_error(where, field, "given twice");
    if (ds.empty()) throw file_error(where, field, "no offsets");
    Window w{feature, {}};
    for (double d : ds) {
      if (!std::isfinite(d)) throw file_error(where, field, "offset " + show(d) + " s is not a finite number");
      // std::nearbyint rounds ties to even under the default rounding mode, as Python's round().
      const double frames = std::nearbyint(d * fps);
      if (!(std::abs(d * fps - frames) / fps <= tolerance_s))
        throw file_error(where, field,
                         "offset " + show(d) + " s is not a multiple of 1/" + show(fps) + " s within tolerance_s " +
                             show(tolerance_s));
      w.offsets.push_back(static_cast<int64_t>(frames));
    }
    out.push_back(std::move(w));
  }
  return out;
}

void window_query(const std::vector<int64_t>& offsets, int64_t length, int64_t frame, int64_t* frames,
                  bool* is_pad) {
  for (size_t i = 0; i < offsets.size(); ++i) {
    const int64_t q = frame + offsets[i];
    is_pad[i] = q < 0 || q >= length;
    frames[i] = std::clamp<int64_t>(q, 0, length - 1);
  }
}

EpisodeSplit split_episodes(const RobotDataset& dataset, const EpisodeSelection& sel) {
  const std::string& where = dataset.root();
  std::vector<int64_t> subset;
  if (sel.episodes.empty()) {
    for (size_t i = 0; i < dataset.episodes().size(); ++i) subset.push_back(static_cast<int64_t>(i));
  } else {
    std::set<int64_t> seen;
    for (int64_t e : sel.episodes) {
      if (!seen.insert(e).second) throw file_error(where, "episodes", "episode " + std::to_string(e) + " given twice");
      subset.push_back(dataset.episode_position(e));
    }
    std::sort(subset.begin(), subset.end());
  }
  if (subset.empty()) throw file_error(where, "episodes", "the dataset has no episodes");
  if (sel.val_count < 0) throw file_error(where, "val_episodes", "a negative count");
  if (sel.val_count > 0 && !sel.val_episodes.empty())
    throw file_error(where, "val_episodes", "give a count or a list of episodes, not both");

  std::vector<bool> held(subset.size(), false);
  const auto n = static_cast<int64_t>(subset.size());
  if (sel.val_count > 0) {
    if (sel.val_count >= n)
      throw file_error(where, "val_episodes",
                       "holding out " + std::to_string(sel.val_count) + " of " + std::to_string(n) +
                           " episodes leaves none to train on");
    for (int64_t i = 0; i < sel.val_count; ++i)
      held[static_cast<size_t>((2 * i + 1) * n / (2 * sel.val_count))] = true;
  }
  std::set<int64_t> seen;
  for (int64_t e : sel.val_episodes) {
    if (!seen.insert(e).second) throw file_error(where, "val_episodes", "episode " + std::to_string(e) + " given twice");
    const int64_t pos = dataset.episode_position(e);
    auto it = std::lower_bound(subset.begin(), subset.end(), pos);
    if (it == subset.end() || *it != pos)
      throw file_error(where, "val_episodes", "episode " + std::to_string(e) + " is not among the episodes used");
    held[static_cast<size_t>(it - subset.begin())] = true;
  }
  EpisodeSplit out;
  for (size_t i = 0; i < subset.size(); ++i) (held[i] ? out.val : out.train).push_back(subset[i]);
  if (out.train.empty()) throw file_error(where, "val_episodes", "every episode is held out: none left to train on");
  return out;
}

// ---- SamplerState

nlohmann::json SamplerState::to_json() const {
  return {{"seed", seed},       {"epoch", epoch},     {"position", position},
          {"frames", frames},   {"shuffle", shuffle}, {"episodes", episodes}};
}

SamplerState SamplerState::from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw file_error(where, "", "expected a JSON object");
  auto field = [&](const char* name) -> const nlohmann::json& {
    if (!j.contains(name)) throw file_error(where, name, "missing");
    return j.at(name);
  };
  auto count = [&](const char* name) {
    const auto& v = field(name);
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
      throw file_error(where, name, "expected a non-negative integer, got " + v.dump());
    return v.get<uint64_t>();
  };
  SamplerState s;
  s.seed = count("seed");
  s.epoch = static_cast<int64_t>(count("epoch"));
  s.position = static_cast<int64_t>(count("position"));
  s.frames = static_cast<int64_t>(count("frames"));
  if (!field("shuffle").is_boolean()) throw file_error(where, "shuffle", "expected true or false");
  s.shuffle = field("shuffle").get<bool>();
  if (!field("episodes").is_string()) throw file_error(where, "episodes", "expected a string");
  s.episodes = field("episodes").get<std::string>();
  if (s.position > s.frames) throw file_error(where, "position", "beyond the epoch's " + std::to_string(s.frames) + " frames");
  return s;
}

// ---- FrameSampler

FrameSampler::FrameSampler(const RobotDataset& dataset, std::vector<int64_t> episode_positions, bool shuffle,
                           uint64_t seed, int64_t stride, int64_t drop_last)
    : shuffle_(shuffle), seed_(seed), stride_(stride), drop_last_(drop_last) {
  if (stride_ < 1) throw file_error(dataset.root(), "stride", "must be at least 1, got " + std::to_string(stride_));
  if (drop_last_ < 0)
    throw file_error(dataset.root(), "drop_n_last_frames", "must be at least 0, got " + std::to_string(drop_last_));
  const auto& eps = dataset.episodes();
  uint64_t h = 1469598103934665603ULL;  // FNV-1a over the positions and lengths
  auto feed = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ULL;
    }
  };
  for (int64_t p : episode_positions) {
    if (p < 0 || p >= static_cast<int64_t>(eps.size()))
      throw file_error(dataset.root(), "episodes", "no episode at position " + std::to_string(p));
    feed(static_cast<uint64_t>(p));
    feed(static_cast<uint64_t>(eps[static_cast<size_t>(p)].length));
    const int64_t kept = eps[static_cast<size_t>(p)].length - drop_last_;
    if (kept <= 0) continue;  // as LeRobot's sampler: an episode drop_n_last_frames empties is skipped
    episodes_.push_back(p);
    starts_.push_back(total_);
    total_ += (kept + stride_ - 1) / stride_;
  }
  if (stride_ != 1) feed(static_cast<uint64_t>(stride_));
  if (drop_last_ != 0) feed(static_cast<uint64_t>(drop_last_) ^ 0xd509ULL);
  if (total_ == 0)
    throw file_error(dataset.root(), "episodes",
                     "the episodes used have no frames (" + join(episode_positions) + ")" +
                         (drop_last_ ? ", leaving out the last " + std::to_string(drop_last_) +
                                           " of each (the policy's drop_n_last_frames)"
                                     : std::string()));
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  fingerprint_ = buf;
  load_epoch();
}

FrameRef FrameSampler::at(int64_t k) const {
  auto it = std::upper_bound(starts_.begin(), starts_.end(), k);
  const auto i = static_cast<size_t>(it - starts_.begin() - 1);
  return {episodes_[i], (k - starts_[i]) * stride_};
}

void FrameSampler::load_epoch() {
  if (shuffle_) order_ = epoch_order(total_, seed_, epoch_);
}

FrameRef FrameSampler::next() {
  if (position_ == total_) {
    ++epoch_;
    position_ = 0;
    load_epoch();
  }
  const int64_t k = shuffle_ ? order_[static_cast<size_t>(position_)] : position_;
  ++position_;
  return at(k);
}

std::vector<FrameRef> FrameSampler::next_batch(int64_t n) {
  std::vector<FrameRef> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(next());
  return out;
}

SamplerState FrameSampler::state() const { return {seed_, epoch_, position_, total_, shuffle_, fingerprint_}; }

void FrameSampler::restore(const SamplerState& s, const std::string& where) {
  if (s.frames != total_ || s.episodes != fingerprint_)
    throw file_error(where, "episodes",
                     "the state belongs to other episodes (" + std::to_string(s.frames) + " frames per epoch, here " +
                         std::to_string(total_) + ")");
  if (s.shuffle != shuffle_)
    throw file_error(where, "shuffle", std::string("the state was saved with shuffle ") + (s.shuffle ? "on" : "off"));
  if (s.shuffle && s.seed != seed_)
    throw file_error(where, "seed",
                     "the state was saved with seed " + std::to_string(s.seed) + ", here " + std::to_string(seed_));
  if (s.position > total_) throw file_error(where, "position", "beyond the epoch");
  epoch_ = s.epoch;
  position_ = s.position;
  load_epoch();
}

}  // namespace lf::data::robot

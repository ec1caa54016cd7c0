// What a robot-policy step samples from a RobotDataset (dataset.h): LeRobot's delta_timestamps windows with their
// padding rules, episode subsets and held-out validation episodes, and a seeded, epoch-aware frame order that resumes
// exactly from a small state.
//
// Windows follow lerobot/datasets (feature_utils.check_delta_timestamps / get_delta_indices, dataset_reader.
// _get_query_indices): a feature's offsets in seconds d become frame offsets round(d * fps) (ties to even, as Python's
// round); every d must be within tolerance_s of a multiple of 1/fps (|d*fps - round(d*fps)| / fps <= tolerance_s).
// For frame f of an episode of L frames the window reads frames clamp(f + k, 0, L - 1) and `<feature>_is_pad` is
// true where f + k falls outside [0, L).
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/data/robot/dataset.h"

namespace lf::data::robot {

// Per feature, offsets in seconds, in the order given (LeRobot's delta_timestamps dict).
using DeltaTimestamps = std::vector<std::pair<std::string, std::vector<double>>>;

struct Window {
  std::string feature;
  std::vector<int64_t> offsets;  // frames
};

// Checks every offset against 1/FPS within TOLERANCE_S and converts it to frames. WHERE names the origin in errors
// (the dataset); an offset off the frame grid is one line naming WHERE, "delta_timestamps.<feature>" and the value.
std::vector<Window> delta_windows(const DeltaTimestamps& deltas, double fps, double tolerance_s,
                                  const std::string& where);

// The frames (clamped into the episode) and pad flags of a window at frame FRAME of an episode of LENGTH frames;
// FRAMES and IS_PAD get offsets.size() entries each.
void window_query(const std::vector<int64_t>& offsets, int64_t length, int64_t frame, int64_t* frames,
                  bool* is_pad);

// Which episodes a run uses. Episodes are named by their episode_index.
struct EpisodeSelection {
  std::vector<int64_t> episodes;      // the subset to use; empty: every episode
  int64_t val_count = 0;              // hold out this many for validation, spread evenly over the subset
  std::vector<int64_t> val_episodes;  // or hold out exactly these (members of the subset)
};

// Positions in RobotDataset::episodes(), ascending. val_count N picks the subset's positions floor((i + 0.5) * n / N)
// for i < N (deterministic, independent of any seed, spread over the recording); train is the rest. Errors (one
// line naming the dataset and the option): an unknown or repeated episode, both val_count and val_episodes, a
// held-out episode outside the subset, nothing left to train on.
struct EpisodeSplit {
  std::vector<int64_t> train, val;
};
EpisodeSplit split_episodes(const RobotDataset& dataset, const EpisodeSelection& selection);

struct FrameRef {
  int64_t episode = 0;  // position in RobotDataset::episodes()
  int64_t frame = 0;    // frame within the episode
  bool operator==(const FrameRef&) const = default;
};

// Where a FrameSampler is: enough to continue exactly. `frames` and `episodes` (a fingerprint of the episode
// positions) make a restore into a sampler over other episodes fail instead of silently reading other frames.
struct SamplerState {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t position = 0;  // frames of this epoch already drawn
  int64_t frames = 0;    // frames per epoch
  bool shuffle = false;
  std::string episodes;  // fingerprint of the episode positions (hex)

  nlohmann::json to_json() const;
  // WHERE names the origin in errors (a state file).
  static SamplerState from_json(const nlohmann::json& j, const std::string& where);
  bool operator==(const SamplerState&) const = default;
};

// The frames of some episodes, one epoch after another: in episode order, or (shuffle) in epoch_order(frames, seed,
// epoch) (data/shuffle.h: the seeded order the other datasets use), so epoch e's order depends only on (seed, e).
// STRIDE > 1 keeps every stride-th frame of each episode (0, stride, 2 stride, ...: open-loop evaluation's queries).
// DROP_LAST leaves out the last drop_last frames of each episode (LeRobot's EpisodeAwareSampler drop_n_last_frames,
// the policy's PolicySpec::drop_n_last_frames); an episode with no frames left is skipped, and none left at all is an
// error naming the dataset.
class FrameSampler {
 public:
  FrameSampler(const RobotDataset& dataset, std::vector<int64_t> episode_positions, bool shuffle, uint64_t seed,
               int64_t stride = 1, int64_t drop_last = 0);

  int64_t frames_per_epoch() const { return total_; }
  const std::vector<int64_t>& episode_positions() const { return episodes_; }  // those with frames to draw
  FrameRef at(int64_t k) const;  // the K-th frame in episode order (0 <= K < frames_per_epoch())
  FrameRef next();
  std::vector<FrameRef> next_batch(int64_t n);

  SamplerState state() const;
  // lf::Error naming WHERE and the field when STATE belongs to other episodes, another seed or shuffle setting.
  void restore(const SamplerState& state, const std::string& where = "sampler state");

 private:
  void load_epoch();
  std::vector<int64_t> episodes_, starts_;  // starts_[i]: the first frame number of episodes_[i] in episode order
  int64_t total_ = 0;
  bool shuffle_ = false;
  uint64_t seed_ = 0;
  int64_t stride_ = 1, drop_last_ = 0;
  int64_t epoch_ = 0, position_ = 0;
  std::vector<int64_t> order_;  // this epoch's order (shuffle only)
  std::string fingerprint_;
};

}  // namespace lf::data::robot

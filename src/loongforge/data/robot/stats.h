// Per-feature statistics of a robot dataset, computed as LeRobot computes them (lerobot/datasets/compute_stats.py),
// so that a dataset without meta/stats.json, or a subset of episodes, normalises as LeRobot would:
//   - per episode: numeric features over all frames; cameras over sampled frames (sample_indices), large frames
//     subsampled by an integer stride (auto_downsample_height_width), per channel, scaled to [0, 1];
//     min, max, mean, std (from the running mean of squares, in the data's float precision: float32 data gives
//     float32 mean and std as LeRobot's numpy code does), count, and the quantiles q01, q10, q50, q90, q99 from a
//     5000-bin histogram between min and max, interpolated within the bin;
//   - over episodes: aggregate_stats (count-weighted mean, parallel variance, min of mins, max of maxes,
//     count-weighted quantiles).
// The arithmetic follows numpy's order of operations (sums along the frames in numpy's order, float32 where numpy
// computes in float32) so the results equal LeRobot's own bit for bit.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loongforge/data/robot/dataset.h"

namespace lf::data::robot {

// The statistics of one feature, in the dtypes LeRobot's numpy code leaves them in (float32 data: float32 min, max,
// mean, std; float64 quantiles, float32 when every one is a bin edge; int64 count), shaped as LeRobot stores them ([D], [1] for a scalar, [C, 1, 1] for a
// camera). to_stats() turns a set of them into the float64 Stats of dataset.h.
using FeatureStats = std::map<std::string, at::Tensor>;
using RawStats = std::map<std::string, FeatureStats>;

// LeRobot's get_feature_stats(values, axis=0, keepdims=values.dim() == 1) for numeric values [N] or [N, D]
// (any real dtype: integers and bool are promoted as numpy promotes them with float32).
FeatureStats numeric_stats(const at::Tensor& values);
// LeRobot's image statistics of sampled frames uint8 [n, H, W, C] (already sampled and downsampled): per channel,
// shaped [C, 1, 1], divided by 255, count n.
FeatureStats image_stats(const at::Tensor& frames);
// LeRobot's sample_indices(n): the frames of an episode of N frames whose images enter the statistics.
std::vector<int64_t> sample_indices(int64_t n);
// LeRobot's auto_downsample_height_width on frames [n, H, W, C]: every k-th row and column when max(H, W) >= 300.
at::Tensor auto_downsample(const at::Tensor& frames);
// LeRobot's aggregate_stats over episodes' statistics of one feature.
FeatureStats aggregate_feature_stats(const std::vector<FeatureStats>& per_episode);

// The statistics of the episode at position EPISODE, for FEATURES (numeric and camera features; empty: all of
// them; text features are skipped). Depth cameras as LeRobot computes a depth map's at recording: from its sampled
// frames in the recorded unit, not divided by 255 (from a depth video's decoded frames: within its quantisation).
RawStats episode_stats(const RobotDataset& dataset, int64_t episode, const std::vector<std::string>& features = {});
// Over the episodes at positions EPISODES (empty: all; taken in the dataset's order, each once): each episode's
// stats, then aggregate_stats.
// Episodes with no frames are left out.
RawStats compute_stats(const RobotDataset& dataset, const std::vector<int64_t>& episodes = {},
                       const std::vector<std::string>& features = {});
// float64 tensors (dataset.h's Stats).
Stats to_stats(const RawStats& raw);

// LeRobot's meta/stats.json layout: {feature: {stat: nested lists}} (numbers as float64 / int64).
std::string stats_to_json(const Stats& stats);
// Reads a stats.json (LeRobot's layout) into float64 tensors.
Stats stats_from_json(const std::string& text, const std::string& name);

}  // namespace lf::data::robot

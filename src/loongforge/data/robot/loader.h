// RobotLoader: batches of delta_timestamps windows from a RobotDataset, read by decode threads ahead of the step.
//
// A batch is named tensors, B frames first (the FrameSampler's order):
//   numeric feature with a window of W offsets:  [B, W, shape...] in the feature's dtype; without a window [B, shape...]
//   camera with a window:                        uint8 [B, W, H, W', C]; without [B, H, W', C] (camera_to_float when
//                                                the step needs LeRobot's float [.., C, H, W] in [0, 1])
//   "<feature>_is_pad" for each windowed feature: bool [B, W] (LeRobot's padding at episode edges).
// Work: each batch is cut into tasks, one per (episode, camera) and one per episode for the numeric features; a
// camera task reads its episode's frames in ascending order in one read_camera call, so one thread walks a video
// forward and the reader's GOP cache decodes each GOP once. Threads take tasks in batch order; `prefetch` batches
// are planned ahead. Batches come out in the sampler's order whatever the thread count (the same tensors for 0, 1 or
// N threads). A task's error (the reader's one-line lf::Error) is rethrown by next() for the batch it belongs to.
// The destructor stops and joins the threads (batches in flight are dropped).
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/robot/sampler.h"

namespace lf::data::robot {

struct LoaderOptions {
  DeltaTimestamps delta_timestamps;   // windows; features without one give the frame itself
  std::vector<std::string> features;  // features in a batch; empty: every numeric and camera feature
  int64_t batch_size = 8;
  int threads = 2;        // decode threads; 0: everything in the caller's thread, inside next()
  int prefetch = 0;       // batches planned ahead of the consumer; 0: 2 * max(threads, 1)
  double tolerance_s = 1e-4;  // delta_timestamps grid tolerance, and the video frame tolerance
  // rows_count > 0: each batch is rows [rows_first, rows_first + rows_count) of the sampler's next batch_size frames
  // (a data-parallel rank's share; the sampler moves past all batch_size frames, so state() does not depend on it).
  int64_t rows_first = 0, rows_count = 0;
};

using RobotBatch = std::map<std::string, at::Tensor>;

class RobotLoader {
 public:
  // Checks the options against the dataset (unknown or text features, windows off the frame grid: one line naming
  // the dataset and the option) and starts the threads. SAMPLER gives the frames (and where to resume from).
  RobotLoader(std::shared_ptr<const RobotDataset> dataset, FrameSampler sampler, LoaderOptions options);
  ~RobotLoader();
  RobotLoader(const RobotLoader&) = delete;
  RobotLoader& operator=(const RobotLoader&) = delete;

  RobotBatch next();
  // The sampler's state after the last batch next() returned (before the first: the sampler's initial state):
  // restoring it into a FrameSampler over the same episodes continues with the next batch.
  SamplerState state() const;
  const std::vector<std::string>& features() const;  // what a batch holds (without the _is_pad masks)
  const std::vector<Window>& windows() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// uint8 [..., H, W, C] -> float32 [..., C, H, W] in [0, 1] (LeRobot's camera tensors).
at::Tensor camera_to_float(const at::Tensor& frames);

}  // namespace lf::data::robot

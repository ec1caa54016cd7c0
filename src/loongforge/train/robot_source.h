// Robot-policy training batches from a robot dataset (LeRobot v3.0 / v2.1, HDF5: data/robot/), made the way
// LeRobot's training script makes them for a policy (lerobot_train: LeRobotDataset with the policy's
// delta_timestamps, image transforms, then the policy's preprocessor), from what the policy's contract says
// (models/policy_io.h): its input features and the action, windowed by its observation / action frame offsets
// ("<feature>_is_pad" masks at episode edges), cameras as float [.., C, H, W] in [0, 1] after the image transforms,
// every feature normalised by its type's mode with the dataset's statistics (meta/stats.json; computed over the
// training episodes as LeRobot computes them when the dataset has none; or a stats.json given), the policy's
// training draws (ACT's vae_eps, flow matching's noise and time), and for policies that read the task as tokens
// (PolicySpec::language) the rows' prompts (Policy::prompts of the dataset's task texts and the
// normalised batch) through the tokenizer, cut and padded as LeRobot's TokenizerProcessorStep. Training rows leave
// out the last drop_n_last_frames frames of each episode, as LeRobot's training sampler does for the policy's config.
//
// Rows form one stream (the frame sampler's seeded epoch order over the training episodes); row k's image
// transforms and random draws come from its own generators seeded by (seed, k), so a row is the same however the
// rows are split over processes or micro-batches, and resume continues the stream exactly. Decoding runs on
// data::robot::RobotLoader's threads, a few global batches ahead of the step.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/robot/loader.h"
#include "loongforge/data/robot/normalize.h"
#include "loongforge/data/robot/sampler.h"
#include "loongforge/data/robot/transforms.h"
#include "loongforge/models/model.h"
#include "loongforge/models/policy_io.h"
#include "loongforge/train/batch.h"
#include "loongforge/train/prompt_encoder.h"

namespace lf::train {

struct RobotSourceOptions {
  std::string dataset;                       // data.train[0].path: a LeRobot dataset folder or HDF5 episodes
  data::robot::EpisodeSelection episodes;    // data.robot.episodes, data.robot.valid_episodes
  bool valid = false;                        // the held-out episodes (in episode order, no transforms, no shuffle)
  uint64_t seed = 0;
  int threads = 2;                           // data.robot.threads: decode threads
  double tolerance_s = 1e-4;                 // data.robot.tolerance_s
  std::string stats_file;                    // data.robot.stats: a stats.json to normalise with ("": the dataset's)
  data::robot::ImageTransformsConfig transforms;  // data.robot.image_transforms (training rows only)
  int64_t stride = 1;  // validation: every stride-th frame of each episode (open-loop evaluation's queries)
  // Policies that read the task as tokens (PolicySpec::language): data.robot.tokenizer, the tokenizer's folder
  // (tokenizer.json or tokenizer.model, tokenizer_config.json's pad_token); "": the policy's folder (model.path).
  std::string tokenizer, policy_dir;
};

class RobotSource : public BatchSource {
 public:
  // Errors (one line naming the dataset or the recipe key): features the policy needs that the dataset lacks or
  // shapes that differ, statistics missing for a normalised feature, a language policy without a tokenizer or on a
  // dataset without tasks.
  RobotSource(RobotSourceOptions o, const models::Model& model);
  ~RobotSource() override;
  Batch next(int64_t micro_batch_size) override { return next_rows(micro_batch_size, 0, micro_batch_size); }
  Batch next_rows(int64_t global_rows, int64_t first, int64_t n) override;
  nlohmann::json state() const override;
  void restore(const nlohmann::json& state) override;
  std::string origin() const override { return opts_.dataset; }
  // LeRobot's processor files (policy_preprocessor.json, ...) and, for a language policy, the tokenizer's files.
  std::string write_model_files(const std::string& dir) const override;

  const data::robot::Stats& stats() const { return stats_; }
  const std::map<std::string, data::robot::NormMode>& modes() const { return modes_; }
  const data::robot::RobotDataset& dataset() const { return *ds_; }
  const models::PolicySpec& spec() const { return spec_; }
  // Rows per pass over the episodes this source reads (an epoch of its sampler), and the frame of stream row k.
  int64_t rows_per_epoch() const;
  data::robot::FrameRef frame_of(int64_t k) const;

 private:
  data::robot::FrameSampler sampler() const;  // a fresh sampler over this split's frames
  RobotSourceOptions opts_;
  const models::Model& model_;
  const models::Policy& policy_;
  models::PolicySpec spec_;
  std::shared_ptr<const data::robot::RobotDataset> ds_;
  std::vector<int64_t> episodes_;  // positions this split reads
  data::robot::Stats stats_;
  std::map<std::string, data::robot::NormMode> modes_;
  data::robot::LoaderOptions loader_opts_;
  std::unique_ptr<data::robot::RobotLoader> loader_;  // for the current (global_rows, first, n); rebuilt on change
  data::robot::SamplerState sampler_;                 // after the last batch given
  int64_t rows_ = 0;                                  // rows of the stream given so far (all ranks' shares)
  std::unique_ptr<PromptEncoder> prompt_;  // policies that read the task as a prompt
  std::string prompt_dir() const { return prompt_ ? prompt_->folder() : std::string(); }
  std::vector<std::string> task_texts(const at::Tensor& task_index) const;
};

}  // namespace lf::train

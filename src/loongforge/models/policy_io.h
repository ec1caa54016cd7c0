// The robot-policy side of the model contract (models/model.h): what a policy reads from a robot dataset, how its
// features are normalised, which random draws a training forward takes, and how it predicts an action chunk.
// Policies (models/policy/) implement models::Model and this interface; the layers above models/ (the robot batch
// source, checkpoints with LeRobot's processor files, open-loop evaluation) reach it through as_policy() and never
// name a policy type.
//
// Vocabulary is LeRobot's: features are named as in its datasets and policy configs ("observation.state",
// "observation.images.<camera>", "observation.environment_state", "action"), typed STATE / VISUAL / ENV / ACTION /
// LANGUAGE, normalised by the mode the policy's normalization_mapping gives their type (IDENTITY, MEAN_STD, MIN_MAX,
// QUANTILES, QUANTILE10), and windowed by frame offsets (LeRobot's observation_delta_indices /
// action_delta_indices).
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "loongforge/models/batch.h"

namespace lf::models {

class Model;

struct PolicyFeature {
  std::string name;            // "observation.state", "observation.images.top", "action", ...
  std::string type;            // STATE, VISUAL, ENV, ACTION, LANGUAGE
  std::vector<int64_t> shape;  // per frame: [D] for vectors, [C, H, W] for cameras
};

struct PolicySpec {
  std::vector<PolicyFeature> inputs, outputs;  // the config's input_features / output_features, in its order
  std::map<std::string, std::string> norm_map;  // feature type -> mode name (the config's normalization_mapping)
  // Frame offsets of the observation features and of the action (empty: the frame alone, no window dimension; with
  // offsets the batch holds [B, offsets, ...] and "<feature>_is_pad" [B, offsets]).
  std::vector<int64_t> observation_offsets, action_offsets;
  int64_t n_action_steps = 1;  // actions executed per predicted chunk (open-loop evaluation queries every this many)
  // Training frames leave out the last this many frames of each episode (LeRobot's EpisodeAwareSampler with the
  // config's drop_n_last_frames; an episode with no frames left is skipped). Validation and open-loop evaluation read
  // every frame.
  int64_t drop_n_last_frames = 0;
  // The processor zeroes a training row's state with this probability (GR00T N1.7's state_dropout_prob): the batch
  // source draws a bool per training row from the row's stream into the batch's "state_dropout" [B] before
  // Policy::pack_batch, which applies it (held-out rows and deployment: none).
  double state_dropout_prob = 0;
  // The policy also reads the task text as tokens (observation.language.tokens / .attention_mask) that its
  // processor makes: Policy::prompts' texts through a tokenizer (with its special tokens), truncated on the right and
  // padded with its pad token on `padding_side` to tokenizer_max_length (LeRobot's TokenizerProcessorStep; ids int64,
  // mask bool).
  bool language = false;
  int64_t tokenizer_max_length = 0;
  std::string padding_side = "right";
  // LeRobot's processor steps ({registry_name, config}) when the policy's pipelines differ from the default ones
  // (preprocessor: rename, to-batch, device, normaliser; postprocessor: unnormaliser, device); the writer fills the
  // normalizer_processor / unnormalizer_processor steps (config, state file) and the tokenizer_processor's
  // tokenizer_name. Empty (null): the default pipelines.
  nlohmann::json preprocessor_steps, postprocessor_steps;
  // A step of those lists with "stats_features": [names] gets a state file (named as the normaliser's) holding the
  // dataset statistics of those features ("<feature>.<stat>"; the field is dropped): the policy's own processor steps
  // that normalise with the statistics (GR00T's pack / unpack steps). The source needs statistics for them even
  // when norm_map leaves them IDENTITY.
  std::vector<std::string> stats_features;
  // Policies whose processor writes a vision-language chat prompt (GR00T: LeRobot's GrootN17VLMEncodeStep with the
  // Qwen3-VL processor): one user message holding every camera's frame as an image (cameras in name order), then
  // Policy::prompts' text, rendered by the processor folder's chat template, tokenised, each image's token expanded
  // to its merged patch grid, rows padded with the pad token on `padding_side` to the longest row: input_ids,
  // attention_mask (int64), pixel_values, image_grid_thw, from the folder's image processor. Before it each frame
  // (the float camera as uint8, (x.clamp(0, 1) * 255) truncated) is resized (torchvision, bicubic, antialiased) to a
  // square of resize_edge, centre-cropped to round(edge * crop_fraction) (offset floored; none unless in (0, 1)) and
  // resized to target_height x target_width. With `letterbox` the frame is first zero-padded to a square (centred).
  // With `opencv_area` (GR00T N1.7's albumentations path) instead: the shortest edge resized to resize_edge with
  // OpenCV's INTER_AREA (aspect kept), cropped to int(side * crop_fraction) per side (centred; training rows at the
  // row's drawn position, the same for all its cameras), and the shortest edge resized to resize_edge again.
  struct VlmPrompt {
    bool enabled = false;
    int64_t image_token_id = -1;  // the token the template writes per image (expanded)
    int64_t resize_edge = 0, target_height = 0, target_width = 0;
    double crop_fraction = 0;
    bool opencv_area = false, letterbox = false;
    // the cameras (feature names) in the prompt's order; empty: every VISUAL input, sorted by name
    std::vector<std::string> cameras;
    std::string padding_side = "left";
  } vlm_prompt;
  // The normalisation mode of a feature (its type's entry in norm_map; IDENTITY when the type has none).
  std::string mode_of(const PolicyFeature& f) const {
    auto it = norm_map.find(f.type);
    return it == norm_map.end() ? "IDENTITY" : it->second;
  }
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual PolicySpec policy_spec() const = 0;
  // The random draws a training forward of `rows` rows takes as batch tensors (ACT: the latent's `vae_eps`; flow
  // matching: `noise` and `time`), drawn from `gen` so that a batch source can give every row its own stream: the
  // same draws whatever the split over processes, and exact resume. Empty: none.
  virtual std::map<std::string, at::Tensor> training_draws(int64_t rows, at::Generator& gen) const { return {}; }
  // The eval-mode action chunk [B, chunk, action_dim] of a normalised batch (LeRobot's predict_action_chunk),
  // normalised; sampler noise comes from the batch where the policy takes it (`sample_noise`), else from the
  // global generator.
  virtual at::Tensor predict_action_chunk(const Batch& b) = 0;
  // The text its processor tokenises for each row (spec.language): from the row's task (the dataset's task text) and
  // the batch's normalised features (B rows). Default: the task as it is.
  virtual std::vector<std::string> prompts(const std::vector<std::string>& tasks, const Batch& normalised) const {
    return tasks;
  }
  // Per feature, its statistics ({stat: tensor}), as the dataset's meta/stats.json holds them.
  using Stats = std::map<std::string, std::map<std::string, at::Tensor>>;
  // Policies whose processor packs the features itself (GR00T): the model's batch from the source's (the features
  // normalised by norm_map, "action_is_pad", the prompt's tensors) and the statistics of spec.stats_features.
  // Default: the batch as it is.
  virtual Batch pack_batch(const Batch& features, const Stats& stats) const { return features; }
  // Such a policy's postprocessor: the action chunk [.., >= action_dim] of its batch or of predict_action_chunk in
  // the dataset's units [.., action_dim]. Undefined (the default): the inverse of norm_map's action normalisation.
  virtual at::Tensor unpack_action(const at::Tensor& chunk, const Stats& stats) const { return {}; }
  // The statistics the processor normalises with, from the dataset's (DATASET): a policy whose checkpoint brings its
  // own (GR00T N1.7's statistics.json for its embodiment) replaces them; the batch source packs, writes the
  // processor files and evaluates with these. Default: the dataset's.
  virtual Stats processor_stats(const Stats& dataset) const { return dataset; }
};

// The model's policy interface (nullptr: not a policy).
Policy* as_policy(Model& model);
const Policy* as_policy(const Model& model);

}  // namespace lf::models

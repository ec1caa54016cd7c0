// A trained robot policy at deployment: raw observations in (as a robot or simulator sends them), the unnormalised
// action chunk out. What LeRobot's policy + its pre/postprocessor pipelines do for one observation, for every
// registered policy family (through the contract, models/policy_io.h; nothing here names a family). Used by the
// policy server (`loongforge serve`) and the C API (<loongforge/loongforge.h>).
//
// A policy folder is LeRobot's layout (as LoongForge's training or LeRobot's save_pretrained write it): config.json,
// model.safetensors, policy_preprocessor.json / policy_postprocessor.json with the normaliser's statistics, and for
// policies that read the task as text its tokenizer (tokenizer.json, ...) or processor files.
//
// Observations, by the policy's LeRobot feature names (PolicySpec::inputs):
// - vectors ("observation.state", "observation.environment_state"): [D] or [1, D], any float or integer dtype;
// - cameras ("observation.images.<camera>"): uint8 [H, W, C] or [C, H, W] (0..255), or float [C, H, W] in [0, 1]
//   (LeRobot's dataset frames); a leading batch dimension of 1 is allowed;
// - the task text (policies that read a prompt): passed as `prompt`.
// Policies with an observation window (Diffusion Policy's n_obs_steps = S > 1) take either one frame, seen at every
// offset of the window (LeRobot's queues at an episode's start, filled with copies), or the window itself: S frames
// along a leading dimension, oldest first ([S, D] vectors, [S, H, W, C] / [S, C, H, W] cameras), as LeRobot's
// select_action stacks its observation queue.
// Missing and misshapen features are errors naming the feature (lf::Error, one line); other keys are ignored (as
// LeRobot's policies ignore batch keys they do not read: a robot may send everything it has).
#pragma once
#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "loongforge/models/model.h"
#include "loongforge/models/policy_io.h"

namespace lf::train {

class PromptEncoder;  // train/prompt_encoder.h

class PolicyRunner {
 public:
  // Opens DIR (errors name the file and field). `device`: "cpu" or "cuda" (falls back to the CPU with a message when
  // no GPU is there).
  explicit PolicyRunner(const std::string& dir, const std::string& device = "cpu");
  ~PolicyRunner();

  // The unnormalised action chunk [chunk, action_dim] (float32, CPU) for one observation. Eval mode; samplers draw
  // from `seed` (the same observation and seed give the same chunk). Thread-safe: calls are serialised.
  at::Tensor predict(const std::map<std::string, at::Tensor>& observation, const std::string& prompt = "",
                     uint64_t seed = 0);

  // What a client needs to know (the server's metadata on connect): the policy type, its input features
  // {name: {type, shape}}, the action's shape [chunk, action_dim], n_action_steps, whether it reads a prompt.
  nlohmann::json metadata() const;

  const models::PolicySpec& spec() const { return spec_; }
  models::Model& model() { return *model_; }
  const std::string& dir() const { return dir_; }
  std::mutex& mutex() { return mu_; }  // held by predict; hold it while changing the model's weights

 private:
  std::string dir_;
  std::shared_ptr<models::Model> model_;
  models::Policy* policy_ = nullptr;
  models::PolicySpec spec_;
  std::map<std::string, int> modes_;                                  // feature -> data::robot::NormMode
  std::map<std::string, std::map<std::string, at::Tensor>> stats_;    // feature -> {stat: tensor}
  double eps_ = 1e-8;
  std::unique_ptr<PromptEncoder> prompt_;
  std::mutex mu_;
};

}  // namespace lf::train

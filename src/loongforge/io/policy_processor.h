// LeRobot's processor pipelines saved beside a policy (lerobot/processor/pipeline.py): policy_preprocessor.json with
// its normalizer_processor step's state file (policy_preprocessor_step_N_normalizer_processor.safetensors: tensors
// "<feature>.<stat>") and policy_postprocessor.json with the unnormalizer's. What a policy needs from them: each
// feature's normalisation mode (the step's norm_map by the feature's type) and statistics, and eps.
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>

#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/robot/normalize.h"

namespace lf::io {

struct PolicyNormalization {
  nlohmann::json features;  // the step's features: {name: {type, shape}} (LeRobot's PolicyFeature)
  nlohmann::json norm_map;  // {feature type: mode name}
  std::map<std::string, data::robot::NormMode> modes;  // per feature, from norm_map by its type (absent: IDENTITY)
  data::robot::Stats stats;                            // per feature: {stat: tensor} as stored (float32)
  double eps = 1e-8;
};

// The normaliser of DIR's policy_preprocessor.json (nullopt when DIR has none). Errors name the file and field;
// a file without a normalizer_processor step is one unless `own_steps` (a policy whose own processor steps normalise:
// nullopt then).
std::optional<PolicyNormalization> read_policy_normalization(const std::string& dir, bool own_steps = false);

// Writes DIR/policy_preprocessor.json and policy_postprocessor.json with their state files, as LeRobot's
// make_pre_post_processors(config, dataset_stats) followed by save_pretrained writes them (rename, to-batch, device,
// normaliser over every feature; unnormaliser over the outputs, device), from N's features, norm_map, stats and eps;
// `outputs` names the features the postprocessor unnormalises (LeRobot: the policy's output features). PRE_STEPS /
// POST_STEPS (lists of {registry_name, config}; null: the default pipelines above) give a policy's own pipelines:
// their normalizer_processor / unnormalizer_processor steps get N's config and their state file (named by the step's
// position, as LeRobot names it); a step with "stats_features" (a list of feature names: a policy's own steps that
// normalise, GR00T's pack / unpack) gets a state file with N's statistics of those features instead of that field.
void write_policy_processors(const std::string& dir, const PolicyNormalization& n, const nlohmann::json& outputs,
                             const nlohmann::json& pre_steps = nullptr, const nlohmann::json& post_steps = nullptr);

}  // namespace lf::io

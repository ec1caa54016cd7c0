// The parts of a policy's PolicySpec (models/policy_io.h) every LeRobot policy config states the same way.
#pragma once
#include <nlohmann/json.hpp>

#include <string>

#include "loongforge/models/policy_io.h"

namespace lf::models::policy {

// input_features / output_features ({name: {type, shape}}) and normalization_mapping ({type: mode}) of a LeRobot
// policy config (FILE names it in errors), and drop_n_last_frames when the config has one; offsets and n_action_steps
// are left for the policy to set.
PolicySpec lerobot_policy_spec(const nlohmann::json& config, const std::string& file);

}  // namespace lf::models::policy

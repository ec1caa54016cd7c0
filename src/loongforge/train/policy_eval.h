// Open-loop evaluation of a robot policy on held-out episodes, the offline check robot-learning people run before a
// robot or simulator: at frames 0, n, 2n, ... of each held-out episode (n = the policy's n_action_steps) the policy
// predicts an action chunk from the recorded observations (eval mode; samplers draw from a fixed seed), and the
// prediction is compared, unnormalised, with the recorded actions at the same offsets, over the steps that lie inside
// the episode. Reported: MSE and MAE overall, per action dimension and per step of the chunk; PNG plots of the
// recorded trajectory and the executed prediction (each chunk's first n actions) per episode and action dimension.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "loongforge/models/model.h"

namespace lf::train {

struct OpenLoopReport {
  int64_t episodes = 0, chunks = 0;
  double mse = 0, mae = 0;
  std::vector<double> mse_per_dim, mae_per_dim, mse_per_step, mae_per_step;
  std::vector<std::string> plots;  // the PNGs written
  nlohmann::json to_json() const;
};

// The recipe's data block (data.format: robot, data.robot.valid_episodes > 0) gives the held-out episodes; eval.batches
// is not used (every held-out episode is evaluated). PLOT_DIR: where the report (open_loop.json) and the plots go
// ("" : nowhere), plots for the first MAX_PLOT_EPISODES episodes. The model is left in training mode.
OpenLoopReport open_loop_eval(const nlohmann::json& recipe, models::Model& model, const std::string& plot_dir,
                              int64_t max_plot_episodes = 2);

}  // namespace lf::train

// The trainer: builds model, data, optimizer and schedule from a recipe (train/recipe.h) and runs the loop with
// gradient accumulation, clipping, logging (metrics.jsonl, TensorBoard, progress), validation and checkpoints.
// Parallel layouts come from the recipe's parallel.* (train/dist_engine.cpp); one process runs SingleEngine.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace lf::train {

struct TrainOutcome {
  int64_t steps = 0;
  double last_loss = 0;
  std::string last_checkpoint;
};

TrainOutcome train(const nlohmann::json& recipe, bool resume);

// Validation loss of a model folder (a checkpoint or a HF folder) on the recipe's held-out split.
double evaluate(const nlohmann::json& recipe, const std::string& model_dir, int64_t batches);

}  // namespace lf::train

// Training checkpoints: OUTPUT_DIR/checkpoints/step_NNNNNNNN/ holding
//   model.safetensors + config.json (+ tokenizer files): the model's folder (io/hf_model.h), or for LoRA
//   runs adapter_config.json + adapter_model.safetensors (PEFT's layout; the base stays where it is),
//   optimizer.safetensors: exp_avg.<name>, exp_avg_sq.<name> and the CPU RNG state (rng.cpu),
//   trainer_state.json: step, optimizer steps, data position, tokens seen, the recipe.
// A checkpoint is written into a temporary folder, every file fsync'ed, then renamed into place, and only then
// does OUTPUT_DIR/checkpoints/latest (itself replaced atomically) point at it: a killed process never leaves a
// half-written latest checkpoint.
#pragma once
#include <nlohmann/json.hpp>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/nn/lora.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/optim/adamw.h"

namespace lf::train {

struct TrainableSet {  // the parameters the optimizer updates, by HF name, in optimizer order
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::optional<nn::LoraConfig> lora;  // a LoRA run: checkpoints hold the adapter (PEFT layout), not the base
  std::string base_model;              // the base model folder of a LoRA run
};

std::string checkpoint_name(int64_t step);

// One process's checkpoint (a world of one through write_checkpoint): writes ROOT/step_N atomically and points
// ROOT/latest at it; keeps the newest `keep` checkpoints (0: all). Returns the folder written.
std::string save_checkpoint(const std::string& root, int64_t step, models::Model& model,
                            const TrainableSet& trainable, optim::AdamW& opt, const nlohmann::json& trainer_state,
                            const std::string& tokenizer_src, int keep);

// Where this process stands among the writers of a checkpoint (the default: a world of one).
struct CheckpointRanks {
  int rank = 0, world = 1;        // in the job; rank 0 writes the indexes and metadata
  int writer = 0, writers = 1;    // among the ranks holding the same whole tensors: each writes every writers-th one
  std::function<void()> barrier = [] {};
  std::string layout = "single process";
};
// The one checkpoint writer (ema: the weight average by parameter name, whole; written as DIR/ema): every rank writes its share of the whole weights (by checkpoint name; LoRA runs: the
// adapter by parameter name) and of the optimizer moments (by parameter name) into <stem>-rank-R.safetensors, rank
// 0 the indexes (model.safetensors.index.json, the format transformers reads; optimizer.index.json), config.json,
// tokenizer files and trainer_state.json (LoRA: PEFT's adapter_config.json + adapter_model.safetensors instead of the
// weights). A world of one writes model.safetensors and optimizer.safetensors without indexes. Collective (barrier).
std::string write_checkpoint(const std::string& root, int64_t step, const CheckpointRanks& ranks,
                             const std::map<std::string, at::Tensor>& weights,
                             const std::map<std::string, at::Tensor>& exp_avg,
                             const std::map<std::string, at::Tensor>& exp_avg_sq, int64_t optimizer_steps,
                             const models::Model& model, const TrainableSet& trainable,
                             const nlohmann::json& trainer_state, const std::string& tokenizer, int keep,
                             const std::map<std::string, at::Tensor>& ema = {});
// The folder of a checkpoint's weight average (ema.*): DIR/ema, a model folder like DIR itself with the averaged
// values of the trained parameters (the rest as in DIR).
std::string ema_dir(const std::string& checkpoint_dir);
// The file of rank R's share: <stem>.safetensors in a world of one, else rank_file.
std::string shard_file(const std::string& stem, int rank, int world);

// The steps of write_checkpoint, for engines that write a checkpoint from several processes: a fresh temporary
// folder for step N (unique: named after this process; else the same name on every rank of a job); then, once
// every file is in it, fsync + rename into ROOT/step_N + point ROOT/latest at it + prune to `keep`.
std::string begin_checkpoint(const std::string& root, int64_t step, bool unique);
std::string commit_checkpoint(const std::string& root, int64_t step, const std::string& tmp_dir, int keep);
at::Tensor cpu_rng_state();
void set_cpu_rng_state(const at::Tensor& state);
void checkpoint_test_delay();  // LOONGFORGE_TEST_SAVE_DELAY_MS (tests interrupt saves in that window)

// The optimizer part of a checkpoint: optimizer.safetensors (one process) or the per-rank files named by
// optimizer.index.json (distributed runs). Keys "exp_avg.<name>", "exp_avg_sq.<name>".
class OptimizerStateReader {
 public:
  explicit OptimizerStateReader(const std::string& dir);
  at::Tensor tensor(const std::string& key);  // lf::Error naming the file and key when missing
  int64_t steps() const { return steps_; }
  int saved_world() const { return world_; }

 private:
  std::string dir_;
  std::map<std::string, std::string> file_of_;  // parameter name -> file (distributed)
  std::map<std::string, std::shared_ptr<io::SafetensorsFile>> open_;
  int64_t steps_ = 0;
  int world_ = 1;
};

// The folder ROOT/latest points at, if any (lf::Error if `latest` names a missing folder).
std::optional<std::string> latest_checkpoint(const std::string& root);

// The buffers that are checkpoint tensors (e.g. MoE routers' correction biases), as the model lists them.
std::map<std::string, std::string> checkpoint_buffers(const models::Model& model);  // buffer -> checkpoint name
// Whole tensors by parameter name -> by checkpoint name (Model::checkpoint_tensors: stacked expert parameters become
// the per-expert tensors a single-process run and the Hub's checkpoints use).
std::map<std::string, at::Tensor> to_checkpoint_names(const models::Model& model,
                                                      const std::map<std::string, at::Tensor>& by_param);
// The whole parameter `name` from a checkpoint: stored under its own name, or assembled from its per-expert
// checkpoint tensors. `dir` names the checkpoint in errors.
at::Tensor read_whole(const io::SafetensorsCheckpoint& ckpt, const models::Model& model, const std::string& name,
                      const std::string& dir);
// "<stem>-rank-00003.safetensors": a distributed checkpoint's per-rank file.
std::string rank_file(const std::string& stem, int rank);

// Restores weights, optimizer moments and step, and the RNG; returns trainer_state.json.
nlohmann::json load_checkpoint(const std::string& dir, models::Model& model,
                               const TrainableSet& trainable, optim::AdamW& opt);

}  // namespace lf::train

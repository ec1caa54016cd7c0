// Builders from a recipe: the model bundle (family from the registry, LoRA, freezing, weight decay groups), the
// batch source of data.format, and the device the run takes.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "loongforge/data/pretrain_dataset.h"
#include "loongforge/optim/schedule.h"
#include "loongforge/train/batch.h"
#include "loongforge/train/engine.h"

namespace lf::train {

// The model of model.path / model.config (model.family), with moe.*, model.recompute, lora.* and model.freeze /
// optim.no_decay applied.
ModelBundle build_model(const nlohmann::json& recipe);
// The batch source of the recipe's data block for `split`; `model` (when given) says whether batches carry images
// (Model::image_tokens; preprocessed as model.path's preprocessor_config.json says, data.image_root / image_backend).
std::unique_ptr<BatchSource> build_data(const nlohmann::json& recipe, data::Split split, const std::string& tokenizer,
                                        const models::Model* model = nullptr);
// The robot batch source's options of a recipe with data.format: robot (train/robot_source.h), checked.
struct RobotSourceOptions;
RobotSourceOptions robot_source_options(const nlohmann::json& recipe, data::Split split);
// The engines' options from the recipe (optim.*, precision, train.*, parallel.*, moe.guest_slots/ranks_per_node),
// checked: a bad value is one line naming the key.
EngineOptions engine_options(const nlohmann::json& recipe);
// What the training loop itself takes from the recipe (the engines take EngineOptions), read once.
struct RunOptions {
  uint64_t seed = 0;                  // seed
  int threads = 0;                    // train.threads (0: leave ATen's default)
  std::string output_dir;             // output_dir
  int64_t steps = 0, stop_at_step = 0;  // train.steps, train.stop_at_step (0: none)
  bool skip_nonfinite = false;        // train.on_nonfinite: skip (else stop) a step whose loss or gradient is NaN / inf
  optim::Schedule schedule;           // schedule.*, optim.lr; total_steps = steps
  double clip = 1.0;                  // optim.clip
  bool distributed = false;           // a layout other than one process, or launched as several processes
  bool fp8 = false, fp8_blockwise = false;  // precision: fp8, fp8_scaling: blockwise
  bool validate = false;              // data.valid_fraction > 0
  bool balance = false;               // data.balance: cost (rows placed on data-parallel ranks by cost)
  int64_t eval_every = 0, eval_batches = 0;  // eval.every, eval.batches
  int64_t log_every = 1;              // log.every (at least 1)
  std::string progress = "auto";      // log.progress
  bool tensorboard = false, plot = false;  // log.tensorboard, log.plot
  double peak_tflops = 0;             // log.peak_tflops
  int64_t checkpoint_every = 0;       // checkpoint.every
  int keep = 0;                       // checkpoint.keep
  std::string model_path, model_family, tokenizer;  // model.path, model.family, model.tokenizer (or model.path)
};
RunOptions run_options(const nlohmann::json& recipe);

// The recipe's device after checking what this machine has. device: cuda without a usable GPU prints one line and
// gives the CPU (train.cuda_graphs then has nothing to capture and is ignored); precision: fp8 needs the GPU. A
// distributed run (any layout) gives each rank its local rank's GPU (modulo the GPUs it sees).
at::Device choose_device(const nlohmann::json& recipe, bool distributed);
// precision: fp8: every Linear of the model's blocks (not the output head, not the embedding) runs its GEMMs in
// e4m3 with tensorwise scales (kernels::cuda::fp8_linear) or, with fp8_scaling: blockwise, 1 x 128 / 128 x 128
// block scales (kernels::cuda::fp8_linear_blockwise, where the shapes are multiples of 128; tensorwise otherwise);
// shapes _scaled_mm cannot take stay in bf16.
void use_fp8_linears(models::Model& model, bool blockwise);

}  // namespace lf::train

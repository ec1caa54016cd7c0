// Builders from a recipe: the model bundle (family from the registry, LoRA, freezing, weight decay groups), the
// batch source of data.format, and the device the run takes.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "loongforge/data/pretrain_dataset.h"
#include "loongforge/train/batch.h"
#include "loongforge/train/engine.h"

namespace lf::train {

// The model of model.path / model.config (model.family), with moe.*, model.recompute, lora.* and model.freeze /
// optim.no_decay applied.
ModelBundle build_model(const nlohmann::json& recipe);
// The batch source of the recipe's data block for `split`.
std::unique_ptr<BatchSource> build_data(const nlohmann::json& recipe, data::Split split, const std::string& tokenizer);
// The engines' options from the recipe (optim.*, precision, train.*, parallel.*, moe.guest_slots/ranks_per_node),
// checked: a bad value is one line naming the key.
EngineOptions engine_options(const nlohmann::json& recipe);
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

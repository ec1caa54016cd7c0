// PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors) <-> nn/lora.h adapters.
//
// PEFT names a parameter "base_model.model.<module>.lora_A.weight" (in memory "...lora_A.default.weight"; both are
// accepted on load). Only plain LoRA is supported: config fields that would change the arithmetic (DoRA, bias
// training, modules_to_save, rank/alpha patterns, layer selection, ...) are lf::Errors naming the file and field.
#pragma once
#include <torch/nn/module.h>

#include <string>

#include "loongforge/io/safetensors.h"
#include "loongforge/nn/lora.h"

namespace lf::io {

// "model.layers.0.self_attn.q_proj.lora_A.weight" -> "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
std::string peft_name(const std::string& name);

// Reads DIR/adapter_config.json (the LoRA settings; throws lf::Error naming the file and field).
nn::LoraConfig read_peft_config(const std::string& dir);

// Applies the adapter of DIR to `root` (apply_lora with its config) and loads its weights (converted to the
// parameters' dtype). Missing, misshapen or unexpected tensors are errors naming the file and the tensor. Returns the
// adapter parameters, as apply_lora does.
NamedTensors load_peft_adapter(const std::string& dir, torch::nn::Module& root);

// Writes DIR/adapter_config.json and DIR/adapter_model.safetensors (each atomically; DIR is created) for the adapters
// attached to `root` with `cfg`, in a form PeftModel.from_pretrained loads. Target entries "re:P" are written as one
// PEFT regex string (plain names become "(.*\.)?name").
void save_peft_adapter(const std::string& dir, torch::nn::Module& root, const nn::LoraConfig& cfg,
                       const std::string& base_model_name_or_path = "");
// The same files from adapter tensors given by their model names ("model.layers.0.self_attn.q_proj.lora_A.weight"),
// e.g. whole tensors gathered from the ranks of a distributed run. TASK_TYPE: the config's task_type ("": null, as
// LeRobot's policies' adapters have it, so PeftModel.from_pretrained wraps them in a plain PeftModel).
void save_peft_tensors(const std::string& dir, const NamedTensors& params, const nn::LoraConfig& cfg,
                       const std::string& base_model_name_or_path = "", const std::string& task_type = "CAUSAL_LM");

}  // namespace lf::io

// Hugging Face folders <-> LoongForge models. Parameter names are the HF names, so loading and exporting are a
// name-for-name copy: config.json + model.safetensors (or sharded with model.safetensors.index.json) + tokenizer files.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/llama/model.h"

namespace lf::io {

// Loads DIR/config.json and the weights (single or sharded safetensors, any float dtype) into a model whose
// parameters have dtype `dtype`. Missing or misshapen tensors are errors naming the file and the tensor.
models::llama::CausalLM load_causal_lm(const std::string& dir, at::ScalarType dtype = at::kFloat);

// Copies checkpoint tensors into the module's parameters by name; `file_hint` names the folder in errors.
void load_state(torch::nn::Module& module, const std::string& dir);

// Every checkpoint tensor name of a module with the model tensor it fills (a view: copy_ into it loads, reading it
// exports): for a CausalLM models::llama::checkpoint_tensors (per-expert checkpoint tensors <-> slices of the
// stacked expert parameters, buffers like e_score_correction_bias), else the parameters by name.
std::vector<std::pair<std::string, at::Tensor>> checkpoint_targets(torch::nn::Module& module);

// Writes a Hugging Face folder that transformers loads: config.json (with "dtype" set), the weights in `dtype`
// (sharded above max_shard_bytes, like save_pretrained), generation_config.json and tokenizer files copied from
// tokenizer_src (when given and present). Files are written atomically; an existing OUT's other files are kept.
void export_hf(models::llama::CausalLMImpl& model, const std::string& out_dir, at::ScalarType dtype,
               size_t max_shard_bytes = size_t(5) << 30, const std::string& tokenizer_src = "");

// The files of a HF folder besides the weights: config.json (with "dtype"), and generation_config.json and
// tokenizer files copied from tokenizer_src when given and present.
void write_hf_metadata(const models::llama::DecoderConfig& config, const std::string& out_dir, at::ScalarType dtype,
                       const std::string& tokenizer_src = "");

}  // namespace lf::io

// Model folders <-> LoongForge models, for every registered family: config.json (the family comes from the registry,
// models/registry.h) + the weights (model.safetensors, or sharded with model.safetensors.index.json) + tokenizer
// files. Parameter names are the checkpoint's names up to the family's declarative map (Model::checkpoint_tensors),
// so loading and exporting are a name-for-name copy.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/models/registry.h"

namespace lf::io {

// Builds the model DIR/config.json describes (`family`: the recipe's model.family where the config alone cannot
// tell) and loads its weights (any float dtype) into parameters of dtype `dtype`. Missing, unexpected or misshapen
// tensors are errors naming the file and the tensor.
std::shared_ptr<models::Model> load_model(const std::string& dir, at::ScalarType dtype = at::kFloat,
                                          const std::string& family = "");

// Copies the checkpoint tensors of DIR into the model (by the family's checkpoint names).
void load_state(models::Model& model, const std::string& dir);
// Copies a part's folder into the model's checkpoint tensors (Composition::Part): stored name n fills the tensor
// canonical_checkpoint_name(part.prefix + n); every tensor the part takes must be there (errors name DIR and the
// tensor); stored tensors that fill none (a CLIP folder's text tower, a whole VLM's language model) are skipped.
void load_part(models::Model& model, const models::Composition::Part& part);
// A model composed from parts' folders (models::compose): built from the composition's config, initialised as for
// training from scratch (init_std < 0: the config's), then each part loaded (load_part).
std::shared_ptr<models::Model> load_composed(const models::Composition& c, double init_std = -1,
                                             at::ScalarType dtype = at::kFloat);

// Writes a folder the family's ecosystem loads (transformers' from_pretrained for the decoder LMs): config.json
// (with "dtype" set), the weights in `dtype` (sharded above max_shard_bytes, like save_pretrained), and
// generation_config.json and tokenizer files copied from tokenizer_src (when given and present). Files are written
// atomically; an existing OUT's other files are kept.
void export_model(models::Model& model, const std::string& out_dir, at::ScalarType dtype,
                  size_t max_shard_bytes = size_t(5) << 30, const std::string& tokenizer_src = "");

// The files of a model folder besides the weights: config.json (the model's, with "dtype"), and
// generation_config.json and tokenizer files copied from tokenizer_src when given and present.
void write_model_metadata(const models::Model& model, const std::string& out_dir, at::ScalarType dtype,
                          const std::string& tokenizer_src = "");

}  // namespace lf::io

// LLaVA (transformers' LlavaForConditionalGeneration): a CLIP or SigLIP vision tower, a two-layer projector
// (linear_1 -> act -> linear_2) and a decoder language model; each image's selected tower features
// (vision_feature_layer: one layer or several concatenated; "default" strategy drops the first token) replace the
// image tokens of input_ids in order.
//
// On the contract (models/model.h) the tower and projector run inside embed(), so they sit before the language
// model's blocks: pipeline stage 0 holds them, tensor parallelism leaves them replicated (the plan names only the
// language model's modules), FSDP wraps them with the embedding.
//
// Module names follow the key layout transformers 5 writes (`vision_tower.encoder.layers.N...`,
// `multi_modal_projector.linear_1`, `language_model.model.layers.N...`, `language_model.lm_head`); loading also
// takes llava-hf's `vision_tower.vision_model.*` and the in-memory `model.*` names; `dump` names gradients as
// transformers' named_parameters() does (`model.language_model.layers.N...`, `lm_head.weight`).
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "loongforge/models/llama/model.h"
#include "loongforge/models/model.h"
#include "loongforge/models/registry.h"
#include "loongforge/models/vision/vit.h"
#include "loongforge/models/vlm/base.h"
#include "loongforge/nn/linear.h"

namespace lf::models::vlm {

struct LlavaConfig {
  vision::VitConfig vision;
  llama::DecoderConfig text;
  int64_t image_token_id = 32000;
  std::vector<int64_t> feature_layers;  // vision_feature_layer, as given (negative: from the end)
  bool feature_layer_list = false;      // given as a list (features concatenated)
  std::string select_strategy = "default";  // default (drop the first token) | full
  std::string projector_act = "gelu";
  bool projector_bias = true;
  nlohmann::json raw;

  // Index into the tower's hidden_states of each feature layer.
  std::vector<int64_t> feature_indices() const;
  // Image tokens per image.
  int64_t tokens_per_image() const { return vision.num_positions() - (select_strategy == "default" ? 1 : 0); }
  static LlavaConfig from_json(const nlohmann::json& j, const std::string& file);
};

class ProjectorImpl : public torch::nn::Module {
 public:
  ProjectorImpl(int64_t in, int64_t out, bool bias, std::string act);
  at::Tensor forward(const at::Tensor& x);
  nn::Linear linear_1{nullptr}, linear_2{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(Projector);

class LlavaImpl : public VisionLanguageModel {
 public:
  explicit LlavaImpl(LlavaConfig c);

  std::string family() const override { return "vlm"; }
  std::string model_type() const override { return "llava"; }
  const nlohmann::json& config_json() const override { return config_.raw; }
  void init_weights(double std) override;
  // The decoder LM's fields plus pixel_values [images, C, H, W] (float), the images of the batch in the order of
  // their image tokens (row by row); pixel_values.row [images] gives each image's row (Batch::rows splits by it).
  BatchSchema batch_schema() const override;
  at::Tensor embed(const Batch& b) override;
  Batch block_inputs(const Batch& b, at::ScalarType dtype) const override {
    return language_model->block_inputs(b, dtype);
  }
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;
  // the language model's terms plus the vision tower's (load balancing)
  TrainWork train_work() const override;
  std::optional<ImageTokens> image_tokens() const override {
    return ImageTokens{config_.image_token_id, config_.tokens_per_image()};
  }
  bool set_pre_recompute(bool on) override {
    vision_tower->recompute = on;
    return true;
  }
  std::vector<CheckpointTensor> checkpoint_tensors() const override;
  bool ignorable_checkpoint_tensor(const std::string& name) const override;
  std::string canonical_checkpoint_name(const std::string& stored) const override;
  std::string reference_name(const std::string& checkpoint_name) const override;

  // The projected features of images [N, C, H, W]: [N, tokens_per_image, text hidden].
  at::Tensor image_features(const at::Tensor& pixel_values);
  // Text embeddings of ids with the image features scattered into the image tokens (`where` names the batch in
  // errors: the counts must match).
  at::Tensor merged_embeddings(const at::Tensor& ids, const at::Tensor& pixel_values, const std::string& where);
  const LlavaConfig& config() const { return config_; }

  vision::VisionTower vision_tower{nullptr};
  Projector multi_modal_projector{nullptr};

 protected:
  std::vector<std::string> vision_modules() const override { return {"vision_tower", "multi_modal_projector"}; }

 private:
  LlavaConfig config_;
};
TORCH_MODULE(Llava);

// Registry pieces of model_type llava (models/vlm/family.h lists them in the vision-language family).
std::shared_ptr<Model> build_llava(const nlohmann::json& config, const std::string& file);
// A LLaVA composed from a CLIP / SigLIP vision folder (a vision model's, or a whole CLIP / SigLIP model's: its
// vision_config and vision_model.* weights) and a decoder LM folder, joined by an mlp2x_gelu projector (transformers'
// LlavaMultiModalProjector); the config transformers' LlavaConfig reads. Errors name the parts' files and fields.
Composition compose_llava(const ComposeParts& parts);
nlohmann::json describe_llava(const nlohmann::json& config, const std::string& file);

}  // namespace lf::models::vlm

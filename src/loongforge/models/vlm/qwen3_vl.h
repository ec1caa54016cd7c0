// Qwen3-VL (transformers' Qwen3VLForConditionalGeneration): the Qwen3-VL vision tower (models/vision/qwen3_vit.h)
// and a Qwen3 decoder (q/k norms) with interleaved multimodal RoPE. As in Qwen2.5-VL (qwen_vl.h, whose positions,
// batch fields and checks it shares) each image's merged features replace its image tokens and the positions are
// get_rope_index's; the rotary frequencies interleave instead of forming sections: frequency j turns with the row
// position when j % 3 == 1 (j < 3 * mrope_section[1]), with the column when j % 3 == 2 (j < 3 * mrope_section[2]),
// else with the temporal one.
//
// Deepstack: the tower's deepstack features (one per deepstack_visual_indexes entry) are added to the hidden states
// at the image tokens after decoder blocks 0, 1, ... On the contract: embed() runs the tower and keeps the features
// of its batch; block_inputs() hands them (deepstack.K [image tokens, hidden]) with the image token mask
// (visual_mask [B,T]) to the blocks, and block_forward(i) adds deepstack.i after block i. The blocks that take
// deepstack features must run on the stage that ran embed() (pipeline stage 0), without recomputation or FSDP units
// (their gradients would not reach the tower): block_forward says so in one line instead.
//
// Qwen3.5 (transformers' Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, model_type qwen3_5 /
// qwen3_5_moe) is this model with a tower without deepstack (Qwen3_5VisionModel) and the qwen3_5_text /
// qwen3_5_moe_text decoder (Gated DeltaNet + gated full attention, models/llama/gated_deltanet.h) whose partial
// rotary features (rotary_dim = head_dim x partial_rotary_factor) take the interleaved sections (default 11, 11, 10);
// its positions are Qwen3-VL's get_rope_index.
//
// Module names: `visual.*` (the tower) and `language_model.{model,lm_head}.*`. Checkpoints use the key layout
// save_pretrained writes, transformers' in-memory names (`model.visual.*`, `model.language_model.*`,
// `lm_head.weight`); loading also takes the Qwen2.5-VL-style layout (`visual.*`, `model.*`).
#pragma once
#include <nlohmann/json.hpp>

#include <deque>
#include <mutex>

#include <map>
#include <string>
#include <vector>

#include "loongforge/models/llama/model.h"
#include "loongforge/models/model.h"
#include "loongforge/models/vision/qwen3_vit.h"
#include "loongforge/models/vlm/base.h"

namespace lf::models::vlm {

struct Qwen3VLConfig {
  std::string model_type = "qwen3_vl";  // or qwen3_5 / qwen3_5_moe
  vision::Qwen3VitConfig vision;
  llama::DecoderConfig text;
  int64_t image_token_id = 151655, video_token_id = 151656;
  int64_t vision_start_token_id = 151652, vision_end_token_id = 151653;
  nlohmann::json raw;

  static Qwen3VLConfig from_json(const nlohmann::json& j, const std::string& file);
};

class Qwen3VLImpl : public VisionLanguageModel {
 public:
  explicit Qwen3VLImpl(Qwen3VLConfig c);

  std::string family() const override { return "vlm"; }
  std::string model_type() const override { return config_.model_type; }
  const nlohmann::json& config_json() const override { return config_.raw; }
  // the language model's terms plus the vision tower's (load balancing)
  TrainWork train_work() const override;
  void init_weights(double std) override;
  BatchSchema batch_schema() const override;  // as Qwen2.5-VL's (videos without second_per_grid_ts)
  at::Tensor embed(const Batch& b) override;
  // cos, sin of the multimodal positions (per packed document of segment_ids), segment_ids; with images,
  // visual_mask and the deepstack features embed() made.
  Batch block_inputs(const Batch& b, at::ScalarType dtype) const override;
  at::Tensor position_ids(const Batch& b) const override;
  std::optional<ImageTokens> image_tokens() const override {
    return ImageTokens{config_.image_token_id, 0, config_.vision_start_token_id, config_.vision_end_token_id};
  }
  bool set_pre_recompute(bool on) override {
    visual->recompute = on;
    return true;
  }
  // input_ids, optional labels, pixel_values + image_grid_thw, optional mm_token_type_ids and attention_mask.
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;
  std::vector<CheckpointTensor> checkpoint_tensors() const override;
  bool ignorable_checkpoint_tensor(const std::string& name) const override;
  std::string canonical_checkpoint_name(const std::string& stored) const override;
  // checkpoint names are transformers' in-memory names; a module path `dump` asks for (stacked experts, which no
  // single checkpoint tensor names) is placed as transformers places it
  std::string reference_name(const std::string& checkpoint_name) const override;
  const Qwen3VLConfig& config() const { return config_; }

  vision::Qwen3VisionTower visual{nullptr};

 protected:
  std::vector<std::string> vision_modules() const override { return {"visual"}; }
  // transformers' _deepstack_process: the first blocks add the deepstack features at the image tokens.
  at::Tensor block_extra(const Batch& in, at::Tensor y, int64_t i) override;

 private:
  // Text embeddings with the images' merged features in their image tokens and the videos' in their video tokens;
  // *deepstack gets the deepstack features of every visual token (images and videos) in sequence order.
  at::Tensor merged_embeddings(const at::Tensor& ids, const at::Tensor& pixel_values, const at::Tensor& grid_thw,
                               const std::string& where, std::vector<at::Tensor>* deepstack,
                               const at::Tensor& video_pixels = {}, const at::Tensor& video_grid = {});
  // cos, sin and, with deepstack features, visual_mask and deepstack.K. Videos' positions: each frame on its own
  // (transformers splits video_grid_thw per frame: the frames are separated by timestamp text).
  Batch blocks_batch(const at::Tensor& ids, const at::Tensor& rope_mask, const at::Tensor& grid,
                     const std::vector<at::Tensor>& deepstack, at::ScalarType dtype, const std::string& where,
                     const at::Tensor& segment_ids = {}, const at::Tensor& video_rope_mask = {},
                     const at::Tensor& video_grid = {}) const;

  Qwen3VLConfig config_;
  // The deepstack features of the batch embed() ran last (its input_ids, to match block_inputs' batch).
  // Engines may run embed() on several micro-batches or row parts (threads) before their block_inputs(): the
  // last few, under a lock.
  struct Stashed {
    at::Tensor ids;
    std::vector<at::Tensor> deepstack;
  };
  mutable std::mutex stash_mutex_;
  std::deque<Stashed> stash_;
};
TORCH_MODULE(Qwen3VL);

// Registry pieces of model_types qwen3_vl, qwen3_5 and qwen3_5_moe (models/vlm/family.h lists them in the vision-language family).
std::shared_ptr<Model> build_qwen3_vl(const nlohmann::json& config, const std::string& file);
nlohmann::json describe_qwen3_vl(const nlohmann::json& config, const std::string& file);

}  // namespace lf::models::vlm

// Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): the Qwen2.5-VL vision tower and patch merger
// (models/vision/qwen_vit.h) and a Qwen2 decoder with multimodal RoPE. Each image's merged features replace its
// image tokens (image_token_id) in order; positions are transformers' get_rope_index: text tokens count on from the
// previous token, an image's tokens get (temporal, row, column) positions on its merged grid offset by the position
// where the image starts, and the text after an image continues at that start + max(rows, columns). The rotary
// frequencies are split into mrope_section (temporal, height, width) sections, each turned by its own position.
//
// On the contract (models/model.h) the tower and merger run inside embed(), before the language model's blocks:
// pipeline stage 0 holds them, tensor parallelism leaves them replicated (the plan names only the language model's
// modules). Batches carry the images as item fields: pixel_values [patches, C * T * P * P] with pixel_values.row
// (each patch's row) and image_grid_thw [images, 3] with image_grid_thw.row.
//
// Module names: `visual.*` (the tower, as the checkpoint) and `language_model.{model,lm_head}.*` (a decoder LM).
// Checkpoints use the key layout save_pretrained writes (`visual.*`, `model.*`, `lm_head.weight`); loading also
// takes transformers' in-memory names (`model.visual.*`, `model.language_model.*`), which `dump` names gradients by.
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/llama/model.h"
#include "loongforge/models/model.h"
#include "loongforge/models/registry.h"
#include "loongforge/models/vision/qwen_vit.h"
#include "loongforge/models/vlm/base.h"

namespace lf::models::vlm {

struct QwenVLConfig {
  vision::QwenVitConfig vision;
  llama::DecoderConfig text;
  int64_t image_token_id = 151655, video_token_id = 151656;
  int64_t vision_start_token_id = 151652, vision_end_token_id = 151653;  // around each image's run of tokens
  nlohmann::json raw;

  static QwenVLConfig from_json(const nlohmann::json& j, const std::string& file);
};

class QwenVLImpl : public VisionLanguageModel {
 public:
  explicit QwenVLImpl(QwenVLConfig c);

  std::string family() const override { return "vlm"; }
  std::string model_type() const override { return "qwen2_5_vl"; }
  const nlohmann::json& config_json() const override { return config_.raw; }
  // the language model's terms plus the vision tower's (load balancing)
  TrainWork train_work() const override;
  void init_weights(double std) override;
  // input_ids, targets [B,T]; pixel_values [patches, C*T*P*P] and image_grid_thw [images, 3] (item fields with
  // .row), the images in the order of their image tokens.
  BatchSchema batch_schema() const override;
  at::Tensor embed(const Batch& b) override;
  // cos, sin of the multimodal positions of input_ids and image_grid_thw (restarting at each packed document of
  // segment_ids, when given, as if each were its own sample), and segment_ids.
  Batch block_inputs(const Batch& b, at::ScalarType dtype) const override;
  at::Tensor position_ids(const Batch& b) const override;
  // As many tokens per image as its merged grid gives, between <|vision_start|> and <|vision_end|>.
  std::optional<ImageTokens> image_tokens() const override {
    return ImageTokens{config_.image_token_id, 0, config_.vision_start_token_id, config_.vision_end_token_id};
  }
  bool set_pre_recompute(bool on) override {
    visual->recompute = on;
    return true;
  }
  // input_ids, optional labels, pixel_values + image_grid_thw, optional mm_token_type_ids (1 marks image tokens;
  // default: the image_token_id tokens) and attention_mask (all ones).
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;
  std::vector<CheckpointTensor> checkpoint_tensors() const override;
  bool ignorable_checkpoint_tensor(const std::string& name) const override;
  std::string canonical_checkpoint_name(const std::string& stored) const override;
  std::string reference_name(const std::string& checkpoint_name) const override;

  // transformers' get_rope_index: [3, B, T] positions of ids [B,T] whose image tokens (where image_mask [B,T] is
  // true) hold the images of grid_thw [images, 3] in order; with segment_ids [B,T], each packed document's
  // positions start again at 0. `where` names the batch in errors.
  at::Tensor rope_index(const at::Tensor& ids, const at::Tensor& image_mask, const at::Tensor& grid_thw,
                        const std::string& where, const at::Tensor& segment_ids = {}) const;
  // Text embeddings with the images' merged features in their image tokens (the counts must match), and the
  // videos' in their video tokens when video_pixels is defined.
  at::Tensor merged_embeddings(const at::Tensor& ids, const at::Tensor& pixel_values, const at::Tensor& grid_thw,
                               const at::Tensor& image_mask, const std::string& where,
                               const at::Tensor& video_pixels = {}, const at::Tensor& video_grid = {});
  const QwenVLConfig& config() const { return config_; }

  vision::QwenVisionTower visual{nullptr};

 protected:
  std::vector<std::string> vision_modules() const override { return {"visual"}; }

 private:
  QwenVLConfig config_;
};
TORCH_MODULE(QwenVL);

// Pieces the Qwen VL models (Qwen2.5-VL here, Qwen3-VL in qwen3_vl.h) share.
// The decoder of config.json `j` (its text_config, or the top-level fields) as transformers' `decoder` model_type,
// `defaults` filling absent fields, the multimodal rope sections checked (absent: `default_sections`).
llama::DecoderConfig qwen_vl_text_config(const nlohmann::json& j, const std::string& file, const std::string& decoder,
                                         const std::vector<std::pair<const char*, nlohmann::json>>& defaults,
                                         const std::vector<int64_t>& default_sections);
// image_token_id / video_token_id of `j` (kept when absent), checked against the vocabulary; the vision tower's
// out_hidden_size against the decoder's hidden_size.
// and vision_start_token_id / vision_end_token_id likewise.
void qwen_vl_tokens(const nlohmann::json& j, const std::string& file, int64_t vocab, int64_t vision_out,
                    int64_t text_hidden, int64_t* image_token_id, int64_t* video_token_id,
                    int64_t* vision_start_token_id, int64_t* vision_end_token_id);
// input_ids, targets, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw and, with video_seconds
// (Qwen2.5-VL), second_per_grid_ts.
BatchSchema qwen_vl_batch_schema(const llama::CausalLMImpl& lm, bool video_seconds);
// Videos (Qwen2.5-VL): where their tokens are, their grids [videos, 3], seconds per temporal patch [videos] (float;
// undefined: 1 each) and the tower's tokens_per_second: frame k of a video sits at temporal position
// start + trunc(k * tokens_per_second * seconds), computed in float32 as transformers does.
struct QwenVideos {
  at::Tensor mask, grid_thw, second_per_grid;
  int64_t tokens_per_second = 4;
};
// transformers' get_rope_index with spatial merge size m (QwenVLImpl::rope_index), images and (when given) videos.
at::Tensor qwen_rope_index(const at::Tensor& ids, const at::Tensor& image_mask, const at::Tensor& grid_thw, int64_t m,
                           const std::string& where, const at::Tensor& segment_ids = {},
                           const QwenVideos* videos = nullptr);
// The number of images of grid_thw; an error naming `where` unless image_mask holds as many image tokens as they give.
int64_t qwen_check_image_tokens(const at::Tensor& image_mask, const at::Tensor& grid_thw, int64_t merge_unit,
                                int64_t image_token_id, const std::string& where);
// A dump batch's images (pixel_values, image_grid_thw: checked, undefined when absent) and the image tokens positions
// are grouped by (mm_token_type_ids == 1, default: the image_token_id tokens); errors name `file`.
struct QwenImages {
  at::Tensor pixel_values, grid_thw, rope_mask;
  // videos (pixel_values_videos, video_grid_thw, second_per_grid_ts; their positions grouped by mm_token_type_ids
  // == 2, default: the video_token_id tokens); undefined when the batch has none
  at::Tensor video_pixels, video_grid, second_per_grid, video_rope_mask;
};
// video_token_id < 0: the family takes no videos (they are an error naming the tensor).
QwenImages qwen_reference_images(const std::map<std::string, at::Tensor>& batch, const at::Tensor& ids,
                                 int64_t image_token_id, const std::string& file, int64_t video_token_id = -1);

// Registry pieces of model_type qwen2_5_vl (models/vlm/family.h lists them in the vision-language family).
std::shared_ptr<Model> build_qwen_vl(const nlohmann::json& config, const std::string& file);
nlohmann::json describe_qwen_vl(const nlohmann::json& config, const std::string& file);

}  // namespace lf::models::vlm

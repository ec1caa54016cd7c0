// LeRobot's GR00T N1.7 policy (GrootPolicy, config type "groot"), with LeRobot's parameter names
// (_groot_model.backbone.model.model.{visual, language_model}.*, _groot_model.action_head.*):
//   backbone: a Qwen3-VL (models/vlm/qwen3_vl.h) cut to its first select_layer decoder layers; the features are the
//     last kept layer's output before the final norm (deepstack features added in the first layers as transformers
//     does), with the image-token mask and the attention mask;
//   action head: vlln (LayerNorm) and vl_self_attention (SelfAttentionTransformer: LayerNorm blocks, no mask) over the
//     features; the state through state_encoder (a per-embodiment MLP: CategorySpecificLinear, ReLU,
//     CategorySpecificLinear; weights W [embodiments, in, out], b [embodiments, out] picked by embodiment_id); the
//     noisy action chunk through action_encoder (W1, then W2 over [W1 x, sin/cos of the discretised time], swish, W3)
//     plus position_embedding; [state token, action tokens] through the DiT `model` (AlternateVLDiT, or DiT):
//     timestep_encoder (diffusers' Timesteps(256, flip_sin_to_cos, shift 1) -> linear_1 -> SiLU -> linear_2) and
//     transformer blocks whose norm1 is an adaptive LayerNorm on the time (scale, shift), even blocks
//     cross-attending to the VL features (AlternateVLDiT: every 2 x attend_text_every_n_blocks-th block to the
//     non-image tokens, the other even blocks to the image tokens, both under the attention mask), odd blocks
//     self-attending; GELU(tanh) feed-forward; the output LayerNorm shifted and scaled by proj_out_1(SiLU(time)),
//     proj_out_2; action_decoder (a per-embodiment MLP) of the last action_horizon tokens: the velocity.
// Flow matching (GR00T's convention: t = 1 is the data): x_t = (1 − t)·noise + t·action, target action − noise,
// t = (1 − Beta(1.5, 1))·noise_s, the time given to the encoders as floor(t·num_timestep_buckets); loss = Σ (v − target)²
// · action_mask / (Σ action_mask + 1e-6). Sampling: num_inference_timesteps Euler steps from noise at t = 0.
// The batch is GR00T's processed one (what GrootPolicy.forward receives): state [B, 1, max_state_dim], action and
// action_mask [B, action_horizon, max_action_dim], embodiment_id [B], input_ids / attention_mask [B, L] (prompts
// padded on the left, as LeRobot's processor pads them: the pads get transformers' features, no attention output and
// each layer's MLP; right padding is refused), pixel_values [patches, C·T·P·P] with image_grid_thw [images, 3]; the
// robot batch source makes it from a dataset through policy_spec / prompts / pack_batch; `dump` takes the draws `noise`
// [B, action_horizon, max_action_dim], `time` [B] (GR00T's t) and the sampler's start `sample_noise`.
// The architecture is read as LeRobot reads it: the policy's config.json names base_model_path, a folder whose
// config.json is GR00T N1.7's model config (diffusion_model_cfg, select_layer, ...; GR00T_N1_7_DEFAULTS for absent
// fields), whose model_name is a folder with the Qwen3-VL config.json (or nvidia/Cosmos-Reason2-2B, known here).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <map>
#include <string>
#include <vector>

#include "loongforge/models/policy/common.h"
#include "loongforge/models/vlm/qwen3_vl.h"
#include "loongforge/nn/linear.h"

namespace lf::models::policy {

// diffusers' BasicTransformerBlock stack settings (a DiT's diffusion_model_cfg or vl_self_attention_cfg).
struct GrootBlocksConfig {
  int64_t num_layers = 12, num_attention_heads = 8, attention_head_dim = 64, output_dim = 26;
  double dropout = 0.1, norm_eps = 1e-5;
  bool final_dropout = true, attention_bias = true, interleave_self_attention = false, norm_elementwise_affine = false;
  int64_t inner() const { return num_attention_heads * attention_head_dim; }
};

struct GrootConfig {
  // GR00T N1.7's model config
  int64_t backbone_embedding_dim = 2048, select_layer = 16, hidden_size = 1024, input_embedding_dim = 1536;
  int64_t max_state_dim = 132, max_action_dim = 132, action_horizon = 40, state_history_length = 1;
  int64_t max_seq_len = 1024, max_num_embodiments = 32, num_inference_timesteps = 4, num_timestep_buckets = 1000;
  int64_t attend_text_every_n_blocks = 2;
  bool add_pos_embed = true, use_vlln = true, use_alternate_vl_dit = true;
  double noise_beta_alpha = 1.5, noise_beta_beta = 1.0, noise_s = 0.999, state_dropout_prob = 0.2;
  GrootBlocksConfig dit, vl;  // vl.num_layers 0: no vl_self_attention
  vlm::Qwen3VLConfig backbone;
  // the policy's config.json
  int64_t chunk_size = 40, n_action_steps = 40, action_dim = 0, state_dim = 0;
  bool tune_llm = false, tune_visual = false, tune_projector = true, tune_diffusion_model = true, tune_vlln = true;
  int64_t tune_top_llm_layers = 0;
  // GR00T's processor's image geometry (GrootN17VLMEncodeStep): each camera resized to a square of resize_edge,
  // centre-cropped by crop_fraction (0: none), resized to target; LeRobot's defaults (256, 230 / 256, 256 x 256), or a
  // raw N1.7 checkpoint's processor_config.json (base_model_path) where it gives image_target_size. `geometry` holds
  // the step's fields as LeRobot writes them.
  int64_t image_resize_edge = 256, image_target_h = 256, image_target_w = 256;
  double image_crop_fraction = 230.0 / 256.0;
  // the sidecar's use_albumentations (OpenCV's INTER_AREA on the shortest edge, aspect kept; training crops at a
  // random position per row) and letter_box_transform (zero padding to a square first)
  bool image_opencv_area = false, image_letterbox = false;
  // the sidecar's processor switches: the task lower-cased and stripped to letters, digits, '_' and spaces; the
  // normalised state / action clipped to [-1, 1]; a training row's state zeroed with this probability
  bool formalize_language = true, clip_outliers = true;
  double processor_state_dropout = 0;
  // the checkpoint's statistics for the embodiment (statistics.json, flattened in its modality config's key order;
  // q01 / q99 as min / max with use_percentiles): "observation.state" / "action" -> {min, max, mean, std}; empty: the
  // dataset's. valid_action_horizon: the modality config's action delta_indices (0: all). embodiment_ids: the
  // checkpoint's embodiment_id.json (empty: LeRobot's N1.7 mapping). video_keys: the modality config's camera order.
  std::map<std::string, std::map<std::string, at::Tensor>> checkpoint_stats;
  int64_t valid_action_horizon = 0;
  std::map<std::string, int64_t> embodiment_ids;
  std::vector<std::string> video_keys;
  nlohmann::json image_geometry;
  nlohmann::json raw;
  static GrootConfig from_json(const nlohmann::json& j, const std::string& file);
};

// CategorySpecificLinear: x [B, T, in] @ W[cat] + b[cat].
class CategoryLinearImpl : public torch::nn::Module {
 public:
  CategoryLinearImpl(int64_t categories, int64_t in, int64_t out);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cat);
  at::Tensor W, b;
};
TORCH_MODULE(CategoryLinear);

// CategorySpecificMLP: layer1 -> ReLU -> layer2.
class CategoryMLPImpl : public torch::nn::Module {
 public:
  CategoryMLPImpl(int64_t categories, int64_t in, int64_t hidden, int64_t out);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cat);
  CategoryLinear layer1{nullptr}, layer2{nullptr};
};
TORCH_MODULE(CategoryMLP);

// diffusers' Attention (to_q, to_k, to_v, to_out.0; scaled dot product, an optional key mask [B, S] bool).
class GrootAttentionImpl : public torch::nn::Module {
 public:
  GrootAttentionImpl(int64_t dim, int64_t context_dim, const GrootBlocksConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& key_mask);
  nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out{nullptr};

 private:
  int64_t heads_, head_dim_;
  double dropout_;
};
TORCH_MODULE(GrootAttention);

// diffusers' BasicTransformerBlock as GR00T uses it: norm1 (adaptive on the time, or a LayerNorm), attn1 (cross
// attention when context_dim > 0), norm3, ff (GELU-tanh feed-forward, 4 x dim).
class GrootBlockImpl : public torch::nn::Module {
 public:
  GrootBlockImpl(int64_t dim, int64_t context_dim, bool ada_norm, const GrootBlocksConfig& c);
  at::Tensor forward(const at::Tensor& h, const at::Tensor& context, const at::Tensor& key_mask, const at::Tensor& temb);
  std::shared_ptr<torch::nn::Module> norm1;  // ada: `linear`; else LayerNorm weight/bias
  nn::Linear norm1_linear{nullptr};
  torch::nn::LayerNorm norm1_ln{nullptr}, norm3{nullptr};
  GrootAttention attn1{nullptr};
  torch::nn::ModuleList ff_net{nullptr};
  bool cross;

 private:
  bool ada_;
  double dropout_;
  bool final_dropout_;
};
TORCH_MODULE(GrootBlock);

// GR00T's DiT / AlternateVLDiT (the action head's `model`).
class GrootDiTImpl : public torch::nn::Module {
 public:
  GrootDiTImpl(const GrootConfig& c);
  // hidden [B, T, inner], vl [B, S, backbone_embedding_dim], timestep [B] (the discretised time), image_mask and
  // attention_mask [B, S] bool -> [B, T, output_dim].
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& vl, const at::Tensor& timestep,
                     const at::Tensor& image_mask, const at::Tensor& attention_mask);
  std::shared_ptr<torch::nn::Module> timestep_encoder, timestep_embedder;
  nn::Linear linear_1{nullptr}, linear_2{nullptr}, proj_out_1{nullptr}, proj_out_2{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};

 private:
  GrootConfig c_;
};
TORCH_MODULE(GrootDiT);

// GR00TN17ActionHead.
class GrootActionHeadImpl : public torch::nn::Module {
 public:
  explicit GrootActionHeadImpl(const GrootConfig& c);
  // vlln and vl_self_attention over the backbone's features.
  at::Tensor vl_features(const at::Tensor& features);
  // The velocity [B, action_horizon, max_action_dim] at x_t for the discretised time [B] (int64).
  at::Tensor velocity(const at::Tensor& vl, const at::Tensor& state_features, const at::Tensor& x_t,
                      const at::Tensor& t_discrete, const at::Tensor& embodiment, const at::Tensor& image_mask,
                      const at::Tensor& attention_mask);
  GrootDiT model{nullptr};
  CategoryMLP state_encoder{nullptr}, action_decoder{nullptr};
  std::shared_ptr<torch::nn::Module> action_encoder;
  CategoryLinear W1{nullptr}, W2{nullptr}, W3{nullptr};
  torch::nn::LayerNorm vlln{nullptr};
  std::shared_ptr<torch::nn::Module> vl_self_attention;
  torch::nn::ModuleList vl_blocks{nullptr};
  torch::nn::Embedding position_embedding{nullptr};

 private:
  GrootConfig c_;
};
TORCH_MODULE(GrootActionHead);

class GrootPolicyImpl : public PolicyModel {
 public:
  explicit GrootPolicyImpl(GrootConfig c);
  std::string model_type() const override { return "groot"; }
  void init_weights(double std) override;
  BatchSchema batch_schema() const override;
  // one term per unmasked action element
  int64_t loss_terms(const Batch& b) const override;
  double train_flops_per_sample(int64_t) const override;
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;
  // the backbone under transformers' names (prefixed), the action head under its module paths
  std::vector<CheckpointTensor> checkpoint_tensors() const override;
  bool ignorable_checkpoint_tensor(const std::string& name) const override;
  // LeRobot's files keep the tied embedding under the (unused) lm_head's name
  std::string canonical_checkpoint_name(const std::string& stored) const override;
  // Built from a policy config alone, the policy starts from base_model_path's weights when that folder holds them
  // (GR00T N1.7's checkpoint: model.safetensors or its sharded index; names as GR00TN17's state_dict, the policy's
  // without `_groot_model.`), as GrootPolicy(config) loads them; a folder with only config.json: random init.
  std::optional<BaseWeights> base_weights() const override;

  // GR00T's processor (LeRobot's make_groot_pre_post_processors without a raw N1.7 checkpoint's sidecars, absolute
  // actions): the action window min(chunk_size, 40) frames, the last window - 1 frames of each episode left out of
  // training, no LeRobot normaliser (IDENTITY), the state and action's min / max statistics for the pack step, the
  // Qwen3-VL chat prompt (cameras as 256 x 256 images after a 230 / 256 centre crop, or a raw N1.7 checkpoint's
  // processor_config.json geometry; then the formalised task),
  // padded on the left; the processor files' steps as LeRobot saves them.
  PolicySpec policy_spec() const override;
  // GR00T's formalize_language: the task lower-cased, keeping letters, digits, whitespace and '_' ("" -> "perform
  // the task"). ASCII letters and digits only: other characters are dropped (Python keeps Unicode ones).
  std::vector<std::string> prompts(const std::vector<std::string>& tasks, const Batch& normalised) const override;
  // GrootN17PackInputsStep: state [B, 1, max_state_dim] and action [B, H, max_action_dim] min-max normalised to
  // [-1, 1] (2 (x - min) / (max - min) - 1; 0 where max = min; clipped), zero-padded; action_mask 1 on the action's
  // dims of the steps that are not padding (the action zeroed there); embodiment_id of embodiment_tag (LeRobot's
  // N1.7 mapping; unknown tags 0). The cameras and raw features leave the batch.
  Batch pack_batch(const Batch& features, const Stats& stats) const override;
  // GrootActionUnpackUnnormalizeStep: the first action_dim dims, clipped to [-1, 1], min-max unnormalised.
  at::Tensor unpack_action(const at::Tensor& chunk, const Stats& stats) const override;
  Stats processor_stats(const Stats& dataset) const override;
  // noise [rows, action_horizon, max_action_dim] and time [rows] ((1 - Beta(alpha, beta)) x noise_s)
  std::map<std::string, at::Tensor> training_draws(int64_t rows, at::Generator& gen) const override;
  // The eval-mode chunk [B, min(action_horizon, chunk_size, n_action_steps), action_dim] from `noise`
  // [B, action_horizon, max_action_dim] (undefined: drawn).
  at::Tensor predict_action_chunk(const Batch& b, const at::Tensor& noise);
  at::Tensor predict_action_chunk(const Batch& b) override { return predict_action_chunk(b, b.get("sample_noise")); }
  const GrootConfig& config() const { return config_; }

  std::shared_ptr<torch::nn::Module> groot_model, backbone;
  vlm::Qwen3VL qwen{nullptr};
  GrootActionHead action_head{nullptr};

 protected:
  // The masked squared errors [B, action_horizon * max_action_dim] of a training forward.
  at::Tensor forward_whole(const Batch& b) override;

 private:
  struct Backbone {
    at::Tensor features, image_mask, attention_mask;
  };
  Backbone run_backbone(const Batch& b);
  Batch check_batch(const std::map<std::string, at::Tensor>& batch, const std::string& file) const;
  GrootConfig config_;
};
TORCH_MODULE(GrootPolicy);

std::shared_ptr<Model> build_groot(const nlohmann::json& j, const std::string& file);
nlohmann::json describe_groot(const nlohmann::json& j, const std::string& file);

}  // namespace lf::models::policy

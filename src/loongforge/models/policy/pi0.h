// LeRobot's π0 and π0.5 policies (PI0Policy, config type "pi0"; PI05Policy, "pi05") on the model contract, with
// LeRobot's parameter names (model.paligemma_with_expert.paligemma.model.{vision_tower, multi_modal_projector,
// language_model}, model.paligemma_with_expert.gemma_expert.model.layers.N, model.action_in_proj, model.state_proj,
// model.action_time_mlp_in / time_mlp_in, model.action_out_proj, ...):
//   prefix: per camera a SigLIP tower (images resized with padding to image_resolution, scaled to [-1, 1]) and the
//     PaliGemma projector; the language tokens' embeddings x sqrt(width) (an absent camera: a -1 image, masked out);
//   suffix: π0: the state token (state_proj), then the action chunk: action_in_proj(x_t) joined with the flow time's
//     sine embedding through action_time_mlp_in -> SiLU -> action_time_mlp_out; π0.5: action_in_proj(x_t) alone, the
//     time through time_mlp_in -> SiLU -> time_mlp_out -> SiLU conditions the expert's adaptive RMSNorms (scale,
//     shift, gate from a dense layer of the condition; gated residuals);
//   a Gemma language model (the prefix) and a Gemma action expert (the suffix) share attention per layer: each
//     stream projects q/k/v with its own weights, attention runs over the concatenated sequence under the block mask
//     (image + language bidirectional and blind to the suffix; π0's state token a block of its own; the action chunk
//     bidirectional), each stream has its own o_proj, RMSNorms (1 + w) and GeGLU (gelu-tanh) MLP; positions are the
//     cumulative count of valid tokens; rotary on q and k; GQA.
//   action_out_proj of the expert's last chunk_size outputs: the velocity v_t.
// Training (LeRobot's forward): x_t = t·noise + (1 − t)·actions, loss = mean over (batch, chunk, action dims) of
// (noise − actions − v_t)² (action_is_pad is not used, as in LeRobot 0.6.1). Sampling: 10 (num_inference_steps) Euler
// steps from t = 1 (noise) to 0, dt = −1 / steps, with the prefix's keys and values computed once (a KV cache).
// States and actions are padded with zeros to max_state_dim / max_action_dim; the chunk is cut back to action_dim.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/registry.h"
#include "loongforge/models/vision/vit.h"
#include "loongforge/models/policy_io.h"
#include "loongforge/models/whole_model.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/rotary.h"

namespace lf::models::policy {

// One Gemma size of LeRobot's table (get_gemma_config): gemma_300m, gemma_2b, or a config's variant_sizes entry.
struct GemmaSize {
  int64_t width = 0, depth = 0, mlp_dim = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
};

struct PI0Config {
  bool pi05 = false;  // type "pi05"
  std::string paligemma_variant = "gemma_2b", action_expert_variant = "gemma_300m";
  GemmaSize vlm, expert;
  int64_t vocab_size = 257152;
  vision::VitConfig vision;  // SigLIP (So400m unless the config's vision_config says otherwise)
  int64_t projection_dim = 2048;
  std::vector<std::string> cameras;  // LeRobot's image_features: VISUAL inputs in config order (+ empty_camera_i)
  int64_t state_dim = 0, action_dim = 0, max_state_dim = 32, max_action_dim = 32;
  int64_t chunk_size = 50, n_action_steps = 50, num_inference_steps = 10;
  double min_period = 4e-3, max_period = 4.0;
  double time_beta_alpha = 1.5, time_beta_beta = 1.0, time_scale = 0.999, time_offset = 0.001;
  int64_t resolution = 224;  // image_resolution (square)
  int64_t tokenizer_max_length = 48;  // the prompt's tokens (π0.5: 200)
  bool freeze_vision_encoder = false, train_expert_only = false;
  nlohmann::json raw;
  static PI0Config from_json(const nlohmann::json& j, const std::string& file);
};

// LeRobot's PiGemmaRMSNorm: x / rms(x) * (1 + weight), or with a condition (π0.5's expert) dense(cond) -> scale,
// shift, gate: x / rms(x) * (1 + scale) + shift, the gate returned for the gated residual.
class PiRMSNormImpl : public torch::nn::Module {
 public:
  PiRMSNormImpl(int64_t dim, double eps, int64_t cond_dim);  // cond_dim 0: the plain norm
  // (normalised x, gate: undefined without a condition)
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& cond);
  at::Tensor weight;
  nn::Linear dense{nullptr};

 private:
  double eps_;
};
TORCH_MODULE(PiRMSNorm);

class GemmaAttentionImpl : public torch::nn::Module {
 public:
  GemmaAttentionImpl(int64_t width, const GemmaSize& s);
  int64_t head_dim() const { return head_dim_; }
  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  int64_t head_dim_;
};
TORCH_MODULE(GemmaAttention);

class GemmaMLPImpl : public torch::nn::Module {
 public:
  GemmaMLPImpl(int64_t width, int64_t inner);
  at::Tensor forward(const at::Tensor& x);
  nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(GemmaMLP);

class GemmaLayerImpl : public torch::nn::Module {
 public:
  GemmaLayerImpl(const GemmaSize& s, int64_t cond_dim);
  GemmaAttention self_attn{nullptr};
  GemmaMLP mlp{nullptr};
  PiRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(GemmaLayer);

// A Gemma model's `model` (language_model / gemma_expert.model): embed_tokens (the language model only), layers, norm.
class GemmaStackImpl : public torch::nn::Module {
 public:
  GemmaStackImpl(const GemmaSize& s, int64_t vocab, bool embeddings, int64_t cond_dim);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  PiRMSNorm norm{nullptr};
  GemmaLayerImpl& layer(int64_t i) { return *(*layers)[static_cast<size_t>(i)]->as<GemmaLayerImpl>(); }
};
TORCH_MODULE(GemmaStack);

// The prefix's keys and values per layer ([B, kv_heads, prefix, head_dim], after rotary) and its padding [B, prefix].
struct PrefixCache {
  std::vector<at::Tensor> keys, values;
  at::Tensor pad;
};

// LeRobot's PI0Pytorch / PI05Pytorch (the policy's `model`).
class PI0ModelImpl : public torch::nn::Module {
 public:
  explicit PI0ModelImpl(const PI0Config& c);
  // The velocity v_t [B, chunk, max_action_dim] of the whole sequence (training): images [B, 3, R, R] in [-1, 1]
  // with their masks [B], tokens [B, L] and mask [B, L] (bool), state [B, max_state_dim] (π0), x_t, time [B].
  at::Tensor velocity(const std::vector<at::Tensor>& images, const std::vector<at::Tensor>& image_masks,
                      const at::Tensor& tokens, const at::Tensor& token_mask, const at::Tensor& state,
                      const at::Tensor& x_t, const at::Tensor& time);
  // The prefix through the language model once, its keys and values kept.
  PrefixCache encode_prefix(const std::vector<at::Tensor>& images, const std::vector<at::Tensor>& image_masks,
                            const at::Tensor& tokens, const at::Tensor& token_mask);
  // One denoising step's velocity: the suffix through the expert against the cached prefix.
  at::Tensor denoise_step(const PrefixCache& cache, const at::Tensor& state, const at::Tensor& x_t, const at::Tensor& time);

  std::shared_ptr<torch::nn::Module> paligemma_with_expert;
  vision::VisionTower vision_tower{nullptr};
  nn::Linear projector{nullptr};
  GemmaStack language_model{nullptr}, expert{nullptr};
  nn::Linear paligemma_lm_head{nullptr}, expert_lm_head{nullptr};  // unused by the policy; LeRobot keeps them
  nn::Linear action_in_proj{nullptr}, action_out_proj{nullptr}, state_proj{nullptr};
  nn::Linear time_mlp_in{nullptr}, time_mlp_out{nullptr};  // π0: action_time_mlp_in/out; π0.5: time_mlp_in/out

 private:
  // (embeddings [B, P, W], padding [B, P] bool) of the prefix.
  std::pair<at::Tensor, at::Tensor> embed_prefix(const std::vector<at::Tensor>& images,
                                                 const std::vector<at::Tensor>& image_masks, const at::Tensor& tokens,
                                                 const at::Tensor& token_mask);
  // (embeddings [B, S, We], the block starts [S] int64 (1: a new block), the expert's condition or undefined).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> embed_suffix(const at::Tensor& state, const at::Tensor& x_t, const at::Tensor& time);
  PI0Config c_;
  nn::Rotary rotary_;
};
TORCH_MODULE(PI0Model);

class PI0PolicyImpl : public WholeModel, public Policy {
 public:
  explicit PI0PolicyImpl(PI0Config c);

  std::string family() const override { return "policy"; }
  std::string model_type() const override { return config_.pi05 ? "pi05" : "pi0"; }
  const nlohmann::json& config_json() const override { return config_.raw; }
  void init_weights(double std) override;
  BatchSchema batch_schema() const override;
  int64_t loss_terms(const Batch& b) const override { return b.num_rows(); }
  double train_flops_per_sample(int64_t) const override;
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;
  bool config_records_dtype() const override { return false; }  // LeRobot's "dtype" is the compute precision
  // Checkpoints saved with transformers < 5.24 name the SigLIP tower's weights vision_tower.vision_model.*.
  std::string canonical_checkpoint_name(const std::string& stored) const override;

  // The eval-mode action chunk [B, chunk, action_dim] (normalised) from the sampler's start `noise`
  // [B, chunk, max_action_dim] (undefined: drawn).
  at::Tensor predict_action_chunk(const Batch& b, const at::Tensor& noise);
  // The policy side of the contract: one observation frame, actions at offsets [0, chunk_size), the task as tokens;
  // the training draws noise [rows, chunk, max_action_dim] and time [rows] (Beta(alpha, beta) x scale + offset); the
  // sampler starts from the batch's sample_noise when given.
  PolicySpec policy_spec() const override;
  std::map<std::string, at::Tensor> training_draws(int64_t rows, at::Generator& gen) const override;
  at::Tensor predict_action_chunk(const Batch& b) override { return predict_action_chunk(b, b.get("sample_noise")); }
  // LeRobot's prompts: π0 the task ending in a newline (Pi0NewLineProcessor); π0.5 "Task: <task, stripped, '_' and
  // newlines as spaces>, State: <the normalised state's 256-bin indices>;\nAction: "
  // (Pi05PrepareStateTokenizerProcessorStep).
  std::vector<std::string> prompts(const std::vector<std::string>& tasks, const Batch& normalised) const override;
  const PI0Config& config() const { return config_; }

  PI0Model model{nullptr};

 protected:
  // The per-element losses [B, chunk * action_dim] of a training forward (the batch's noise / time, else drawn).
  at::Tensor forward_whole(const Batch& b) override;

 private:
  // The batch's tensors checked (names, dtypes, shapes: errors name `file` and the tensor) and cast to the model's.
  Batch check_batch(const std::map<std::string, at::Tensor>& batch, const std::string& file, bool need_action) const;
  // LeRobot's _preprocess_images: the present cameras resized with padding and scaled to [-1, 1], then a -1 image
  // (masked) per absent camera.
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> images(const Batch& b) const;
  at::Tensor padded(const at::Tensor& x, int64_t dim) const;
  PI0Config config_;
};
TORCH_MODULE(PI0Policy);

std::shared_ptr<Model> build_pi0(const nlohmann::json& j, const std::string& file);
nlohmann::json describe_pi0(const nlohmann::json& j, const std::string& file);

}  // namespace lf::models::policy

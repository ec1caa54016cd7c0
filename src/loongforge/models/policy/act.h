// LeRobot's ACT policy (ACTPolicy: Action Chunking with Transformers) on the model contract, with LeRobot's
// parameter names (model.backbone.layer1.0.conv1, model.encoder.layers.N.self_attn.in_proj_weight,
// model.vae_encoder_cls_embed, model.action_head, ...):
//   a ResNet backbone with frozen batch norm per camera -> 1x1 projection, 2D sine positions; a latent token (from the
//   CVAE encoder over [cls, state, action chunk] in training, zeros at inference), the state / environment tokens ->
//   a post-norm (or pre-norm) transformer encoder -> a decoder of chunk_size zero queries with learned positions ->
//   action_head: an action chunk [B, chunk_size, action_dim].
// The batch is what LeRobot's policy.forward receives after its preprocessor (normalised): observation.state,
// observation.environment_state, observation.images.<camera> [B, 3, H, W], action [B, chunk, A], action_is_pad
// [B, chunk]; `vae_eps` [B, latent_dim] replaces the latent's random draw (latent = mu + exp(logvar / 2) * vae_eps).
// The loss: L1 over the non-padded action elements + kl_weight x the KL of the latent (summed over its dims, mean
// over rows).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <string>
#include <tuple>
#include <vector>

#include "loongforge/models/policy/common.h"
#include "loongforge/models/policy/resnet.h"
#include "loongforge/models/policy_io.h"
#include "loongforge/models/registry.h"

namespace lf::models::policy {

struct ACTConfig {
  int64_t state_dim = 0, env_dim = 0, action_dim = 0;  // 0: the feature is absent
  std::vector<std::string> cameras;                     // observation.images.* feature names, in config order
  std::vector<int64_t> image_shape;                     // [C, H, W] of the cameras
  int64_t chunk_size = 100, n_action_steps = 100, n_obs_steps = 1;
  std::string vision_backbone = "resnet18";
  bool dilation = false;  // replace_final_stride_with_dilation
  bool pre_norm = false;
  int64_t dim_model = 512, n_heads = 8, dim_feedforward = 3200;
  std::string activation = "relu";
  int64_t n_encoder_layers = 4, n_decoder_layers = 1;
  bool use_vae = true;
  int64_t latent_dim = 32, n_vae_encoder_layers = 4;
  double temporal_ensemble_coeff = 0;  // 0 with has_ensemble false: none
  bool has_ensemble = false;
  double dropout = 0.1, kl_weight = 10.0;
  ResNetLayout backbone;  // from vision_backbone (the weights may give another: io loads by shapes)
  nlohmann::json raw;
  static ACTConfig from_json(const nlohmann::json& j, const std::string& file);
};

// torch.nn.MultiheadAttention (sequence-first in PyTorch; batch-first here): in_proj_weight [3D, D], in_proj_bias,
// out_proj; key_padding_mask true = ignored key.
class MultiheadAttentionImpl : public torch::nn::Module {
 public:
  MultiheadAttentionImpl(int64_t dim, int64_t heads, double dropout);
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_padding_mask = {});
  at::Tensor in_proj_weight, in_proj_bias;
  torch::nn::Linear out_proj{nullptr};

 private:
  int64_t heads_;
  double dropout_;
};
TORCH_MODULE(MultiheadAttention);

class ACTEncoderLayerImpl : public torch::nn::Module {
 public:
  explicit ACTEncoderLayerImpl(const ACTConfig& c);
  // x [B, T, D] -> [B, T, D]; with queries > 0 only the first `queries` positions' outputs [B, queries, D].
  at::Tensor forward(at::Tensor x, const at::Tensor& pos, const at::Tensor& key_padding_mask, int64_t queries = 0);
  MultiheadAttention self_attn{nullptr};
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};

 private:
  bool pre_norm_;
  double dropout_;
  std::string activation_;
};
TORCH_MODULE(ACTEncoderLayer);

class ACTDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit ACTDecoderLayerImpl(const ACTConfig& c);
  at::Tensor forward(at::Tensor x, const at::Tensor& memory, const at::Tensor& pos, const at::Tensor& memory_pos);
  MultiheadAttention self_attn{nullptr}, multihead_attn{nullptr};
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};

 private:
  bool pre_norm_;
  double dropout_;
  std::string activation_;
};
TORCH_MODULE(ACTDecoderLayer);

// LeRobot's ACTEncoder (layers, then a LayerNorm only with pre_norm) and ACTDecoder (layers, then a LayerNorm).
class ACTStackImpl : public torch::nn::Module {
 public:
  ACTStackImpl(const ACTConfig& c, int64_t layers, bool decoder);
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm norm{nullptr};  // null: identity
};
TORCH_MODULE(ACTStack);

// LeRobot's ACT module (the policy's `model`).
class ACTImpl : public torch::nn::Module {
 public:
  explicit ACTImpl(const ACTConfig& c);
  // (actions [B, chunk, A], mu, logvar): the CVAE path when `vae` (mu, logvar [B, latent]; eps the latent's draw,
  // undefined: drawn here), else a zero latent (mu, logvar undefined).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const Batch& b, bool vae, const at::Tensor& eps);

  ACTStack vae_encoder{nullptr}, encoder{nullptr}, decoder{nullptr};
  torch::nn::Embedding vae_encoder_cls_embed{nullptr}, encoder_1d_feature_pos_embed{nullptr}, decoder_pos_embed{nullptr};
  torch::nn::Linear vae_encoder_robot_state_input_proj{nullptr}, vae_encoder_action_input_proj{nullptr},
      vae_encoder_latent_output_proj{nullptr}, encoder_robot_state_input_proj{nullptr},
      encoder_env_state_input_proj{nullptr}, encoder_latent_input_proj{nullptr}, action_head{nullptr};
  torch::nn::Conv2d encoder_img_feat_input_proj{nullptr};
  ResNet backbone{nullptr};
  at::Tensor vae_encoder_pos_enc;  // buffer [1, 1 (+1) + chunk, D]

 private:
  ACTConfig c_;
};
TORCH_MODULE(ACT);

class ACTPolicyImpl : public PolicyModel {
 public:
  explicit ACTPolicyImpl(ACTConfig c);

  std::string model_type() const override { return "act"; }
  void init_weights(double std) override;
  BatchSchema batch_schema() const override;
  // Training counts the non-padded action steps (as tokens): the step's L1 is LeRobot's over the whole global batch
  // however it is split; the KL term enters each row weighted by its non-padded steps (LeRobot's mean over rows when
  // no row is padded).
  int64_t loss_terms(const Batch& b) const override;
  double train_flops_per_sample(int64_t) const override;
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;

  // (l1, kld, loss) of a training forward's packed output (mean over the batch as LeRobot's forward).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> losses(const at::Tensor& h, const Batch& b) const;
  // The eval-mode action chunk (zero latent) [B, chunk, A], normalised.
  at::Tensor predict_action_chunk(const Batch& b) override;
  // The policy side of the contract: no observation window, actions at offsets [0, chunk_size).
  PolicySpec policy_spec() const override;
  // vae_eps [rows, latent_dim] (standard normal) when the CVAE trains.
  std::map<std::string, at::Tensor> training_draws(int64_t rows, at::Generator& gen) const override;
  const ACTConfig& config() const { return config_; }

  ACT model{nullptr};

 protected:
  // [B, chunk * A (+ 2 * latent)]: the actions, then mu and logvar when the CVAE runs.
  at::Tensor forward_whole(const Batch& b) override;

 private:
  // The batch's tensors checked (names, dtypes, shapes: errors name `file` and the tensor) and cast to the model's.
  Batch check_batch(const std::map<std::string, at::Tensor>& batch, const std::string& file, bool need_action) const;
  ACTConfig config_;
};
TORCH_MODULE(ACTPolicy);

std::shared_ptr<Model> build_act(const nlohmann::json& j, const std::string& file);
// The backbone's stages, blocks and widths from the stored tensors (narrow ResNets named "resnet18" load too).
std::shared_ptr<Model> build_act_for_weights(const nlohmann::json& j, const std::string& file, const Family::TensorShapes& shapes);
nlohmann::json describe_act(const nlohmann::json& j, const std::string& file);

}  // namespace lf::models::policy

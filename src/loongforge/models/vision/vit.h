// Vision transformers of the CLIP / SigLIP kind (transformers' CLIPVisionModel, SiglipVisionModel): patch embedding
// (a strided convolution), learned absolute positions (CLIP: plus a class token and a LayerNorm before the
// encoder), pre-norm encoder layers (LayerNorm, multi-head attention with biases, LayerNorm, fc1 -> activation ->
// fc2), a final LayerNorm (SigLIP: on every token; CLIP: on the pooled class token) and SigLIP's attention-pooling
// head. Module names are transformers 5's (`embeddings.patch_embedding`, `encoder.layers.N.self_attn.q_proj`, ...).
// A component of the vision-language families (models/vlm) and, later, of robot policies: not a family itself.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <string>
#include <vector>

#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"

namespace lf {
class JsonReader;
}

namespace lf::models::vision {

struct VitConfig {
  std::string model_type;  // clip_vision_model | siglip_vision_model
  int64_t hidden_size = 768, intermediate_size = 3072, num_hidden_layers = 12, num_attention_heads = 12;
  int64_t num_channels = 3, image_size = 224, patch_size = 16;
  std::string hidden_act;
  double layer_norm_eps = 1e-6;
  bool class_token = false;  // CLIP: a class embedding first, positions for patches + 1, pre_layrnorm
  bool use_head = false;     // SigLIP's vision_use_head (attention-pooling head; not used by the VLMs' features)
  double initializer_range = 0.02, initializer_factor = 1.0;
  nlohmann::json raw;

  int64_t grid() const { return image_size / patch_size; }
  int64_t num_patches() const { return grid() * grid(); }
  int64_t num_positions() const { return num_patches() + (class_token ? 1 : 0); }
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t num_parameters() const;
  // `file` and `path` (e.g. "vision_config") name the config in errors.
  static VitConfig from_json(const nlohmann::json& j, const std::string& file, const std::string& path = "");
  static bool handles(const std::string& model_type);
};

// x through a transformers activation by name (gelu, gelu_pytorch_tanh, gelu_new, quick_gelu, relu, silu).
at::Tensor activation(const std::string& name, const at::Tensor& x);
// An error naming r's field `key` unless `activation` knows `name`.
void require_activation(const JsonReader& r, const std::string& key, const std::string& name);

class VitAttentionImpl : public torch::nn::Module, public nn::AttentionHook {
 public:
  VitAttentionImpl(int64_t hidden, int64_t heads);
  // x [B, T, hidden] -> [B, T, hidden]; all tokens see each other.
  at::Tensor forward(const at::Tensor& x);
  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  int64_t head_dim;
};
TORCH_MODULE(VitAttention);

class VitMLPImpl : public torch::nn::Module {
 public:
  VitMLPImpl(int64_t hidden, int64_t inner, std::string act);
  at::Tensor forward(const at::Tensor& x) { return fc2(activation(act_, fc1(x))); }
  nn::Linear fc1{nullptr}, fc2{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(VitMLP);

class VitLayerImpl : public torch::nn::Module {
 public:
  explicit VitLayerImpl(const VitConfig& c);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::LayerNorm layer_norm1{nullptr}, layer_norm2{nullptr};
  VitAttention self_attn{nullptr};
  VitMLP mlp{nullptr};
};
TORCH_MODULE(VitLayer);

class VitEmbeddingsImpl : public torch::nn::Module {
 public:
  explicit VitEmbeddingsImpl(const VitConfig& c);
  // pixel_values [N, C, H, W] (H = W = image_size) -> [N, positions, hidden].
  at::Tensor forward(const at::Tensor& pixel_values);
  torch::nn::Conv2d patch_embedding{nullptr};
  torch::nn::Embedding position_embedding{nullptr};
  at::Tensor class_embedding;  // CLIP only

 private:
  VitConfig c_;
};
TORCH_MODULE(VitEmbeddings);

class VitEncoderImpl : public torch::nn::Module {
 public:
  explicit VitEncoderImpl(const VitConfig& c);
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(VitEncoder);

// SigLIP's multi-head attention pooling: a learned probe attends over the tokens (torch.nn.MultiheadAttention's
// packed in_proj), then LayerNorm + MLP with a residual.
class AttentionPoolingHeadImpl : public torch::nn::Module {
 public:
  explicit AttentionPoolingHeadImpl(const VitConfig& c);
  at::Tensor forward(const at::Tensor& x);  // [N, T, hidden] -> [N, hidden]
  at::Tensor probe, in_proj_weight, in_proj_bias;
  nn::Linear out_proj{nullptr};
  torch::nn::LayerNorm layernorm{nullptr};
  VitMLP mlp{nullptr};

 private:
  int64_t heads_;
};
TORCH_MODULE(AttentionPoolingHead);

class VisionTowerImpl : public torch::nn::Module {
 public:
  explicit VisionTowerImpl(VitConfig c);
  // transformers' hidden_states of the tower: [0] the encoder's input (after pre_layrnorm for CLIP), [i] the output
  // of layer i; only the states up to `upto` (< 0: all num_hidden_layers + 1) are computed.
  std::vector<at::Tensor> hidden_states(const at::Tensor& pixel_values, int64_t upto = -1);
  // The tower's last_hidden_state (SigLIP: after post_layernorm; CLIP: the last layer's output).
  at::Tensor last_hidden_state(const at::Tensor& pixel_values);
  // transformers' _init_weights for the tower (std < 0: the config's initializer_range).
  void init_weights(double std);
  const VitConfig& config() const { return c_; }
  std::vector<nn::AttentionHook*> attention_modules();
  bool recompute = false;  // each layer recomputed in backward (activation recomputation)

  VitEmbeddings embeddings{nullptr};
  torch::nn::LayerNorm pre_layrnorm{nullptr};  // CLIP
  VitEncoder encoder{nullptr};
  torch::nn::LayerNorm post_layernorm{nullptr};
  AttentionPoolingHead head{nullptr};  // SigLIP with vision_use_head

 private:
  VitConfig c_;
};
TORCH_MODULE(VisionTower);

}  // namespace lf::models::vision

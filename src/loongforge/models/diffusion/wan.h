// Wan 2.1's video diffusion transformer (diffusers' WanTransformer3DModel), text-to-video: latents [B, C, F, H, W]
// cut into 3D patches by a strided Conv3d (patch_embedding), 3D rotary positions (head dims split over frame, height
// and width), a condition embedder (sinusoidal timestep -> time_embedder MLP -> time_proj to 6 x dim modulations;
// text_embedder MLP on the text encoder's states), blocks of self-attention (q/k RMS norm across heads, rotary),
// cross-attention to the text and a GELU-tanh feed-forward, each modulated (shift / scale / gate) by the shared time
// projection plus the block's scale_shift_table, FP32 LayerNorms as diffusers has them; the output norm modulated by
// the time embedding plus its own scale_shift_table, proj_out and unpatchify.
//
// On the model contract (models/model.h): embed() is the patch embedding; block_inputs() holds the rotary tables and
// the conditions (time embedding, its 6 x dim projection, the projected text) made by condition_embedder from the
// batch, with gradients; post_blocks() is norm_out; head_loss_sum() modulates, projects (proj_out) and sums the
// squared error against the batch's target in patch space (the target patchified rather than the output
// unpatchified; diffusers' training loss is its mean: loss_terms = target elements). Context parallelism cuts the
// token sequence inside (sequence_inside: the patches after embed(), the rotary tables' rows, the target's patches)
// and runs the self-attentions (attn1, the hooks) as ring or all-to-all attention; cross-attention to the text
// attends each rank's queries to every text token.
// Parameter names are diffusers' (`blocks.N.attn1.to_q`, `condition_embedder.time_embedder.linear_1`, ...).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <array>
#include <map>
#include <string>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"

namespace lf::models::diffusion {

struct WanConfig {
  std::array<int64_t, 3> patch_size{1, 2, 2};
  int64_t num_attention_heads = 40, attention_head_dim = 128, in_channels = 16, out_channels = 16;
  int64_t text_dim = 4096, freq_dim = 256, ffn_dim = 13824, num_layers = 40, rope_max_seq_len = 1024;
  bool cross_attn_norm = true;
  double eps = 1e-6;
  nlohmann::json raw;

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  int64_t patch_volume() const { return patch_size[0] * patch_size[1] * patch_size[2]; }
  // Rotary dims of frame, height, width (diffusers' WanRotaryPosEmbed: h = w = 2 * (head_dim / 6), t the rest).
  std::array<int64_t, 3> rope_dims() const;
  // Parameters of each component, as describe() and `loongforge info` give them.
  int64_t patch_embedding_parameters() const;
  int64_t condition_embedder_parameters() const;
  int64_t block_parameters() const;
  int64_t output_parameters() const;  // proj_out + scale_shift_table
  int64_t num_parameters() const;
  static WanConfig from_json(const nlohmann::json& j, const std::string& file);
};

// torch.nn.RMSNorm over the last dim with a weight (diffusers' norm_q / norm_k: across all heads).
class WanRMSNormImpl : public torch::nn::Module {
 public:
  WanRMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(WanRMSNorm);

// diffusers' FP32LayerNorm: layer norm in float32, the result in the input's dtype; affine parameters optional.
class WanLayerNormImpl : public torch::nn::Module {
 public:
  WanLayerNormImpl(int64_t dim, double eps, bool affine);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;

 private:
  int64_t dim_;
  double eps_;
};
TORCH_MODULE(WanLayerNorm);

// diffusers' WanAttention (no added image key/values): to_q / to_k / to_v, norm_q / norm_k, to_out.0. The hook
// (bidirectional) serves self-attention only: context parallelism installs attention_fn there; cross-attention to
// the text always attends to every text key.
class WanAttentionImpl : public torch::nn::Module, public nn::AttentionHook {
 public:
  WanAttentionImpl(int64_t dim, int64_t heads, double eps);
  // x [B, S, D]; context [B, L, D] (undefined: self-attention); cos / sin [S, head_dim / 2] (undefined: none).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& cos, const at::Tensor& sin);
  nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, out{nullptr};
  WanRMSNorm norm_q{nullptr}, norm_k{nullptr};

 private:
  int64_t heads_;
};
TORCH_MODULE(WanAttention);

// diffusers' FeedForward(activation_fn="gelu-approximate"): net.0.proj -> GELU(tanh) -> net.2.
class WanFeedForwardImpl : public torch::nn::Module {
 public:
  WanFeedForwardImpl(int64_t dim, int64_t inner);
  at::Tensor forward(const at::Tensor& x);
  nn::Linear proj{nullptr}, out{nullptr};
};
TORCH_MODULE(WanFeedForward);

class WanBlockImpl : public torch::nn::Module {
 public:
  explicit WanBlockImpl(const WanConfig& c);
  // h [B, S, D]; timestep_proj [B, 6, D]; text [B, L, D]; cos / sin the rotary tables.
  at::Tensor forward(const at::Tensor& h, const at::Tensor& timestep_proj, const at::Tensor& text, const at::Tensor& cos,
                     const at::Tensor& sin);
  WanLayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};  // norm2: null without cross_attn_norm
  WanAttention attn1{nullptr}, attn2{nullptr};
  WanFeedForward ffn{nullptr};
  at::Tensor scale_shift_table;  // [1, 6, D]
};
TORCH_MODULE(WanBlock);

// diffusers' WanTimeTextImageEmbedding without the image embedder.
class WanConditionEmbedderImpl : public torch::nn::Module {
 public:
  explicit WanConditionEmbedderImpl(const WanConfig& c);
  struct Out {
    at::Tensor temb, timestep_proj, text;  // [B, D], [B, 6, D], [B, L, D]
  };
  // timestep [B] (any real dtype), text [B, L, text_dim].
  Out forward(const at::Tensor& timestep, const at::Tensor& text);
  // The time embedding alone ([B, D]).
  at::Tensor time_embedding(const at::Tensor& timestep);
  nn::Linear time_1{nullptr}, time_2{nullptr}, time_proj{nullptr}, text_1{nullptr}, text_2{nullptr};

 private:
  int64_t freq_dim_;
};
TORCH_MODULE(WanConditionEmbedder);

class WanTransformer3DImpl : public Model {
 public:
  explicit WanTransformer3DImpl(WanConfig c);

  std::string family() const override { return "diffusion"; }
  std::string model_type() const override { return "WanTransformer3DModel"; }
  const nlohmann::json& config_json() const override { return config_.raw; }
  // diffusers' initialisation (std < 0): torch's defaults for Conv3d / Linear, ones for the norms' weights,
  // randn / sqrt(dim) for the scale-shift tables; std >= 0: normal(0, std) matrices, zero biases instead.
  void init_weights(double std) override;

  // hidden_states [B, C, F, H, W], timestep [B], encoder_hidden_states [B, L, text_dim], target [B, C_out, F, H, W].
  BatchSchema batch_schema() const override;
  int64_t loss_terms(const Batch& b) const override { return b.at("target").numel(); }
  // per latent patch (the sequence of the blocks)
  double train_flops_per_sample(int64_t seq) const override;

  at::Tensor embed(const Batch& b) override;
  // cos, sin [S, head_dim / 2]; temb [B, D], timestep_proj [B, 6, D], text [B, L, D] (condition_embedder's, with
  // gradients); the latent grid (grid [3]: patches along frame, height, width).
  Batch block_inputs(const Batch& b, at::ScalarType dtype) const override;
  at::Tensor block_forward(const Batch& inputs, const at::Tensor& h, int64_t i) override;
  at::Tensor post_blocks(const at::Tensor& h) override;
  // modulation (scale_shift_table + the time embedding), proj_out, the summed squared error against `target`
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  int64_t hidden_size() const override { return config_.inner_dim(); }
  int64_t num_blocks() const override { return config_.num_layers; }

  // `dump`: outputs `output` (diffusers' sample [B, C_out, F, H, W]) and the loss = MSE against `target`.
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;

  Split split() const override;
  // None yet: the q / k norms span every head (a split would need their statistics summed over tp).
  TensorParallelSpec tensor_parallel_spec() const override { return {}; }
  // The blocks' self-attentions (attn1; cross-attention is not a sequence-parallel attention).
  std::vector<nn::AttentionHook*> attention_modules() override;
  // The token sequence (the latents' patches) is made in embed(): context parallelism cuts it there, the rotary
  // tables in block_inputs() and the target's patches in head_loss_sum() through cut_sequence_fn.
  bool sequence_inside() const override { return true; }
  std::string pipeline_blocker() const override;

  std::string weights_file_stem() const override { return "diffusion_pytorch_model"; }
  bool config_records_dtype() const override { return false; }

  const WanConfig& config() const { return config_; }

  std::shared_ptr<torch::nn::Module> patch_embedding_module;
  at::Tensor patch_weight, patch_bias;  // patch_embedding.weight [D, C, pt, ph, pw], .bias [D]
  WanConditionEmbedder condition_embedder{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  WanLayerNorm norm_out{nullptr};
  nn::Linear proj_out{nullptr};
  at::Tensor scale_shift_table;  // [1, 2, D]

 private:
  // The batch's tensors, checked (errors name `where` and the field); target optional.
  struct Inputs {
    at::Tensor latents, timestep, text, target;
  };
  Inputs check(const Batch& b, const std::string& where, bool need_target) const;
  // The model's output [B, C_out, F, H, W] from post_blocks' output, the time embedding and the latent shape.
  at::Tensor output(const at::Tensor& normed, const at::Tensor& temb, at::IntArrayRef latent_shape);
  Batch conditions(const Inputs& in, at::ScalarType dtype) const;

  WanConfig config_;
};
TORCH_MODULE(WanTransformer3D);

std::shared_ptr<Model> build_wan(const nlohmann::json& config, const std::string& file);
nlohmann::json describe_wan(const nlohmann::json& config, const std::string& file);

}  // namespace lf::models::diffusion

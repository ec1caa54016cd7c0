// DiT (diffusers' DiTTransformer2DModel) on the model contract: latents [B, C, H, W] cut into p x p patches
// (a convolution) plus fixed 2D sin-cos positions, adaLN-Zero blocks conditioned on the timestep and the class
// label (each block has its own timestep + label embedder, as diffusers builds it), a final adaptive LayerNorm
// conditioned through block 0's embedder, and the patches folded back into [B, out_channels, H, W]
// (out_channels = 2 * in_channels for learned-sigma models: the prediction is the first in_channels).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <string>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"

namespace lf::models::diffusion {

struct DiTConfig {
  int64_t num_attention_heads = 16, attention_head_dim = 72;
  int64_t in_channels = 4, out_channels = 4;
  int64_t num_layers = 28;
  int64_t sample_size = 32, patch_size = 2;
  int64_t num_embeds_ada_norm = 1000;  // the class labels (the embedding has one more row: the dropped label)
  bool attention_bias = true;
  bool norm_elementwise_affine = false;
  double norm_eps = 1e-5;
  std::string activation_fn = "gelu-approximate";
  nlohmann::json raw;

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  bool learned_sigma() const { return out_channels == 2 * in_channels; }
  static DiTConfig from_json(const nlohmann::json& j, const std::string& file);
};

// Timestep (sinusoidal projection + 2-layer MLP) plus class-label embeddings: the conditioning vector [B, dim].
class DiTConditionImpl : public torch::nn::Module {
 public:
  DiTConditionImpl(int64_t dim, int64_t num_classes);
  at::Tensor forward(const at::Tensor& timestep, const at::Tensor& class_labels);
  nn::Linear linear_1{nullptr}, linear_2{nullptr};  // timestep_embedder.*
  torch::nn::Embedding embedding_table{nullptr};      // class_embedder.embedding_table
};
TORCH_MODULE(DiTCondition);

class DiTAttentionImpl : public torch::nn::Module, public nn::AttentionHook {
 public:
  DiTAttentionImpl(int64_t heads, int64_t head_dim, bool bias);
  at::Tensor forward(const at::Tensor& x);  // [B, T, dim], every token sees every token
  nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, to_out{nullptr};
  int64_t head_dim;
};
TORCH_MODULE(DiTAttention);

class DiTBlockImpl : public torch::nn::Module {
 public:
  explicit DiTBlockImpl(const DiTConfig& c);
  // x [B, T, dim]; timestep [B]; class_labels [B] (int64).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& timestep, const at::Tensor& class_labels);
  DiTCondition emb{nullptr};   // norm1.emb
  nn::Linear ada{nullptr};     // norm1.linear: the six modulations
  DiTAttention attn1{nullptr};
  torch::nn::LayerNorm norm3{nullptr};
  nn::Linear ff_in{nullptr}, ff_out{nullptr};  // ff.net.0.proj, ff.net.2

 private:
  double eps_;
  bool tanh_gelu_;
};
TORCH_MODULE(DiTBlock);

class DiTImpl : public Model {
 public:
  explicit DiTImpl(DiTConfig c);

  std::string family() const override { return "diffusion"; }
  std::string model_type() const override { return "DiTTransformer2DModel"; }
  const nlohmann::json& config_json() const override { return c_.raw; }
  // The DiT paper's initialisation: Xavier-uniform linears (the patch convolution as a linear), zero biases,
  // N(0, 0.02) timestep MLP and label table, and the adaLN-Zero part zero: every block's modulation and the output
  // layers, so each block starts as the identity. (std >= 0 replaces 0.02.)
  void init_weights(double std) override;
  // hidden_states float [B, in_channels, H, W] (H, W multiples of patch_size), timestep [B] (float or int64),
  // class_labels int64 [B] in [0, num_embeds_ada_norm] (the last: no label), target [B, in_channels, H, W].
  BatchSchema batch_schema() const override;
  int64_t loss_terms(const Batch& b) const override;
  double train_flops_per_sample(int64_t tokens) const override;

  at::Tensor embed(const Batch& b) override;
  Batch block_inputs(const Batch& b, at::ScalarType dtype) const override;
  at::Tensor block_forward(const Batch& inputs, const at::Tensor& h, int64_t i) override;
  at::Tensor post_blocks(const at::Tensor& h) override { return h; }
  // The final adaptive norm and projection (conditioned through block 0's embedder), folded back to latents, and
  // the summed squared error of the first in_channels channels against `target`.
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  int64_t hidden_size() const override { return c_.inner_dim(); }
  int64_t num_blocks() const override { return c_.num_layers; }
  // hidden_states, timestep, class_labels (and target for the loss) -> output [B, out_channels, H, W], loss.
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;

  // class_labels -> num_embeds_ada_norm (the "no label" row the label dropout trains).
  std::map<std::string, at::Tensor> unconditional(const std::map<std::string, at::Tensor>& conditions,
                                                  const std::string& file) const override;
  Split split() const override;
  TensorParallelSpec tensor_parallel_spec() const override { return {}; }
  std::vector<nn::AttentionHook*> attention_modules() override;
  // The patches' sequence is made in embed(): context parallelism cuts it there and the target's patches in
  // head_loss_sum() through cut_sequence_fn.
  bool sequence_inside() const override { return true; }
  std::string pipeline_blocker() const override;
  std::string weights_file_stem() const override { return "diffusion_pytorch_model"; }
  bool config_records_dtype() const override { return false; }

  // The model's prediction [B, out_channels, H, W] for latents x at timestep t with labels y.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& t, const at::Tensor& y);
  const DiTConfig& config() const { return c_; }

  at::Tensor patch_weight, patch_bias;  // pos_embed.proj
  torch::nn::ModuleList transformer_blocks{nullptr};
  nn::Linear proj_out_1{nullptr}, proj_out_2{nullptr};

 private:
  // The latents' patches [B, T, dim] with their positions; (grid_h, grid_w) of the patches.
  at::Tensor patchify(const at::Tensor& x) const;
  at::Tensor final_layer(const at::Tensor& h, const at::Tensor& t, const at::Tensor& y, int64_t grid_h, int64_t grid_w);
  DiTConfig c_;
};
TORCH_MODULE(DiT);

std::shared_ptr<Model> build_dit(const nlohmann::json& config, const std::string& file);
nlohmann::json describe_dit(const nlohmann::json& config, const std::string& file);

// DiT's variational-bound term for learned-sigma models (guided diffusion's _vb_terms_bpd with the prediction's mean
// frozen), element by element in bits (a row's bound is the mean over its elements): the KL between the true posterior
// q(x_{t-1} | x_t, x0) and the model's Gaussian (mean from the detached epsilon `eps`, log-variance interpolated
// between the clipped posterior's and log beta_t by (v + 1) / 2 of the variance channels v), or at t = 0 the
// decoder's discretized log-likelihood of x0; times the row's weight. eps, v, x_t, x0 share one layout, rows first;
// terms [B, 8]: the posterior mean coefficients (x0, x_t), the clipped posterior log-variance, log beta_t,
// sqrt(1 / abar_t), sqrt(1 / abar_t - 1), t == 0 (1 or 0), the weight.
at::Tensor learned_variance_vlb(const at::Tensor& eps, const at::Tensor& v, const at::Tensor& x_t, const at::Tensor& x0,
                                const at::Tensor& terms);

}  // namespace lf::models::diffusion

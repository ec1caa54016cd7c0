// The T5 / UMT5 text encoder (transformers' T5EncoderModel / UMT5EncoderModel, model_type "t5" / "umt5"): the
// caption encoder of diffusion models. Token embeddings, then blocks of [RMS-style layer norm (no mean subtraction,
// no bias) -> self-attention with a learned relative position bias and no 1/sqrt(d) scaling -> residual] and
// [layer norm -> feed-forward (relu: wi -> act -> wo; gated-X: act(wi_0) * wi_1 -> wo) -> residual], then a final
// layer norm. T5 learns the position bias in block 0 and shares it with every block; UMT5 learns one per block.
//
// Module names are transformers' (`encoder.block.N.layer.0.SelfAttention.q`, `encoder.block.N.layer.1.DenseReluDense.
// wi_0`, `encoder.final_layer_norm`); the embedding is tied: transformers names it `shared.weight` (checkpoints and
// named_parameters()) with `encoder.embed_tokens.weight` a copy some checkpoints also store, so the module here is
// `encoder.embed_tokens` whose checkpoint name is `shared.weight` (loading takes either). A whole
// T5ForConditionalGeneration / T5Model folder loads too: its decoder and lm_head tensors are skipped. Dropout is not
// applied (as in eval mode).
//
// On the contract it is a WholeModel (models/whole_model.h): the batch is input_ids [B,T] and an optional
// attention_mask [B,T] (1: a token, 0: padding, which no position attends to); the training loss is the mean of
// last_hidden_state^2 over the unmasked positions and the channels (what `dump` compares, a stand-in for the losses
// a diffusion model's training puts on the encoder's output).
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "loongforge/models/whole_model.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/rms_norm.h"

namespace lf::models::text_encoder {

struct T5Config {
  std::string model_type;  // "t5" | "umt5"
  int64_t vocab_size = 32128, d_model = 512, d_kv = 64, d_ff = 2048, num_layers = 6, num_heads = 8;
  int64_t relative_attention_num_buckets = 32, relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6, initializer_factor = 1.0;
  std::string feed_forward_proj = "relu";
  bool gated = false;        // "gated-X"
  std::string act = "relu";  // transformers' dense_act_fn ("gated-gelu" -> "gelu_new")
  nlohmann::json raw;

  // UMT5 learns a position bias in every block, T5 in block 0 only.
  bool bias_in_block(int64_t i) const { return model_type == "umt5" || i == 0; }
  int64_t inner_dim() const { return num_heads * d_kv; }
  int64_t num_parameters() const;
  // The encoder class transformers loads the written folder with (T5EncoderModel / UMT5EncoderModel).
  std::string encoder_class() const { return model_type == "umt5" ? "UMT5EncoderModel" : "T5EncoderModel"; }
  static T5Config from_json(const nlohmann::json& j, const std::string& file);
};

// transformers' bidirectional relative-position buckets of key j - query i: [T, T] int64 in [0, num_buckets).
at::Tensor relative_position_buckets(int64_t length, int64_t num_buckets, int64_t max_distance);

class T5AttentionImpl : public torch::nn::Module {
 public:
  T5AttentionImpl(const T5Config& c, bool relative_bias);
  // x [B,T,d], bias [1 or B, H, T, T] (position bias + mask, added to the unscaled scores) -> [B,T,d].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias);
  // The learned position bias [1, H, T, T] (only with relative_attention_bias).
  at::Tensor position_bias(int64_t length);
  nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  torch::nn::Embedding relative_attention_bias{nullptr};

 private:
  int64_t heads_, d_kv_, buckets_, max_distance_;
};
TORCH_MODULE(T5Attention);

class T5LayerSelfAttentionImpl : public torch::nn::Module {
 public:
  T5LayerSelfAttentionImpl(const T5Config& c, bool relative_bias);
  T5Attention SelfAttention{nullptr};
  nn::RMSNorm layer_norm{nullptr};
};
TORCH_MODULE(T5LayerSelfAttention);

// DenseReluDense: wi / wo, or wi_0 / wi_1 / wo when gated.
class T5DenseImpl : public torch::nn::Module {
 public:
  explicit T5DenseImpl(const T5Config& c);
  at::Tensor forward(const at::Tensor& x);
  nn::Linear wi{nullptr}, wi_0{nullptr}, wi_1{nullptr}, wo{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(T5Dense);

class T5LayerFFImpl : public torch::nn::Module {
 public:
  explicit T5LayerFFImpl(const T5Config& c);
  T5Dense DenseReluDense{nullptr};
  nn::RMSNorm layer_norm{nullptr};
};
TORCH_MODULE(T5LayerFF);

class T5BlockImpl : public torch::nn::Module {
 public:
  T5BlockImpl(const T5Config& c, bool relative_bias);
  // h [B,T,d]; mask [B,1,1,T] additive (undefined: none); shared_bias: block 0's position bias under T5 (undefined
  // for UMT5 and for block 0 itself, which computes its own).
  at::Tensor forward(const at::Tensor& h, const at::Tensor& mask, const at::Tensor& shared_bias);
  torch::nn::ModuleList layer{nullptr};  // [T5LayerSelfAttention, T5LayerFF]
  T5LayerSelfAttentionImpl* self_attention() const;
  T5LayerFFImpl* feed_forward() const;
};
TORCH_MODULE(T5Block);

class T5StackImpl : public torch::nn::Module {
 public:
  explicit T5StackImpl(const T5Config& c);
  // ids [B,T], mask [B,T] (undefined: all tokens) -> last_hidden_state [B,T,d].
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& mask);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList block{nullptr};
  nn::RMSNorm final_layer_norm{nullptr};

 private:
  T5Config c_;
};
TORCH_MODULE(T5Stack);

class T5EncoderImpl : public WholeModel {
 public:
  explicit T5EncoderImpl(T5Config c);

  std::string family() const override { return "text_encoder"; }
  std::string model_type() const override { return config_.model_type; }
  // The file's config with architectures naming the encoder class (a whole seq2seq folder's config says
  // T5ForConditionalGeneration; what `convert` writes is an encoder).
  const nlohmann::json& config_json() const override { return written_; }
  // std < 0: transformers' _init_weights (initializer_factor-scaled normals per projection); else every matrix
  // normal(0, std), norms one.
  void init_weights(double std) override;
  BatchSchema batch_schema() const override;
  // The unmasked positions.
  int64_t loss_terms(const Batch& b) const override;
  double train_flops_per_sample(int64_t seq) const override;
  // sum over unmasked positions of mean_c(last_hidden_state^2), float32.
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  // input_ids int64 [B,T], optional attention_mask int64 [B,T] -> last_hidden_state; loss: head_loss_sum / terms.
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;

  // The embedding is stored as shared.weight (encoder.embed_tokens.weight loads too).
  std::vector<CheckpointTensor> checkpoint_tensors() const override;
  // A whole seq2seq model's decoder and lm_head.
  bool ignorable_checkpoint_tensor(const std::string& name) const override;
  const T5Config& config() const { return config_; }

  T5Stack encoder{nullptr};

 protected:
  at::Tensor forward_whole(const Batch& b) override;

 private:
  T5Config config_;
  nlohmann::json written_;
};
TORCH_MODULE(T5Encoder);

std::shared_ptr<Model> build_t5(const nlohmann::json& config, const std::string& file);
nlohmann::json describe_t5(const nlohmann::json& config, const std::string& file);

}  // namespace lf::models::text_encoder

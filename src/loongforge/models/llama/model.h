// The decoder-LM family (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, DeepSeek-V3; GLM-4-MoE, MiniMax-M2, Mistral 4)
// as a plain torch::nn::Module tree whose parameter names are the Hugging Face names (model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight,
// ..., lm_head.weight), implementing the model contract (models/model.h). No parallelism inside: parallel layouts are
// applied from outside through the contract.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

#include <functional>

#include "loongforge/models/llama/config.h"
#include "loongforge/models/llama/gated_deltanet.h"
#include "loongforge/models/llama/kimi_delta.h"
#include "loongforge/models/llama/mla.h"
#include "loongforge/models/model.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/moe.h"
#include "loongforge/nn/rms_norm.h"
#include "loongforge/nn/rotary.h"

namespace lf::models::llama {

// heads/kv_heads (nn::AttentionHook): the heads this module computes (tensor parallelism lowers them to the local
// share); attention_fn replaces nn::causal_attention when set (context parallelism, packed-document kernels).
class AttentionImpl : public torch::nn::Module, public nn::AttentionHook {
 public:
  AttentionImpl(const DecoderConfig& c, int64_t layer_idx);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, nn::KVCache* cache,
                     const at::Tensor& segment_ids = {});

  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  nn::RMSNorm q_norm{nullptr}, k_norm{nullptr};
  int64_t layer_idx, head_dim;
  bool output_gate = false;  // Qwen3-Next: q_proj gives [q | gate] per head; the output is times sigmoid(gate)
  bool zero_centered = false;  // q_norm / k_norm scale by 1 + weight (DecoderConfig::zero_centered_norm)
  bool qk_norm_whole = false;  // MiniMax-M2: q_norm / k_norm over the whole projections, before the head split
};
TORCH_MODULE(Attention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const DecoderConfig& c);
  at::Tensor forward(const at::Tensor& x);

  nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  std::string act;
};
TORCH_MODULE(MLP);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const DecoderConfig& c, int64_t layer_idx);
  // q_scale [B,T]: Mistral 4's per-position query scale (undefined: none).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, nn::KVCache* cache,
                     const at::Tensor& segment_ids = {}, const at::Tensor& q_scale = {});

  Attention self_attn{nullptr};  // null with config.mla: then mla is registered as "self_attn"
  MLA mla{nullptr};
  MLP mlp{nullptr};  // null in MoE layers (config.is_moe_layer): then moe, registered as config.moe_module_name
  nn::MoE moe{nullptr};
  nn::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  GatedDeltaNet linear_attn{nullptr};  // config.is_linear_layer: the token mixer instead of self_attn
  KimiDeltaAttention kda{nullptr};     // the same for Kimi Linear, registered as "self_attn"
  // Qwen3-Next's MoE layers: a shared expert behind a sigmoid gate, registered inside the MoE block (as
  // mlp.shared_expert, mlp.shared_expert_gate) and added to its output here.
  nn::SharedExpert shared_expert{nullptr};
  nn::Linear shared_expert_gate{nullptr};
  bool zero_centered = false;  // the layer's norms scale by 1 + weight (DecoderConfig::zero_centered_norm)
};
TORCH_MODULE(DecoderLayer);

// "model": embeddings, layers, final norm.
class DecoderModelImpl : public torch::nn::Module {
 public:
  explicit DecoderModelImpl(const DecoderConfig& c);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  nn::RMSNorm norm{nullptr};
  std::shared_ptr<torch::nn::Module> hc_head;  // DeepSeek-V4's hyper head (deepseek_v4.h)
};
TORCH_MODULE(DecoderModel);

class MtpImpl;  // models/llama/mtp.h
struct V4Rotary;  // models/llama/deepseek_v4.h

class CausalLMImpl : public models::Model {
 public:
  explicit CausalLMImpl(DecoderConfig c);

  // ---- the model contract (models/model.h) ----
  std::string family() const override { return "decoder_lm"; }
  std::string model_type() const override { return config_.model_type; }
  const nlohmann::json& config_json() const override { return config_.raw; }
  void init_weights(double std) override;
  // input_ids int64 [B,T]; targets int64 [B,T] (the token each position predicts, already shifted; -100 not
  // counted); optional position_ids [B,T] (default 0..T-1) and segment_ids [B,T] (packed documents).
  BatchSchema batch_schema() const override;
  int64_t loss_terms(const Batch& b) const override;  // targets != -100
  double train_flops_per_sample(int64_t seq) const override;
  at::Tensor embed(const Batch& b) override;  // DeepSeek-V4: hc_mult copies [B,T,hc_mult,hidden]
  Batch block_inputs(const Batch& b, at::ScalarType dtype) const override;  // cos, sin, segment_ids (, q_scale)
  at::Tensor block_forward(const Batch& inputs, const at::Tensor& h, int64_t i) override;
  // The same with a key/value cache (generation).
  at::Tensor block_forward(const Batch& inputs, const at::Tensor& h, int64_t i, nn::KVCache* cache);
  at::Tensor post_blocks(const at::Tensor& h) override { return final_norm(h); }
  // The summed token cross-entropy of the final hidden states h [B,T,H] against targets: the fused linear +
  // cross-entropy over vocabulary chunks for large batches (no [N, V] logits kept), logits + cross_entropy otherwise;
  // vocab_loss_fn when a layout set it.
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  int64_t hidden_size() const override { return config_.hidden_size; }
  std::vector<int64_t> activation_shape(int64_t rows, int64_t seq) const override {  // DeepSeek-V4: the hc streams
    if (config_.deepseek_v4) return {rows, seq, config_.hc_mult, config_.hidden_size};
    return {rows, seq, config_.hidden_size};
  }
  int64_t num_blocks() const override { return config_.num_hidden_layers; }
  torch::nn::Module& block(int64_t i) override { return *(*model->layers)[static_cast<size_t>(i)]; }
  ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) override;
  Split split() const override;
  TensorParallelSpec tensor_parallel_spec() const override;
  std::vector<nn::AttentionHook*> attention_modules() override;
  std::vector<std::pair<int64_t, nn::MoEImpl*>> moe_layers() const override;
  std::string cuda_graph_blocker() const override;
  // Hub checkpoints and save_pretrained store experts one tensor per expert (Qwen3-MoE:
  // model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight; Mixtral: model.layers.L.block_sparse_moe.experts.E.
  // {w1,w3,w2}.weight) while the model stacks them (experts.gate_up_proj [E,2f,d] = [gate; up], experts.down_proj
  // [E,d,f]); the routers' e_score_correction_bias are buffers saved with the weights. GLM-4-MoE: Qwen3-MoE's
  // names; MiniMax-M2: Mixtral's, its bias block_sparse_moe.e_score_correction_bias; Mistral 4: stacked, as in memory.
  std::vector<CheckpointTensor> checkpoint_tensors() const override;
  bool ignorable_checkpoint_tensor(const std::string& name) const override;
  // transformers' in-memory name of a checkpoint tensor: Mixtral's checkpoints say block_sparse_moe where the module
  // is mlp.
  std::string reference_name(const std::string& checkpoint_name) const override;

  // ---- the decoder LM's own interface (generation, tests) ----
  // Final hidden states [B,T,hidden]. position_ids [B,T] (default: cache length + 0..T-1); segment_ids [B,T]
  // restrict attention to packed documents.
  at::Tensor hidden_states(const at::Tensor& input_ids, const at::Tensor& position_ids = {},
                           nn::KVCache* cache = nullptr, const at::Tensor& segment_ids = {});
  // hidden_states from input embeddings h [B,T,hidden] (a VLM's text + image features).
  at::Tensor hidden_states_from(at::Tensor h, const at::Tensor& position_ids = {}, nn::KVCache* cache = nullptr,
                                const at::Tensor& segment_ids = {});
  // Logits [B,T,V] from hidden states.
  at::Tensor logits(const at::Tensor& hidden);
  // The pieces of hidden_states: embeddings of input_ids (embed_fn when set); cos/sin of the positions; layers
  // [begin, end) (recomputation as set; with a cache: none); final norm.
  at::Tensor embed(const at::Tensor& input_ids);
  std::pair<at::Tensor, at::Tensor> rotary(const at::Tensor& position_ids, at::ScalarType dtype) const;
  at::Tensor run_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, int64_t begin, int64_t end,
                        nn::KVCache* cache = nullptr, const at::Tensor& segment_ids = {}, const at::Tensor& q_scale = {});
  // Mistral 4's query scale of the positions [B,T]: 1 + beta * log(1 + floor(pos / original_max)) (transformers'
  // get_llama_4_attn_scale), in dtype; undefined for the other families.
  at::Tensor query_scale(const at::Tensor& position_ids, at::ScalarType dtype) const;
  at::Tensor final_norm(const at::Tensor& h);
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& position_ids = {}, nn::KVCache* cache = nullptr) {
    return logits(hidden_states(input_ids, position_ids, cache));
  }
  // The output projection's weight ([V, hidden]; the embedding when tied).
  at::Tensor output_weight() const;
  const DecoderConfig& config() const { return config_; }
  // Module::to, and the rotary frequencies (not a parameter or buffer) follow the model to its device.
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  nn::KVCache new_cache() const { return nn::KVCache(static_cast<size_t>(config_.num_hidden_layers)); }

  // ---- multi-token prediction (DeepSeek-V3's MTP layers; models/llama/mtp.h) ----
  // The MTP layers (null when the config declares none, the checkpoint lacks them or a run from scratch drops them).
  MtpImpl* mtp() const { return mtp_.get(); }
  // MTP depth k on prev [B,T,H] (the main model's final hidden states for k = 0, depth k-1's output after) and the
  // ids [B,T] of the tokens k+1 ahead of prev's positions, at those tokens' position_ids: depth k's output [B,T,H]
  // (after its shared_head.norm: what the shared lm_head reads and depth k+1 takes).
  at::Tensor mtp_forward(int64_t k, const at::Tensor& prev, const at::Tensor& ids, const at::Tensor& position_ids,
                         nn::KVCache* cache = nullptr, const at::Tensor& segment_ids = {});
  void drop_absent_parts(const std::set<std::string>& stored) override;
  std::string set_mtp_loss_weight(double weight) override;
  std::vector<std::pair<std::string, double>> take_loss_parts() override;
  // DeepSeek sparse attention's indexers (dsa.h): their KL loss joins head_loss_sum in training forwards.
  std::string set_indexer_training(double loss_coef, bool dense_warmup) override;
  bool thread_split_safe() const override {
    return mtp_loss_weight_ == 0 && indexer_loss_coef_ == 0 && !dsa_shares_selection(config_);
  }
  // GLM-5's shared sparse-attention layers read the selection an earlier layer made on the same micro-batch (dsa.h)
  std::string pipeline_blocker() const override {
    return dsa_shares_selection(config_) ? dsa_pipeline_blocker : "";
  }
  // Stacked experts of the MTP blocks stored whole (model.layers.{L+k}.mlp.experts.gate_up_proj) -> their in-memory
  // names, as the main layers' load under theirs.
  std::string canonical_checkpoint_name(const std::string& stored) const override;

  DecoderModel model{nullptr};
  nn::Linear lm_head{nullptr};  // absent when tie_word_embeddings

 private:
  // The main head's token loss (head_loss_sum adds the MTP loss to it when trained).
  at::Tensor main_head_loss_sum(const at::Tensor& h, const Batch& b);
  // The weighted MTP loss (summed over its terms) of a training forward's final hidden states (mtp.h).
  at::Tensor mtp_loss_part(const at::Tensor& hidden, const Batch& b);
  std::shared_ptr<MtpImpl> mtp_;
  std::shared_ptr<V4Rotary> v4_rotary_;  // DeepSeek-V4's main and compress rotaries
  // DeepSeek-V4 hidden states (with a cache: incremental, deepseek_v4.h v4_cache_state)
  at::Tensor v4_hidden_states(const at::Tensor& input_ids, const at::Tensor& position_ids, nn::KVCache* cache,
                              const at::Tensor& segment_ids = {});
  double mtp_loss_weight_ = 0, mtp_loss_sum_ = 0;
  double indexer_loss_coef_ = 0, indexer_loss_sum_ = 0;
  std::vector<IndexerImpl*> indexers() const;  // the DSA layers' indexers, in layer order
  // The indexers' KL terms since the last call, summed (times indexer_loss_coef; undefined when none), taken from
  // them; their unweighted mean over the layers joins the logged indexer_kl.
  at::Tensor take_indexer_kl();
  DecoderConfig config_;
  nn::Rotary rotary_;
  void zero_centered_norms_to_zero();  // Qwen3-Next's (1 + weight) norms start at 0 (the gated one at 1)
};
TORCH_MODULE(CausalLM);

nn::RopeSpec rope_spec(const DecoderConfig& c);
// RMSNorm n of x, scaled by its weight, or by 1 + weight when zero-centred (Qwen3-Next; its weight starts at 0).
at::Tensor apply_norm(const nn::RMSNorm& n, const at::Tensor& x, bool zero_centered);
// The MoE block options of a config's MoE layers.
nn::MoEOptions moe_options(const DecoderConfig& c);

}  // namespace lf::models::llama

// The dense decoder LM as a plain torch::nn::Module tree whose parameter names are the Hugging Face names
// (model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ..., lm_head.weight). No parallelism inside:
// parallel layouts are applied from outside.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

#include <functional>

#include "loongforge/models/llama/config.h"
#include "loongforge/models/llama/mla.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/moe.h"
#include "loongforge/nn/rms_norm.h"
#include "loongforge/nn/rotary.h"

namespace lf::models::llama {

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const DecoderConfig& c, int64_t layer_idx);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, nn::KVCache* cache,
                     const at::Tensor& segment_ids = {});

  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  nn::RMSNorm q_norm{nullptr}, k_norm{nullptr};
  // heads/kv_heads: the heads this module computes (a tensor-parallel layout lowers them to the local share).
  int64_t layer_idx, heads, kv_heads, head_dim, window;
  // Replaces nn::causal_attention when set (context parallel layouts): same arguments and result.
  using AttentionFn = std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               int64_t q_offset, int64_t window, double scale,
                                               const at::Tensor& segment_ids)>;
  AttentionFn attention_fn;
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
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, nn::KVCache* cache,
                     const at::Tensor& segment_ids = {});

  Attention self_attn{nullptr};  // null with config.mla: then mla is registered as "self_attn"
  MLA mla{nullptr};
  MLP mlp{nullptr};  // null in MoE layers (config.is_moe_layer): then moe, registered as config.moe_module_name
  nn::MoE moe{nullptr};
  nn::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(DecoderLayer);

// "model": embeddings, layers, final norm.
class DecoderModelImpl : public torch::nn::Module {
 public:
  explicit DecoderModelImpl(const DecoderConfig& c);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  nn::RMSNorm norm{nullptr};
};
TORCH_MODULE(DecoderModel);

class CausalLMImpl : public torch::nn::Module {
 public:
  explicit CausalLMImpl(DecoderConfig c);

  // Final hidden states [B,T,hidden]. position_ids [B,T] (default: cache length + 0..T-1); segment_ids [B,T]
  // restrict attention to packed documents.
  at::Tensor hidden_states(const at::Tensor& input_ids, const at::Tensor& position_ids = {},
                           nn::KVCache* cache = nullptr, const at::Tensor& segment_ids = {});
  // Activation recomputation: "none", "full" (every layer) or every n-th layer.
  // Activation recomputation of every n-th layer (0: none). Recomputed MoE layers make their router statistics in
  // the graph-free forward too (MoEImpl::force_stats); their router losses are backpropagated in the recomputation
  // through layer_loss_fn.
  void set_recompute(int64_t every_n_layers);
  // Router losses of a recomputed layer (index), called in its backward recomputation; set by the trainer for each
  // micro-batch (the layer's share times the loss weight), unset: none.
  std::function<at::Tensor(int64_t layer)> layer_loss_fn;
  // Whether layer i's activations are recomputed in training.
  bool recomputed(int64_t layer) const { return recompute_every_ > 0 && layer % recompute_every_ == 0; }
  // Logits [B,T,V] from hidden states.
  at::Tensor logits(const at::Tensor& hidden);

  // The pieces of hidden_states, for engines that run part of the model (pipeline stages):
  // embeddings of input_ids; cos/sin of the positions; layers [begin, end) (recomputation as set); final norm.
  at::Tensor embed(const at::Tensor& input_ids);
  std::pair<at::Tensor, at::Tensor> rotary(const at::Tensor& position_ids, at::ScalarType dtype) const;
  at::Tensor run_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, int64_t begin, int64_t end,
                        nn::KVCache* cache = nullptr, const at::Tensor& segment_ids = {});
  at::Tensor final_norm(const at::Tensor& h);
  // Replace the embedding lookup (vocabulary-parallel layouts); same argument and result as embed().
  std::function<at::Tensor(const at::Tensor& input_ids)> embed_fn;
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

  DecoderModel model{nullptr};
  nn::Linear lm_head{nullptr};  // absent when tie_word_embeddings

  // Mixture of experts. The MoE blocks of the layers, in layer order (empty for dense models).
  std::vector<nn::MoEImpl*> moe_blocks() const;
  // Router losses of the last forward with gradients, to add to the mean token loss (undefined when none):
  // router_aux_loss_coef * transformers' load_balancing_loss_func over all MoE layers (its statistics pooled
  // across layers, as transformers does) + every block's sequence-level and z-loss terms.
  at::Tensor aux_loss() const;
  // This rank's share of those router losses when every micro-batch is split over data-parallel ranks (rows), in
  // two halves. aux_stats: the statistics of the layers [begin, end) (end < 0: all) with `reduce` summing a tensor
  // over those ranks in place (collective; called once whenever any block of the range has router losses):
  // expert counts and rows summed over the ranks, the sequence-level and z-loss means taken over the ranks'
  // sequences and tokens (undefined `counts` and zero sizes when no block of the range has router losses).
  // aux_share: the share of the layers [lo, hi) (a sub-range) from those statistics and the blocks' current tensors
  // (this rank's probability sums stay local); the shares sum over the ranks to aux_loss() of the whole micro-batch
  // in one process (value and gradients). The pooled load-balancing loss needs the counts and rows of every layer:
  // with_lb = false leaves it out, for layouts that pool them later (pipeline stages: lb_prob_sum and lb_share). It
  // is linear in each layer's probability sums, so the shares of the layers add up to the share of the range (FSDP:
  // each layer in its backward recomputation).
  struct AuxStats {
    at::Tensor counts;  // [E] float64: expert assignments pooled over layers and ranks
    double rows = 0, tokens = 0, sequences = 0;  // summed over ranks (rows: pooled over layers)
    bool any = false;
  };
  AuxStats aux_stats(const std::function<void(at::Tensor&)>& reduce, int64_t begin = 0, int64_t end = -1) const;
  at::Tensor aux_share(const AuxStats& st, int64_t lo = 0, int64_t hi = -1, bool with_lb = true) const;
  // The load-balancing loss in parts: the probability sums [E] of the last forward's blocks in [begin, end) (with
  // gradients; undefined when none has the loss on), and the loss of such a sum given the expert counts [E] and rows
  // pooled over every layer (and data rank): router_aux_loss_coef * E * sum(counts / rows * prob_sum / rows).
  at::Tensor lb_prob_sum(int64_t begin, int64_t end) const;
  at::Tensor lb_share(const at::Tensor& prob_sum, const at::Tensor& counts, double rows) const;
  // Aux-loss-free bias updates of every block (nn::MoEImpl::update_bias); call after the optimizer step.
  void update_moe_bias();
  // Training options of every MoE block (recipe `moe.*`): the load-balancing coefficient (replaces config.json's
  // router_aux_loss_coef), sequence-level and z-loss coefficients, aux-loss-free bias update rate, capacity factor.
  void set_moe_training(double aux_loss_coef, double seq_aux_loss_coef, double z_loss_coef, double bias_update_rate,
                        double capacity_factor);

 private:
  DecoderConfig config_;
  nn::Rotary rotary_;
  int64_t recompute_every_ = 0;
};
TORCH_MODULE(CausalLM);

nn::RopeSpec rope_spec(const DecoderConfig& c);
// The MoE block options of a config's MoE layers.
nn::MoEOptions moe_options(const DecoderConfig& c);

// Checkpoint names <-> model tensors. Hub checkpoints and save_pretrained store experts one tensor per expert
// (Qwen3-MoE: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight; Mixtral:
// model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight) while the model stacks them
// (experts.gate_up_proj [E,2f,d] = [gate; up], experts.down_proj [E,d,f]). Each entry names one checkpoint tensor
// and the slice of a model parameter (or, with buffer, a buffer) it fills: param[index, begin:end] along dim 1, or
// the whole tensor when index < 0. Every other parameter maps to itself. Loading and export apply this list.
struct CheckpointTensor {
  std::string name, param;
  int64_t index = -1, begin = 0, end = 0;
  bool buffer = false;
};
std::vector<CheckpointTensor> checkpoint_tensors(const CausalLMImpl& model);
// The view of `t` (the tensor named entry.param) that entry fills.
at::Tensor checkpoint_slice(const at::Tensor& t, const CheckpointTensor& entry);

}  // namespace lf::models::llama

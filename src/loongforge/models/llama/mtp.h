// DeepSeek-V3's multi-token prediction (MTP) layers, as transformers 5.24's MtpModel (modeling_layers.py) computes
// them: depth k (0-based) takes the hidden state at position i (the main model's final one for k = 0, depth k-1's
// output after) and the embedding of token i+k+1, joins RMSNorm(embedding) and RMSNorm(hidden) (enorm, hnorm) into
// eh_proj, runs one decoder block (always a MoE block: first_k_dense_replace = 0 in the MTP config) and a final
// RMSNorm (the checkpoint's shared_head.norm); the shared lm_head turns it into logits for token i+k+2.
//
// Qwen3-Next / Qwen3.5 (mtp_num_hidden_layers; transformers skips their weights, vLLM's Qwen3NextMTP runs them) are
// the same computation with (1 + weight) norms and a gated full-attention block of the main model's MLP kind, stored
// as mtp.pre_fc_norm_embedding (enorm), mtp.pre_fc_norm_hidden (hnorm), mtp.fc (eh_proj), mtp.layers.0.* (the block),
// mtp.norm (the final norm).
//
// Checkpoints store depth k as model.layers.{num_hidden_layers + k}.* (enorm, hnorm, eh_proj, shared_head.norm and
// the block's own names; DeepSeek's files also hold copies of the embedding and head there, embed_tokens and
// shared_head.head, which loading skips). In memory they are mtp.layers.k.{enorm,hnorm,eh_proj,mtp_block,post_norm},
// owned by CausalLM (its mtp()). A folder without them loads the main model alone.
//
// Training (model.mtp_loss_weight = w > 0): head_loss_sum adds w / K x sum_k CE_k, CE_k the summed cross-entropy of
// depth k over the positions whose target token exists (targets[i+k+1], -100 not counted, never across packed
// documents), on the step's divisor (the main loss's counted tokens). Generation: generate_with_mtp drafts K tokens
// with the MTP layers and verifies them with the main model (greedy: the output equals plain greedy decoding).
#pragma once
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/generate.h"
#include "loongforge/models/llama/model.h"

namespace lf::models::llama {

// The MTP layers a config declares: deepseek_v3's and glm4_moe's num_nextn_predict_layers (transformers' default 1
// when absent); Qwen3-Next's / Qwen3.5's mtp_num_hidden_layers (absent: 0; at most 1); 0 for the other families.
int64_t mtp_layers_declared(const DecoderConfig& c);
// The config the MTP blocks are built from: the main one with num_hidden_layers = K and every block MoE
// (transformers' get_mtp_config).
DecoderConfig mtp_block_config(const DecoderConfig& c);

class MtpLayerImpl : public torch::nn::Module {
 public:
  MtpLayerImpl(const DecoderConfig& block_config, int64_t depth);

  nn::RMSNorm enorm{nullptr}, hnorm{nullptr};
  nn::Linear eh_proj{nullptr};
  DecoderLayer mtp_block{nullptr};
  nn::RMSNorm post_norm{nullptr};
};
TORCH_MODULE(MtpLayer);

class MtpImpl : public torch::nn::Module {
 public:
  explicit MtpImpl(const DecoderConfig& main);
  int64_t depths() const { return static_cast<int64_t>(layers->size()); }
  MtpLayerImpl& layer(int64_t k) { return *layers->ptr(static_cast<size_t>(k))->as<MtpLayerImpl>(); }

  DecoderConfig block_config;
  torch::nn::ModuleList layers{nullptr};
};

// The checkpoint name of an in-memory name (mtp.layers.k.X -> model.layers.{L+k}.X'; Qwen3-Next / Qwen3.5:
// mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm} and mtp.layers.k.<block>; other names unchanged).
std::string mtp_checkpoint_name(const std::string& name, const DecoderConfig& c);
// DeepSeek's copies of the embedding and head beside each MTP layer (model.layers.{L+k}.embed_tokens.weight,
// .shared_head.head.weight): the shared ones serve, loading skips them.
bool mtp_shared_copy(const std::string& checkpoint_name, const DecoderConfig& c);

// `dump`'s MTP outputs: mtp_logits.k [B, T-k-1, V], depth k's logits at positions 0..T-k-2 with the batch's own
// tokens as inputs (teacher forcing; position i predicts token i+k+2).
void add_mtp_outputs(CausalLMImpl& model, const at::Tensor& ids, std::vector<std::pair<std::string, at::Tensor>>& out);

// Speculative greedy decoding: the MTP layers draft K tokens after each verified one, the main model checks them in
// one forward and keeps the drafts up to the first it would not have chosen, plus its own next token (models with
// linear-attention layers run the kept tokens again from the cache before verification when a draft is rejected).
std::vector<int64_t> generate_with_mtp(CausalLMImpl& model, const std::vector<int64_t>& prompt,
                                       const GenerateOptions& opts, const std::function<void(int64_t)>& on_token);

}  // namespace lf::models::llama

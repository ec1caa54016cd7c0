// Multi-head latent attention (MLA) of DeepSeek-V2/V3, as transformers' DeepseekV3Attention: the queries come from
// a low-rank path (q_a_proj -> q_a_layernorm -> q_b_proj) or a plain q_proj; keys and values from one compressed
// latent (kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj) plus a rotary part shared by all heads. Each head's
// query/key is [nope part | rope part] (qk_nope_head_dim + qk_rope_head_dim); values have v_head_dim.
// Registered under "self_attn" with the Hugging Face child names. The KV cache holds the compressed latent
// (keys[layer] = normed latent [B,1,T,kv_lora_rank], values[layer] = rotated shared key [B,1,T,qk_rope_head_dim]).
// Kimi Linear's variant (transformers' KimiLinearAttention) rotates nothing: the shared key part stays as projected.
#pragma once
#include <torch/nn/module.h>

#include "loongforge/models/llama/config.h"
#include "loongforge/models/llama/dsa.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/rms_norm.h"
#include "loongforge/nn/sequence_parts.h"

namespace lf::models::llama {

// Under context parallelism a sparse-attention layer (config.dsa) runs on its parts (nn::SequencePartsHook): it gathers
// the whole sequence's latents, rotated shared keys and index keys, and its local queries attend to the keys their
// indexer keeps among them; other latent attention takes the layout's ring / a2a attention_fn.
class MLAImpl : public torch::nn::Module, public nn::AttentionHook, public nn::SequencePartsHook {  // kv_heads = heads
 public:
  bool runs_in_parts() const override { return selection != nullptr; }
  MLAImpl(const DecoderConfig& c, int64_t layer_idx);
  // x [B,T,hidden]; cos/sin [B,T,qk_rope_head_dim] from the model's rotary (attention scaling included);
  // segment_ids [B,T] restrict attention to packed documents; q_scale [B,T] multiplies the queries (Mistral 4's
  // scaling by position; undefined: none). Returns [B,T,hidden].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, nn::KVCache* cache,
                     const at::Tensor& segment_ids = {}, const at::Tensor& q_scale = {});

  nn::Linear q_proj{nullptr};                            // q_lora_rank null
  nn::Linear q_a_proj{nullptr}, q_b_proj{nullptr};       // q_lora_rank set
  nn::RMSNorm q_a_layernorm{nullptr};
  nn::Linear kv_a_proj_with_mqa{nullptr}, kv_b_proj{nullptr}, o_proj{nullptr};
  nn::RMSNorm kv_a_layernorm{nullptr};
  int64_t layer_idx, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
  int64_t all_heads;  // num_attention_heads (heads: this rank's share under tensor parallelism)
  bool rope_interleave;
  bool rope = true;  // false: no rotary at all (Kimi Linear's NoPE latent attention; DecoderConfig::mla_rope)
  double scale;  // softmax scale: qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2
  // DeepSeek sparse attention (config.dsa; dsa.h): the layer's indexer (null in GLM-5's shared layers) and the
  // selection it shares; the cache's values[layer] then hold [rotated shared key | index key].
  Indexer indexer{nullptr};
  std::shared_ptr<DsaSelection> selection;

 private:
  at::Tensor dsa_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& x,
                        const at::Tensor& q_resid, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& index_keys, int64_t offset, const at::Tensor& segment_ids,
                        bool train_indexer);
};
TORCH_MODULE(MLA);

// DeepSeek's interleaved rotary: the rope dimensions come in pairs (x0,x1),(x2,x3)...; the result is laid out
// de-interleaved [x0',x2',...,x1',x3',...] as transformers' apply_rotary_pos_emb_interleave. x [B,H,T,D],
// cos/sin [B,T,D].
at::Tensor apply_rotary_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace lf::models::llama

// Gated DeltaNet linear attention of Qwen3-Next / Qwen3.5 (transformers' Qwen3NextGatedDeltaNet /
// Qwen3_5GatedDeltaNet), with their parameter names:
//   qwen3_next: in_proj_qkvz [2Kd + 2Vd, d], in_proj_ba [2Hv, d] (packed per key head: q, k, its value heads' v and
//               z; its value heads' b and a)
//   qwen3_5:    in_proj_qkv [2Kd + Vd, d], in_proj_z [Vd, d], in_proj_b [Hv, d], in_proj_a [Hv, d]
//   conv1d.weight [2Kd + Vd, 1, K] (depthwise, causal, SiLU), dt_bias [Hv], A_log [Hv], norm.weight [Dv] (gated
//   RMSNorm), out_proj [d, Vd]
// (Kd = Hk x Dk, Vd = Hv x Dv). q, k are L2-normalised and q scaled by Dk^-1/2; beta = sigmoid(b), the log decay
// g = -exp(A_log) softplus(a + dt_bias); the gated delta rule (nn/gated_delta.h) runs chunk-wise over a sequence and
// token by token when a cache holds the layer's state (conv inputs + recurrent state).
//
// The layer is an nn::AttentionHook (heads: value heads, kv_heads: key heads; tensor parallelism splits both, the
// projections by heads and the convolution's [q | k | v] channels as three blocks) so that layouts see it, but it refuses
// an attention_fn: under context parallelism it is an nn::SequencePartsHook instead (nn/sequence_parts.h: the
// recurrent state and the convolution's past pass between the ranks' parts of the sequence).
// In an nn::KVCache the layer keeps its recurrent state [B, Hv, Dk, Dv] in values[layer] and the last K - 1
// convolution inputs [B, K - 1, C] in keys[layer], viewed (no copy) as [B, K - 1, T, C] with a zero stride over the T
// tokens seen, so that the cache's length() counts tokens as for attention layers.
#pragma once
#include <torch/nn/module.h>

#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "loongforge/models/llama/config.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/rms_norm.h"
#include "loongforge/nn/sequence_parts.h"

namespace lf::models::llama {

// The conv1d's weight under transformers' name (conv1d.weight).
class DepthwiseConvWeightImpl : public torch::nn::Module {
 public:
  DepthwiseConvWeightImpl(int64_t channels, int64_t kernel);
  at::Tensor weight;
};
TORCH_MODULE(DepthwiseConvWeight);

// A linear-attention layer's states in an nn::KVCache (the layout above): the last K - 1 convolution inputs
// [B, K - 1, C] and the recurrent state (both undefined before the first call).
struct LinearCacheState {
  at::Tensor conv, recurrent;
};
LinearCacheState linear_cache_state(const nn::KVCache* cache, int64_t layer);
// Stores them after a call over t more tokens.
void store_linear_cache_state(nn::KVCache& cache, int64_t layer, int64_t t, const at::Tensor& conv, const at::Tensor& recurrent);

// The documents of packed rows (segment_ids [B, T]) as [start, end) ranges of the flattened [B*T] tokens
// (nn::document_ranges); empty when every row is one document (nothing to separate).
std::vector<std::pair<int64_t, int64_t>> packed_documents(const at::Tensor& segment_ids);
// f applied to every document's tokens on its own ([1, len, ...] slices of the flattened tensors xs [B, T, ...]), the
// results put back in place: [B, T, ...].
at::Tensor per_document(const std::vector<std::pair<int64_t, int64_t>>& docs, const std::vector<at::Tensor>& xs,
                        const std::function<at::Tensor(const std::vector<at::Tensor>&)>& f);

// How a linear-attention layer (Gated DeltaNet, KDA) runs its short convolution and delta rule in one call: packed
// documents (segment_ids [B, T]: each document alone, from a zero state and convolution past), this rank's parts of
// the sequence (context parallelism, nn/sequence_parts.h), or one sequence per row continuing a cache's states
// (token by token for one token with a state, else chunk-wise); documents and parts together: each part's documents
// restart the state and convolution, a document running on from the part before continues (nn/sequence_parts.h).
// Documents with a cache, parts with a cache, and an attention_fn on the layer's hook are errors naming the layer.
class LinearLayout {
 public:
  LinearLayout(const nn::AttentionHook& hook, const at::Tensor& segment_ids,
               const std::optional<nn::SequenceParts>& parts, nn::KVCache* cache, int64_t layer);
  // x [B, T, C] -> causal_depthwise_conv_silu(x) in this layout (keeps the last K - 1 inputs for the cache).
  at::Tensor conv(const at::Tensor& x, const at::Tensor& weight);
  // The gated delta rule in this layout (g per head or per channel, nn/gated_delta.h); with a cache, stores the new
  // convolution inputs and recurrent state there. Returns the outputs [B, T, Hv, Dv].
  at::Tensor delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, int64_t chunk) const;

 private:
  std::vector<std::pair<int64_t, int64_t>> docs_;  // [start, end) of the flattened [B*T] tokens; empty: none
  const nn::SequenceParts* parts_ = nullptr;
  at::Tensor part_segments_;  // with parts: the local tokens' document ids (undefined: none)
  nn::KVCache* cache_ = nullptr;
  int64_t layer_ = 0;
  LinearCacheState past_;
  at::Tensor conv_state_;
};

class GatedDeltaNetImpl : public torch::nn::Module, public nn::AttentionHook, public nn::SequencePartsHook {
 public:
  GatedDeltaNetImpl(const DecoderConfig& c, int64_t layer_idx);
  // x [B,T,d] -> [B,T,d]. With a cache: continues from and updates the layer's states there. segment_ids [B,T]
  // (packed documents): every document starts from a zero state and convolution past.
  at::Tensor forward(const at::Tensor& x, nn::KVCache* cache = nullptr, const at::Tensor& segment_ids = {});

  nn::Linear in_proj_qkvz{nullptr}, in_proj_ba{nullptr};                          // qwen3_next
  nn::Linear in_proj_qkv{nullptr}, in_proj_z{nullptr}, in_proj_b{nullptr}, in_proj_a{nullptr};  // qwen3_5
  nn::Linear out_proj{nullptr};
  DepthwiseConvWeight conv1d{nullptr};
  nn::RMSNorm norm{nullptr};  // the gated norm's weight and eps
  at::Tensor dt_bias, A_log;
  int64_t layer_idx, key_heads, value_heads, key_dim, value_dim, kernel;  // the whole layer's heads (forward: the
                                                                          // AttentionHook's, this rank's share)
  int64_t chunk = 64;  // transformers' torch_chunk_gated_delta_rule chunk size
};
TORCH_MODULE(GatedDeltaNet);

}  // namespace lf::models::llama

// Kimi Delta Attention (KDA), the linear attention of Kimi Linear (transformers' KimiLinearDeltaAttention), with its
// parameter names under "self_attn":
//   q_proj, k_proj, v_proj [HD, d]; conv1d.weight [3HD, 1, K] (depthwise, causal, SiLU, over [q | k | v]);
//   forget_gate.{f_a_proj [D, d], f_b_proj [HD, D], dt_bias [HD], A_log [1, 1, H, 1]}; b_proj [H, d];
//   g_a_proj [D, d], g_b_proj [HD, D]; o_norm.weight [D] (RMSNorm gated by sigmoid); o_proj [d, HD]
// (H heads of D features for queries, keys and values alike). q, k are L2-normalised and q scaled by D^-1/2;
// beta = sigmoid(b_proj x); the per-channel log decay g = -exp(A_log) softplus(f_b_proj f_a_proj x + dt_bias)
// [B, T, H, D]; the gated delta rule (nn/gated_delta.h) runs chunk-wise over a sequence and token by token with a
// cache; the output is o_norm(o, g_b_proj g_a_proj x) through o_proj. Checkpoints (save_pretrained, the Hub) keep
// the forget gate's tensors directly under self_attn and the convolution as q_conv1d / k_conv1d / v_conv1d
// (CausalLM::checkpoint_tensors maps them).
// The cache layout, packed documents, context parallelism (an nn::SequencePartsHook: the per-channel decay keeps the
// delta rule affine in its start state, nn/sequence_parts.h) and the refusal of attention_fn are Gated DeltaNet's
// (gated_deltanet.h: LinearLayout). Tensor parallelism splits the heads (AttentionHook::heads, kv_heads: H): q/k/v,
// b_proj, f_b_proj, g_b_proj by rows, the convolution's [q | k | v] channels as three blocks, dt_bias and A_log by
// heads, o_proj by columns; the low-rank entries f_a_proj / g_a_proj and o_norm stay whole.
#pragma once
#include <torch/nn/module.h>

#include "loongforge/models/llama/config.h"
#include "loongforge/models/llama/gated_deltanet.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/rms_norm.h"
#include "loongforge/nn/sequence_parts.h"

namespace lf::models::llama {

class KdaForgetGateImpl : public torch::nn::Module {
 public:
  KdaForgetGateImpl(int64_t hidden, int64_t heads, int64_t head_dim);
  // x [B,T,d] -> the log decay g [B,T,H,D] in the compute dtype (float32 unless float64); H: the heads of dt_bias
  // (this rank's under tensor parallelism), T: the projections' (a sequence-parallel entry gathers the sequence).
  at::Tensor forward(const at::Tensor& x);

  nn::Linear f_a_proj{nullptr}, f_b_proj{nullptr};
  at::Tensor dt_bias, A_log;
  int64_t heads, head_dim;
};
TORCH_MODULE(KdaForgetGate);

class KimiDeltaAttentionImpl : public torch::nn::Module, public nn::AttentionHook, public nn::SequencePartsHook {
 public:
  KimiDeltaAttentionImpl(const DecoderConfig& c, int64_t layer_idx);
  // x [B,T,d] -> [B,T,d]. With a cache: continues from and updates the layer's states there. segment_ids [B,T]
  // (packed documents): every document starts from a zero state and convolution past.
  at::Tensor forward(const at::Tensor& x, nn::KVCache* cache = nullptr, const at::Tensor& segment_ids = {});

  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, b_proj{nullptr}, g_a_proj{nullptr}, g_b_proj{nullptr},
      o_proj{nullptr};
  DepthwiseConvWeight conv1d{nullptr};
  KdaForgetGate forget_gate{nullptr};
  nn::RMSNorm o_norm{nullptr};
  int64_t layer_idx, head_dim, kernel;
  int64_t chunk = 64;  // transformers' chunk_kimi_delta_attention chunk size
};
TORCH_MODULE(KimiDeltaAttention);

}  // namespace lf::models::llama

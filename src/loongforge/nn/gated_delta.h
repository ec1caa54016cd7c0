// The gated delta rule (Gated DeltaNet's linear attention, Yang et al. 2024) and the small ops around it (layer nn;
// generic, no model includes). Per value head, with a state S [Dk, Dv] that starts at S0 (zeros by default):
//   S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t
// q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; beta [B, T, Hv]; g the log decay (<= 0): [B, T, Hv], one per head (Gated
// DeltaNet), or [B, T, Hv, Dk], one per key channel (Kimi Delta Attention, KDA: S_t = diag(exp(g_t)) S_{t-1}). Each
// query/key head serves Hv / Hk consecutive value heads. Nothing is normalised or scaled here (the caller L2-normalises q and k and scales
// q). The math runs in float32 (float64 stays float64); outputs [B, T, Hv, Dv] come back in v's dtype, states
// [B, Hv, Dk, Dv] in the compute dtype.
#pragma once
#include <ATen/core/Tensor.h>

#include <utility>

namespace lf::nn {

// Whole sequences (training, prefill). On the CPU (computing in float32, or float64) the fused kernel (kernels/gated_delta.h): one
// task per head carries the state through the tokens in L1 / L2, checkpointed at the start of every chunk of `chunk`
// tokens, and backward recomputes each chunk from its checkpoint. Elsewhere (bf16, CUDA) the chunk-wise composite below.
std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& g, const at::Tensor& beta,
                                                         const at::Tensor& initial_state = {}, int64_t chunk = 64,
                                                         bool final_state = false);

// The chunk-wise composite (ATen ops, any dtype and device): within a chunk of `chunk` tokens the delta-rule updates
// are condensed by a unit-lower-triangular solve (the WY / UT transform) into batched GEMMs; only the state passes
// sequentially from chunk to chunk. Per-channel decays weight each key channel of the in-chunk products q_i.k_j and
// k_i.k_j by exp(gc_i - gc_j) (gc: the cumulative log decay): explicit [16, 16, Dk] products inside sub-chunks of 16
// tokens, GEMMs between them (the decay factored through a reference point, every factor <= 1). Any T (the last chunk is padded). Autograd runs through ATen ops. Returns the
// outputs and the final state (undefined unless final_state).
std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule_reference(const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v, const at::Tensor& g,
                                                                   const at::Tensor& beta,
                                                                   const at::Tensor& initial_state = {},
                                                                   int64_t chunk = 64, bool final_state = false);

// Token by token (generation steps with a cached state): the same math, one update per token. Returns the outputs
// and the final state.
std::pair<at::Tensor, at::Tensor> recurrent_gated_delta_rule(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& g,
                                                             const at::Tensor& beta,
                                                             const at::Tensor& initial_state = {});

// x * rsqrt(sum(x^2, -1) + eps) (the FLA library's l2norm, as transformers).
at::Tensor l2_normalize(const at::Tensor& x, double eps = 1e-6);

// Causal depthwise convolution over time with SiLU: x [B, T, C], weight [C, 1, K] (torch.nn.Conv1d's layout, no
// bias); y_t = silu(sum_j weight[:, 0, j] * x_{t - K + 1 + j}), x before the start being `past` [B, K - 1, C] (zeros
// when undefined). The fused kernel kernels/causal_conv.h (ATen's CPU convolution backward is not safe on several
// threads). Returns y and the last K - 1 inputs (the state a next call continues from).
std::pair<at::Tensor, at::Tensor> causal_depthwise_conv_silu(const at::Tensor& x, const at::Tensor& weight,
                                                             const at::Tensor& past = {});

// Gated RMSNorm of the linear-attention output: weight * rms_norm(x) * silu(gate) (Gated DeltaNet) or
// * sigmoid(gate) (KDA), statistics and gating in float32.
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps,
                          bool sigmoid_gate = false);

}  // namespace lf::nn

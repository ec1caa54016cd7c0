// Fused gated delta rule on the CPU (Gated DeltaNet / KDA training and prefill), per value head with a state S [Dk, Dv]:
//   S'_t = diag(a_t) S_{t-1}  (a_t = exp(g_t): one per head, or one per key channel),
//   u_t = v_t - S'_t^T k_t,  S_t = S'_t + k_t (beta_t u_t)^T,  o_t = S_t^T q_t.
//
// One task per (batch row, head) keeps its state in a [Dk, Dv] buffer (L1 / L2 resident) and runs the tokens in
// order: two passes over the state per token, with no [T, T] or per-chunk intermediates. The state is checkpointed at
// the start of every chunk of `chunk` tokens; backward walks the chunks in reverse, recomputes a chunk's states from its
// checkpoint into a buffer of chunk + 1 states, and runs the exact reverse of each token's update (two passes over the
// state gradient): dq, dk, dv, dg, dbeta and the start state's gradient. The composite version (nn/gated_delta.h's
// chunk-wise ATen ops) is the reference in the tests and what other dtypes and devices run. Tasks are independent and
// run their tokens in a fixed order, so results do not depend on the thread count. Accumulates in the inputs' dtype
// (float32 or float64).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lf::kernels {

// Heads first: q, k [B, H, T, Dk]; v [B, H, T, Dv]; g [B, H, T] or [B, H, T, Dk] (log decays); beta [B, H, T]; s0
// [B, H, Dk, Dv] (undefined: zeros). All one dtype, float32 or float64, on the CPU. Returns {o [B, H, T, Dv], final
// state [B, H, Dk, Dv]}; autograd-aware in q, k, v, g, beta and s0.
std::tuple<at::Tensor, at::Tensor> gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& g, const at::Tensor& beta, const at::Tensor& s0,
                                                    int64_t chunk = 64);
// Whether gated_delta_rule takes these operands (CPU, float32 / float64, one dtype).
bool gated_delta_kernel_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                              const at::Tensor& beta);

// Raw kernels (no autograd), for tests and benchmarks. Forward returns {o, final state, checkpoints [B, H, n, Dk, Dv]
// (the state at the start of each of the n = ceil(T / chunk) chunks)}; backward {dq, dk, dv, dg, dbeta, ds0} (dfinal
// undefined: zero).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                       const at::Tensor& v, const at::Tensor& g,
                                                                       const at::Tensor& beta, const at::Tensor& s0,
                                                                       int64_t chunk);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_backward_cpu(
    const at::Tensor& dout, const at::Tensor& dfinal, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& g, const at::Tensor& beta, const at::Tensor& checkpoints, int64_t chunk);

}  // namespace lf::kernels

// Fused top-k sparse attention (DeepSeek sparse attention: each query attends only to the keys its lightning indexer
// picked):
//   out[b, h, i] = sum_j p_ij v[b, h', idx[b, i, j]],   p_i = softmax_j(scale q[b, h, i] . k[b, h', idx[b, i, j]])
// over the j with idx[b, i, j] >= 0 (h' = h / (H / Hk): key/value heads shared by groups of query heads).
//
// The composite version (dense scores with the unpicked keys masked, as transformers' eager path) keeps [B, H, Tq, Tk]
// probabilities for backward; this kernel touches only the K picked keys of each query and keeps the log-sum-exp
// [B, H, Tq]: O(Tq K) work and memory instead of O(Tq Tk). Backward recomputes the probabilities from the
// log-sum-exp (flash-attention style); dk / dv are summed per key/value head by one task each, in query order, so the
// result does not depend on the thread count. Accumulates in float32 (float64 for double inputs).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lf::kernels {

// Fused op (autograd-aware in q, k, v). q [B, H, Tq, D], k [B, Hk, Tk, D], v [B, Hk, Tk, Dv] (Hk divides H), idx
// [B, Tq, K] int64 key positions (-1: none; every row picks at least one key; a key picked twice counts twice). Returns
// [B, H, Tq, Dv] in q's dtype. CPU float32 / float64 run the kernel; other dtypes and devices the composite version.
at::Tensor sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
                            double scale);

// Whether sparse_attention runs the kernel on these operands (CPU, float32 / float64, one dtype).
bool sparse_attention_kernel_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// The composite ATen version of the same math (the picked keys gathered: [B, H, Tq, K, D]).
at::Tensor sparse_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& idx, double scale);

// The picked keys of a keep mask [B, Tq, Tk] (true: the query attends to the key) as idx [B, Tq, K] in key order, K
// the most any row keeps, rows with fewer padded with -1.
at::Tensor keep_to_index(const at::Tensor& keep);

// Raw kernels (no autograd), for tests and benchmarks. Forward returns {out, lse}; backward {dq, dk, dv}.
std::tuple<at::Tensor, at::Tensor> sparse_attention_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& v, const at::Tensor& idx,
                                                                double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_backward_cpu(const at::Tensor& dout,
                                                                             const at::Tensor& q, const at::Tensor& k,
                                                                             const at::Tensor& v,
                                                                             const at::Tensor& idx,
                                                                             const at::Tensor& lse, double scale);

}  // namespace lf::kernels

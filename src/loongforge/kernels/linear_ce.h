// Fused linear + cross-entropy over the vocabulary: loss_sum = sum_i CE(x_i W^T, t_i), rows with t_i == ignore_index
// skipped, without ever holding the full [N, V] logits.
//
// The rows are processed in chunks: logits_c = x_c W^T (at::mm), then one fused pass per row computes max,
// logsumexp, the target logit and, when gradients are needed, the softmax - onehot gradient in place; two more GEMMs
// turn it into dX_c and dW += G_c^T x_c. The gradient is computed during the forward for an incoming gradient of 1
// and scaled by the real one in backward (the loss is a scalar, so this is exact up to one rounding), so backward is
// two in-place scalar multiplications and nothing of size N x V is kept (so one backward per forward: a second one
// through the same graph is autograd's in-place modification error). Tied embeddings: pass the embedding as weight.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lf::kernels {

inline constexpr int64_t kLinearCEIgnoreIndex = -100;

// Fused op (autograd-aware). x: [..., H], weight: [V, H], target: x's leading shape (int64). Returns
// {loss_sum (0-dim float32, float64 for f64 inputs; differentiable in x and weight), count (0-dim int64: rows whose
// target is not ignore_index)}. chunk_rows <= 0 picks a chunk size. x and weight: one dtype (f32, bf16 or f64;
// bf16 GEMMs in bf16, the softmax in f32); other inputs use the composite version.
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight,
                                                        const at::Tensor& target,
                                                        int64_t ignore_index = kLinearCEIgnoreIndex,
                                                        int64_t chunk_rows = 0);

// The composite ATen version: at::cross_entropy_loss(x W^T in float32, target, sum, ignore_index) and the count.
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_reference(const at::Tensor& x, const at::Tensor& weight,
                                                                  const at::Tensor& target,
                                                                  int64_t ignore_index = kLinearCEIgnoreIndex);

// Raw kernel (no autograd), for tests and benchmarks: x [N, H], weight [V, H], target [N]. Returns
// {loss_sum, count, dx, dweight}; dx/dweight are the gradients of loss_sum (incoming gradient 1), each undefined
// unless asked for. Rows whose target is ignore_index are dropped before the GEMMs (their dx rows are 0).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_cpu(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target, int64_t ignore_index, int64_t chunk_rows,
    bool need_dx, bool need_dweight);

// The chunk size (rows) used when chunk_rows <= 0, for a vocabulary of v and hidden size h.
int64_t linear_cross_entropy_default_chunk(int64_t v, int64_t h);

}  // namespace lf::kernels

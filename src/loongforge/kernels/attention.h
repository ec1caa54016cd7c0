// Causal self-attention for training on the CPU: the whole sequence attends to itself (query i sees keys j <= i),
// optionally within a sliding window and within packed-document segments, with GQA; and the same kernel for
// bidirectional attention (full_attention: every query sees every key of its segment; vision towers, DiT).
//
// Why our own: ATen's CPU flash attention (what scaled_dot_product_attention runs on the CPU) works in 64-row query
// blocks against the full key range and issues many small GEMMs; at the bench shapes it took ~15 % of a PyTorch
// training step. Here each (batch, head) runs row blocks of queries against only the keys they can see, as a few
// larger BLAS calls per block; the backward recomputes the probabilities from the saved log-sum-exp (nothing of size
// T x T is kept between forward and backward).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace lf::kernels {

// q [B,H,T,D], k/v [B,Hkv,T,D] (H a multiple of Hkv), the last dim contiguous (any other strides; the model passes
// views of [B,T,H,D] memory). Query t sees keys j <= t, with window > 0 also j > t - window (transformers' sliding
// window rule), and with segment_ids [B,T] (integer) only keys of its own segment. Returns [B,H,T,D] (a view of
// [B,T,H,D] memory, so the usual transpose + reshape to [B,T,H*D] costs no copy). Autograd-aware (first order).
// CPU float32/float64 run the kernel below; anything else goes to causal_attention_reference.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t window = 0, const at::Tensor& segment_ids = {});

// Whether causal_attention runs the CPU kernel for these inputs (CPU float32/float64, shapes as above).
bool causal_attention_kernel_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& segment_ids = {});

// The composite ATen version of the same math: an explicit mask and at::scaled_dot_product_attention.
at::Tensor causal_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                      int64_t window = 0, const at::Tensor& segment_ids = {});

// Bidirectional: every query sees every key (with segment_ids only those of its own segment). Same shapes, dtypes
// and kernel as causal_attention; anything the kernel does not take goes to full_attention_reference.
at::Tensor full_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          const at::Tensor& segment_ids = {});
// The composite ATen version: at::scaled_dot_product_attention (with a [B,1,T,T] mask for segment_ids).
at::Tensor full_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                    const at::Tensor& segment_ids = {});

// Attention under an explicit mask: query t of q [B,H,T,D] sees key j of k/v [B,Hkv,S,D] (H a multiple of Hkv;
// S may differ from T) where allowed[b,t,j] (bool [B,T,S] or [B,1,T,S]); a query that sees no key gets a zero output
// (and passes no gradient). For block masks such as π0's (a bidirectional prefix, blocks that see every earlier
// block, padded keys): the same row-block kernel, each block of queries against the key range its rows see, holes
// in a range masked key by key. Returns [B,H,T,D] (a view of [B,T,H,D] memory). Autograd-aware (first order).
// CPU float32/float64 run the kernel; anything else goes to masked_attention_reference.
at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const at::Tensor& allowed);
bool masked_attention_kernel_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& allowed);
// The composite version (transformers' eager attention: keys repeated to H, masked scores, softmax in float32,
// rows that see no key zeroed).
at::Tensor masked_attention_reference(const at::Tensor& q, at::Tensor k, at::Tensor v, double scale,
                                      const at::Tensor& allowed);

// Raw CPU kernels (no autograd), for tests and benchmarks; block_rows 0 picks the default; causal false: the
// bidirectional form (window ignored). Forward returns
// {out [B,H,T,D] as above, lse [B,H,T] in q's dtype (log-sum-exp of each query's scaled scores)}; backward returns
// {dq, dk, dv} in the layouts of q, k, v's shapes (contiguous [B,T,H,D] / [B,T,Hkv,D] memory).
std::tuple<at::Tensor, at::Tensor> causal_attention_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& v, double scale, int64_t window,
                                                                const at::Tensor& segment_ids, int64_t block_rows = 0,
                                                                bool causal = true);
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t window, const at::Tensor& segment_ids, int64_t block_rows = 0,
    bool causal = true);

// Raw masked kernels (no autograd): as the causal ones above, keys [B,Hkv,S,D]; dk/dv in k's shape.
std::tuple<at::Tensor, at::Tensor> masked_attention_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& v, double scale,
                                                                const at::Tensor& allowed, int64_t block_rows = 0);
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_attention_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, const at::Tensor& allowed, int64_t block_rows = 0);

}  // namespace lf::kernels

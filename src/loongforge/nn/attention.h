// Causal self-attention with GQA, sliding windows, packed documents and a key/value cache for generation: the whole
// sequence on the CPU (training, prefill) runs our kernel (kernels/attention.h), everything else ATen's
// scaled_dot_product_attention (flash/efficient/math backends).
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace lf::nn {

// Keys and values of every layer for the positions seen so far: [B, Hkv, T, D] per layer.
struct KVCache {
  std::vector<at::Tensor> keys, values;
  explicit KVCache(size_t layers) : keys(layers), values(layers) {}
  int64_t length() const { return keys.empty() || !keys[0].defined() ? 0 : keys[0].size(2); }
  // Appends k/v of layer `layer`; returns the full keys/values.
  std::pair<at::Tensor, at::Tensor> append(size_t layer, const at::Tensor& k, const at::Tensor& v);
};

// q [B,H,Tq,D], k/v [B,Hkv,Tk,D]. The queries sit at absolute positions q_offset .. q_offset+Tq-1 and the keys at
// 0 .. Tk-1; a query sees keys at or before its position and, with window > 0, less than `window` positions back
// (transformers' sliding-window rule: kv_idx > q_idx - window). With segment_ids [B,T] (no cache), a query sees
// only keys of its own segment (packed documents). Returns [B,H,Tq,D].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_offset,
                            int64_t window, double scale, const at::Tensor& segment_ids = {});

// Bidirectional attention (vision encoders, diffusion transformers): every query sees every key, or with
// segment_ids [B,T] only the keys of its own segment (several images packed in one sequence). Shapes as above. CPU
// float32/float64 run our kernel (kernels::full_attention), everything else ATen's scaled_dot_product_attention.
at::Tensor full_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          const at::Tensor& segment_ids = {});

// The hook every attention module exposes (models::Model::attention_modules): its head counts, sliding window and
// an optional replacement of the attention computation. Layouts install themselves here: tensor parallelism lowers
// heads/kv_heads to this rank's share, context parallelism (ring, all-to-all) and packed-document kernels set
// attention_fn. q [B,H,Tq,D], k [B,Hkv,Tk,D], v [B,Hkv,Tk,Dv] (Dv may differ from D: DeepSeek's MLA).
struct AttentionHook {
  using AttentionFn = std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               int64_t q_offset, int64_t window, double scale,
                                               const at::Tensor& segment_ids)>;
  AttentionHook(int64_t heads, int64_t kv_heads, int64_t window) : heads(heads), kv_heads(kv_heads), window(window) {}
  virtual ~AttentionHook() = default;
  // attention_fn when set, else causal_attention (full_attention for a bidirectional module).
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_offset, double scale,
                    const at::Tensor& segment_ids) const {
    if (attention_fn) return attention_fn(q, k, v, q_offset, window, scale, segment_ids);
    return causal ? causal_attention(q, k, v, q_offset, window, scale, segment_ids)
                  : full_attention(q, k, v, scale, segment_ids);
  }
  int64_t heads, kv_heads, window;
  bool causal = true;  // false: every query sees every key (of its segment): vision encoders, diffusion transformers
  AttentionFn attention_fn;
  // A per-head quantity summed over this module's heads, t (no autograd) -> the sum over all heads: tensor
  // parallelism sets it to a sum over the ranks that split the heads; unset: this rank has every head.
  std::function<at::Tensor(const at::Tensor& t)> head_sum_fn;
  at::Tensor sum_over_heads(const at::Tensor& t) const { return head_sum_fn ? head_sum_fn(t) : t; }
};

// Packed documents as token ranges of the flattened [B*T] batch, from segment_ids [B,T] (int64, CPU; a document
// ends where the id changes or the row ends): cu_seqlens int32 [documents + 1] (0, every later document's start,
// B*T) and the longest document's length.
std::pair<at::Tensor, int64_t> document_ranges(const at::Tensor& segment_ids);

// causal_attention for packed documents given also as ranges (document_ranges; cu_seqlens on q's device): on CUDA in
// bfloat16/float16 for whole sequences, flash attention's varlen kernels (no [B,1,T,T] mask; kernels/cuda_ops.h),
// otherwise causal_attention with segment_ids. Same arguments and result.
at::Tensor document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_offset,
                              int64_t window, double scale, const at::Tensor& segment_ids,
                              const at::Tensor& cu_seqlens, int64_t max_len);

}  // namespace lf::nn

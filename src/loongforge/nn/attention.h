// Causal self-attention with GQA, sliding windows, packed documents and a key/value cache for generation: the whole
// sequence on the CPU (training, prefill) runs our kernel (kernels/attention.h), everything else ATen's
// scaled_dot_product_attention (flash/efficient/math backends).
#pragma once
#include <ATen/core/Tensor.h>

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

}  // namespace lf::nn

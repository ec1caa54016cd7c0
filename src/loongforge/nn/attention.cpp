#include "loongforge/nn/attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "loongforge/kernels/attention.h"
#include "loongforge/kernels/cuda_ops.h"

namespace lf::nn {

std::pair<at::Tensor, at::Tensor> KVCache::append(size_t layer, const at::Tensor& k, const at::Tensor& v) {
  if (!keys[layer].defined()) {
    keys[layer] = k;
    values[layer] = v;
  } else {
    keys[layer] = at::cat({keys[layer], k}, 2);
    values[layer] = at::cat({values[layer], v}, 2);
  }
  return {keys[layer], values[layer]};
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_offset,
                            int64_t window, double scale, const at::Tensor& segment_ids) {
  const int64_t tq = q.size(2), tk = k.size(2);
  const bool gqa = q.size(1) != k.size(1);
  const bool window_bites = window > 0 && q_offset + tq > window;
  // Training and prefill on the CPU: our kernel (kernels/attention.h) for the whole-sequence case.
  if (q_offset == 0 && tq == tk && kernels::causal_attention_kernel_supported(q, k, v, segment_ids))
    return kernels::causal_attention(q, k, v, scale, window_bites ? window : 0, segment_ids);
  if (!window_bites && !segment_ids.defined()) {
    if (q_offset == 0 && tq == tk)
      return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale, gqa);
    if (tq == 1 && q_offset == tk - 1)
      return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/false, scale, gqa);
  }
  auto opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  at::Tensor qpos = at::arange(q_offset, q_offset + tq, opts).unsqueeze(1);
  at::Tensor kpos = at::arange(0, tk, opts).unsqueeze(0);
  at::Tensor allowed = kpos <= qpos;
  if (window > 0) allowed = allowed.logical_and(kpos > qpos - window);
  if (segment_ids.defined()) {  // [B,1,Tq,Tk]
    TORCH_CHECK(tq == tk && q_offset == 0, "causal_attention: segment_ids need the full sequence (no cache)");
    allowed = allowed.unsqueeze(0).logical_and(segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1);
  }
  return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, scale, gqa);
}

at::Tensor full_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          const at::Tensor& segment_ids) {
  // Whole sequences on the CPU: our kernel (kernels/attention.h), bidirectional.
  if (q.size(2) == k.size(2) && kernels::causal_attention_kernel_supported(q, k, v, segment_ids))
    return kernels::full_attention(q, k, v, scale, segment_ids);
  const bool gqa = q.size(1) != k.size(1);
  if (!segment_ids.defined()) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, false, scale, gqa);
  TORCH_CHECK(q.size(2) == k.size(2), "full_attention: segment_ids need queries and keys of one sequence");
  at::Tensor allowed = (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1);  // [B,1,T,T]
  return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, scale, gqa);
}

std::pair<at::Tensor, int64_t> document_ranges(const at::Tensor& segment_ids) {
  TORCH_CHECK(segment_ids.dim() == 2 && segment_ids.scalar_type() == at::kLong,
              "document_ranges: segment_ids must be int64 [B, T]");
  const at::Tensor seg = segment_ids.cpu().contiguous();
  const int64_t rows = seg.size(0), t = seg.size(1);
  const int64_t* s = seg.data_ptr<int64_t>();
  std::vector<int32_t> cu;
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < t; ++j)
      if (j == 0 || s[r * t + j] != s[r * t + j - 1]) {
        if (!cu.empty()) longest = std::max<int64_t>(longest, r * t + j - cu.back());
        cu.push_back(static_cast<int32_t>(r * t + j));
      }
  if (!cu.empty()) longest = std::max<int64_t>(longest, rows * t - cu.back());
  cu.push_back(static_cast<int32_t>(rows * t));
  return {at::tensor(cu, at::TensorOptions().dtype(at::kInt)), longest};
}

at::Tensor document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_offset,
                              int64_t window, double scale, const at::Tensor& segment_ids,
                              const at::Tensor& cu_seqlens, int64_t max_len) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  if (cu_seqlens.defined() && q_offset == 0 && k.size(2) == t && v.size(3) == d && q.is_cuda()) {
    // [B,H,T,D] -> [B*T, H, D]: the tokens of every row one after the other, as the ranges count them
    at::Tensor qf = q.transpose(1, 2).reshape({b * t, h, d});
    at::Tensor kf = k.transpose(1, 2).reshape({b * t, k.size(1), d});
    if (kernels::cuda::flash_varlen_supported(qf, kf)) {
      at::Tensor vf = v.transpose(1, 2).reshape({b * t, v.size(1), d});
      return kernels::cuda::flash_varlen_attention(qf, kf, vf, cu_seqlens, max_len, scale, window)
          .view({b, t, h, d})
          .transpose(1, 2);
    }
  }
  return causal_attention(q, k, v, q_offset, window, scale, segment_ids);
}

}  // namespace lf::nn

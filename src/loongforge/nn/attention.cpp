#include "loongforge/nn/attention.h"

#include <ATen/ATen.h>

#include "loongforge/kernels/attention.h"

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

}  // namespace lf::nn

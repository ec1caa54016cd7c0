// Flash attention over packed documents (kernels/cuda_ops.h: flash_varlen_attention): FlashAttention-2's varlen
// kernels as ATen ships them (at::_flash_attention_forward / _flash_attention_backward, which have no autograd
// formula of their own in C++), wrapped in an autograd Function. Stand-ins that throw without LOONGFORGE_CUDA.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "loongforge/kernels/cuda_ops.h"

namespace lf::kernels::cuda {

bool flash_varlen_supported(const at::Tensor& q, const at::Tensor& k) {
#if defined(LOONGFORGE_CUDA) && LOONGFORGE_CUDA
  if (!q.defined() || !k.defined() || !q.is_cuda() || q.dim() != 3 || k.dim() != 3) return false;
  const auto dt = q.scalar_type();
  const int64_t d = q.size(2);
  return (dt == at::kBFloat16 || dt == at::kHalf) && k.scalar_type() == dt && d == k.size(2) && d % 8 == 0 &&
         d <= 256 && k.size(1) > 0 && q.size(1) % k.size(1) == 0;
#else
  (void)q, (void)k;
  return false;
#endif
}

#if defined(LOONGFORGE_CUDA) && LOONGFORGE_CUDA
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Keys visible to a query: its document's, causally, and with window > 0 fewer than `window` positions back
// (FlashAttention's window_size_left = window - 1, right = 0).
std::optional<int64_t> left_window(int64_t window) { return window > 0 ? std::optional<int64_t>(window - 1) : std::nullopt; }
std::optional<int64_t> right_window(int64_t window) { return window > 0 ? std::optional<int64_t>(0) : std::nullopt; }

struct FlashVarlen : public torch::autograd::Function<FlashVarlen> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu, int64_t max_len, double scale, int64_t window) {
    auto [out, lse, rng, unused, mask] =
        at::_flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, /*is_causal=*/true,
                                     /*return_debug_mask=*/false, scale, left_window(window), right_window(window));
    (void)mask;
    ctx->save_for_backward({q, k, v, out, lse, cu, rng, unused});
    ctx->saved_data["max_len"] = max_len;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const int64_t max_len = ctx->saved_data["max_len"].toInt(), window = ctx->saved_data["window"].toInt();
    auto [dq, dk, dv] = at::_flash_attention_backward(
        grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[5], max_len, max_len, 0.0, /*is_causal=*/true,
        s[6], s[7], ctx->saved_data["scale"].toDouble(), left_window(window), right_window(window));
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor flash_varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, int64_t max_len, double scale, int64_t window) {
  TORCH_CHECK(flash_varlen_supported(q, k) && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() &&
                  q.size(0) == k.size(0),
              "flash_varlen_attention: q [N, H, D], k/v [N, Hkv, D] bfloat16/float16 CUDA tensors expected (H a "
              "multiple of Hkv, D a multiple of 8 up to 256)");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 && cu_seqlens.device() == q.device(),
              "flash_varlen_attention: cu_seqlens must be int32 [documents + 1] on q's device");
  return FlashVarlen::apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, max_len, scale, window);
}

#else

at::Tensor flash_varlen_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                  double, int64_t) {
  TORCH_CHECK(false, "LoongForge was built without CUDA kernels (-DLOONGFORGE_CUDA=OFF): flash_varlen_attention is "
                     "unavailable");
  return {};
}

#endif

}  // namespace lf::kernels::cuda

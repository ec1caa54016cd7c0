// FP8 GEMMs for `precision: fp8` (kernels/cuda_ops.h): tensorwise-scaled e4m3 operands through at::_scaled_mm.
// Plain ATen, compiled in every build: on the CPU ATen's reference _scaled_mm runs the same math (tests), on Hopper
// cuBLASLt's FP8 GEMMs.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "loongforge/kernels/cuda_ops.h"

namespace lf::kernels::cuda {
namespace {

double fp8_max(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return 448.0;
    case at::kFloat8_e5m2: return 57344.0;
    default: break;
  }
  TORCH_CHECK(false, "fp8_quantize_tensorwise: Float8_e4m3fn or Float8_e5m2 expected, got ", t);
  return 0;
}

// a [M, K] row-major fp8, b [K, N] column-major fp8 (i.e. b.t() contiguous).
at::Tensor scaled_mm(const Fp8Tensor& a, const at::Tensor& b_data, const at::Tensor& b_scale_inv, at::ScalarType out) {
  return at::_scaled_mm(a.data, b_data, a.scale_inv, b_scale_inv, std::nullopt, std::nullopt, out);
}

// b [K, N] as a column-major view of a row-major [N, K] tensor, or of a transposed copy.
at::Tensor col_major(const at::Tensor& rows_nk) { return rows_nk.t(); }                      // [N,K] -> [K,N] col-major
at::Tensor col_major_of(const at::Tensor& kn) { return kn.t().contiguous().t(); }            // [K,N] -> col-major copy

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

class Fp8Linear : public torch::autograd::Function<Fp8Linear> {
 public:
  // x2 [M, K], w [N, K]; returns y [M, N] in out_dtype.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x2, const at::Tensor& w, int64_t out_dtype) {
    const auto out = static_cast<at::ScalarType>(out_dtype);
    Fp8Tensor qx = fp8_quantize_tensorwise(x2), qw = fp8_quantize_tensorwise(w);
    at::Tensor y = scaled_mm(qx, col_major(qw.data), qw.scale_inv, out);
    // Only the fp8 copies are kept for backward (a quarter of float32 x's memory).
    ctx->save_for_backward({qx.data, qx.scale_inv, qw.data, qw.scale_inv});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x2.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return y;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto s = ctx->get_saved_variables();
    const Fp8Tensor qx{s[0], s[1]}, qw{s[2], s[3]};
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    const at::Tensor dy = grads[0].contiguous();            // [M, N]
    Fp8Tensor qdy = fp8_quantize_tensorwise(dy);
    // dX [M, K] = dY [M, N] @ W [N, K]
    at::Tensor dx = scaled_mm(qdy, col_major_of(qw.data), qw.scale_inv, x_dtype == at::kDouble ? at::kFloat : x_dtype);
    // dW [N, K] = dY^T [N, M] @ X [M, K]
    Fp8Tensor qdyt{qdy.data.t().contiguous(), qdy.scale_inv};
    at::Tensor dw = scaled_mm(qdyt, col_major_of(qx.data), qx.scale_inv, at::kFloat).to(w_dtype);
    return {dx.to(x_dtype), dw, at::Tensor()};
  }
};

}  // namespace

Fp8Tensor fp8_quantize_tensorwise(const at::Tensor& t, at::ScalarType fp8) {
  at::NoGradGuard no_grad;
  const double mx = fp8_max(fp8);
  at::Tensor amax = t.detach().abs().amax().to(at::kFloat).clamp_min(1e-12);
  at::Tensor scale = mx / amax;
  at::Tensor data = (t.detach().to(at::kFloat) * scale).clamp(-mx, mx).to(fp8);
  return {data, scale.reciprocal()};
}

bool fp8_linear_supported(const at::Tensor& x, const at::Tensor& w) {
  if (!x.defined() || !w.defined() || w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1)) return false;
  if (x.device() != w.device() || !at::isFloatingType(x.scalar_type()) || !at::isFloatingType(w.scalar_type()))
    return false;
  const int64_t K = w.size(1), N = w.size(0), M = K == 0 ? 0 : x.numel() / K;
  return M > 0 && M % 16 == 0 && K % 16 == 0 && N % 16 == 0;
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(fp8_linear_supported(x, w),
              "fp8_linear: x [..., K] and w [N, K] on one device with rows, K and N multiples of 16 expected");
  // The output dtype autocast would give the GEMM (bf16 under bf16 autocast), else x's.
  at::ScalarType out = x.scalar_type();
  const auto dev = x.device().type();
  if (at::autocast::is_autocast_enabled(dev)) out = at::autocast::get_autocast_dtype(dev);
  if (out == at::kDouble) out = at::kFloat;  // _scaled_mm outputs float32/bf16/f16
  const int64_t K = x.size(-1);
  at::Tensor y = Fp8Linear::apply(x.reshape({-1, K}), w, static_cast<int64_t>(out));
  auto shape = x.sizes().vec();
  shape.back() = w.size(0);
  y = y.reshape(shape);
  if (bias.defined()) y = y + bias.to(y.scalar_type());
  return y;
}

}  // namespace lf::kernels::cuda

// FP8 GEMMs for `precision: fp8` (kernels/cuda_ops.h): e4m3 operands through at::_scaled_mm, tensorwise scales or
// blockwise (`fp8_scaling: blockwise`: 1 x 128 blocks for activations and gradients, 128 x 128 for weights).
// Plain ATen, compiled in every build: on the CPU ATen's reference _scaled_mm runs the same math (tests), on Hopper
// cuBLASLt's FP8 GEMMs.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <cmath>
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

// ---- blockwise ----
// a [M, K] (1 x 128 blocks along K), b given as its transpose bt [N, K] with 1 x 128 or 128 x 128 blocks along K:
// out [M, N] = a b. CUDA: at::_scaled_mm with the scales laid out as its blockwise path expects (1 x 128 scales
// outer-dimension-major, b's scales transposed); CPU: the dequantized operands in float32.
at::Tensor block_mm(const Fp8Tensor& a, const Fp8Tensor& bt, at::ScalarType out) {
  if (a.data.is_cuda()) {
    at::Tensor sa = a.scale_inv.t().contiguous().t();  // [M, K/128], column-major
    // b's scales as [K/128, N]: 1 x 128 blocks of bt (column-major per bt row, i.e. a contiguous transpose), or
    // [K/128, N/128]: 128 x 128 blocks
    const bool bt_rows = bt.scale_inv.size(0) == bt.data.size(0);
    at::Tensor sb = bt_rows ? bt.scale_inv.t().contiguous() : bt.scale_inv.t();
    return at::_scaled_mm(a.data, bt.data.t(), sa, sb, std::nullopt, std::nullopt, out);
  }
  return at::mm(fp8_dequantize_blockwise(a), fp8_dequantize_blockwise(bt).t()).to(out);
}

class Fp8LinearBlockwise : public torch::autograd::Function<Fp8LinearBlockwise> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x2, const at::Tensor& w, int64_t out_dtype) {
    const auto out = static_cast<at::ScalarType>(out_dtype);
    Fp8Tensor qx = fp8_quantize_blockwise(x2, 1), qw = fp8_quantize_blockwise(w, 128);
    at::Tensor y = block_mm(qx, qw, out);
    // dW needs x in 1 x 128 blocks along M (the rows), i.e. x^T quantized per row: made here, kept in fp8.
    Fp8Tensor qxt = fp8_quantize_blockwise(x2.t().contiguous(), 1);
    ctx->save_for_backward({qxt.data, qxt.scale_inv, qw.data, qw.scale_inv});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x2.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return y;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto s = ctx->get_saved_variables();
    const Fp8Tensor qxt{s[0], s[1]}, qw{s[2], s[3]};
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    const at::Tensor dy = grads[0].contiguous();  // [M, N]
    // dX [M, K] = dY [M, N] W [N, K]: dY in 1 x 128 blocks along N, W's 128 x 128 blocks read as W^T's.
    Fp8Tensor qdy = fp8_quantize_blockwise(dy, 1);
    Fp8Tensor qwt{qw.data.t().contiguous(), qw.scale_inv.t().contiguous()};
    at::Tensor dx = block_mm(qdy, qwt, x_dtype == at::kDouble ? at::kFloat : x_dtype);
    // dW [N, K] = dY^T [N, M] X [M, K]: both in 1 x 128 blocks along M.
    Fp8Tensor qdyt = fp8_quantize_blockwise(dy.t().contiguous(), 1);
    at::Tensor dw = block_mm(qdyt, qxt, at::kFloat).to(w_dtype);
    return {dx.to(x_dtype), dw, at::Tensor()};
  }
};

at::ScalarType fp8_out_dtype(const at::Tensor& x) {
  // The output dtype autocast would give the GEMM (bf16 under bf16 autocast), else x's.
  at::ScalarType out = x.scalar_type();
  const auto dev = x.device().type();
  if (at::autocast::is_autocast_enabled(dev)) out = at::autocast::get_autocast_dtype(dev);
  return out == at::kDouble ? at::kFloat : out;  // _scaled_mm outputs float32/bf16/f16
}

// y [M, N] back to x's leading shape, plus the bias.
at::Tensor finish(const at::Tensor& y2, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  auto shape = x.sizes().vec();
  shape.back() = w.size(0);
  at::Tensor y = y2.reshape(shape);
  return bias.defined() ? y + bias.to(y.scalar_type()) : y;
}

}  // namespace

Fp8Tensor fp8_quantize_blockwise(const at::Tensor& t, int64_t block_rows, at::ScalarType fp8) {
  TORCH_CHECK(t.dim() == 2 && (block_rows == 1 || block_rows == 128) && t.size(1) % 128 == 0 &&
                  t.size(0) % block_rows == 0,
              "fp8_quantize_blockwise: a 2-d tensor with columns (and, for 128 x 128 blocks, rows) a multiple of 128 "
              "expected, got ", t.sizes(), " with blocks of ", block_rows, " x 128");
  at::NoGradGuard no_grad;
  const double mx = fp8_max(fp8);
  const int64_t R = t.size(0), C = t.size(1), br = R / block_rows, bc = C / 128;
  at::Tensor blocks = t.detach().to(at::kFloat).reshape({br, block_rows, bc, 128});
  at::Tensor amax = blocks.abs().amax({1, 3}).clamp_min(1e-12);  // [br, bc]
  at::Tensor scale = mx / amax;
  at::Tensor data = (blocks * scale.view({br, 1, bc, 1})).clamp(-mx, mx).to(fp8).reshape({R, C});
  return {data, scale.reciprocal().contiguous()};
}

at::Tensor fp8_dequantize_blockwise(const Fp8Tensor& q) {
  const int64_t R = q.data.size(0), C = q.data.size(1), br = q.scale_inv.size(0), bc = q.scale_inv.size(1);
  TORCH_CHECK(br > 0 && bc > 0 && R % br == 0 && C % bc == 0, "fp8_dequantize_blockwise: scales do not tile the data");
  return (q.data.to(at::kFloat).reshape({br, R / br, bc, C / bc}) * q.scale_inv.view({br, 1, bc, 1})).reshape({R, C});
}

bool fp8_linear_blockwise_supported(const at::Tensor& x, const at::Tensor& w) {
  if (!fp8_linear_supported(x, w)) return false;
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  return M % 128 == 0 && K % 128 == 0 && N % 128 == 0;
}

at::Tensor fp8_linear_blockwise(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(fp8_linear_blockwise_supported(x, w),
              "fp8_linear_blockwise: x [..., K] and w [N, K] on one device with rows, K and N multiples of 128 expected");
  return finish(Fp8LinearBlockwise::apply(x.reshape({-1, x.size(-1)}), w, static_cast<int64_t>(fp8_out_dtype(x))), x,
                w, bias);
}

Fp8Tensor fp8_quantize_tensorwise(const at::Tensor& t, at::ScalarType fp8) {
  at::NoGradGuard no_grad;
  const double mx = fp8_max(fp8);
  if (fp8 == at::kFloat8_e4m3fn && supported(t)) {
    // On the GPU two passes over t: max |t| (one reduction), then our scale + saturating cast (the same values as the
    // composite below, which makes six).
    at::Tensor amax = at::linalg_vector_norm(t.detach(), INFINITY, std::nullopt, false, at::kFloat).clamp_min(1e-12);
    at::Tensor scale = mx / amax;
    return {fp8_e4m3_cast(t.detach(), scale), scale.reciprocal()};
  }
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
  return finish(Fp8Linear::apply(x.reshape({-1, x.size(-1)}), w, static_cast<int64_t>(fp8_out_dtype(x))), x, w, bias);
}

}  // namespace lf::kernels::cuda

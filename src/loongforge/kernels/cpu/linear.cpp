// Linear with row-split GEMMs on the CPU (kernels/linear.h) and its autograd Function.
#include "loongforge/kernels/linear.h"

#include "loongforge/kernels/cpu/blas.h"
#include "loongforge/kernels/cpu/gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace lf::kernels {

namespace {

// [rows, cols] with unit column stride (parameters and fresh tensors already are).
at::Tensor rows_dense(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// Bias or not as a template argument: an undefined tensor cannot be a Function input.
template <bool HasBias>
class LinearFunction : public torch::autograd::Function<LinearFunction<HasBias>> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b = at::Tensor()) {
    const int64_t in = w.size(1), out = w.size(0);
    at::Tensor x2 = x.reshape({-1, in});
    if (!x2.is_contiguous()) x2 = x2.contiguous();
    const int64_t m = x2.size(0), parts = cpu::split_parts(m, in, out);
    at::Tensor y = at::empty({m, out}, x.options());
    if (parts <= 1 && x.scalar_type() == at::kFloat) {  // B = W packed once (kernels/cpu/blas.h)
      const at::Tensor wd = rows_dense(w);
      cpu::linear_nt(m, out, in, x2.const_data_ptr<float>(), in, wd.const_data_ptr<float>(), wd.stride(0),
                     y.mutable_data_ptr<float>(), out);
    } else {
      cpu::mm_rows(y, x2, w.t(), parts);
    }
    if constexpr (HasBias) y.add_(b);
    ctx->save_for_backward({x2, w});
    auto shape = x.sizes().vec();
    shape.back() = out;
    return y.view(shape);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x2 = saved[0];
    const at::Tensor& w = saved[1];
    const int64_t in = w.size(1), out = w.size(0);
    at::Tensor dy = grads[0].reshape({-1, out});
    if (!dy.is_contiguous()) dy = dy.contiguous();
    const int64_t parts = cpu::split_parts(dy.size(0), in, out);
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      dx = at::empty({dy.size(0), in}, dy.options());
      if (parts <= 1 && dy.scalar_type() == at::kFloat) {
        const at::Tensor wd = rows_dense(w);
        cpu::linear_nn(dy.size(0), out, in, dy.const_data_ptr<float>(), out, wd.const_data_ptr<float>(), wd.stride(0),
                       dx.mutable_data_ptr<float>(), in);
      } else {
        cpu::mm_rows(dx, dy, w, parts);
      }
      auto shape = grads[0].sizes().vec();
      shape.back() = in;
      dx = dx.view(shape);
    }
    if (ctx->needs_input_grad(1)) {  // dW [out, in] = dy^T x: split over out (rows of dy^T)
      dw = at::empty({out, in}, w.options());
      cpu::mm_rows(dw, dy.t(), x2, parts);
    }
    if constexpr (HasBias) {
      if (ctx->needs_input_grad(2)) db = dy.sum(0);
      return {dx, dw, db};
    }
    return {dx, dw};
  }
};

}  // namespace

namespace {
std::atomic<int> g_split{-1};  // -1: not read from the environment yet
}  // namespace

namespace cpu {

// Products below this many multiply-adds run as one at::mm (the fork/join would cost more than it gains).
constexpr double kMinSplitMacs = 4.0e6;

namespace {
// A 2-D float view as a BLAS operand: transposed or not, and its leading dimension; false when neither layout fits.
bool blas_operand(const at::Tensor& t, bool& trans, int64_t& ld) {
  const int64_t r = t.size(0), c = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(c, 1)) {
    trans = false, ld = t.stride(0);
    return true;
  }
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(r, 1)) {
    trans = true, ld = t.stride(1);
    return true;
  }
  return false;
}
}  // namespace

void mm_rows(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, int64_t parts, bool accumulate) {
  const int64_t m = a.size(0);
  if (out.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
      blas_backend() == BlasBackend::kOpenBlas && a.size(1) > 0) {
    // gemm splits over ATen's threads itself (kernels/cpu/blas.cpp)
    bool ta = false, tb = false, tc = false;
    int64_t lda = 0, ldb = 0, ldc = 0;
    if (blas_operand(a, ta, lda) && blas_operand(b, tb, ldb) && blas_operand(out, tc, ldc) && !tc) {
      gemm<float>(ta, tb, m, b.size(1), a.size(1), 1.0f, a.const_data_ptr<float>(), lda, b.const_data_ptr<float>(),
                  ldb, accumulate ? 1.0f : 0.0f, out.mutable_data_ptr<float>(), ldc);
      return;
    }
  }
  auto one = [&](at::Tensor o, const at::Tensor& ab) {
    if (accumulate) o.addmm_(ab, b);
    else at::mm_out(o, ab, b);
  };
  if (parts <= 1 || m < 2 * 8) {
    one(out, a);
    return;
  }
  const int64_t per = ((m + parts - 1) / parts + 7) / 8 * 8;
  const int64_t blocks = (m + per - 1) / per;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;  // pool threads start with grad mode on; these are raw products
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = i * per, r1 = std::min(m, r0 + per);
      one(out.narrow(0, r0, r1 - r0), a.narrow(0, r0, r1 - r0));
    }
  });
}

int64_t split_parts(int64_t m, int64_t k, int64_t n) {
  if (at::in_parallel_region()) return 1;
  const int mode = linear_split_mode();
  const int64_t t = at::get_num_threads();
  if (mode == 2) return std::max<int64_t>(t, 2);
  if (t <= 1 || mode == 0) return 1;
  return static_cast<double>(m) * k * n >= kMinSplitMacs ? t : 1;
}

}  // namespace cpu

int linear_split_mode() {
  int s = g_split.load(std::memory_order_relaxed);
  if (s < 0) {
    const char* e = std::getenv("LOONGFORGE_SPLIT_GEMM");
    s = (e && std::strcmp(e, "1") == 0) ? 1 : 0;
    g_split.store(s, std::memory_order_relaxed);
  }
  return s;
}

void set_linear_split_mode(int mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "set_linear_split_mode: 0, 1 or 2");
  g_split.store(mode, std::memory_order_relaxed);
}

at::Tensor mm_split_rows(const at::Tensor& a, const at::Tensor& b, int64_t parts) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "mm_split_rows: a [M,K] and b [K,N] expected");
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  cpu::mm_rows(out, a, b, parts > 0 ? parts : at::get_num_threads());
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const bool ok = x.device().is_cpu() && weight.device().is_cpu() && x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) && weight.dim() == 2 &&
                  x.dim() >= 1 && x.size(-1) == weight.size(1) &&
                  (!bias.defined() || (bias.scalar_type() == x.scalar_type() && bias.device().is_cpu() &&
                                       bias.dim() == 1 && bias.size(0) == weight.size(0)));
  const int64_t m = ok && weight.size(1) > 0 ? x.numel() / weight.size(1) : 0;
  // Our Function where it differs from at::linear: split GEMMs, float32 products with rows enough for a packed W, or
  // any float32 product when the chosen BLAS is OpenBLAS (at::linear would run MKL's AVX2 path on those CPUs:
  // kernels/cpu/blas.h).
  // Under CPU autocast at::linear runs in bfloat16: our Function would bypass the cast.
  const bool f32 = ok && x.scalar_type() == at::kFloat && m > 0 && weight.size(0) > 0 && weight.size(1) > 0 &&
                   !at::autocast::is_autocast_enabled(at::kCPU);
  const bool direct = f32 && (cpu::use_packed(m, weight.size(0), weight.size(1)) ||
                              cpu::blas_backend() == cpu::BlasBackend::kOpenBlas);
  if (!ok || (!direct && cpu::split_parts(m, weight.size(1), weight.size(0)) <= 1))
    return at::linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  if (bias.defined()) return LinearFunction<true>::apply(x, weight, bias);
  return LinearFunction<false>::apply(x, weight);
}

}  // namespace lf::kernels

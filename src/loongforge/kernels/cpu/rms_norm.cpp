// CPU kernels of the fused RMSNorm, and its autograd Function.
#include "loongforge/kernels/rms_norm.h"
#include "loongforge/kernels/cuda_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

namespace lf::kernels {
namespace {

// Rows are independent: one row = one normalised vector of length n. Accumulate in Acc (double for f64, float
// otherwise, as transformers computes the variance in float32).
template <typename T, typename Acc>
void forward_rows(const T* x, const T* w, T* y, Acc* rstd, int64_t rows, int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      Acc ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += static_cast<Acc>(xr[i]) * static_cast<Acc>(xr[i]);
      Acc inv = Acc(1) / std::sqrt(ss / static_cast<Acc>(n) + static_cast<Acc>(eps));
      rstd[r] = inv;
      for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<T>(w[i] * static_cast<T>(static_cast<Acc>(xr[i]) * inv));
    }
  });
}

// dx_i = r * g_i - x_i * r^3 * mean_j(g_j x_j), with g = dy * w;   dw_i = sum_rows dy_i * x_i * r.
template <typename T, typename Acc>
void backward_rows(const T* dy, const T* x, const T* w, const Acc* rstd, T* dx, Acc* dw_partial, int64_t rows,
                   int64_t n, int64_t chunks) {
  // dw is reduced over rows: each chunk of rows accumulates its own partial sum, summed afterwards.
  int64_t per = (rows + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      Acc* dwc = dw_partial + c * n;
      for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        const T* dyr = dy + r * n;
        const T* xr = x + r * n;
        T* dxr = dx + r * n;
        Acc inv = rstd[r];
        Acc dot = 0;
        for (int64_t i = 0; i < n; ++i) dot += static_cast<Acc>(dyr[i]) * static_cast<Acc>(w[i]) * static_cast<Acc>(xr[i]);
        Acc k = dot * inv * inv * inv / static_cast<Acc>(n);
        for (int64_t i = 0; i < n; ++i) {
          Acc g = static_cast<Acc>(dyr[i]) * static_cast<Acc>(w[i]);
          dxr[i] = static_cast<T>(g * inv - static_cast<Acc>(xr[i]) * k);
          dwc[i] += static_cast<Acc>(dyr[i]) * static_cast<Acc>(xr[i]) * inv;
        }
      }
    }
  });
}

bool fused_supported(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && w.device().is_cpu() && x.scalar_type() == w.scalar_type() &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble);
}

class RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    auto [y, rstd] = rms_norm_forward_cpu(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto [dx, dw] = rms_norm_backward_cpu(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(fused_supported(x_in, w_in), "rms_norm_forward_cpu: f32/f64 CPU tensors of one dtype expected");
  TORCH_CHECK(w_in.dim() == 1 && x_in.size(-1) == w_in.size(0), "rms_norm: weight must be [x.size(-1)]");
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  at::Tensor y = at::empty_like(x);
  auto lead = x.sizes().vec();
  lead.pop_back();
  if (x.scalar_type() == at::kDouble) {
    at::Tensor rstd = at::empty(lead, x.options());
    forward_rows<double, double>(x.data_ptr<double>(), w.data_ptr<double>(), y.data_ptr<double>(),
                                 rstd.data_ptr<double>(), rows, n, eps);
    return {y, rstd};
  }
  at::Tensor rstd = at::empty(lead, x.options().dtype(at::kFloat));
  forward_rows<float, float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rstd.data_ptr<float>(),
                             rows, n, eps);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                         const at::Tensor& w_in, const at::Tensor& rstd_in) {
  at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous(), rstd = rstd_in.contiguous();
  int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads() * 4));
  at::Tensor dx = at::empty_like(x);
  if (x.scalar_type() == at::kDouble) {
    at::Tensor part = at::zeros({chunks, n}, x.options());
    backward_rows<double, double>(dy.data_ptr<double>(), x.data_ptr<double>(), w.data_ptr<double>(),
                                  rstd.data_ptr<double>(), dx.data_ptr<double>(), part.data_ptr<double>(), rows, n,
                                  chunks);
    return {dx, part.sum(0)};
  }
  at::Tensor part = at::zeros({chunks, n}, x.options().dtype(at::kFloat));
  backward_rows<float, float>(dy.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), rstd.data_ptr<float>(),
                              dx.data_ptr<float>(), part.data_ptr<float>(), rows, n, chunks);
  return {dx, part.sum(0).to(w.scalar_type())};
}

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto in_dtype = x.scalar_type();
  at::Tensor h = x.to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor var = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(var + eps);
  return weight * h.to(in_dtype);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (cuda::supported(x) && weight.scalar_type() == x.scalar_type() && weight.device() == x.device())
    return cuda::rms_norm(x, weight, eps);  // kernels/cuda/rms_norm.cu
  if (!fused_supported(x, weight)) return rms_norm_reference(x, weight, eps);
  return RMSNormFunction::apply(x, weight, eps);
}

}  // namespace lf::kernels

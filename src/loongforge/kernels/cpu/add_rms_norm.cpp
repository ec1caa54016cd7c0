// Residual add + RMSNorm: the device dispatch, the CPU autograd Function and the composite reference.
//
// CPU f32/f64: one pass per row writes s = x + residual and y = rms_norm(s) (kernels/cpu/rms_norm.cpp); backward
// folds the gradient that reaches s directly (the residual stream) into the norm's backward pass, so neither the
// add nor autograd's sum of the two gradients of s costs a pass of its own.
#include "loongforge/kernels/add_rms_norm.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/kernels/rms_norm.h"

namespace lf::kernels {

namespace {

class AddRMSNormFunction : public torch::autograd::Function<AddRMSNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& residual, const at::Tensor& weight, double eps) {
    auto [s, y, rstd] = add_rms_norm_forward_cpu(x, residual, weight, eps);
    ctx->save_for_backward({s, weight, rstd});
    return {s, y};
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    // grads are materialised (zeros for an unused output), so both are defined
    auto [dx, dw] = rms_norm_backward_cpu(grads[1], saved[0], saved[1], saved[2], grads[0]);
    return {dx, dx, dw, at::Tensor()};
  }
};

bool cpu_supported(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight) {
  const auto dt = x.scalar_type();
  return (dt == at::kFloat || dt == at::kDouble) && residual.scalar_type() == dt && weight.scalar_type() == dt &&
         x.device().is_cpu() && residual.device().is_cpu() && weight.device().is_cpu() &&
         residual.sizes() == x.sizes() && x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rms_norm_reference(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps) {
  at::Tensor s = x + residual;
  return {s, rms_norm_reference(s, weight, eps)};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  if (cuda::supported(x) && residual.scalar_type() == x.scalar_type() && residual.sizes() == x.sizes() &&
      weight.scalar_type() == x.scalar_type() && weight.device() == x.device())
    return cuda::add_rms_norm(x, residual, weight, eps);
  if (cpu_supported(x, residual, weight)) {
    auto out = AddRMSNormFunction::apply(x, residual, weight, eps);
    return {out[0], out[1]};
  }
  at::Tensor s = x + residual;
  return {s, rms_norm(s, weight, eps)};
}

}  // namespace lf::kernels

// Residual add + RMSNorm: the device dispatch and the composite reference.
#include "loongforge/kernels/add_rms_norm.h"

#include <ATen/ATen.h>

#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/kernels/rms_norm.h"

namespace lf::kernels {

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
  at::Tensor s = x + residual;
  return {s, rms_norm(s, weight, eps)};
}

}  // namespace lf::kernels

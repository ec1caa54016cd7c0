#include "loongforge/nn/rms_norm.h"

#include <ATen/ATen.h>

#include "loongforge/kernels/rms_norm.h"

namespace lf::nn {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) { return kernels::rms_norm(x, weight, eps); }

}  // namespace lf::nn

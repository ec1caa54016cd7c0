#include "loongforge/nn/linear.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loongforge/kernels/linear.h"

namespace lf::nn {

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias) : in_features(in), out_features(out) {
  // nn.Linear's default initialisation (kaiming-uniform weight, uniform bias); models re-initialise or load.
  double bound = 1.0 / std::sqrt(static_cast<double>(in));
  weight = register_parameter("weight", at::empty({out, in}).uniform_(-bound, bound));
  if (with_bias) bias = register_parameter("bias", at::empty({out}).uniform_(-bound, bound));
}

at::Tensor LinearImpl::forward(const at::Tensor& x_in) {
  const at::Tensor x = input_fn ? input_fn(x_in) : x_in;
  at::Tensor y = matmul_fn ? matmul_fn(x, weight, bias)
                           : kernels::linear(x, weight, bias);  // at::linear, GEMMs split per thread on the CPU
  if (adapter) y = y + adapter->forward(x);
  return output_fn ? output_fn(y) : y;
}

}  // namespace lf::nn

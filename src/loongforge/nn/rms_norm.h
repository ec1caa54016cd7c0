// RMSNorm module (parameter "weight"), backed by the fused kernel.
#pragma once
#include <torch/nn/module.h>

namespace lf::nn {

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

}  // namespace lf::nn

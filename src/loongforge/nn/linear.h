// Linear layer (parameters "weight" [out,in] and optional "bias", as nn.Linear) with an optional low-rank adapter
// slot. Adapters are attached from outside (nn/lora.h), so model definitions stay plain.
#pragma once
#include <torch/nn/module.h>

#include <functional>
#include <memory>

namespace lf::nn {

// Adds a term to a linear layer's output: y = x W^T + b + adapter(x). Implementations register their own
// parameters as children of the linear module (e.g. "lora_A.weight").
class LinearAdapter {
 public:
  virtual ~LinearAdapter() = default;
  virtual at::Tensor forward(const at::Tensor& x) = 0;
};

class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight, bias;
  int64_t in_features, out_features;
  std::shared_ptr<LinearAdapter> adapter;  // null: a plain linear layer
  // Set from outside by parallel layouts (tensor/sequence parallel): applied to the input before the product and
  // to the output after it (adapter included). Empty: identity.
  std::function<at::Tensor(const at::Tensor&)> input_fn, output_fn;
  // Replaces at::linear(x, weight, bias) when set (e.g. FP8 GEMMs for `precision: fp8`); bias may be undefined.
  std::function<at::Tensor(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b)> matmul_fn;
};
TORCH_MODULE(Linear);

}  // namespace lf::nn

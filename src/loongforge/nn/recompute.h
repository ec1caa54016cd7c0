// Activation recomputation (reentrant checkpointing): run fn without keeping its activations, and run it again
// during backward to get the gradients. Parameter gradients accumulate into .grad (use with loss.backward()).
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace lf::nn {

at::Tensor recompute(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                     const std::vector<at::Tensor>& params);

}  // namespace lf::nn

// Activation recomputation (reentrant checkpointing): run fn without keeping its activations, and run it again
// during backward to get the gradients. Parameter gradients accumulate into .grad (use with loss.backward()).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <vector>

namespace lf::nn {

// extra (optional): called in backward right after fn's recomputation (gradients on); a defined scalar it returns
// (a loss made inside fn, e.g. MoE router losses, already scaled as the caller's loss) is backpropagated with fn's
// output.
at::Tensor recompute(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                     const std::vector<at::Tensor>& params, std::function<at::Tensor()> extra = nullptr);
// The same for an fn that also reads `side` tensors with gradients of their own (a block's conditions, made from
// parameters before the blocks): fn(x, side) is called with them (detached copies in the recomputation), and their
// gradients flow back along their graphs like x's. Each side tensor must require grad.
at::Tensor recompute(std::function<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)> fn,
                     const at::Tensor& x, const std::vector<at::Tensor>& side, const std::vector<at::Tensor>& params,
                     std::function<at::Tensor()> extra = nullptr);

// fn(x), one layer of `layer`: recomputed in backward over its trainable parameters when `on` and gradients are on
// (and something needs them); else run as is.
at::Tensor maybe_recompute(bool on, torch::nn::Module& layer, const std::function<at::Tensor(const at::Tensor&)>& fn,
                           const at::Tensor& x);

}  // namespace lf::nn

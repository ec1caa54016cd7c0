#include "loongforge/nn/recompute.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace lf::nn {
namespace {

struct RecomputeNode : torch::autograd::Node {
  std::function<at::Tensor(const at::Tensor&)> fn;
  std::function<at::Tensor()> extra;
  at::Tensor input;
  at::Tensor rng_state;  // the CPU generator before the first run: dropout masks repeat exactly
  bool input_requires_grad = false;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor x = input.detach().requires_grad_(input_requires_grad);
    at::Tensor y;
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    at::Tensor now;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      now = gen.get_state();
      gen.set_state(rng_state);
    }
    at::Tensor e;
    {
      at::AutoGradMode enable(true);
      y = fn(x);
      if (extra) e = extra();
    }
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(now);
    }
    if (e.defined() && e.requires_grad())
      torch::autograd::backward({y, e}, {grads[0], at::ones_like(e)});
    else
      torch::autograd::backward({y}, {grads[0]});
    at::Tensor gx = input_requires_grad ? x.grad() : at::Tensor();
    input = at::Tensor();  // free the saved input once used
    return {gx};
  }
  void release_variables() override { input = at::Tensor(); }
};

}  // namespace

at::Tensor recompute(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                     const std::vector<at::Tensor>& params, std::function<at::Tensor()> extra) {
  bool any = x.requires_grad();
  for (const auto& p : params) any = any || p.requires_grad();
  if (!any || !at::GradMode::is_enabled()) return fn(x);
  at::Tensor rng;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = fn(x);
  }
  auto node = std::shared_ptr<RecomputeNode>(new RecomputeNode(), torch::autograd::deleteNode);
  node->fn = std::move(fn);
  node->extra = std::move(extra);
  node->input = x.detach();
  node->rng_state = rng;
  node->input_requires_grad = x.requires_grad();
  // The node's one input edge is x; parameters receive their gradients through the inner backward.
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(y, node);
  return y;
}

at::Tensor maybe_recompute(bool on, torch::nn::Module& layer, const std::function<at::Tensor(const at::Tensor&)>& fn,
                           const at::Tensor& x) {
  if (!on || !at::GradMode::is_enabled()) return fn(x);
  std::vector<at::Tensor> params;
  for (const auto& p : layer.parameters())
    if (p.requires_grad()) params.push_back(p);
  if (params.empty() && !x.requires_grad()) return fn(x);
  return recompute(fn, x, params);
}

}  // namespace lf::nn

#include "loongforge/nn/recompute.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace lf::nn {
namespace {

struct RecomputeNode : torch::autograd::Node {
  std::function<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)> fn;
  std::function<at::Tensor()> extra;
  at::Tensor input;
  std::vector<at::Tensor> side;  // the other inputs fn reads with gradients (edges 1.. of this node)
  at::Tensor rng_state;  // the CPU generator before the first run: dropout masks repeat exactly
  bool input_requires_grad = false;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor x = input.detach().requires_grad_(input_requires_grad);
    std::vector<at::Tensor> s;
    for (const auto& t : side) s.push_back(t.detach().requires_grad_(true));
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
      y = fn(x, s);
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
    torch::autograd::variable_list out = {input_requires_grad ? x.grad() : at::Tensor()};
    for (const auto& t : s) out.push_back(t.grad());
    input = at::Tensor();  // free the saved inputs once used
    side.clear();
    return out;
  }
  void release_variables() override {
    input = at::Tensor();
    side.clear();
  }
};

}  // namespace

at::Tensor recompute(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                     const std::vector<at::Tensor>& params, std::function<at::Tensor()> extra) {
  return recompute([fn = std::move(fn)](const at::Tensor& y, const std::vector<at::Tensor>&) { return fn(y); }, x, {},
                   params, std::move(extra));
}

at::Tensor recompute(std::function<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)> fn,
                     const at::Tensor& x, const std::vector<at::Tensor>& side, const std::vector<at::Tensor>& params,
                     std::function<at::Tensor()> extra) {
  bool any = x.requires_grad();
  for (const auto& p : params) any = any || p.requires_grad();
  for (const auto& t : side) any = any || t.requires_grad();
  if (!any || !at::GradMode::is_enabled()) return fn(x, side);
  at::Tensor rng;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = fn(x, side);
  }
  auto node = std::shared_ptr<RecomputeNode>(new RecomputeNode(), torch::autograd::deleteNode);
  node->fn = std::move(fn);
  node->extra = std::move(extra);
  node->input = x.detach();
  node->rng_state = rng;
  node->input_requires_grad = x.requires_grad();
  // The node's input edges are x and the side inputs; parameters receive their gradients through the inner backward.
  std::vector<at::Tensor> edges = {x};
  for (const auto& t : side) {
    node->side.push_back(t.detach());
    edges.push_back(t);
  }
  node->set_next_edges(torch::autograd::collect_next_edges(edges));
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

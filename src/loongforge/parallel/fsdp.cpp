#include "loongforge/parallel/fsdp.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>  // Pending holds a c10d::Work (incomplete in comm.h)
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "loongforge/core/error.h"
#include "loongforge/nn/linear.h"

#include <set>

namespace lf::parallel {
namespace {

// A block run without keeping activations; backward re-gathers the layer, recomputes it with autograd and
// hands the parameter gradients to the engine (reduce-scatter).
struct LayerNode : torch::autograd::Node {
  FullyShardedModel* fsdp = nullptr;
  size_t unit = 0;
  models::Model* model = nullptr;
  std::vector<at::Tensor> params;  // the unit's trainable parameters (module tensors; gathered in apply)
  std::vector<at::Tensor> shared;  // root-unit parameters the block uses (gathered throughout): grads into .grad
  models::Batch inputs;            // the blocks' other inputs (Model::block_inputs), detached
  std::vector<std::string> side;   // those with gradients of their own (edges 1.. of this node)
  at::Tensor input;
  bool input_requires_grad = false;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return torch::autograd::variable_list(1 + side.size());
    fsdp->unit_backward_begin(unit);
    at::Tensor x = input.detach().requires_grad_(input_requires_grad);
    models::Batch in = inputs;
    std::vector<at::Tensor> side_in;
    for (const auto& n : side) {
      side_in.push_back(inputs.at(n).detach().requires_grad_(true));
      in.set(n, side_in.back());
    }
    at::Tensor y;
    {
      at::AutoGradMode enable(true);
      y = model->block_body(in, x, static_cast<int64_t>(unit));
    }
    std::vector<at::Tensor> wrt;
    if (input_requires_grad) wrt.push_back(x);
    for (const auto& t : side_in) wrt.push_back(t);
    for (const auto& p : params) wrt.push_back(p);
    for (const auto& p : shared) wrt.push_back(p);
    at::Tensor extra;
    if (fsdp->layer_loss_fn) {
      at::AutoGradMode enable(true);
      extra = fsdp->layer_loss_fn(unit);
    }
    std::vector<at::Tensor> g;
    if (!wrt.empty()) {
      if (extra.defined() && extra.requires_grad())
        g = torch::autograd::grad({y, extra}, wrt, {grads[0], at::ones_like(extra)}, false, false, true);
      else
        g = torch::autograd::grad({y}, wrt, {grads[0]}, false, false, /*allow_unused=*/true);
    }
    y = at::Tensor();
    fsdp->free_unit(unit);
    const size_t first = input_requires_grad ? 1 : 0;
    torch::autograd::variable_list out = {input_requires_grad ? g[0] : at::Tensor()};
    for (size_t k = 0; k < side.size(); ++k) out.push_back(g[first + k]);
    const auto own = g.begin() + static_cast<std::ptrdiff_t>(first + side.size());
    fsdp->unit_grads(unit, std::vector<at::Tensor>(own, own + static_cast<std::ptrdiff_t>(params.size())));
    {
      at::NoGradGuard no_grad;  // the root unit's parameters accumulate as the head's gradients do
      for (size_t k = 0; k < shared.size(); ++k) {
        const at::Tensor& gk = g[first + side.size() + params.size() + k];
        if (!gk.defined()) continue;
        if (shared[k].grad().defined()) shared[k].mutable_grad().add_(gk);
        else shared[k].mutable_grad() = gk.clone();
      }
    }
    input = at::Tensor();
    return out;
  }
  void release_variables() override { input = at::Tensor(); }
};

// "<blocks>.12.mlp.up_proj.weight" -> 12.
bool block_index(const std::string& name, const std::string& pre, int64_t* idx) {
  if (name.rfind(pre, 0) != 0) return false;
  size_t dot = name.find('.', pre.size());
  *idx = std::stoll(name.substr(pre.size(), dot - pre.size()));
  return true;
}

}  // namespace

FullyShardedModel::FullyShardedModel(models::Model& model, const Group& shard, const Group& replicate, FsdpOptions o)
    : model_(&model), opts_(o) {
  shard_ = &shard;
  replicate_ = &replicate;
  const int64_t L = model.num_blocks();
  const models::Split split = model.split();
  const std::string blocks = split.blocks + ".";
  units_.resize(static_cast<size_t>(L) + 1);
  // Under mixed precision the gathered copies of the linear layers' weights are bf16 (the forward runs under autocast,
  // which casts them for the product anyway: the copies halve the gathers). Every other parameter keeps fp32 as in one
  // process: embedding tables are looked up, and a 2-D parameter outside a linear layer need not be a matmul operand
  // (GR00T's per-embodiment biases [E, out] are added), where a bf16 copy would round its values.
  std::set<std::string> linear_weights;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (const auto* lin = item.value()->as<nn::LinearImpl>(); lin && lin->weight.defined())
      linear_weights.insert(item.key() + ".weight");
  for (auto& item : model.named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    int64_t li = -1;
    size_t u = block_index(item.key(), blocks, &li) ? static_cast<size_t>(li) : static_cast<size_t>(L);
    if (u > static_cast<size_t>(L)) throw Error("fsdp: parameter '" + item.key() + "' names a layer past the last");
    for (const auto& m : split.shared)
      if (u < static_cast<size_t>(L) && item.key().rfind(m + ".", 0) == 0) {  // in the root unit, used by block u
        units_[u].shared.push_back(names_.size());
        u = static_cast<size_t>(L);
        break;
      }
    units_[u].members.push_back(names_.size());
    names_.push_back(item.key());
    shapes_.push_back(item.value().sizes().vec());
    params_.push_back(item.value());
  }
  if (o.compute_dtype != at::kFloat && o.compute_dtype != at::kBFloat16 && o.compute_dtype != at::kHalf)
    throw Error("fsdp: compute dtype must be float32, bfloat16 or float16");
  for (auto& unit : units_)
    for (size_t i : unit.members)
      unit.low.push_back(shapes_[i].size() == 2 && linear_weights.count(names_[i]));
  const int S = shard.size(), r = shard.rank();
  at::NoGradGuard no_grad;
  for (auto& unit : units_) {
    FlatShard fs;
    int64_t total = 0;
    for (size_t i : unit.members) {
      fs.params.push_back(i);
      fs.offsets.push_back(total);
      fs.numels.push_back(params_[i].numel());
      total += params_[i].numel();
    }
    const int64_t k = (total + S - 1) / S;
    auto opts = unit.members.empty() ? at::TensorOptions(at::kFloat) : params_[unit.members[0]].options();
    opts = opts.requires_grad(false);
    if (o.device) opts = opts.device(*o.device);
    at::Tensor flat = at::zeros({S * k}, opts);
    for (size_t j = 0; j < unit.members.size(); ++j) {
      const at::Tensor& p = params_[unit.members[j]];
      if (p.scalar_type() != flat.scalar_type())
        throw Error("fsdp: parameter '" + names_[unit.members[j]] + "' has another dtype than its unit");
      flat.narrow(0, fs.offsets[j], fs.numels[j]).copy_(p.detach().reshape(-1));
    }
    fs.param = flat.narrow(0, r * k, k).clone();
    fs.grad = at::zeros({k}, opts);
    fs.shard_rank = r;
    fs.shard_size = S;
    shards_.push_back(std::move(fs));
  }
  for (size_t u = 0; u < units_.size(); ++u) free_unit(u);
}

FullyShardedModel::~FullyShardedModel() {
  try {
    drain(0);
    for (auto& u : units_) u.gathering.wait();
  } catch (...) {
  }
}

void FullyShardedModel::prefetch(size_t u) {
  Unit& unit = units_[u];
  if (unit.gathered || !unit.gathering.done() || shards_[u].param.numel() == 0) return;
  const FlatShard& fs = shards_[u];
  unit.full = at::empty({fs.param.numel() * fs.shard_size}, fs.param.options());
  unit.gathering = shard_->all_gather_async(unit.full, fs.param);
}

void FullyShardedModel::gather(size_t u) {
  Unit& unit = units_[u];
  if (unit.gathered) return;
  if (shards_[u].param.numel() == 0) {
    unit.gathered = true;
    return;
  }
  if (!unit.full.defined()) prefetch(u);
  unit.gathering.wait();
  at::NoGradGuard no_grad;
  const FlatShard& fs = shards_[u];
  for (size_t j = 0; j < unit.members.size(); ++j) {
    size_t i = unit.members[j];
    at::Tensor v = unit.full.narrow(0, fs.offsets[j], fs.numels[j]).view(shapes_[i]);
    params_[i].set_data(unit.low[j] && opts_.compute_dtype != at::kFloat ? v.to(opts_.compute_dtype) : v);
  }
  unit.gathered = true;
}

void FullyShardedModel::free_unit(size_t u) {
  Unit& unit = units_[u];
  unit.gathering.wait();
  at::NoGradGuard no_grad;
  for (size_t i : unit.members)
    params_[i].set_data(at::empty({0}, shards_[u].param.options().dtype(at::kFloat).requires_grad(false)));
  unit.full = at::Tensor();
  unit.gathered = false;
}

void FullyShardedModel::unit_backward_begin(size_t u) {
  gather(u);
  if (opts_.prefetch && u > 0) prefetch(u - 1);
}

void FullyShardedModel::unit_grads(size_t u, const std::vector<at::Tensor>& grads) {
  const FlatShard& fs = shards_[u];
  if (fs.param.numel() == 0) return;
  at::NoGradGuard no_grad;
  Reduction red;
  red.in = at::zeros({fs.param.numel() * fs.shard_size}, fs.param.options());
  for (size_t j = 0; j < grads.size(); ++j)
    if (grads[j].defined()) red.in.narrow(0, fs.offsets[j], fs.numels[j]).copy_(grads[j].reshape(-1));
  red.out = at::empty_like(fs.param);
  red.unit = u;
  red.work = shard_->reduce_scatter_async(red.out, red.in);
  reductions_.push_back(std::move(red));
  reduced_ = false;
  drain(2);  // at most two reductions in flight (bounded memory)
}

void FullyShardedModel::drain(size_t keep) {
  at::NoGradGuard no_grad;
  while (reductions_.size() > keep) {
    Reduction& r = reductions_.front();
    r.work.wait();
    shards_[r.unit].grad.add_(r.out);
    reductions_.pop_front();
  }
}

void FullyShardedModel::flush_root_grads() {
  const size_t root = units_.size() - 1;
  std::vector<at::Tensor> grads;
  bool any = false;
  for (size_t i : units_[root].members) {
    grads.push_back(params_[i].grad());
    any = any || grads.back().defined();
  }
  if (!any) return;
  unit_grads(root, grads);
  for (size_t i : units_[root].members) params_[i].mutable_grad() = at::Tensor();
}

at::Tensor FullyShardedModel::forward_hidden(const models::Batch& b) {
  const size_t L = units_.size() - 1, root = L;
  flush_root_grads();  // a previous micro-batch's, if finish_backward() was not called
  gather(root);
  if (opts_.prefetch && L > 0) prefetch(0);
  at::Tensor h = model_->embed(b);
  const models::Batch inputs = model_->block_inputs(b, h.scalar_type());
  for (size_t i = 0; i < L; ++i) {
    gather(i);
    if (opts_.prefetch && i + 1 < L) prefetch(i + 1);
    std::vector<at::Tensor> ps;
    for (size_t m : units_[i].members) ps.push_back(params_[m]);
    std::vector<at::Tensor> shared;
    for (size_t m : units_[i].shared) shared.push_back(params_[m]);
    bool needs_node = at::GradMode::is_enabled() && (h.requires_grad() || !ps.empty() || !shared.empty());
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      y = model_->block_body(inputs, h, static_cast<int64_t>(i));
    }
    free_unit(i);
    if (needs_node) {
      auto node = std::shared_ptr<LayerNode>(new LayerNode(), torch::autograd::deleteNode);
      node->fsdp = this;
      node->unit = i;
      node->model = model_;
      node->params = std::move(ps);
      node->shared = std::move(shared);
      node->input = h.detach();
      std::vector<at::Tensor> edges = {h};
      for (const auto& [name, t] : inputs.tensors()) {
        node->inputs.set(name, t.defined() ? t.detach() : t);
        if (t.defined() && t.requires_grad()) {
          node->side.push_back(name);
          edges.push_back(t);
        }
      }
      node->input_requires_grad = h.requires_grad();
      node->set_next_edges(torch::autograd::collect_next_edges(edges));
      torch::autograd::set_history(y, node);
    }
    h = model_->block_after(inputs, y, static_cast<int64_t>(i));  // outside the unit, with the graph kept
  }
  return model_->post_blocks(h);
}

void FullyShardedModel::finish_backward() {
  flush_root_grads();
  drain(0);
  for (size_t u = 0; u + 1 < units_.size(); ++u)  // drop unused prefetches
    if (!units_[u].gathered) {
      units_[u].gathering.wait();
      units_[u].full = at::Tensor();
    }
  if (sync_ && !reduced_ && replicate_->size() > 1) {
    std::vector<Pending> w;
    for (auto& s : shards_)
      if (s.grad.numel() > 0) w.push_back(replicate_->all_reduce_async(s.grad));
    for (auto& x : w) x.wait();
  }
  if (sync_) reduced_ = true;
}

void FullyShardedModel::zero_grad() {
  drain(0);
  at::NoGradGuard no_grad;
  for (auto& s : shards_) s.grad.zero_();
  for (size_t i : units_.back().members) params_[i].mutable_grad() = at::Tensor();
  reduced_ = false;
}

void FullyShardedModel::after_step() { reshard(); }

void FullyShardedModel::set_compute_dtype(at::ScalarType t) {
  if (t == opts_.compute_dtype) return;
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf)
    throw Error("fsdp: compute dtype must be float32, bfloat16 or float16");
  drain(0);
  reshard();
  opts_.compute_dtype = t;
}

void FullyShardedModel::gather_all() {
  for (size_t u = 0; u < units_.size(); ++u) gather(u);
}

void FullyShardedModel::reshard() {
  for (size_t u = 0; u < units_.size(); ++u) free_unit(u);
}

std::map<std::string, at::Tensor> FullyShardedModel::full_parameters() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& fs : shards_) {
    if (fs.param.numel() == 0) continue;
    at::Tensor full = shard_->all_gather(fs.param, 0);
    for (size_t j = 0; j < fs.params.size(); ++j)
      out[names_[fs.params[j]]] = full.narrow(0, fs.offsets[j], fs.numels[j]).view(shapes_[fs.params[j]]).to(
          at::kCPU, full.scalar_type(), /*non_blocking=*/false, /*copy=*/true);  // whole models live on the host
  }
  return out;
}

void FullyShardedModel::load_full_parameters(const std::map<std::string, at::Tensor>& params) {
  at::NoGradGuard no_grad;
  for (auto& fs : shards_)
    for (const auto& pc : fs.pieces()) {
      auto it = params.find(names_[pc.param]);
      if (it == params.end()) throw Error("fsdp: load_full_parameters: missing '" + names_[pc.param] + "'");
      at::Tensor src = it->second.reshape(-1).to(fs.param.scalar_type());
      if (src.numel() != c10::multiply_integers(shapes_[pc.param]))
        throw Error("fsdp: load_full_parameters: '" + names_[pc.param] + "' has the wrong size");
      fs.param.narrow(0, pc.shard_offset, pc.length).copy_(src.narrow(0, pc.param_offset, pc.length));
    }
  reshard();
}

std::shared_ptr<FullyShardedModel> fully_shard(models::Model& model, const Group& shard,
                                               const Group& replicate, FsdpOptions opts) {
  return std::make_shared<FullyShardedModel>(model, shard, replicate, opts);
}

}  // namespace lf::parallel

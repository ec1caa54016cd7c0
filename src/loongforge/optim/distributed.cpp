#include "loongforge/optim/distributed.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>  // Pending holds a c10d::Work (incomplete in comm.h)

#include <cmath>

#include "loongforge/core/error.h"

namespace lf::optim {

namespace {
std::shared_ptr<parallel::GradSync> make_engine(std::vector<std::string> names, std::vector<at::Tensor> params,
                                                const parallel::Group& replicate, const parallel::Group& shard,
                                                const DataParallelOptions& dp) {
  if (dp.zero == 3)
    throw OptionError("zero", "3 (FSDP) needs parallel::fully_shard and the engine constructor");
  if (dp.zero != 0 && dp.zero != 1)
    throw OptionError("zero", std::to_string(dp.zero) + " is not 0, 1 or 3");
  if (dp.zero == 0 && shard.size() != 1)
    throw OptionError("zero", "0 (DDP) takes a shard group of one, got " +
                std::to_string(shard.size()) + " ranks");
  return std::make_shared<parallel::BucketedDataParallel>(std::move(names), std::move(params), replicate, shard,
                                                          dp.bucket_bytes);
}
}  // namespace

DataParallelOptimizer::DataParallelOptimizer(std::vector<std::string> names, std::vector<at::Tensor> params,
                                             std::vector<double> weight_decay, AdamWOptions opts,
                                             const parallel::Group& dp_replicate, const parallel::Group& dp_shard,
                                             DataParallelOptions dp, const parallel::Group* model_parallel,
                                             std::vector<bool> count_in_norm)
    : engine_(make_engine(std::move(names), std::move(params), dp_replicate, dp_shard, dp)),
      model_parallel_(model_parallel) {
  init(std::move(weight_decay), opts, std::move(count_in_norm));
}

DataParallelOptimizer::DataParallelOptimizer(std::shared_ptr<parallel::GradSync> engine,
                                             std::vector<double> weight_decay, AdamWOptions opts,
                                             const parallel::Group* model_parallel, std::vector<bool> count_in_norm)
    : engine_(std::move(engine)), model_parallel_(model_parallel) {
  if (!engine_) throw Error("DataParallelOptimizer: no engine");
  init(std::move(weight_decay), opts, std::move(count_in_norm));
}

void DataParallelOptimizer::init(std::vector<double> weight_decay, AdamWOptions opts,
                                 std::vector<bool> count_in_norm) {
  const size_t n = engine_->names().size();
  if (weight_decay.empty()) weight_decay.assign(n, opts.weight_decay);
  if (count_in_norm.empty()) count_in_norm.assign(n, true);
  if (weight_decay.size() != n || count_in_norm.size() != n)
    throw Error("DataParallelOptimizer: weight_decay and count_in_norm need one entry per parameter");
  std::vector<double> wd;
  auto& shards = engine_->shards();
  for (size_t s = 0; s < shards.size(); ++s)
    for (const auto& pc : shards[s].pieces()) {
      pieces_.push_back({s, pc});
      counted_.push_back(count_in_norm[pc.param]);
      wd.push_back(weight_decay[pc.param]);
      at::Tensor p = shards[s].param.narrow(0, pc.shard_offset, pc.length);
      at::Tensor g = shards[s].grad.narrow(0, pc.shard_offset, pc.length);
      p.mutable_grad() = g;
      param_views_.push_back(p);
      grad_views_.push_back(g);
    }
  adam_ = std::make_unique<AdamW>(param_views_, opts, wd);
}

double DataParallelOptimizer::grad_sq_norm() {
  finish_backward();
  at::NoGradGuard no_grad;
  // on the gradients' device (the sums never leave it before the all-reduce)
  at::Tensor sq = at::zeros({1}, at::TensorOptions(at::kDouble).device(grad_views_.empty() ? at::Device(at::kCPU)
                                                                                           : grad_views_[0].device()));
  for (size_t i = 0; i < pieces_.size(); ++i)
    if (counted_[i]) sq += grad_views_[i].to(at::kDouble).square().sum();
  if (engine_->shard_group().size() > 1) engine_->shard_group().all_reduce(sq);
  if (model_parallel_ && model_parallel_->size() > 1) model_parallel_->all_reduce(sq);
  return sq.item<double>();
}

void DataParallelOptimizer::scale_grads(double total, double max_norm) {
  if (max_norm <= 0) return;
  at::NoGradGuard no_grad;
  // As torch.nn.utils.clip_grad_norm_: the coefficient in the gradients' precision.
  auto dtype = grad_views_.empty() ? at::kFloat : grad_views_[0].scalar_type();
  at::Tensor t = at::scalar_tensor(total, at::TensorOptions(dtype));
  at::Tensor coef = at::clamp_max(max_norm / (t + 1e-6), 1.0);
  for (auto& s : engine_->shards())
    if (s.grad.numel() > 0) s.grad.mul_(coef);
}

double DataParallelOptimizer::clip_grad_norm(double max_norm) {
  const double total = std::sqrt(grad_sq_norm());
  scale_grads(total, max_norm);
  return total;
}

void DataParallelOptimizer::set_lr_scale(const std::map<std::string, double>& by_name) {
  std::vector<double> scale;
  for (const auto& pr : pieces_) {
    auto it = by_name.find(engine_->names()[pr.piece.param]);
    scale.push_back(it == by_name.end() ? 1.0 : it->second);
  }
  adam_->set_lr_scale(std::move(scale));
}

void DataParallelOptimizer::step(double lr) {
  finish_backward();
  // Re-attach the gradient views (a caller may have cleared .grad of our views; they alias the shards).
  for (size_t i = 0; i < param_views_.size(); ++i)
    if (!param_views_[i].grad().is_same(grad_views_[i])) param_views_[i].mutable_grad() = grad_views_[i];
  adam_->step(lr);
  engine_->after_step();
}

at::Tensor& DataParallelOptimizer::state_of(const std::string& which, size_t i) const {
  if (which == "exp_avg") return adam_->exp_avg()[i];
  if (which == "exp_avg_sq") return adam_->exp_avg_sq()[i];
  if (which == "param") return param_views_[i];
  if (which == "ema" && adam_->has_ema()) return adam_->ema()[i];
  throw Error("DataParallelOptimizer: unknown state '" + which + "' (exp_avg, exp_avg_sq, param; ema when enabled)");
}

std::map<std::string, at::Tensor> DataParallelOptimizer::full_state(const std::string& which) const {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  const auto& shards = engine_->shards();
  std::vector<at::Tensor> local;
  for (const auto& s : shards) local.push_back(at::zeros_like(s.param));
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& pr = pieces_[i];
    local[pr.shard].narrow(0, pr.piece.shard_offset, pr.piece.length).copy_(state_of(which, i));
  }
  for (size_t s = 0; s < shards.size(); ++s) {
    const auto& fs = shards[s];
    if (fs.params.empty()) continue;
    at::Tensor full = engine_->shard_group().size() > 1 ? engine_->shard_group().all_gather(local[s], 0) : local[s];
    for (size_t j = 0; j < fs.params.size(); ++j)
      out[engine_->names()[fs.params[j]]] = full.narrow(0, fs.offsets[j], fs.numels[j])
                                                .view(engine_->shapes()[fs.params[j]])
                                                .to(at::kCPU, full.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  }
  return out;
}

void DataParallelOptimizer::load_full_state(const std::string& which,
                                            const std::map<std::string, at::Tensor>& state) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& pc = pieces_[i].piece;
    const std::string& name = engine_->names()[pc.param];
    auto it = state.find(name);
    if (it == state.end()) throw Error("DataParallelOptimizer: load_full_state('" + which + "'): missing '" + name + "'");
    at::Tensor src = it->second.reshape(-1);
    if (src.numel() != c10::multiply_integers(engine_->shapes()[pc.param]))
      throw Error("DataParallelOptimizer: load_full_state('" + which + "'): '" + name + "' has the wrong size");
    state_of(which, i).copy_(src.narrow(0, pc.param_offset, pc.length));
  }
  if (which == "param") engine_->after_step();
}

}  // namespace lf::optim

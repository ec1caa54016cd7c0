#include "loongforge/parallel/data_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>  // Pending holds a c10d::Work (incomplete in comm.h)
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "loongforge/core/error.h"

namespace lf::parallel {

std::vector<FlatShard::Piece> FlatShard::pieces() const {
  std::vector<Piece> out;
  const int64_t k = param.numel(), lo = shard_rank * k, hi = lo + k;
  for (size_t j = 0; j < params.size(); ++j) {
    int64_t a = std::max(lo, offsets[j]), b = std::min(hi, offsets[j] + numels[j]);
    if (a < b) out.push_back({params[j], a - lo, a - offsets[j], b - a});
  }
  return out;
}

namespace {
struct ReadyHook : torch::autograd::PostAccumulateGradHook {
  BucketedDataParallel* self;
  size_t index;
  ReadyHook(BucketedDataParallel* s, size_t i) : self(s), index(i) {}
  void operator()(const torch::autograd::Variable&) override { self->grad_ready(index); }
};
}  // namespace

BucketedDataParallel::BucketedDataParallel(std::vector<std::string> names, std::vector<at::Tensor> params,
                                           const Group& replicate, const Group& shard, int64_t bucket_bytes)
    : params_(std::move(params)) {
  names_ = std::move(names);
  shard_ = &shard;
  replicate_ = &replicate;
  if (names_.size() != params_.size()) throw Error("data parallel: one name per parameter");
  if (bucket_bytes <= 0) throw Error("data parallel: bucket_bytes must be positive");
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad())
      throw Error("data parallel: parameter '" + names_[i] + "' does not require grad (pass trainable ones only)");
    shapes_.push_back(params_[i].sizes().vec());
  }
  bucket_of_.assign(params_.size(), 0);
  grad_views_.resize(params_.size());
  const int S = shard.size(), r = shard.rank();
  // Buckets in reverse parameter order (the order in which backward produces the gradients).
  std::vector<std::vector<size_t>> groups;
  int64_t bytes = 0;
  for (size_t n = params_.size(); n-- > 0;) {
    const at::Tensor& p = params_[n];
    int64_t b = p.numel() * static_cast<int64_t>(p.element_size());
    bool fresh = groups.empty() || bytes + b > bucket_bytes ||
                 params_[groups.back().front()].scalar_type() != p.scalar_type() ||
                 params_[groups.back().front()].device() != p.device();
    if (fresh && !(groups.empty() || groups.back().empty())) {
      groups.emplace_back();
      bytes = 0;
    }
    if (groups.empty()) groups.emplace_back();
    groups.back().push_back(n);
    bytes += b;
  }
  at::NoGradGuard no_grad;
  for (auto& members : groups) {
    FlatShard fs;
    int64_t total = 0;
    for (size_t i : members) {
      fs.params.push_back(i);
      fs.offsets.push_back(total);
      fs.numels.push_back(params_[i].numel());
      total += params_[i].numel();
    }
    const int64_t k = (total + S - 1) / S;
    const auto opts = params_[members.front()].options().requires_grad(false);
    Bucket bk;
    bk.param_flat = at::zeros({S * k}, opts);
    bk.grad_flat = at::zeros({S * k}, opts);
    for (size_t j = 0; j < members.size(); ++j) {
      at::Tensor& p = params_[members[j]];
      at::Tensor pv = bk.param_flat.narrow(0, fs.offsets[j], fs.numels[j]);
      pv.copy_(p.detach().reshape(-1));
      p.set_data(pv.view(p.sizes()));
      grad_views_[members[j]] = bk.grad_flat.narrow(0, fs.offsets[j], fs.numels[j]).view(p.sizes());
      p.mutable_grad() = grad_views_[members[j]];
      bucket_of_[members[j]] = buckets_.size();
    }
    fs.shard_rank = r;
    fs.shard_size = S;
    if (S == 1) {
      fs.param = bk.param_flat;
      fs.grad = bk.grad_flat;
    } else {
      fs.param = bk.param_flat.narrow(0, r * k, k);
      fs.grad = at::zeros({k}, opts);
    }
    shards_.push_back(std::move(fs));
    buckets_.push_back(std::move(bk));
  }
  reset_counts();
  for (size_t i = 0; i < params_.size(); ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(params_[i], std::make_unique<ReadyHook>(this, i));
}

BucketedDataParallel::~BucketedDataParallel() {
  for (auto& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
  for (auto& b : buckets_) {
    try {
      b.work.wait();
    } catch (...) {
    }
  }
}

void BucketedDataParallel::reset_counts() {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].pending = static_cast<int64_t>(shards_[b].params.size());
    buckets_[b].launched = false;
  }
  next_launch_ = 0;
}

void BucketedDataParallel::set_sync(bool last_micro_batch) {
  sync_ = last_micro_batch;
  if (next_launch_ == 0) reset_counts();
}

void BucketedDataParallel::grad_ready(size_t i) {
  at::Tensor& g = params_[i].mutable_grad();
  if (!g.defined() || !g.is_same(grad_views_[i])) {
    // Someone replaced .grad (e.g. a plain zero_grad that undefines it): the new tensor holds the gradients since
    // then; put them back into the bucket.
    at::NoGradGuard no_grad;
    if (g.defined()) grad_views_[i].copy_(g);
    else grad_views_[i].zero_();
    g = grad_views_[i];
  }
  reduced_ = false;
  if (!sync_) return;
  Bucket& b = buckets_[bucket_of_[i]];
  if (b.pending <= 0 || b.launched)
    throw Error("data parallel: the gradient of '" + names_[i] +
                "' arrived twice in one synced backward (call finish_backward() after each backward and "
                "set_sync(false) for all but the last micro-batch)");
  --b.pending;
  launch_ready();
}

void BucketedDataParallel::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    launch(next_launch_++);
    ++started_in_backward_;
  }
}

void BucketedDataParallel::launch(size_t b) {
  Bucket& bk = buckets_[b];
  if (shard_->size() > 1) bk.work = shard_->reduce_scatter_async(shards_[b].grad, bk.grad_flat);
  else if (replicate_->size() > 1) bk.work = replicate_->all_reduce_async(bk.grad_flat);
  bk.launched = true;
}

void BucketedDataParallel::finish_backward() {
  if (!sync_ || reduced_) return;
  // Buckets whose parameters got no gradient in this backward (unused) start now, in order.
  while (next_launch_ < buckets_.size()) launch(next_launch_++);
  for (auto& b : buckets_) b.work.wait();
  if (shard_->size() > 1 && replicate_->size() > 1) {
    std::vector<Pending> w;
    for (auto& s : shards_) w.push_back(replicate_->all_reduce_async(s.grad));
    for (auto& x : w) x.wait();
  }
  reduced_ = true;
  reset_counts();
}

void BucketedDataParallel::zero_grad() {
  at::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b.work.wait();
    b.grad_flat.zero_();
  }
  if (shard_->size() > 1)
    for (auto& s : shards_) s.grad.zero_();
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].grad().is_same(grad_views_[i])) params_[i].mutable_grad() = grad_views_[i];
  reduced_ = false;
  reset_counts();
}

void BucketedDataParallel::after_step() {
  if (shard_->size() == 1) return;  // DDP: the parameters are the updated buckets
  std::vector<at::Tensor> sent;
  std::vector<Pending> w;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    sent.push_back(shards_[b].param.clone());
    w.push_back(shard_->all_gather_async(buckets_[b].param_flat, sent.back()));
  }
  for (auto& x : w) x.wait();
}

}  // namespace lf::parallel

// The collectives of the communication layer (parallel/comm.h): Group's blocking and asynchronous operations with
// tensors staged to the backend's device, Pending, batched point-to-point, and the Mesh. Comm::init, the heartbeat
// and the failure diagnosis (Group::fail) are in rendezvous.cpp.
#include "loongforge/parallel/comm.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#if defined(LOONGFORGE_CUDA) && LOONGFORGE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#define LF_HAVE_NCCL 1
#endif

#include <algorithm>

#include "loongforge/core/error.h"

namespace lf::parallel {

namespace {

c10d::ReduceOp to_c10d(Reduce op) {
  switch (op) {
    case Reduce::Max: return c10d::ReduceOp::MAX;
    case Reduce::Min: return c10d::ReduceOp::MIN;
    default: return c10d::ReduceOp::SUM;
  }
}

}  // namespace

// The device the group's backend takes tensors on: NCCL the current CUDA device, Gloo the CPU. Tensors elsewhere are
// staged there and back (small host-side values under NCCL; GPU tensors under Gloo, e.g. several ranks sharing one
// GPU in tests), so callers need not care which backend runs.
at::Device Group::backend_device() const {
#ifdef LF_HAVE_NCCL
  if (comm_ && comm_->backend_name() == "nccl") return at::Device(at::kCUDA, c10::cuda::current_device());
#endif
  return at::Device(at::kCPU);
}

bool Group::staged(const at::Tensor& t) const { return backend_ && t.device() != backend_device(); }

#define LF_COLLECTIVE(opname, ...)                  \
  try {                                              \
    __VA_ARGS__;                                     \
  } catch (const lf::Error&) {                       \
    throw;                                           \
  } catch (const std::exception& e) {                \
    fail(opname, e);                                 \
  }

void Group::all_reduce(at::Tensor& t, Reduce op) const {
  if (!backend_) return;
  if (staged(t)) {
    at::Tensor s = t.to(backend_device()).contiguous();
    all_reduce(s, op);
    t.copy_(s);
    return;
  }
  bump();
  TORCH_CHECK(t.is_contiguous(), "all_reduce needs a contiguous tensor");
  LF_COLLECTIVE("all_reduce", {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = comm_->timeout();
    (*backend_)->allreduce(v, o)->wait(comm_->timeout());
  });
  if (op == Reduce::Avg) t.div_(size());
}

at::Tensor Group::all_gather(const at::Tensor& t, int64_t dim) const {
  if (!backend_) return t;
  if (staged(t)) return all_gather(t.to(backend_device()), dim).to(t.device());
  bump();
  at::Tensor in = t.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape.insert(shape.begin(), size());
  at::Tensor out = at::empty(shape, in.options());
  LF_COLLECTIVE("all_gather", {
    c10d::AllgatherOptions o;
    o.timeout = comm_->timeout();
    at::Tensor flat_out = out.view({-1}), flat_in = in.view({-1});
    (*backend_)->_allgather_base(flat_out, flat_in, o)->wait(comm_->timeout());
  });
  // out [size, ...]: move the rank axis next to dim and merge.
  if (dim < 0) dim += in.dim();
  return out.movedim(0, dim).flatten(dim, dim + 1).contiguous();
}

at::Tensor Group::reduce_scatter(const at::Tensor& t, int64_t dim) const {
  if (!backend_) return t;
  if (staged(t)) return reduce_scatter(t.to(backend_device()), dim).to(t.device());
  bump();
  if (dim < 0) dim += t.dim();
  TORCH_CHECK(t.size(dim) % size() == 0, "reduce_scatter: dim ", dim, " of size ", t.size(dim), " is not divisible by ", size());
  // [.., size*k, ..] -> [size, .., k, ..] contiguous so that each rank's part is one block.
  std::vector<int64_t> shape = t.sizes().vec();
  shape[static_cast<size_t>(dim)] /= size();
  std::vector<int64_t> split = t.sizes().vec();
  split[static_cast<size_t>(dim)] = shape[static_cast<size_t>(dim)];
  split.insert(split.begin() + dim, size());
  at::Tensor in = t.reshape(split).movedim(dim, 0).contiguous();
  at::Tensor out = at::empty(shape, t.options());
  LF_COLLECTIVE("reduce_scatter", {
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.timeout = comm_->timeout();
    at::Tensor flat_out = out.view({-1}), flat_in = in.view({-1});
    (*backend_)->_reduce_scatter_base(flat_out, flat_in, o)->wait(comm_->timeout());
  });
  return out;
}

at::Tensor Group::all_to_all(const at::Tensor& t) const {
  if (!backend_) return t;
  std::vector<int64_t> counts(static_cast<size_t>(size()), t.size(0) / size());
  TORCH_CHECK(t.size(0) % size() == 0, "all_to_all: dim 0 of size ", t.size(0), " is not divisible by ", size());
  return all_to_all_v(t, counts, counts);
}

at::Tensor Group::all_to_all_v(const at::Tensor& t, const std::vector<int64_t>& send_counts,
                               const std::vector<int64_t>& recv_counts) const {
  if (!backend_) return t;
  if (staged(t)) return all_to_all_v(t.to(backend_device()), send_counts, recv_counts).to(t.device());
  bump();
  at::Tensor in = t.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  int64_t total = 0;
  for (auto c : recv_counts) total += c;
  shape[0] = total;
  at::Tensor out = at::empty(shape, in.options());
  std::vector<int64_t> sc = send_counts, rc = recv_counts;
  LF_COLLECTIVE("all_to_all", {
    c10d::AllToAllOptions o;
    o.timeout = comm_->timeout();
    (*backend_)->alltoall_base(out, in, rc, sc, o)->wait(comm_->timeout());
  });
  return out;
}

void Group::broadcast(at::Tensor& t, int root) const {
  if (!backend_) return;
  if (staged(t)) {
    at::Tensor s = t.to(backend_device()).contiguous();
    broadcast(s, root);
    t.copy_(s);
    return;
  }
  bump();
  LF_COLLECTIVE("broadcast", {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = comm_->timeout();
    (*backend_)->broadcast(v, o)->wait(comm_->timeout());
  });
}

void Group::send(const at::Tensor& t, int dst) const {
  isend(t.contiguous(), dst).wait();
}

void Group::recv(at::Tensor& t, int src) const {
  irecv(t, src).wait();
}

void Group::barrier() const {
  if (!backend_) return;
  bump();
  LF_COLLECTIVE("barrier", {
    // An all-reduce of one element: Gloo's barrier has no per-call timeout of its own.
    at::Tensor t = at::zeros({1}, at::TensorOptions().device(comm_->backend_name() == "nccl" ? at::kCUDA : at::kCPU));
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.timeout = comm_->timeout();
    (*backend_)->allreduce(v, o)->wait(comm_->timeout());
  });
}

// ---------------------------------------------------------------------------------------------------------------

Pending::Pending() = default;
Pending::Pending(Pending&& o) noexcept
    : work_(std::move(o.work_)), more_(std::move(o.more_)), group_(o.group_), op_(o.op_), then_(std::move(o.then_)) {
  o.more_.clear();
}

Pending& Pending::operator=(Pending&& o) noexcept {
  if (this != &o) {
    if (!done()) {
      try { wait(); } catch (...) {}
    }
    work_ = std::move(o.work_);
    more_ = std::move(o.more_);
    o.more_.clear();
    group_ = o.group_;
    op_ = o.op_;
    then_ = std::move(o.then_);
  }
  return *this;
}

Pending::~Pending() {
  if (!done()) {
    try { wait(); } catch (...) {}
  }
}

void Pending::wait() {
  if (done()) return;
  auto w = std::move(work_);
  work_.reset();
  auto more = std::move(more_);
  more_.clear();
  // every operation is waited for (a staged buffer must outlive all of them), the first error reported
  std::exception_ptr first;
  if (w) more.insert(more.begin(), w);
  for (auto& m : more) {
    try {
      m->wait(group_->comm_->timeout());
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) {
    try {
      std::rethrow_exception(first);
    } catch (const std::exception& e) {
      group_->fail(op_, e);
    }
  }
  if (then_) {
    auto f = std::move(then_);
    then_ = nullptr;
    f();
  }
}

// Staged asynchronous collectives run on a copy; the copy back follows the wait (Pending::then_).
void Group::then_copy(Pending& p, at::Tensor dst, at::Tensor src, at::Tensor keep) const {
  auto prev = std::move(p.then_);
  p.then_ = [prev, dst, src, keep]() mutable {
    if (prev) prev();
    dst.copy_(src.view(dst.sizes()));
    (void)keep;  // the staged input stays alive until the collective is done
  };
}

Pending Group::staged_async(Pending (Group::*op)(at::Tensor&, const at::Tensor&) const, at::Tensor& out,
                            const at::Tensor& in) const {
  at::Tensor si = in.to(backend_device()).contiguous();
  at::Tensor so = at::empty(out.sizes(), out.options().device(backend_device()));
  Pending p = (this->*op)(so, si);
  then_copy(p, out, so, si);
  return p;
}

Pending Group::all_reduce_async(at::Tensor& t, Reduce op) const {
  Pending p;
  if (!backend_) return p;
  if (staged(t)) {
    at::Tensor s = t.to(backend_device()).contiguous();
    p = all_reduce_async(s, op);
    then_copy(p, t, s, at::Tensor());
    return p;
  }
  bump();
  TORCH_CHECK(t.is_contiguous(), "all_reduce needs a contiguous tensor");
  p.group_ = this;
  p.op_ = "all_reduce";
  LF_COLLECTIVE("all_reduce", {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = comm_->timeout();
    p.work_ = (*backend_)->allreduce(v, o);
  });
  if (op == Reduce::Avg) {
    at::Tensor tt = t;
    int n = size();
    p.then_ = [tt, n]() mutable { tt.div_(n); };
  }
  return p;
}

Pending Group::all_gather_async(at::Tensor& out, const at::Tensor& in) const {
  Pending p;
  if (!backend_) {
    out.copy_(in);
    return p;
  }
  TORCH_CHECK(out.is_contiguous() && in.is_contiguous() && out.numel() == in.numel() * size(), "all_gather_async: shapes");
  if (staged(out) || staged(in)) return staged_async(&Group::all_gather_async, out, in);
  p.group_ = this;
  p.op_ = "all_gather";
  bump();
  LF_COLLECTIVE("all_gather", {
    c10d::AllgatherOptions o;
    o.timeout = comm_->timeout();
    at::Tensor fo = out.view({-1}), fi = in.view({-1});
    p.work_ = (*backend_)->_allgather_base(fo, fi, o);
  });
  return p;
}

Pending Group::reduce_scatter_async(at::Tensor& out, const at::Tensor& in) const {
  Pending p;
  if (!backend_) {
    out.copy_(in);
    return p;
  }
  TORCH_CHECK(out.is_contiguous() && in.is_contiguous() && in.numel() == out.numel() * size(), "reduce_scatter_async: shapes");
  if (staged(out) || staged(in)) return staged_async(&Group::reduce_scatter_async, out, in);
  p.group_ = this;
  p.op_ = "reduce_scatter";
  bump();
  LF_COLLECTIVE("reduce_scatter", {
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.timeout = comm_->timeout();
    at::Tensor fo = out.view({-1}), fi = in.view({-1});
    p.work_ = (*backend_)->_reduce_scatter_base(fo, fi, o);
  });
  return p;
}

Pending Group::isend(const at::Tensor& t, int dst, int tag) const {
  return batch_p2p({P2POp{true, t, dst, tag}});
}

Pending Group::irecv(at::Tensor& t, int src, int tag) const {
  return batch_p2p({P2POp{false, t, src, tag}});
}

Pending Group::batch_p2p(const std::vector<P2POp>& ops) const {
  Pending p;
  if (ops.empty()) return p;
  p.group_ = this;
  p.op_ = ops.size() == 1 ? (ops[0].send ? "send" : "recv") : "send/recv";
  std::vector<at::Tensor> bufs;  // what the backend takes: the tensors, or their copies on its device
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (receiver, staged buffer)
  for (const auto& op : ops) {
    TORCH_CHECK(size() > 1 && op.peer != rank_ && op.peer >= 0 && op.peer < size(), op.send ? "send" : "recv",
                " to/from group rank ", op.peer, " of a group of ", size(), " (this rank: ", rank_, ")");
    TORCH_CHECK(op.tensor.is_contiguous(), op.send ? "send" : "recv", " needs a contiguous tensor");
    if (!staged(op.tensor)) {
      bufs.push_back(op.tensor);
    } else if (op.send) {
      bufs.push_back(op.tensor.to(backend_device()).contiguous());
    } else {
      bufs.push_back(at::empty(op.tensor.sizes(), op.tensor.options().device(backend_device())));
      copy_back.emplace_back(op.tensor, bufs.back());
    }
  }
  LF_COLLECTIVE(p.op_, {
    auto& be = *backend_;
    // Under NCCL every batch is a group, even of one operation: c10d sends a lone send/recv over a two-rank
    // communicator of its own and a grouped one over the group's communicator, so a message sent in one way and
    // received in the other would never meet.
    const bool group = be->supportsCoalescing();
    if (group) be->startCoalescing();
    try {
      for (size_t i = 0; i < ops.size(); ++i) {
        std::vector<at::Tensor> v{bufs[i]};
        auto w = ops[i].send ? be->send(v, ops[i].peer, ops[i].tag) : be->recv(v, ops[i].peer, ops[i].tag);
        if (group) continue;  // the group's work covers it
        if (!p.work_) p.work_ = w;
        else p.more_.push_back(w);
      }
    } catch (...) {
      if (group) {  // leave the backend out of its coalescing state
        try { be->endCoalescing(); } catch (...) {}
      }
      throw;
    }
    if (group) p.work_ = be->endCoalescing();
  });
  // staged sends stay alive until they are done; staged receives are copied where they were asked for
  p.then_ = [bufs, copy_back]() {
    for (const auto& [dst, src] : copy_back) dst.copy_(src);
  };
  return p;
}

// ---------------------------------------------------------------------------------------------------------------

Mesh::Mesh(std::shared_ptr<Comm> comm, std::vector<std::pair<std::string, int>> dims) : comm_(std::move(comm)), dims_(std::move(dims)) {
  int64_t prod = 1;
  std::string desc;
  for (auto& [n, s] : dims_) {
    if (s < 1) throw Error("mesh: dimension '" + n + "' has size " + std::to_string(s));
    prod *= s;
    desc += (desc.empty() ? "" : " x ") + n + std::to_string(s);
  }
  if (prod != comm_->world())
    throw Error("mesh: layout " + desc + " needs " + std::to_string(prod) + " ranks but the job has " +
                std::to_string(comm_->world()));
  int r = comm_->rank();
  coords_.assign(dims_.size(), 0);
  for (size_t i = dims_.size(); i-- > 0;) {
    coords_[i] = r % dims_[i].second;
    r /= dims_[i].second;
  }
  for (auto& d : dims_) group(d.first);  // every rank creates the one-dimension groups in the same order
}

size_t Mesh::index(const std::string& dim) const {
  for (size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].first == dim) return i;
  throw Error("mesh: no dimension '" + dim + "'");
}

int Mesh::size(const std::string& dim) const { return dims_[index(dim)].second; }
int Mesh::coord(const std::string& dim) const { return coords_[index(dim)]; }

int Mesh::rank_at(const std::map<std::string, int>& coords) const {
  int r = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    auto it = coords.find(dims_[i].first);
    int c = it == coords.end() ? coords_[i] : it->second;
    r = r * dims_[i].second + c;
  }
  return r;
}

const Group& Mesh::group_over(const std::vector<std::string>& names) const {
  std::vector<size_t> idx;
  for (size_t i = 0; i < dims_.size(); ++i)
    if (std::find(names.begin(), names.end(), dims_[i].first) != names.end()) idx.push_back(i);
  for (const auto& n : names) index(n);  // unknown names are errors
  // Enumerate the coordinates of the chosen dimensions in mesh order (last fastest).
  std::vector<int> ranks;
  std::vector<int> c = coords_;
  int64_t count = 1;
  for (size_t i : idx) count *= dims_[i].second;
  for (int64_t k = 0; k < count; ++k) {
    int64_t rem = k;
    for (size_t j = idx.size(); j-- > 0;) {
      c[idx[j]] = static_cast<int>(rem % dims_[idx[j]].second);
      rem /= dims_[idx[j]].second;
    }
    int r = 0;
    for (size_t i = 0; i < dims_.size(); ++i) r = r * dims_[i].second + c[i];
    ranks.push_back(r);
  }
  return comm_->group(ranks);
}

}  // namespace lf::parallel

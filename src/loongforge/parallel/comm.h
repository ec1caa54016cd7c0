// The communication layer: process groups over LibTorch's c10d engines (Gloo for CPU tensors; NCCL for CUDA
// tensors in CUDA builds) or Open MPI (parallel/mpi_backend.h), and a device mesh with named dimensions. Nothing here is global: a Comm is created once
// per process (Comm::init) and passed to whatever needs it.
//
// Ranks come from the launcher (parallel/launch.h: torchrun, mpirun or srun). Without one the world is one process
// and every collective is the identity. Sources: launch.cpp (launch detection), rendezvous.cpp (Comm::init, the
// heartbeat, dead/hung rank diagnosis), comm.cpp (the collectives, Pending, batched point-to-point, Mesh).
//
// Tensors may live on either device whatever the backend: a collective or point-to-point operation on a tensor the
// backend cannot take (a CPU tensor under NCCL, a CUDA tensor under Gloo) runs on a copy on the backend's device and
// copies the result back.
//
// A rank that exits or hangs never leaves the others hanging: every collective has the timeout given at init
// and every failure becomes an lf::Error that names the group, the operation and the ranks that stopped
// answering (each rank keeps a heartbeat in the rendezvous store).
#pragma once
#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loongforge/parallel/launch.h"

namespace c10d {
class Backend;
class Store;
class Work;
}  // namespace c10d

namespace lf::parallel {

// The collective backends this build can use: "gloo", "nccl" in CUDA builds, "mpi" in builds with Open MPI.
std::vector<std::string> available_backends();

enum class Reduce { Sum, Max, Min, Avg };

class Comm;
class Group;

// An operation in flight (the *_async collectives, isend/irecv); wait() finishes it (errors as the blocking
// versions). Destroying an unfinished Pending waits for it.
class Pending {
 public:
  Pending();
  Pending(Pending&&) noexcept;
  Pending& operator=(Pending&&) noexcept;
  ~Pending();
  void wait();
  bool done() const { return !work_ && more_.empty(); }

 private:
  friend class Group;
  c10::intrusive_ptr<c10d::Work> work_;
  std::vector<c10::intrusive_ptr<c10d::Work>> more_;  // a batch's further operations (Group::batch_p2p)
  const Group* group_ = nullptr;
  const char* op_ = "";
  std::function<void()> then_;  // runs after the wait (e.g. the division of an average)
};

// One point-to-point operation of a batch (Group::batch_p2p).
struct P2POp {
  bool send;          // false: receive into `tensor`
  at::Tensor tensor;  // contiguous
  int peer;           // group rank
  int tag = 0;
};

// One process group: the ranks (global numbers, in group order) and this rank's place among them.
class Group {
 public:
  Group() = default;
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }
  const std::string& name() const { return name_; }
  int global_rank(int group_rank) const { return ranks_.at(static_cast<size_t>(group_rank)); }
  // Collectives started on this group so far (every member counts the same ones).
  int64_t sequence() const { return seq_.load(); }

  // In place. Avg divides by the group size.
  void all_reduce(at::Tensor& t, Reduce op = Reduce::Sum) const;
  // Concatenation of every rank's `t` along `dim` (equal shapes).
  at::Tensor all_gather(const at::Tensor& t, int64_t dim = 0) const;
  // Sum over ranks of `t`, split along `dim` in size() equal parts; this rank's part.
  at::Tensor reduce_scatter(const at::Tensor& t, int64_t dim = 0) const;
  // `t` split along dim 0 in size() equal parts; part j goes to rank j; returns the received parts concatenated
  // along dim 0 in rank order.
  at::Tensor all_to_all(const at::Tensor& t) const;
  // Uneven version: send_counts/recv_counts are rows of dim 0 to and from each rank.
  at::Tensor all_to_all_v(const at::Tensor& t, const std::vector<int64_t>& send_counts,
                          const std::vector<int64_t>& recv_counts) const;
  void broadcast(at::Tensor& t, int root) const;  // root: group rank
  void send(const at::Tensor& t, int dst) const;  // dst/src: group ranks; tensors contiguous
  void recv(at::Tensor& t, int src) const;
  void barrier() const;

  // Started now, finished by Pending::wait() (tensors must stay alive and untouched until then). Collectives
  // must still be started in the same order on every rank of the group.
  Pending all_reduce_async(at::Tensor& t, Reduce op = Reduce::Sum) const;
  // out: [size() * n, ...] for an input of [n, ...] (dim 0 concatenation).
  Pending all_gather_async(at::Tensor& out, const at::Tensor& in) const;
  // in: [size() * n, ...] (contiguous), out: [n, ...]; sum.
  Pending reduce_scatter_async(at::Tensor& out, const at::Tensor& in) const;
  Pending isend(const at::Tensor& t, int dst, int tag = 0) const;
  Pending irecv(at::Tensor& t, int src, int tag = 0) const;
  // Sends and receives started together; the Pending finishes them all. Under NCCL they form one group
  // (ncclGroupStart/End), so a send and a receive between the same two ranks cannot wait for each other (NCCL runs
  // the point-to-point operations of a pair of ranks in order, a send waiting for its receive). NCCL ignores tags:
  // messages between two ranks match in the order they are posted, so both sides must post them in the same order.
  // isend/irecv/send/recv are batches of one (under NCCL also a group, so they meet messages posted in batches). The
  // first batch on a group initializes its NCCL communicator, which every member must do: start with a collective
  // on the group (e.g. barrier) when only some members exchange messages first.
  Pending batch_p2p(const std::vector<P2POp>& ops) const;

 private:
  friend class Comm;
  friend class Pending;
  [[noreturn]] void fail(const char* op, const std::exception& e) const;
  at::Device backend_device() const;
  bool staged(const at::Tensor& t) const;  // t must be copied to backend_device() for the backend to take it
  void then_copy(Pending& p, at::Tensor dst, at::Tensor src, at::Tensor keep) const;
  // op(out, in) on copies on backend_device(), out filled after the wait
  Pending staged_async(Pending (Group::*op)(at::Tensor&, const at::Tensor&) const, at::Tensor& out,
                       const at::Tensor& in) const;
  void bump() const { ++seq_; }
  mutable std::atomic<int64_t> seq_{0};
  std::string name_;
  std::vector<int> ranks_{0};
  int rank_ = 0;
  c10::intrusive_ptr<c10d::Backend>* backend_ = nullptr;  // owned by Comm; null for a group of one
  const Comm* comm_ = nullptr;
};

// The process's view of the job: the world group and the groups of a mesh.
class Comm {
 public:
  struct Options {
    std::chrono::milliseconds timeout{std::chrono::seconds(300)};
    // gloo (CPU tensors) | nccl (CUDA tensors; CUDA builds; world group even at size 1) | mpi (CPU tensors over
    // Open MPI; the job started by mpirun). With mpi, or mpirun over several nodes without MASTER_ADDR, MPI
    // bootstraps the rendezvous store: rank 0's host, and a free port unless MASTER_PORT is set.
    std::string backend = "gloo";
  };
  static std::shared_ptr<Comm> init(const LaunchEnv& env, const Options& opts);
  static std::shared_ptr<Comm> init() { return init(detect_launch(), Options{}); }
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return env_.rank; }
  int world() const { return env_.world; }
  const LaunchEnv& env() const { return env_; }
  const Group& world_group() const { return world_group_; }
  // The group of `ranks` (global, in order), created on first use. Every member must ask for it, in the same
  // order of creation as the other members; a rank that is not a member gets an error.
  const Group& group(const std::vector<int>& ranks) const;
  // Why `g`'s collective failed, for the error message: the ranks whose heartbeat stopped (exited) and the members
  // of `g` that never reached this rank's latest collective on it (hung, or busy elsewhere).
  std::string diagnose(const Group& g) const;
  std::chrono::milliseconds timeout() const { return opts_.timeout; }
  const std::string& backend_name() const { return opts_.backend; }

 private:
  Comm() = default;
  c10::intrusive_ptr<c10d::Backend> make_backend(const std::string& prefix, const std::vector<int>& ranks,
                                                 int group_rank) const;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  LaunchEnv env_;
  Options opts_;
  Group world_group_;
  mutable std::map<std::vector<int>, std::unique_ptr<Group>> groups_;
  mutable std::vector<std::unique_ptr<c10::intrusive_ptr<c10d::Backend>>> backends_;
};

// Named dimensions over the world, outermost first; the last dimension varies fastest among global ranks
// (e.g. {{"pp",2},{"dp",2},{"tp",2}}: ranks 0,1 share pp=0,dp=0 and differ in tp). Sizes must multiply to the
// world size.
class Mesh {
 public:
  Mesh(std::shared_ptr<Comm> comm, std::vector<std::pair<std::string, int>> dims);
  const Comm& comm() const { return *comm_; }
  std::shared_ptr<Comm> comm_ptr() const { return comm_; }
  int size(const std::string& dim) const;
  int coord(const std::string& dim) const;  // this rank's index along dim
  // The group of ranks that share every coordinate except those in `dims` (its group rank order follows the
  // mesh order of those dimensions).
  const Group& group_over(const std::vector<std::string>& dims) const;
  const Group& group(const std::string& dim) const { return group_over(std::vector<std::string>{dim}); }
  // Global rank at the given coordinates (all dimensions).
  int rank_at(const std::map<std::string, int>& coords) const;
  const std::vector<std::pair<std::string, int>>& dims() const { return dims_; }

 private:
  std::shared_ptr<Comm> comm_;
  std::vector<std::pair<std::string, int>> dims_;
  std::vector<int> coords_;
  size_t index(const std::string& dim) const;
};

}  // namespace lf::parallel

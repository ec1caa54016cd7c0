#include "loongforge/parallel/comm.h"

#include <ATen/ATen.h>
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1  // libtorch_cpu is built with Gloo; the header declares it only under this macro
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(LOONGFORGE_CUDA) && LOONGFORGE_CUDA
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define LF_HAVE_NCCL 1
#endif

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "loongforge/core/error.h"
#include "loongforge/parallel/mpi_backend.h"

extern char** environ;

namespace lf::parallel {

namespace {

std::map<std::string, std::string> process_env() {
  std::map<std::string, std::string> m;
  for (char** e = environ; e && *e; ++e) {
    std::string s(*e);
    auto eq = s.find('=');
    if (eq != std::string::npos) m[s.substr(0, eq)] = s.substr(eq + 1);
  }
  return m;
}

int to_int(const std::map<std::string, std::string>& env, const std::string& key, int fallback) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty()) return fallback;
  try {
    size_t pos = 0;
    int v = std::stoi(it->second, &pos);
    if (pos != it->second.size()) throw std::invalid_argument("trailing");
    return v;
  } catch (const std::exception&) {
    throw Error("environment: variable '" + key + "': not an integer: '" + it->second + "'");
  }
}

std::string join(const std::vector<int>& v, const char* sep = ",") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

// The first line of an engine's message (c10 errors append a stack trace), at most 200 characters.
std::string first_line(const std::string& s) {
  std::string l = s.substr(0, s.find('\n'));
  return l.size() > 200 ? l.substr(0, 200) + "..." : l;
}

c10d::ReduceOp to_c10d(Reduce op) {
  switch (op) {
    case Reduce::Max: return c10d::ReduceOp::MAX;
    case Reduce::Min: return c10d::ReduceOp::MIN;
    default: return c10d::ReduceOp::SUM;
  }
}

// The network device Gloo binds: GLOO_SOCKET_IFNAME if set, loopback when the master is local, else the
// address the host name resolves to.
auto gloo_device(const LaunchEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  if (env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0)
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // First entry up to a top-level comma; expand its first bracket range.
  int depth = 0;
  size_t end = nodelist.size();
  for (size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    else if (nodelist[i] == ']') --depth;
    else if (nodelist[i] == ',' && depth == 0) { end = i; break; }
  }
  std::string first = nodelist.substr(0, end);
  auto lb = first.find('[');
  if (lb == std::string::npos) return first;
  auto rb = first.find(']', lb);
  if (rb == std::string::npos) throw Error("environment: variable 'SLURM_JOB_NODELIST': malformed node list '" + nodelist + "'");
  std::string inside = first.substr(lb + 1, rb - lb - 1);
  std::string item = inside.substr(0, inside.find(','));
  std::string lo = item.substr(0, item.find('-'));
  return first.substr(0, lb) + lo + first.substr(rb + 1);
}

std::vector<std::string> available_backends() {
  std::vector<std::string> b{"gloo"};
#ifdef LF_HAVE_NCCL
  b.push_back("nccl");
#endif
  if (mpi_compiled()) b.push_back("mpi");
  return b;
}

LaunchEnv detect_launch(const std::map<std::string, std::string>& env_in) {
  const auto env = env_in.empty() ? process_env() : env_in;
  LaunchEnv e;
  auto has = [&](const char* k) { return env.count(k) && !env.at(k).empty(); };
  if (has("RANK") && has("WORLD_SIZE")) {
    e.launcher = "torchrun";
    e.rank = to_int(env, "RANK", 0);
    e.world = to_int(env, "WORLD_SIZE", 1);
    e.local_rank = to_int(env, "LOCAL_RANK", 0);
  } else if (has("OMPI_COMM_WORLD_RANK") && has("OMPI_COMM_WORLD_SIZE")) {
    e.launcher = "mpirun";
    e.rank = to_int(env, "OMPI_COMM_WORLD_RANK", 0);
    e.world = to_int(env, "OMPI_COMM_WORLD_SIZE", 1);
    e.local_rank = to_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    int local_size = to_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", e.world);
    e.master_unknown = !has("MASTER_ADDR") && local_size != e.world;  // Comm::init asks MPI, or says so
  } else if (has("SLURM_PROCID") && has("SLURM_NTASKS")) {
    e.launcher = "srun";
    e.rank = to_int(env, "SLURM_PROCID", 0);
    e.world = to_int(env, "SLURM_NTASKS", 1);
    e.local_rank = to_int(env, "SLURM_LOCALID", 0);
    if (!has("MASTER_ADDR")) {
      const char* keys[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"};
      for (const char* k : keys)
        if (has(k)) { e.master_addr = first_slurm_host(env.at(k)); break; }
    }
  }
  if (has("MASTER_ADDR")) e.master_addr = env.at("MASTER_ADDR");
  e.master_port = to_int(env, "MASTER_PORT", 29500);
  e.master_port_set = has("MASTER_PORT");
  if (e.world < 1) throw Error("environment: world size " + std::to_string(e.world) + " is not positive");
  if (e.rank < 0 || e.rank >= e.world)
    throw Error("environment: rank " + std::to_string(e.rank) + " is outside world size " + std::to_string(e.world));
  return e;
}

// ---------------------------------------------------------------------------------------------------------------

struct Comm::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Store> hb_store;  // its own connection: the heartbeat never waits behind a collective
  std::thread heartbeat;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::atomic<int64_t> beats{0};
  std::mutex groups_mu;  // Comm::groups_ is read by the heartbeat
};

std::shared_ptr<Comm> Comm::init(const LaunchEnv& env, const Options& opts) {
  std::shared_ptr<Comm> c(new Comm());
  c->env_ = env;
  c->opts_ = opts;
  c->impl_ = std::make_unique<Impl>();
  c->world_group_.name_ = "world";
  c->world_group_.ranks_.resize(static_cast<size_t>(env.world));
  std::iota(c->world_group_.ranks_.begin(), c->world_group_.ranks_.end(), 0);
  c->world_group_.rank_ = env.rank;
  c->world_group_.comm_ = c.get();
#ifdef LF_HAVE_NCCL
  const bool nccl = opts.backend == "nccl";
#else
  const bool nccl = false;
  if (opts.backend == "nccl") throw Error("parallel backend 'nccl': this build has no CUDA (configure with -DLOONGFORGE_CUDA=ON)");
#endif
  if (opts.backend != "gloo" && opts.backend != "nccl" && opts.backend != "mpi")
    throw Error("parallel backend '" + opts.backend + "': unknown (gloo | nccl | mpi)");
  if (opts.backend == "mpi") require_mpi();
  if (env.world == 1 && !nccl) return c;  // one process on the CPU: every collective is the identity
  // MPI tells every rank where rank 0 is (and a free port for the store) when the backend is MPI, or when mpirun
  // spread the job over several nodes without MASTER_ADDR (any backend: MPI + NCCL).
  const bool mpi_boot = opts.backend == "mpi" || (env.launcher == "mpirun" && env.master_unknown && mpi_compiled());
  if (env.master_unknown && !mpi_boot)
    throw Error("environment: variable 'MASTER_ADDR': mpirun over several nodes needs MASTER_ADDR (rank 0's host) "
                "in a build without MPI");
  if (mpi_boot) {
    const std::string host = mpi_bootstrap(env.rank, env.world).master_host;
    if (env.master_unknown) c->env_.master_addr = host;  // else MASTER_ADDR, or the local job's loopback
  }
#ifdef LF_HAVE_NCCL
  if (nccl) {  // the local rank's GPU among those this process sees (one each when the launcher isolates them)
    const int gpus = std::max<int>(1, c10::cuda::device_count());
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(env.local_rank % gpus));
  }
#endif

  const std::string master = c->env_.master_addr;
  int port = env.master_port;
  try {
    c10d::TCPStoreOptions so;
    so.isServer = env.rank == 0;
    so.numWorkers = env.world;
    so.timeout = opts.timeout;
    if (mpi_boot && !env.master_port_set) {
      // rank 0 listens on a port the system picks and MPI tells the others: no port to agree on beforehand
      so.port = 0;
      so.waitWorkers = false;
      if (env.rank == 0) c->impl_->store = c10::make_intrusive<c10d::TCPStore>(master, so);
      port = mpi_broadcast_int(env.rank == 0 ? static_cast<c10d::TCPStore*>(c->impl_->store.get())->getPort() : 0);
      so.port = static_cast<uint16_t>(port);
      if (env.rank != 0) c->impl_->store = c10::make_intrusive<c10d::TCPStore>(master, so);
    } else {
      so.port = static_cast<uint16_t>(port);
      c->impl_->store = c10::make_intrusive<c10d::TCPStore>(master, so);
    }
    c10d::TCPStoreOptions ho = so;
    ho.isServer = false;
    ho.numWorkers = std::nullopt;
    ho.waitWorkers = false;
    c->impl_->hb_store = c10::make_intrusive<c10d::TCPStore>(master, ho);
  } catch (const lf::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(env.rank) + ": cannot reach the rendezvous store at " + master + ":" +
                std::to_string(port) + " (" + env.launcher + "): " + first_line(e.what()));
  }
  // Heartbeat: every 500 ms a counter and how many collectives each group has started ("beat|name=seq;...").
  Impl* impl = c->impl_.get();
  Comm* self = c.get();
  const std::string key = "lf/hb/" + std::to_string(env.rank);
  impl->heartbeat = std::thread([impl, self, key] {
    std::unique_lock<std::mutex> lock(impl->mu);
    while (!impl->stop) {
      std::string v = std::to_string(++impl->beats) + "|";
      {
        std::lock_guard<std::mutex> g(impl->groups_mu);
        v += self->world_group_.name_ + "=" + std::to_string(self->world_group_.sequence()) + ";";
        for (const auto& [ranks, grp] : self->groups_) v += grp->name_ + "=" + std::to_string(grp->sequence()) + ";";
      }
      try {
        impl->hb_store->set(key, v);
      } catch (...) {
        return;  // the store is gone (rank 0 exited): nothing left to report to
      }
      impl->cv.wait_for(lock, std::chrono::milliseconds(500), [impl] { return impl->stop; });
    }
  });
  Group* g = &c->world_group_;
  c->backends_.push_back(std::make_unique<c10::intrusive_ptr<c10d::Backend>>());
  g->backend_ = c->backends_.back().get();
  try {
    *g->backend_ = c->make_backend("lf/world", c->world_group_.ranks_, env.rank);
  } catch (const std::exception& e) {
    g->fail("connect", e);
  }
  return c;
}

c10::intrusive_ptr<c10d::Backend> Comm::make_backend(const std::string& prefix, const std::vector<int>& ranks,
                                                    int group_rank) const {
  if (opts_.backend == "mpi") return make_mpi_backend(ranks, group_rank);
  const int rank = group_rank, size = static_cast<int>(ranks.size());
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, impl_->store);
#ifdef LF_HAVE_NCCL
  if (opts_.backend == "nccl") {
    auto o = c10d::ProcessGroupNCCL::Options::create();
    // Our waits pass the timeout (a blocking wait that throws, which Group::fail turns into the error naming the
    // silent ranks); NCCL's watchdog, which aborts the process on its own timeout, comes a minute later.
    o->timeout = opts_.timeout + std::chrono::seconds(60);
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, o);
  }
#endif
  auto o = c10d::ProcessGroupGloo::Options::create(opts_.timeout);
  o->devices.push_back(gloo_device(env_));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, o);
}

Comm::~Comm() {
  if (!impl_) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
}

const Group& Comm::group(const std::vector<int>& ranks) const {
  if (ranks == world_group_.ranks_) return world_group_;
  auto it = groups_.find(ranks);
  if (it != groups_.end()) return *it->second;
  auto pos = std::find(ranks.begin(), ranks.end(), env_.rank);
  if (pos == ranks.end())
    throw Error("rank " + std::to_string(env_.rank) + " asked for group [" + join(ranks) + "] it is not part of");
  auto g = std::make_unique<Group>();
  g->name_ = "[" + join(ranks) + "]";
  g->ranks_ = ranks;
  g->rank_ = static_cast<int>(pos - ranks.begin());
  g->comm_ = this;
  if (ranks.size() > 1) {
    backends_.push_back(std::make_unique<c10::intrusive_ptr<c10d::Backend>>());
    g->backend_ = backends_.back().get();
    try {
      *g->backend_ = make_backend("lf/g/" + join(ranks, "_"), ranks, g->rank_);
    } catch (const std::exception& e) {
      g->fail("connect", e);
    }
  }
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  return *groups_.emplace(ranks, std::move(g)).first->second;
}

std::string Comm::diagnose(const Group& g) const {
  if (env_.world == 1 || !impl_->hb_store) return "";
  auto read = [&](std::vector<std::string>& out) {
    out.assign(static_cast<size_t>(env_.world), "");
    for (int r = 0; r < env_.world; ++r) {
      std::string k = "lf/hb/" + std::to_string(r);
      if (impl_->hb_store->check({k})) {
        auto v = impl_->hb_store->get(k);
        out[static_cast<size_t>(r)] = std::string(v.begin(), v.end());
      }
    }
  };
  std::vector<int> dead, behind;
  try {
    std::vector<std::string> a, b;
    read(a);
    std::this_thread::sleep_for(std::chrono::milliseconds(1600));
    read(b);
    const std::string tag = g.name() + "=";
    for (int r = 0; r < env_.world; ++r) {
      if (r == env_.rank) continue;
      const std::string& now = b[static_cast<size_t>(r)];
      if (now.substr(0, now.find('|')) == a[static_cast<size_t>(r)].substr(0, a[static_cast<size_t>(r)].find('|'))) {
        dead.push_back(r);
        continue;
      }
      if (std::find(g.ranks().begin(), g.ranks().end(), r) == g.ranks().end()) continue;
      auto pos = now.find("|" + tag) != std::string::npos ? now.find("|" + tag) + 1 : now.find(";" + tag) != std::string::npos ? now.find(";" + tag) + 1 : std::string::npos;
      int64_t seq = pos == std::string::npos ? 0 : std::atoll(now.c_str() + pos + tag.size());
      if (seq < g.sequence()) behind.push_back(r);
    }
  } catch (...) {
    return "rank 0 (the rendezvous store's host) is gone";
  }
  std::string out;
  if (!dead.empty()) out = "rank(s) " + join(dead) + " stopped answering (exited)";
  if (!behind.empty())
    out += (out.empty() ? "" : "; ") + std::string("rank(s) ") + join(behind) + " never reached collective #" +
           std::to_string(g.sequence()) + " on this group (hung or elsewhere)";
  return out.empty() ? "no rank found silent" : out;
}

// ---------------------------------------------------------------------------------------------------------------

void Group::fail(const char* op, const std::exception& e) const {
  std::string what = first_line(e.what());
  std::string who;
  if (comm_) who = comm_->diagnose(*this);
  throw Error("rank " + std::to_string(comm_ ? comm_->rank() : 0) + ": " + op + " on group " + name_ + " failed: " +
              who + "; " + what);
}

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
    throw Error("recipe: field 'parallel': layout " + desc + " needs " + std::to_string(prod) + " ranks but the job has " +
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

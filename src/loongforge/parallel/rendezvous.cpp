// The rendezvous half of the communication layer (parallel/comm.h): Comm::init (the TCP store, MPI's bootstrap of
// mpirun jobs, the engines of each group), the heartbeat every rank keeps in the store, and the diagnosis of a failed
// collective (which ranks exited, which never reached it) that Group::fail puts in its error. The collectives
// themselves are in comm.cpp, launch detection in launch.cpp.
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

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <thread>

#include "loongforge/core/error.h"
#include "loongforge/parallel/mpi_backend.h"

namespace lf::parallel {

namespace {

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

std::vector<std::string> available_backends() {
  std::vector<std::string> b{"gloo"};
#ifdef LF_HAVE_NCCL
  b.push_back("nccl");
#endif
  if (mpi_compiled()) b.push_back("mpi");
  return b;
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

}  // namespace lf::parallel

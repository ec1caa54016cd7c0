#include "loongforge/parallel/mpi_backend.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "loongforge/core/error.h"

#if defined(LF_HAVE_MPI) && LF_HAVE_MPI
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace lf::parallel {

namespace {

// Every MPI call of the process goes through this lock: correct whatever thread level the library grants, and the
// calls are short (nothing here blocks inside MPI except the bootstrap and communicator creation).
std::mutex& mpi_mutex() {
  static std::mutex m;
  return m;
}

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw std::runtime_error(std::string("MPI: ") + what + ": " + std::string(msg, static_cast<size_t>(len)));
}

void finalize_at_exit() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) MPI_Finalize();
}

void ensure_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) return;
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      throw OptionError("backend", "mpi, but MPI_Init_thread failed");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    std::atexit(finalize_at_exit);
  });
}

int count_of(int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX)
    throw std::runtime_error(std::string("MPI: ") + what + ": " + std::to_string(n) +
                             " elements do not fit MPI's int counts");
  return static_cast<int>(n);
}

// Data that only moves: a type of the element's width.
MPI_Datatype unit_type(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1: return MPI_UINT8_T;
    case 2: return MPI_UINT16_T;
    case 4: return MPI_UINT32_T;
    case 8: return MPI_UINT64_T;
    default: throw std::runtime_error("MPI: elements of " + std::to_string(t.element_size()) + " bytes");
  }
}

// 16-bit floats have no MPI type: they are reduced as float32 copies.
bool reduced_as_float(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

MPI_Datatype reduce_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    default: throw std::runtime_error(std::string("MPI: no reduction for ") + c10::toString(t.scalar_type()));
  }
}

MPI_Op reduce_op(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return MPI_SUM;
    case c10d::ReduceOp::MAX: return MPI_MAX;
    case c10d::ReduceOp::MIN: return MPI_MIN;
    case c10d::ReduceOp::PRODUCT: return MPI_PROD;
    case c10d::ReduceOp::BAND: return MPI_BAND;
    case c10d::ReduceOp::BOR: return MPI_BOR;
    case c10d::ReduceOp::BXOR: return MPI_BXOR;
    default: throw std::runtime_error("MPI: unsupported reduce op (sum, max, min, product, band, bor, bxor)");
  }
}

void check_tensor(const at::Tensor& t, const char* what) {
  if (!t.device().is_cpu() || !t.is_contiguous())
    throw std::runtime_error(std::string("MPI: ") + what + " needs a contiguous CPU tensor");
}

// Requests in flight, the tensors they read or write (kept alive until done) and what follows completion (copies
// out of float32 staging). wait() polls: MPI progresses its non-blocking operations inside MPI_Test.
class MpiWork : public c10d::Work {
 public:
  MpiWork(std::vector<MPI_Request> reqs, std::vector<at::Tensor> keep, std::function<void()> then,
          std::chrono::milliseconds timeout)
      : reqs_(std::move(reqs)), keep_(std::move(keep)), then_(std::move(then)), timeout_(timeout) {}
  ~MpiWork() override = default;

  bool isCompleted() override { return test(); }
  bool isSuccess() const override { return true; }

  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout <= std::chrono::milliseconds(0)) timeout = timeout_;
    const auto start = std::chrono::steady_clock::now();
    // Yield for the first 2 ms (several ranks may share a core), then sleep in growing steps up to 0.5 ms.
    std::chrono::microseconds nap(0);
    while (!test()) {
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited > timeout)
        throw std::runtime_error("MPI: operation timed out after " + std::to_string(timeout.count()) + " ms");
      if (waited < std::chrono::milliseconds(2)) {
        std::this_thread::yield();
      } else {
        nap = std::min(std::chrono::microseconds(500), nap + std::chrono::microseconds(20));
        std::this_thread::sleep_for(nap);
      }
    }
    return true;
  }

 private:
  bool test() {
    std::lock_guard<std::mutex> own(mu_);
    if (done_) return true;
    int flag = 0;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      check(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE), "test");
    }
    if (!flag) return false;
    done_ = true;
    if (then_) then_();
    keep_.clear();
    return true;
  }

  std::mutex mu_;
  std::vector<MPI_Request> reqs_;
  std::vector<at::Tensor> keep_;
  std::function<void()> then_;
  std::chrono::milliseconds timeout_;
  bool done_ = false;
};

class MpiBackend : public c10d::Backend {
 public:
  MpiBackend(MPI_Comm comm, int rank, int size) : c10d::Backend(rank, size), comm_(comm) {}
  ~MpiBackend() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && comm_ != MPI_COMM_NULL) {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      MPI_Comm_free(&comm_);
    }
  }
  const std::string getBackendName() const override { return "mpi"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    TORCH_CHECK(ts.size() == 1, "MPI backend: one tensor per all_reduce");
    at::Tensor t = ts[0];
    check_tensor(t, "all_reduce");
    at::Tensor buf = reduced_as_float(t) ? t.to(at::kFloat) : t;
    MPI_Request req;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      check(MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), count_of(buf.numel(), "all_reduce"), reduce_type(buf),
                           reduce_op(o.reduceOp), comm_, &req),
            "all_reduce");
    }
    std::function<void()> then;
    if (!buf.is_same(t)) then = [t, buf]() mutable { t.copy_(buf); };
    return work({req}, {t, buf}, std::move(then), o.timeout);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    check_tensor(out, "all_gather");
    check_tensor(in, "all_gather");
    TORCH_CHECK(out.numel() == in.numel() * getSize() && out.scalar_type() == in.scalar_type(),
                "MPI backend: all_gather shapes");
    const int n = count_of(in.numel(), "all_gather");
    MPI_Request req;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      check(MPI_Iallgather(in.data_ptr(), n, unit_type(in), out.data_ptr(), n, unit_type(out), comm_, &req),
            "all_gather");
    }
    return work({req}, {out, in}, nullptr, o.timeout);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                     const c10d::ReduceScatterOptions& o) override {
    check_tensor(out, "reduce_scatter");
    check_tensor(in, "reduce_scatter");
    TORCH_CHECK(in.numel() == out.numel() * getSize() && out.scalar_type() == in.scalar_type(),
                "MPI backend: reduce_scatter shapes");
    const bool f = reduced_as_float(in);
    at::Tensor bi = f ? in.to(at::kFloat) : in, bo = f ? at::empty(out.sizes(), out.options().dtype(at::kFloat)) : out;
    MPI_Request req;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      check(MPI_Ireduce_scatter_block(bi.data_ptr(), bo.data_ptr(), count_of(bo.numel(), "reduce_scatter"),
                                      reduce_type(bi), reduce_op(o.reduceOp), comm_, &req),
            "reduce_scatter");
    }
    std::function<void()> then;
    if (f) then = [out, bo]() mutable { out.copy_(bo); };
    return work({req}, {out, in, bi, bo}, std::move(then), o.timeout);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_rows,
                                               std::vector<int64_t>& in_rows, const c10d::AllToAllOptions& o) override {
    check_tensor(out, "all_to_all");
    check_tensor(in, "all_to_all");
    const int p = getSize();
    int64_t row = 1;
    for (int64_t i = 1; i < in.dim(); ++i) row *= in.size(i);
    auto layout = [&](const std::vector<int64_t>& rows, int64_t total, std::vector<int>& counts,
                      std::vector<int>& displs) {
      counts.assign(static_cast<size_t>(p), 0);
      displs.assign(static_cast<size_t>(p), 0);
      int64_t off = 0;
      for (int j = 0; j < p; ++j) {
        const int64_t r = rows.empty() ? total / p : rows[static_cast<size_t>(j)];
        counts[static_cast<size_t>(j)] = count_of(r * row, "all_to_all");
        displs[static_cast<size_t>(j)] = count_of(off * row, "all_to_all");
        off += r;
      }
      TORCH_CHECK(off == total, "MPI backend: all_to_all split sizes add up to ", off, ", not ", total);
    };
    std::vector<int> sc, sd, rc, rd;
    layout(in_rows, in.dim() ? in.size(0) : 0, sc, sd);
    layout(out_rows, out.dim() ? out.size(0) : 0, rc, rd);
    MPI_Request req;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      check(MPI_Ialltoallv(in.data_ptr(), sc.data(), sd.data(), unit_type(in), out.data_ptr(), rc.data(), rd.data(),
                           unit_type(out), comm_, &req),
            "all_to_all");
    }
    return work({req}, {out, in}, nullptr, o.timeout);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    TORCH_CHECK(ts.size() == 1, "MPI backend: one tensor per broadcast");
    at::Tensor t = ts[0];
    check_tensor(t, "broadcast");
    MPI_Request req;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      check(MPI_Ibcast(t.data_ptr(), count_of(t.numel(), "broadcast"), unit_type(t), static_cast<int>(o.rootRank),
                       comm_, &req),
            "broadcast");
    }
    return work({req}, {t}, nullptr, o.timeout);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    return p2p(ts, dst, tag, true);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    return p2p(ts, src, tag, false);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    MPI_Request req;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      check(MPI_Ibarrier(comm_, &req), "barrier");
    }
    return work({req}, {}, nullptr, o.timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Work> p2p(std::vector<at::Tensor>& ts, int peer, int tag, bool is_send) {
    TORCH_CHECK(ts.size() == 1, "MPI backend: one tensor per send/recv");
    at::Tensor t = ts[0];
    check_tensor(t, is_send ? "send" : "recv");
    const int n = count_of(t.numel(), is_send ? "send" : "recv");
    MPI_Request req;
    {
      std::lock_guard<std::mutex> lock(mpi_mutex());
      if (is_send)
        check(MPI_Isend(t.data_ptr(), n, unit_type(t), peer, tag, comm_, &req), "send");
      else
        check(MPI_Irecv(t.data_ptr(), n, unit_type(t), peer, tag, comm_, &req), "recv");
    }
    return work({req}, {t}, nullptr, std::chrono::milliseconds(0));
  }

  c10::intrusive_ptr<c10d::Work> work(std::vector<MPI_Request> reqs, std::vector<at::Tensor> keep,
                                      std::function<void()> then, std::chrono::milliseconds timeout) {
    // Group passes its timeout to wait(); a work waited for without one uses the backend's default.
    if (timeout <= std::chrono::milliseconds(0)) timeout = std::chrono::minutes(30);
    return c10::make_intrusive<MpiWork>(std::move(reqs), std::move(keep), std::move(then), timeout);
  }

  MPI_Comm comm_;
};

}  // namespace

bool mpi_compiled() { return true; }
void require_mpi() {}

MpiBootstrap mpi_bootstrap(int rank, int world) {
  ensure_init();
  std::lock_guard<std::mutex> lock(mpi_mutex());
  int r = 0, w = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  if (r != rank || w != world)
    throw OptionError("backend", "mpi, but MPI sees rank " + std::to_string(r) + " of " +
                std::to_string(w) + " where the launcher says rank " + std::to_string(rank) + " of " +
                std::to_string(world) + " (start the job with mpirun, or srun with an MPI plugin)");
  char host[256] = {0};
  if (rank == 0 && gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "127.0.0.1");
  check(MPI_Bcast(host, sizeof(host), MPI_CHAR, 0, MPI_COMM_WORLD), "bootstrap");
  host[sizeof(host) - 1] = 0;
  return MpiBootstrap{host};
}

int mpi_broadcast_int(int value) {
  ensure_init();
  std::lock_guard<std::mutex> lock(mpi_mutex());
  check(MPI_Bcast(&value, 1, MPI_INT, 0, MPI_COMM_WORLD), "bootstrap");
  return value;
}

c10::intrusive_ptr<c10d::Backend> make_mpi_backend(const std::vector<int>& ranks, int group_rank) {
  ensure_init();
  std::lock_guard<std::mutex> lock(mpi_mutex());
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  bool all = static_cast<int>(ranks.size()) == world;
  for (size_t i = 0; all && i < ranks.size(); ++i) all = ranks[i] == static_cast<int>(i);
  MPI_Comm comm = MPI_COMM_NULL;
  if (all) {
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "create the world communicator");
  } else {
    MPI_Group wg, g;
    check(MPI_Comm_group(MPI_COMM_WORLD, &wg), "create a group");
    check(MPI_Group_incl(wg, static_cast<int>(ranks.size()), ranks.data(), &g), "create a group");
    // Members create their groups in the same order; the tag only keeps concurrent creations apart.
    int tag = 0;
    for (int x : ranks) tag = (tag * 31 + x + 1) % 32749;
    check(MPI_Comm_create_group(MPI_COMM_WORLD, g, tag, &comm), "create a group");
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
  }
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int r = -1;
  MPI_Comm_rank(comm, &r);
  if (r != group_rank) throw std::runtime_error("MPI: group rank " + std::to_string(r) + ", expected " + std::to_string(group_rank));
  return c10::make_intrusive<MpiBackend>(comm, group_rank, static_cast<int>(ranks.size()));
}

void abort_mpi_job(int code) {
  int inited = 0, fin = 0, world = 1;
  MPI_Initialized(&inited);
  if (!inited) return;
  MPI_Finalized(&fin);
  if (fin) return;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world <= 1) return;
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
}

}  // namespace lf::parallel

#else  // no MPI in this build

namespace lf::parallel {

bool mpi_compiled() { return false; }
void require_mpi() {
  throw OptionError("backend", "mpi, but this build has no MPI (install libopenmpi-dev and "
              "reconfigure with -DLOONGFORGE_MPI=ON)");
}
MpiBootstrap mpi_bootstrap(int, int) { require_mpi(); return {}; }
int mpi_broadcast_int(int) { require_mpi(); return 0; }
c10::intrusive_ptr<c10d::Backend> make_mpi_backend(const std::vector<int>&, int) { require_mpi(); return {}; }
void abort_mpi_job(int) {}

}  // namespace lf::parallel

#endif

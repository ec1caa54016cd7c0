// The communication layer. Launcher parsing runs in one process; the collectives run as a hook in several
// processes (tests/python/test_dist_comm.py starts them with torchrun-style variables and LF_DIST_HOOK=1).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "loongforge/core/error.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/functional.h"

using namespace lf::parallel;

TEST(Launch, ReadsTorchrunMpirunAndSlurmVariables) {
  auto t = detect_launch({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.2"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(t.launcher, "torchrun");
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.world, 4);
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.master_addr, "10.0.0.2");
  EXPECT_EQ(t.master_port, 1234);
  auto m = detect_launch({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}, {"PATH", "/bin"}});
  EXPECT_EQ(m.launcher, "mpirun");
  EXPECT_EQ(m.rank, 2);
  EXPECT_EQ(m.world, 8);
  EXPECT_EQ(m.master_addr, "127.0.0.1");
  EXPECT_FALSE(m.master_unknown);
  EXPECT_FALSE(m.master_port_set);
  // mpirun over two nodes without MASTER_ADDR: only MPI can tell where rank 0 is (Comm::init asks it)
  EXPECT_TRUE(detect_launch({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}).master_unknown);
  EXPECT_TRUE(detect_launch({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"MASTER_PORT", "29400"},
                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}).master_port_set);
  auto s = detect_launch({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                          {"SLURM_STEP_NODELIST", "gpu[07-08,11],cpu1"}});
  EXPECT_EQ(s.launcher, "srun");
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world, 16);
  EXPECT_EQ(s.master_addr, "gpu07");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("a[3],b[1-2]"), "a3");
  auto none = detect_launch({{"HOME", "/root"}});
  EXPECT_EQ(none.world, 1);
  EXPECT_THROW(detect_launch({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), lf::Error);
  EXPECT_THROW(detect_launch({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), lf::Error);
}

TEST(Mesh, SingleProcessGroupsAreIdentities) {
  auto comm = Comm::init(detect_launch({{"HOME", "/"}}), {});
  Mesh mesh(comm, {{"pp", 1}, {"dp", 1}, {"tp", 1}});
  at::Tensor x = at::randn({4, 6});
  at::Tensor y = x.clone();
  mesh.group("dp").all_reduce(y);
  EXPECT_TRUE(at::equal(x, y));
  EXPECT_TRUE(at::equal(mesh.group_over({"dp", "tp"}).all_gather(x, 1), x));
  EXPECT_THROW(Mesh(comm, {{"dp", 2}}), lf::Error);
}

namespace {
// The hooks' backend: gloo, or LF_DIST_HOOK_BACKEND (mpi when tests/python/test_dist_comm.py starts them by mpirun).
Comm::Options hook_options(int timeout_ms = 300000) {
  Comm::Options o;
  if (const char* b = std::getenv("LF_DIST_HOOK_BACKEND")) o.backend = b;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  return o;
}

// Every rank's data is a function of its rank, so each rank can compute the expected results alone.
at::Tensor data_of(int rank, std::vector<int64_t> shape) {
  at::manual_seed(1000 + rank);
  return at::randn(shape, at::kDouble);
}
}  // namespace

TEST(DistHook, Collectives) {
  if (!std::getenv("LF_DIST_HOOK")) GTEST_SKIP() << "run by tests/python/test_dist_comm.py";
  auto comm = Comm::init(detect_launch(), hook_options());
  const int n = comm->world(), r = comm->rank();
  ASSERT_EQ(n, 4);
  Mesh mesh(comm, {{"a", 2}, {"b", 2}});
  const Group& w = comm->world_group();
  std::vector<at::Tensor> all;
  for (int i = 0; i < n; ++i) all.push_back(data_of(i, {8, 3}));
  at::Tensor sum = at::stack(all).sum(0);

  at::Tensor x = all[static_cast<size_t>(r)].clone();
  w.all_reduce(x);
  EXPECT_TRUE(at::allclose(x, sum));
  x = all[static_cast<size_t>(r)].clone();
  w.all_reduce(x, Reduce::Max);
  EXPECT_TRUE(at::equal(x, std::get<0>(at::stack(all).max(0))));
  EXPECT_TRUE(at::equal(w.all_gather(all[static_cast<size_t>(r)], 1), at::cat(all, 1)));
  // other dtypes: bf16 sums (exact small integers), int64 max, float32 min
  at::Tensor hb = at::full({5}, r + 1, at::kBFloat16);
  w.all_reduce(hb);
  EXPECT_TRUE(at::equal(hb, at::full({5}, n * (n + 1) / 2, at::kBFloat16)));
  at::Tensor li = at::arange(3, at::kLong) * (r + 1);
  w.all_reduce(li, Reduce::Max);
  EXPECT_TRUE(at::equal(li, at::arange(3, at::kLong) * n));
  at::Tensor fm = all[static_cast<size_t>(r)].to(at::kFloat);
  w.all_reduce(fm, Reduce::Min);
  EXPECT_TRUE(at::equal(fm, std::get<0>(at::stack(all).min(0)).to(at::kFloat)));
  at::Tensor rsb = w.reduce_scatter(at::full({n * 2}, r + 1, at::kBFloat16), 0);
  EXPECT_TRUE(at::equal(rsb, at::full({2}, n * (n + 1) / 2, at::kBFloat16)));
  EXPECT_TRUE(at::allclose(w.reduce_scatter(all[static_cast<size_t>(r)], 0), sum.chunk(n, 0)[static_cast<size_t>(r)]));
  EXPECT_TRUE(at::allclose(w.reduce_scatter(all[static_cast<size_t>(r)].t().contiguous(), 1), sum.t().chunk(n, 1)[static_cast<size_t>(r)]));
  // all_to_all: rank i's rows 2j..2j+1 go to rank j
  std::vector<at::Tensor> expect;
  for (int i = 0; i < n; ++i) expect.push_back(all[static_cast<size_t>(i)].chunk(n, 0)[static_cast<size_t>(r)]);
  EXPECT_TRUE(at::equal(w.all_to_all(all[static_cast<size_t>(r)]), at::cat(expect, 0)));
  // uneven: rank i sends i+j+1 rows to rank j (rows of a [32, 3] tensor from the start)
  {
    std::vector<int64_t> sc, rc;
    for (int j = 0; j < n; ++j) { sc.push_back(r + j + 1); rc.push_back(j + r + 1); }
    at::Tensor mine = data_of(r, {32, 3});
    int64_t total = 0;
    for (auto c : sc) total += c;
    at::Tensor got = w.all_to_all_v(mine.narrow(0, 0, total), sc, rc);
    std::vector<at::Tensor> parts;
    for (int i = 0; i < n; ++i) {
      int64_t off = 0;
      for (int j = 0; j < r; ++j) off += i + j + 1;
      parts.push_back(data_of(i, {32, 3}).narrow(0, off, i + r + 1));
    }
    EXPECT_TRUE(at::equal(got, at::cat(parts, 0)));
  }
  at::Tensor b = r == 2 ? all[2].clone() : at::zeros({8, 3}, at::kDouble);
  w.broadcast(b, 2);
  EXPECT_TRUE(at::equal(b, all[2]));
  // ring send/recv
  at::Tensor got = at::empty({8, 3}, at::kDouble);
  if (r % 2 == 0) {
    w.send(all[static_cast<size_t>(r)], (r + 1) % n);
    w.recv(got, (r + n - 1) % n);
  } else {
    w.recv(got, (r + n - 1) % n);
    w.send(all[static_cast<size_t>(r)], (r + 1) % n);
  }
  EXPECT_TRUE(at::equal(got, all[static_cast<size_t>((r + n - 1) % n)]));
  // asynchronous: everyone sends first, then receives (blocking sends would deadlock if unbuffered)
  {
    at::Tensor in = at::empty({8, 3}, at::kDouble);
    Pending s1 = w.isend(all[static_cast<size_t>(r)], (r + 1) % n, 7);
    Pending r1 = w.irecv(in, (r + n - 1) % n, 7);
    at::Tensor sum_async = all[static_cast<size_t>(r)].clone();
    Pending ar = w.all_reduce_async(sum_async, Reduce::Avg);
    r1.wait();
    s1.wait();
    ar.wait();
    EXPECT_TRUE(at::equal(in, all[static_cast<size_t>((r + n - 1) % n)]));
    EXPECT_TRUE(at::allclose(sum_async, sum / n));
    at::Tensor gathered = at::empty({32, 3}, at::kDouble), scattered = at::empty({2, 3}, at::kDouble);
    w.all_gather_async(gathered, all[static_cast<size_t>(r)]).wait();
    EXPECT_TRUE(at::equal(gathered, at::cat(all, 0)));
    w.reduce_scatter_async(scattered, all[static_cast<size_t>(r)]).wait();
    EXPECT_TRUE(at::allclose(scattered, sum.chunk(n, 0)[static_cast<size_t>(r)]));
  }
  // mesh groups: "b" varies fastest
  const Group& gb = mesh.group("b");
  EXPECT_EQ(gb.ranks(), (std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}));
  const Group& ga = mesh.group("a");
  EXPECT_EQ(ga.ranks(), (std::vector<int>{r % 2, r % 2 + 2}));
  x = all[static_cast<size_t>(r)].clone();
  ga.all_reduce(x);
  EXPECT_TRUE(at::allclose(x, all[static_cast<size_t>(r % 2)] + all[static_cast<size_t>(r % 2 + 2)]));
  EXPECT_EQ(mesh.group_over({"a", "b"}).size(), 4);

  // Differentiable collectives: compare gradients with the same computation done on one process.
  // f = sum_k w_k * gather(x_k) over ranks, checked against the analytic gradients.
  at::Tensor xi = all[static_cast<size_t>(r)].clone().requires_grad_(true);
  at::Tensor wgt = data_of(100, {32, 3});  // same on all ranks
  at::Tensor loss = (lf::parallel::gather_rs(xi, w, 0) * wgt).sum();
  loss.backward();
  // d/dx_r of sum over ranks' losses = n * wgt[r-th block]; gather_rs reduce-scatters the n identical grads
  EXPECT_TRUE(at::allclose(xi.grad(), n * wgt.chunk(n, 0)[static_cast<size_t>(r)]));
  at::Tensor xj = all[static_cast<size_t>(r)].clone().requires_grad_(true);
  at::Tensor l2 = (lf::parallel::reduce_scatter(xj, w, 0) * wgt.narrow(0, 0, 2)).sum();
  l2.backward();
  // every rank's x contributes to every rank's part: grad = all-gather of the weights each rank used
  EXPECT_TRUE(at::allclose(xj.grad(), wgt.narrow(0, 0, 2).repeat({n, 1})));
  at::Tensor xk = all[static_cast<size_t>(r)].clone().requires_grad_(true);
  at::Tensor y = lf::parallel::all_to_all(xk.view({2, 4, 3}), w, 1, 0);  // [8, 1, 3]
  (y * wgt.narrow(0, 0, 8).view({8, 1, 3})).sum().backward();
  // x_r[a, c] lands on rank c at row 2r+a of y, where every rank weighs it by wgt[2r+a]
  at::Tensor gexp = wgt.narrow(0, 2 * r, 2).unsqueeze(1).expand({2, 4, 3}).reshape({8, 3});
  EXPECT_TRUE(at::allclose(xk.grad(), gexp));
  at::Tensor xc = all[static_cast<size_t>(r)].clone().requires_grad_(true);
  (lf::parallel::copy_to(xc, w) * wgt.narrow(0, 0, 8)).sum().backward();
  EXPECT_TRUE(at::allclose(xc.grad(), n * wgt.narrow(0, 0, 8)));
  w.barrier();
}

TEST(DistHook, PeerExitIsAnErrorNamingTheRank) {
  if (!std::getenv("LF_DIST_HOOK_EXIT")) GTEST_SKIP() << "run by tests/python/test_dist_comm.py";
  auto comm = Comm::init(detect_launch(), hook_options(std::atoi(std::getenv("LF_DIST_HOOK_EXIT"))));
  const Group& w = comm->world_group();
  at::Tensor x = at::ones({4});
  w.all_reduce(x);
  if (comm->rank() == 1) std::_Exit(3);  // dies without a word
  try {
    w.all_reduce(x);
    FAIL() << "all_reduce with a dead peer returned";
  } catch (const lf::Error& e) {
    std::string msg = e.what();
    std::fprintf(stderr, "ERROR: %s\n", msg.c_str());
    EXPECT_NE(msg.find("rank(s) 1 stopped answering"), std::string::npos) << msg;
  }
}

TEST(DistHook, HungPeerIsNamedAfterTheTimeout) {
  if (!std::getenv("LF_DIST_HOOK_HANG")) GTEST_SKIP() << "run by tests/python/test_dist_comm.py";
  auto comm = Comm::init(detect_launch(), hook_options(std::atoi(std::getenv("LF_DIST_HOOK_HANG"))));
  const Group& w = comm->world_group();
  at::Tensor x = at::ones({4});
  w.all_reduce(x);
  if (comm->rank() == 1) {  // alive (its heartbeat goes on) but stuck: never joins the next collective
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(0);
  }
  auto t0 = std::chrono::steady_clock::now();
  try {
    w.all_reduce(x);
    FAIL() << "all_reduce with a hung peer returned";
  } catch (const lf::Error& e) {
    std::string msg = e.what();
    std::fprintf(stderr, "ERROR: %s\n", msg.c_str());
    EXPECT_NE(msg.find("rank(s) 1 never reached collective #2"), std::string::npos) << msg;
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 9.0);  // the timeout (3 s) plus the diagnosis, well before the peer wakes up
  }
  // Rank 0 hosts the rendezvous store the others read while diagnosing: it stays until they are done (otherwise
  // a slower rank reports "rank 0 is gone" instead of naming the hung rank).
  if (comm->rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(3));
}

// The NCCL path at world size 1 (one GPU cannot host several NCCL ranks); bench/gpu_check.sh runs it.
TEST(DistGpu, NcclWorldOne) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  Comm::Options o;
  o.backend = "nccl";
  o.timeout = std::chrono::milliseconds(60000);
  const char* port = std::getenv("MASTER_PORT");
  auto comm = Comm::init(detect_launch({{"MASTER_PORT", port ? port : "29631"}, {"HOME", "/"}}), o);
  const Group& w = comm->world_group();
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  at::Tensor x = at::arange(8, opts);
  at::Tensor y = x.clone();
  w.all_reduce(y);
  EXPECT_TRUE(at::equal(y.cpu(), x.cpu()));
  EXPECT_TRUE(at::equal(w.all_gather(x, 0).cpu(), x.cpu()));
  EXPECT_TRUE(at::equal(w.reduce_scatter(x, 0).cpu(), x.cpu()));
  at::Tensor b = x.clone();
  w.broadcast(b, 0);
  EXPECT_TRUE(at::equal(b.cpu(), x.cpu()));
  at::Tensor out = at::empty({8}, opts);
  w.all_gather_async(out, x).wait();
  EXPECT_TRUE(at::equal(out.cpu(), x.cpu()));
  w.barrier();
}

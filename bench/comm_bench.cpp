// Collectives on the CPU: the communication layer over Gloo (what PyTorch's CPU process groups use) and over Open MPI
// (parallel.backend: mpi), in the same job, on the same tensors. Rank 0 prints a table: median time per operation,
// bus bandwidth and MPI's speed-up over Gloo.
//
//   mpirun -np 4 --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -x MASTER_PORT=29650 \
//       build/loongforge_bench_comm [--max-mb 16] [--out FILE.md]
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "loongforge/parallel/comm.h"

using namespace lf::parallel;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds of `op` over repetitions (at least 5, up to 0.4 s of them), after 2 warm-up runs; every rank
// starts each repetition together (barrier) and the slowest rank's time counts (max all-reduce).
double time_op(const Group& w, const std::function<void()>& op) {
  for (int i = 0; i < 2; ++i) op();
  std::vector<double> ts;
  double spent = 0;
  while (ts.size() < 5 || (spent < 0.4 && ts.size() < 200)) {
    w.barrier();
    auto t0 = std::chrono::steady_clock::now();
    op();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    at::Tensor m = at::full({1}, dt, at::kDouble);
    w.all_reduce(m, Reduce::Max);
    ts.push_back(m.item<double>());
    spent += ts.back();
    // every rank must agree on when to stop
    at::Tensor s = at::full({1}, spent, at::kDouble);
    w.broadcast(s, 0);
    spent = s.item<double>();
  }
  return median(ts);
}

struct Row {
  std::string op;
  int64_t bytes;
  double gloo_s = 0, mpi_s = 0;
  double bus_factor;  // bus bandwidth = bytes * factor / time (NCCL's convention)
};

}  // namespace

int main(int argc, char** argv) {
  int64_t max_mb = 16;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--max-mb") && i + 1 < argc) max_mb = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[++i];
  }
  const LaunchEnv env = detect_launch();
  std::map<std::string, std::shared_ptr<Comm>> comms;
  for (const char* b : {"gloo", "mpi"}) {
    Comm::Options o;
    o.backend = b;
    LaunchEnv e = env;
    if (!std::strcmp(b, "mpi")) e.master_port_set = false;  // Gloo's store on MASTER_PORT; MPI picks a free port
    comms[b] = Comm::init(e, o);
  }
  const int n = env.world, r = env.rank;
  if (n < 2) {
    std::fprintf(stderr, "loongforge_bench_comm: start it with mpirun -np N (N >= 2)\n");
    return 1;
  }
  std::vector<Row> rows;
  for (int64_t bytes = 4096; bytes <= max_mb * (1 << 20); bytes *= 8) {
    const int64_t elems = bytes / 4 / n * n;  // float32, divisible by the world
    at::Tensor x = at::randn({elems});
    at::Tensor part = at::empty({elems / n});
    at::Tensor full = at::empty({elems});
    at::Tensor recv = at::empty({elems});
    const double f = static_cast<double>(n - 1) / n;
    std::vector<Row> here = {{"all_reduce", bytes, 0, 0, 2 * f}, {"all_gather", bytes, 0, 0, f},
                             {"reduce_scatter", bytes, 0, 0, f}, {"all_to_all", bytes, 0, 0, f},
                             {"ring send/recv", bytes, 0, 0, 1.0}};
    for (auto& [name, comm] : comms) {
      const Group& w = comm->world_group();
      std::vector<std::function<void()>> ops = {
          [&] { at::Tensor y = x.clone(); w.all_reduce(y); },
          [&] { w.all_gather_async(full, part).wait(); },
          [&] { w.reduce_scatter_async(part, x).wait(); },
          [&] { (void)w.all_to_all(x); },
          [&] {
            w.batch_p2p({P2POp{true, x, (r + 1) % n}, P2POp{false, recv, (r + n - 1) % n}}).wait();
          },
      };
      for (size_t i = 0; i < ops.size(); ++i) {
        double t = time_op(w, ops[i]);
        (name == "gloo" ? here[i].gloo_s : here[i].mpi_s) = t;
      }
    }
    rows.insert(rows.end(), here.begin(), here.end());
  }
  if (r == 0) {
    std::string t = "CPU collectives, " + std::to_string(n) + " ranks on one machine, float32, median per operation ("
                    "the slowest rank's time); bus bandwidth as NCCL counts it\n\n"
                    "| operation | size | Gloo | MPI | Gloo GB/s | MPI GB/s | MPI speed-up |\n|---|---|---|---|---|---|---|\n";
    char line[256];
    for (const Row& w : rows) {
      auto fmt_t = [](double s) {
        char b[32];
        if (s < 1e-3) std::snprintf(b, sizeof(b), "%.0f us", s * 1e6);
        else std::snprintf(b, sizeof(b), "%.2f ms", s * 1e3);
        return std::string(b);
      };
      const std::string size = w.bytes >= (1 << 20) ? std::to_string(w.bytes >> 20) + " MB" : std::to_string(w.bytes >> 10) + " KB";
      std::snprintf(line, sizeof(line), "| %s | %s | %s | %s | %.2f | %.2f | %.2fx |\n", w.op.c_str(), size.c_str(),
                    fmt_t(w.gloo_s).c_str(), fmt_t(w.mpi_s).c_str(), w.bytes * w.bus_factor / w.gloo_s / 1e9,
                    w.bytes * w.bus_factor / w.mpi_s / 1e9, w.gloo_s / w.mpi_s);
      t += line;
    }
    std::fputs(t.c_str(), stdout);
    if (!out_path.empty()) std::ofstream(out_path) << t;
  }
  return 0;
}

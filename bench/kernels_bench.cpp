// Our fused CPU kernels against their composite ATen versions (Google Benchmark). Run with
//   OMP_NUM_THREADS=2 build/loongforge_bench_kernels
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/rms_norm.h"

namespace {

template <bool Fused>
void BM_RMSNorm(benchmark::State& st) {
  at::Tensor x = at::randn({st.range(0), st.range(1)}).requires_grad_(), w = at::ones({st.range(1)}).requires_grad_();
  at::Tensor dy = at::randn({st.range(0), st.range(1)});
  for (auto _ : st) {
    at::Tensor y = Fused ? lf::kernels::rms_norm(x, w, 1e-6) : lf::kernels::rms_norm_reference(x, w, 1e-6);
    auto g = torch::autograd::grad({y}, {x, w}, {dy});
    benchmark::DoNotOptimize(g[0].data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_RMSNorm, true)->Args({2048, 512})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_RMSNorm, false)->Args({2048, 512})->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();

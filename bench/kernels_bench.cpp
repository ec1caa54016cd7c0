// Our fused CPU kernels against their composite ATen versions (Google Benchmark). Run with
//   OMP_NUM_THREADS=2 build/loongforge_bench_kernels
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/linear_ce.h"
#include "loongforge/kernels/rms_norm.h"
#include "loongforge/kernels/swiglu.h"

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

// SwiGLU on [rows, ffn] (the MLP of the small bench shape: 2048 tokens x 688; the larger: 2048 x 1376).
template <bool Fused>
void BM_SwiGLU(benchmark::State& st) {
  at::Tensor g = at::randn({st.range(0), st.range(1)}).requires_grad_(), u = at::randn({st.range(0), st.range(1)}).requires_grad_();
  at::Tensor dy = at::randn({st.range(0), st.range(1)});
  for (auto _ : st) {
    at::Tensor y = Fused ? lf::kernels::swiglu(g, u) : lf::kernels::swiglu_reference(g, u);
    auto gr = torch::autograd::grad({y}, {g, u}, {dy});
    benchmark::DoNotOptimize(gr[0].data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_SwiGLU, true)->Args({2048, 688})->Args({2048, 1376})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_SwiGLU, false)->Args({2048, 688})->Args({2048, 1376})->Unit(benchmark::kMicrosecond)->UseRealTime();

// Linear + cross-entropy, forward + backward: N tokens, hidden H, vocabulary V; range(3) = chunk rows (0: default).
// The composite version is what the trainer did before: logits = x W^T, cross_entropy_loss(sum).
template <bool Fused>
void BM_LinearCE(benchmark::State& st) {
  const int64_t n = st.range(0), h = st.range(1), v = st.range(2);
  at::Tensor x = at::randn({n, h}).requires_grad_(), w = (at::randn({v, h}) * 0.05).requires_grad_();
  at::Tensor t = at::randint(0, v, {n}, at::kLong);
  for (auto _ : st) {
    at::Tensor loss = Fused ? std::get<0>(lf::kernels::linear_cross_entropy(x, w, t, -100, st.range(3)))
                            : std::get<0>(lf::kernels::linear_cross_entropy_reference(x, w, t));
    auto gr = torch::autograd::grad({loss}, {x, w});
    benchmark::DoNotOptimize(gr[0].data_ptr());
  }
}
BENCHMARK_TEMPLATE(BM_LinearCE, true)
    ->Args({2048, 256, 8192, 0})->Args({2048, 256, 8192, 512})->Args({2048, 256, 8192, 1024})
    ->Args({2048, 512, 16384, 0})->Args({2048, 512, 16384, 512})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LinearCE, false)
    ->Args({2048, 256, 8192, 0})->Args({2048, 512, 16384, 0})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();

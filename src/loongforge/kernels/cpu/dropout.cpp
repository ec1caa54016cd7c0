// kernels/dropout.h: inverted dropout from a counter-based hash.
#include "loongforge/kernels/dropout.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <mutex>

namespace lf::kernels {

namespace {

// SplitMix64's finaliser of seed + (j + 1) * golden: 64 well-mixed bits for element pair j.
inline __attribute__((always_inline)) uint64_t mix(uint64_t seed, uint64_t j) {
  uint64_t z = seed + (j + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// y[i] = x[i] * scale where the hash keeps element i (its 32 bits below `keep`), else 0, for the element pairs
// [jb, je) (elements 2 jb .. 2 je - 1, the last pair possibly half: n).
template <typename T>
inline __attribute__((always_inline)) void apply_body(const T* x, T* y, int64_t n, int64_t jb, int64_t je, uint64_t seed,
                                                      uint64_t keep, T scale) {
  const int64_t full = std::min(je, n / 2);
#pragma omp simd
  for (int64_t j = jb; j < full; ++j) {
    const uint64_t h = mix(seed, static_cast<uint64_t>(j));
    y[2 * j] = (h & 0xFFFFFFFFull) < keep ? x[2 * j] * scale : T(0);
    y[2 * j + 1] = (h >> 32) < keep ? x[2 * j + 1] * scale : T(0);
  }
  if (je > full && 2 * full < n) {  // the odd last element
    const uint64_t h = mix(seed, static_cast<uint64_t>(full));
    y[2 * full] = (h & 0xFFFFFFFFull) < keep ? x[2 * full] * scale : T(0);
  }
}

template <typename T>
void apply_generic(const T* x, T* y, int64_t n, int64_t jb, int64_t je, uint64_t seed, uint64_t keep, T scale) {
  apply_body(x, y, n, jb, je, seed, keep, scale);
}

#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx512f,avx512dq,avx512vl"))) void apply_avx512(const T* x, T* y, int64_t n, int64_t jb, int64_t je,
                                                                       uint64_t seed, uint64_t keep, T scale) {
  apply_body(x, y, n, jb, je, seed, keep, scale);
}
bool has_avx512dq() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return yes;
}
#endif

template <typename T>
void apply(const T* x, T* y, int64_t n, uint64_t seed, double p) {
  // keep when the 32-bit draw u < (1 - p) 2^32: probability 1 - p (to 2^-32)
  const uint64_t keep = static_cast<uint64_t>(std::llround((1.0 - p) * 4294967296.0));
  const T scale = static_cast<T>(1.0 / (1.0 - p));
  at::parallel_for(0, (n + 1) / 2, 8192, [&](int64_t jb, int64_t je) {
#if defined(__x86_64__)
    if (has_avx512dq()) return apply_avx512(x, y, n, jb, je, seed, keep, scale);
#endif
    apply_generic(x, y, n, jb, je, seed, keep, scale);
  });
}

uint64_t draw_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}

class DropoutFunction : public torch::autograd::Function<DropoutFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double p) {
    const uint64_t seed = draw_seed();
    ctx->saved_data["seed"] = static_cast<int64_t>(seed);
    ctx->saved_data["p"] = p;
    return dropout_cpu(x, p, seed);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    const auto seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
    return {dropout_cpu(grads[0], ctx->saved_data["p"].toDouble(), seed), at::Tensor()};
  }
};

}  // namespace

at::Tensor dropout_cpu(const at::Tensor& x_in, double p, uint64_t seed) {
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kDouble),
              "dropout_cpu: a CPU float32 / float64 tensor expected");
  TORCH_CHECK(p > 0 && p < 1, "dropout_cpu: p must lie in (0, 1)");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == at::kFloat) apply(x.const_data_ptr<float>(), y.data_ptr<float>(), x.numel(), seed, p);
  else apply(x.const_data_ptr<double>(), y.data_ptr<double>(), x.numel(), seed, p);
  return y;
}

at::Tensor dropout(const at::Tensor& x, double p) {
  if (p <= 0) return x;
  if (p >= 1) return x * 0;
  if (!x.device().is_cpu() || (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble))
    return at::dropout(x, p, true);
  return DropoutFunction::apply(x, p);
}

}  // namespace lf::kernels

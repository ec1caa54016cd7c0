// Dot products and axpys over contiguous rows for the CPU kernels, float32 through the AVX2+FMA helpers of vec_math.h
// where the CPU has them (checked once, when the ops are made), plain loops otherwise (float64 always).
#pragma once
#include <cstdint>
#include <type_traits>

#include "loongforge/kernels/cpu/vec_math.h"

namespace lf::kernels::cpu {

template <typename T>
struct RowOps {
  bool avx2 = false;
  // sum_i a[i] b[i]
  T dot(const T* a, const T* b, int64_t n) const {
#if defined(__x86_64__)
    if constexpr (std::is_same_v<T, float>)
      if (avx2) return dot_avx2(a, b, n);
#endif
    T s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  // y += alpha x
  void axpy(T alpha, const T* x, T* y, int64_t n) const {
#if defined(__x86_64__)
    if constexpr (std::is_same_v<T, float>)
      if (avx2) return axpy_avx2(alpha, x, y, n);
#endif
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
  }
};

template <typename T>
RowOps<T> row_ops() {
  RowOps<T> o;
#if defined(__x86_64__)
  o.avx2 = std::is_same_v<T, float> && has_avx2_fma();
#endif
  return o;
}

}  // namespace lf::kernels::cpu

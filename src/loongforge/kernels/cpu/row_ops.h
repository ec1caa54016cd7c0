// Dot products and axpys over contiguous rows for the CPU kernels, as static operations a kernel's row loops take as a
// template argument: PlainRowOps (float64, CPUs without AVX2) or AvxRowOps (float32 through vec_math.h's AVX2 + FMA
// helpers). A kernel instantiates its loops with AvxRowOps inside a function compiled for AVX2 (LF_AVX2), so the
// helpers inline there, and picks that instantiation at run time when has_avx2_fma().
#pragma once
#include <cstdint>

#include "loongforge/kernels/cpu/vec_math.h"

namespace lf::kernels::cpu {

template <typename T>
struct PlainRowOps {
  // sum_i a[i] b[i]
  static inline T dot(const T* a, const T* b, int64_t n) {
    T s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  // y += alpha x
  static inline void axpy(T alpha, const T* x, T* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
  }
};

#if defined(__x86_64__)
struct AvxRowOps {
  LF_AVX2 static inline float dot(const float* a, const float* b, int64_t n) { return dot_avx2(a, b, n); }
  LF_AVX2 static inline void axpy(float alpha, const float* x, float* y, int64_t n) { axpy_avx2(alpha, x, y, n); }
};
#endif

}  // namespace lf::kernels::cpu

// Rotary embedding, rotate-half layout: y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2 (halves of the last dim).
// Backward (the transposed map): dx1 = dy1*c1 + dy2*s2, dx2 = dy2*c2 - dy1*s1. One thread per (row, i < D/2).
#include "loongforge/kernels/cuda/common.cuh"

namespace lf::kernels::cuda {
namespace {
using namespace detail;

template <typename T, typename C>
__global__ void rope_kernel(const T* __restrict__ x, const C* __restrict__ cs, const C* __restrict__ sn,
                            T* __restrict__ y, launch::RopeShape s, int64_t total, bool backward) {
  LF_GRID_STRIDE(idx, total) {
    const int64_t i = idx % s.half, row = idx / s.half;
    const int64_t t = row % s.T, h = (row / s.T) % s.H, b = row / (s.T * s.H);
    const T* xr = x + b * s.xb + h * s.xh + t * s.xt;
    const int64_t co = b * s.cb + t * s.ct;
    // cos/sin rounded to x's dtype first, as the composite version (cos.to(x.dtype)).
    const float c1 = rnd<T>(tof<C>(cs[co + i])), c2 = rnd<T>(tof<C>(cs[co + i + s.half]));
    const float s1 = rnd<T>(tof<C>(sn[co + i])), s2 = rnd<T>(tof<C>(sn[co + i + s.half]));
    const float x1 = tof<T>(xr[i]), x2 = tof<T>(xr[i + s.half]);
    T* yr = y + row * 2 * s.half;
    if (!backward) {
      yr[i] = fromf<T>(x1 * c1 - x2 * s1);
      yr[i + s.half] = fromf<T>(x2 * c2 + x1 * s2);
    } else {
      yr[i] = fromf<T>(x1 * c1 + x2 * s2);
      yr[i + s.half] = fromf<T>(x2 * c2 - x1 * s1);
    }
  }
}

}  // namespace

namespace launch {

int rope(DType t, DType ct, const void* x, const void* cos, const void* sin, void* y, const RopeShape& s,
         bool backward, void* stream) {
  const int64_t total = s.B * s.H * s.T * s.half;
  if (total == 0) return 0;
  const int blocks = blocks_for(total, 256);
  if (ct == DType::f32) {
    LF_CUDA_DISPATCH(t, T,
                     rope_kernel<T, float><<<blocks, 256, 0, as_stream(stream)>>>(
                         static_cast<const T*>(x), static_cast<const float*>(cos), static_cast<const float*>(sin),
                         static_cast<T*>(y), s, total, backward))
  } else {
    LF_CUDA_DISPATCH(t, T,
                     rope_kernel<T, T><<<blocks, 256, 0, as_stream(stream)>>>(
                         static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
                         static_cast<T*>(y), s, total, backward))
  }
  return last_error();
}

}  // namespace launch
}  // namespace lf::kernels::cuda

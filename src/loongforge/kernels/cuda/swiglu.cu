// SwiGLU y = silu(g) * u and its backward, elementwise over [rows, F] views whose rows may be strided (the halves of
// a fused gate/up output). Rounding follows the composite version: silu rounded to the dtype, then the product.
#include "loongforge/kernels/cuda/common.cuh"

namespace lf::kernels::cuda {
namespace {
using namespace detail;

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y, int64_t F,
                                      int64_t gs, int64_t us, int64_t total) {
  LF_GRID_STRIDE(idx, total) {
    const int64_t r = idx / F, j = idx % F;
    const float gv = tof<T>(g[r * gs + j]);
    y[idx] = fromf<T>(rnd<T>(gv / (1.f + expf(-gv))) * tof<T>(u[r * us + j]));
  }
}

// du = dy * silu(g);  dg = T(dy * u) * sig * (1 + g * (1 - sig)).
template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ g, const T* __restrict__ u,
                                       T* __restrict__ dg, T* __restrict__ du, int64_t F, int64_t gs, int64_t us,
                                       int64_t total) {
  LF_GRID_STRIDE(idx, total) {
    const int64_t r = idx / F, j = idx % F;
    const float gv = tof<T>(g[r * gs + j]), uv = tof<T>(u[r * us + j]), d = tof<T>(dy[idx]);
    const float sig = 1.f / (1.f + expf(-gv));
    du[idx] = fromf<T>(d * rnd<T>(gv * sig));
    dg[idx] = fromf<T>(rnd<T>(d * uv) * sig * (1.f + gv * (1.f - sig)));
  }
}

}  // namespace

namespace launch {

int swiglu_forward(DType t, const void* g, const void* u, void* y, int64_t rows, int64_t F, int64_t gs, int64_t us,
                   void* stream) {
  const int64_t total = rows * F;
  if (total == 0) return 0;
  LF_CUDA_DISPATCH(t, T,
                   swiglu_forward_kernel<T><<<blocks_for(total, 256), 256, 0, as_stream(stream)>>>(
                       static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(y), F, gs, us, total))
  return last_error();
}

int swiglu_backward(DType t, const void* dy, const void* g, const void* u, void* dg, void* du, int64_t rows,
                    int64_t F, int64_t gs, int64_t us, void* stream) {
  const int64_t total = rows * F;
  if (total == 0) return 0;
  LF_CUDA_DISPATCH(t, T,
                   swiglu_backward_kernel<T><<<blocks_for(total, 256), 256, 0, as_stream(stream)>>>(
                       static_cast<const T*>(dy), static_cast<const T*>(g), static_cast<const T*>(u),
                       static_cast<T*>(dg), static_cast<T*>(du), F, gs, us, total))
  return last_error();
}

}  // namespace launch
}  // namespace lf::kernels::cuda

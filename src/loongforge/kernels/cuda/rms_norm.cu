// RMSNorm and residual-add + RMSNorm, forward and backward. Forward: one block per row. Backward: rows spread over a
// grid of blocks, each accumulating its own float32 partial of dw (no atomics: deterministic), summed by the caller.
#include "loongforge/kernels/cuda/common.cuh"

namespace lf::kernels::cuda {
namespace {
using namespace detail;

// y = w * T(s * rstd) as transformers' LlamaRMSNorm; s = x, or T(x + res) written to s_out.
template <typename T>
__global__ void rms_forward_kernel(const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,
                                   T* __restrict__ y, T* __restrict__ s_out, float* __restrict__ rstd, int64_t n,
                                   float eps) {
  __shared__ float sh[32];
  const int64_t off = static_cast<int64_t>(blockIdx.x) * n;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    float f = tof<T>(x[off + j]);
    if (res) {
      T v = fromf<T>(f + tof<T>(res[off + j]));
      s_out[off + j] = v;
      f = tof<T>(v);
    }
    ss += f * f;
  }
  ss = block_sum(ss, sh);
  const float r = 1.f / sqrtf(ss / static_cast<float>(n) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  const T* src = res ? s_out : x;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    y[off + j] = fromf<T>(tof<T>(w[j]) * rnd<T>(tof<T>(src[off + j]) * r));
}

template <typename T>
__global__ void rms_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                    const float* __restrict__ rstd, const T* __restrict__ ds, T* __restrict__ dx,
                                    float* __restrict__ dw_part, int64_t rows, int64_t n) {
  __shared__ float sh[32];
  float* dwp = dw_part + static_cast<int64_t>(blockIdx.x) * n;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * n;
    const float r = rstd[row];
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dot += tof<T>(dy[off + j]) * tof<T>(w[j]) * tof<T>(x[off + j]);
    dot = block_sum(dot, sh);
    const float k = dot * r * r * r / static_cast<float>(n);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float dyj = tof<T>(dy[off + j]), xj = tof<T>(x[off + j]);
      float v = dyj * tof<T>(w[j]) * r - xj * k;
      if (ds) v += tof<T>(ds[off + j]);
      dx[off + j] = fromf<T>(v);
      dwp[j] += dyj * xj * r;  // this block's rows only: no race
    }
  }
}

}  // namespace

namespace launch {

int rms_forward(DType t, const void* x, const void* res, const void* w, void* y, void* s_out, float* rstd,
                int64_t rows, int64_t n, float eps, void* stream) {
  if (rows == 0) return 0;
  LF_CUDA_DISPATCH(t, T,
                   rms_forward_kernel<T><<<static_cast<unsigned>(rows), row_threads(n), 0, as_stream(stream)>>>(
                       static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w),
                       static_cast<T*>(y), static_cast<T*>(s_out), rstd, n, eps))
  return last_error();
}

int rms_backward(DType t, const void* dy, const void* x, const void* w, const float* rstd, const void* ds, void* dx,
                 float* dw_part, int64_t rows, int64_t n, int64_t grid, void* stream) {
  if (rows == 0) return 0;
  LF_CUDA_DISPATCH(t, T,
                   rms_backward_kernel<T><<<static_cast<unsigned>(grid), row_threads(n), 0, as_stream(stream)>>>(
                       static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd,
                       static_cast<const T*>(ds), static_cast<T*>(dx), dw_part, rows, n))
  return last_error();
}

}  // namespace launch
}  // namespace lf::kernels::cuda

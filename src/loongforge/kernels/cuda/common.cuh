// Internal helpers of the CUDA kernels: dtype conversions, dispatch, block reductions. CUDA headers only (no ATen):
// nvcc time stays small.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "loongforge/kernels/cuda/launch.h"

namespace lf::kernels::cuda::detail {

template <typename T>
__device__ __forceinline__ float tof(T v);
template <>
__device__ __forceinline__ float tof<float>(float v) { return v; }
template <>
__device__ __forceinline__ float tof<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float tof<__half>(__half v) { return __half2float(v); }

// Round to nearest even, as c10::BFloat16 / c10::Half conversions.
template <typename T>
__device__ __forceinline__ T fromf(float v);
template <>
__device__ __forceinline__ float fromf<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half fromf<__half>(float v) { return __float2half_rn(v); }

// v rounded to T and back: the value a composite op stores in a T tensor.
template <typename T>
__device__ __forceinline__ float rnd(float v) { return tof<T>(fromf<T>(v)); }

#define LF_CUDA_CASE(ENUM, TYPE, ALIAS, ...) \
  case launch::DType::ENUM: {                \
    using ALIAS = TYPE;                      \
    __VA_ARGS__;                             \
  } break;
// Runs the body with ALIAS bound to the element type of DT.
#define LF_CUDA_DISPATCH(DT, ALIAS, ...)                  \
  switch (DT) {                                          \
    LF_CUDA_CASE(f32, float, ALIAS, __VA_ARGS__)          \
    LF_CUDA_CASE(bf16, __nv_bfloat16, ALIAS, __VA_ARGS__) \
    LF_CUDA_CASE(f16, __half, ALIAS, __VA_ARGS__)         \
  }

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
inline int last_error() { return static_cast<int>(cudaGetLastError()); }

inline int blocks_for(int64_t n, int threads, int64_t cap = 65535LL * 16) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min(b, cap)));
}

// Threads per row-block for rows of n elements: a power of two in [32, 512].
inline int row_threads(int64_t n) {
  int t = 32;
  while (t < 512 && t < n) t *= 2;
  return t;
}

#define LF_GRID_STRIDE(IDX, TOTAL)                                                          \
  for (int64_t IDX = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; IDX < (TOTAL); \
       IDX += static_cast<int64_t>(gridDim.x) * blockDim.x)

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the result. sh: 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous call
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    v = lane < nw ? sh[lane] : 0.f;
    v = warp_sum(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  return sh[0];
}

__device__ __forceinline__ float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    v = lane < nw ? sh[lane] : -INFINITY;
    v = warp_max(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  return sh[0];
}

}  // namespace lf::kernels::cuda::detail

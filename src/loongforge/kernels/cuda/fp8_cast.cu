// FP8 tensorwise quantization's elementwise pass: out = e4m3(x * scale), saturated to +-448 and rounded to nearest
// even, as the composite (x.to(float) * scale).clamp(-448, 448).to(Float8_e4m3fn) rounds; the scale is read from
// device memory (no host round trip). One read of x, one byte written per element.
#include <cuda_fp8.h>

#include "loongforge/kernels/cuda/common.cuh"

namespace lf::kernels::cuda {
namespace {
using namespace detail;

template <typename T>
__global__ void fp8_e4m3_cast_kernel(const T* __restrict__ x, const float* __restrict__ scale,
                                     __nv_fp8_storage_t* __restrict__ out, int64_t total) {
  const float s = *scale;
  LF_GRID_STRIDE(idx, total) {
    out[idx] = __nv_cvt_float_to_fp8(tof<T>(x[idx]) * s, __NV_SATFINITE, __NV_E4M3);
  }
}

}  // namespace

namespace launch {

int fp8_e4m3_cast(DType t, const void* x, const float* scale, void* out, int64_t n, void* stream) {
  if (n == 0) return 0;
  LF_CUDA_DISPATCH(t, T,
                   fp8_e4m3_cast_kernel<T><<<blocks_for(n, 256), 256, 0, as_stream(stream)>>>(
                       static_cast<const T*>(x), scale, static_cast<__nv_fp8_storage_t*>(out), n))
  return last_error();
}

}  // namespace launch
}  // namespace lf::kernels::cuda

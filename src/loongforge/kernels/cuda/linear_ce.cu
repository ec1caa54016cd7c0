// Per-chunk kernels of the fused linear + cross-entropy (the GEMMs are cuBLAS through ATen, in ops.cpp): online
// logsumexp statistics over vocabulary chunks, and the in-place softmax gradient of a recomputed chunk.
#include "loongforge/kernels/cuda/common.cuh"

namespace lf::kernels::cuda {
namespace {
using namespace detail;

// One block per row: merge the chunk's (max, sum exp) into the running (m, s); pick the target logit.
template <typename T>
__global__ void ce_stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                                float* __restrict__ m, float* __restrict__ s, float* __restrict__ tl, int64_t C,
                                int64_t v0) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const T* lr = logits + row * C;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) mx = fmaxf(mx, tof<T>(lr[j]));
  mx = block_max(mx, sh);
  float se = 0.f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) se += expf(tof<T>(lr[j]) - mx);
  se = block_sum(se, sh);
  if (threadIdx.x == 0) {
    const float mo = m[row], so = s[row];
    const float mn = fmaxf(mo, mx);
    s[row] = (mo == -INFINITY ? 0.f : so * expf(mo - mn)) + (mx == -INFINITY ? 0.f : se * expf(mx - mn));
    m[row] = mn;
    const int64_t t = target[row];
    if (t >= v0 && t < v0 + C) tl[row] = tof<T>(lr[t - v0]);
  }
}

template <typename T>
__global__ void ce_grad_kernel(T* __restrict__ logits, const int64_t* __restrict__ target,
                               const float* __restrict__ lse, const float* __restrict__ dloss,
                               const float* __restrict__ n_valid, int64_t C, int64_t v0, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  T* lr = logits + row * C;
  const int64_t t = target[row];
  const float scale = t == ignore_index ? 0.f : *dloss / *n_valid;
  const float l = lse[row];
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    float p = expf(tof<T>(lr[j]) - l);
    if (j + v0 == t) p -= 1.f;
    lr[j] = fromf<T>(p * scale);
  }
}

}  // namespace

namespace launch {

int ce_chunk_stats(DType t, const void* logits, const int64_t* target, float* m, float* s, float* tl, int64_t N,
                   int64_t C, int64_t v0, void* stream) {
  if (N == 0) return 0;
  LF_CUDA_DISPATCH(t, T,
                   ce_stats_kernel<T><<<static_cast<unsigned>(N), row_threads(C), 0, as_stream(stream)>>>(
                       static_cast<const T*>(logits), target, m, s, tl, C, v0))
  return last_error();
}

int ce_chunk_grad(DType t, void* logits, const int64_t* target, const float* lse, const float* dloss,
                  const float* n_valid, int64_t N, int64_t C, int64_t v0, int64_t ignore_index, void* stream) {
  if (N == 0) return 0;
  LF_CUDA_DISPATCH(t, T,
                   ce_grad_kernel<T><<<static_cast<unsigned>(N), row_threads(C), 0, as_stream(stream)>>>(
                       static_cast<T*>(logits), target, lse, dloss, n_valid, C, v0, ignore_index))
  return last_error();
}

}  // namespace launch
}  // namespace lf::kernels::cuda

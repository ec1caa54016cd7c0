// Multi-tensor AdamW and sum of squares: one launch over many tensors; each block takes one (tensor, chunk) entry
// of a table the host uploads. Arithmetic as optim::AdamW's CPU kernel (torch.optim.AdamW, float32).
#include "loongforge/kernels/cuda/common.cuh"

namespace lf::kernels::cuda {
namespace {
using namespace detail;
using launch::AdamChunk;
using launch::AdamScalars;
using launch::AdamTensor;
using launch::kAdamChunk;
using launch::NormTensor;

template <typename G, typename M>
__global__ void adamw_kernel(const AdamTensor* __restrict__ tensors, const AdamChunk* __restrict__ chunks,
                             AdamScalars sc, const float* __restrict__ grad_scale) {
  const AdamChunk c = chunks[blockIdx.x];
  const AdamTensor t = tensors[c.tensor];
  const int64_t begin = static_cast<int64_t>(c.chunk) * kAdamChunk;
  const int64_t end = begin + kAdamChunk < t.n ? begin + kAdamChunk : t.n;
  const float gs = grad_scale ? *grad_scale : 1.f;
  const G* g = static_cast<const G*>(t.g);
  M* model = static_cast<M*>(t.model);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float gi = grad_scale ? tof<G>(g[i]) * gs : tof<G>(g[i]);
    const float pi = t.p[i] * t.decay;
    float mi = t.m[i];
    mi = (sc.w1 < 0.5f) ? mi + sc.w1 * (gi - mi) : gi - (gi - mi) * (1.f - sc.w1);
    const float vi = t.v[i] * sc.b2 + sc.one_minus_b2 * gi * gi;
    const float denom = sqrtf(vi) / sc.bc2_sqrt + sc.eps;
    const float pn = pi + sc.neg_step * (mi / denom);
    t.p[i] = pn;
    t.m[i] = mi;
    t.v[i] = vi;
    if (model) model[i] = fromf<M>(pn);
  }
}

template <typename T>
__global__ void sumsq_kernel(const NormTensor* __restrict__ tensors, const AdamChunk* __restrict__ chunks,
                             float* __restrict__ partial) {
  __shared__ float sh[32];
  const AdamChunk c = chunks[blockIdx.x];
  const NormTensor t = tensors[c.tensor];
  const int64_t begin = static_cast<int64_t>(c.chunk) * kAdamChunk;
  const int64_t end = begin + kAdamChunk < t.n ? begin + kAdamChunk : t.n;
  const T* p = static_cast<const T*>(t.p);
  float acc = 0.f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = tof<T>(p[i]);
    acc += v * v;
  }
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

}  // namespace

namespace launch {

int adamw(DType grad_t, DType model_t, const AdamTensor* tensors, const AdamChunk* chunks, int64_t num_chunks,
          AdamScalars sc, const float* grad_scale, void* stream) {
  if (num_chunks == 0) return 0;
  LF_CUDA_DISPATCH(grad_t, G,
                   LF_CUDA_DISPATCH(model_t, M,
                                    adamw_kernel<G, M><<<static_cast<unsigned>(num_chunks), 512, 0,
                                                         as_stream(stream)>>>(tensors, chunks, sc, grad_scale)))
  return last_error();
}

int sumsq(DType t, const NormTensor* tensors, const AdamChunk* chunks, int64_t num_chunks, float* partial,
          void* stream) {
  if (num_chunks == 0) return 0;
  LF_CUDA_DISPATCH(t, T,
                   sumsq_kernel<T><<<static_cast<unsigned>(num_chunks), 512, 0, as_stream(stream)>>>(tensors, chunks,
                                                                                                     partial))
  return last_error();
}

}  // namespace launch
}  // namespace lf::kernels::cuda

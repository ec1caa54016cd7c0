// Internal: the host launchers of the CUDA kernels, in plain C++ (no ATen, no CUDA headers) so that nvcc compiles
// only the kernels (seconds) while ops.cpp (g++, precompiled header) does the ATen side. Pointers are device
// pointers; stream is a cudaStream_t; each launcher returns cudaGetLastError() as an int (0: success).
#pragma once
#include <cstdint>

namespace lf::kernels::cuda::launch {

enum class DType { f32, bf16, f16 };

// RMSNorm (res != nullptr: s = x + res written to s_out and normalised). rstd: float32 [rows].
int rms_forward(DType t, const void* x, const void* res, const void* w, void* y, void* s_out, float* rstd,
                int64_t rows, int64_t n, float eps, void* stream);
// dx = r*g - x*r^3*mean(g*x) (+ ds), g = dy*w; dw_part [grid, n] float32 zeroed, accumulated per block.
int rms_backward(DType t, const void* dy, const void* x, const void* w, const float* rstd, const void* ds, void* dx,
                 float* dw_part, int64_t rows, int64_t n, int64_t grid, void* stream);

struct RopeShape {
  int64_t B, H, T, half;
  int64_t xb, xh, xt;  // x strides (elements) over B, H, T; last dim contiguous
  int64_t cb, ct;      // cos/sin strides over B (0: broadcast), T; last dim contiguous
};
// cos/sin of dtype ct (float32 or t). y contiguous [B, H, T, 2*half].
int rope(DType t, DType ct, const void* x, const void* cos, const void* sin, void* y, const RopeShape& s,
         bool backward, void* stream);

// [rows, F] views with row strides gs, us (last dim contiguous); y, dy, dg, du contiguous.
int swiglu_forward(DType t, const void* g, const void* u, void* y, int64_t rows, int64_t F, int64_t gs, int64_t us,
                   void* stream);
int swiglu_backward(DType t, const void* dy, const void* g, const void* u, void* dg, void* du, int64_t rows,
                    int64_t F, int64_t gs, int64_t us, void* stream);

// Cross-entropy statistics of one vocabulary chunk: logits [N, C] (contiguous) for columns [v0, v0 + C).
// Updates the running max m, sum of exp s, and picks the target logit tl where v0 <= target < v0 + C.
int ce_chunk_stats(DType t, const void* logits, const int64_t* target, float* m, float* s, float* tl, int64_t N,
                   int64_t C, int64_t v0, void* stream);
// In place: logits <- (softmax - onehot) * (*dloss / *n_valid) for rows whose target != ignore_index, 0 otherwise.
int ce_chunk_grad(DType t, void* logits, const int64_t* target, const float* lse, const float* dloss,
                  const float* n_valid, int64_t N, int64_t C, int64_t v0, int64_t ignore_index, void* stream);

// FP8 quantization: out[i] = e4m3(x[i] * *scale), saturated (+-448), nearest even; out: n bytes.
int fp8_e4m3_cast(DType t, const void* x, const float* scale, void* out, int64_t n, void* stream);

// Multi-tensor AdamW. One entry per tensor; the chunk table maps each block to (tensor, chunk of kAdamChunk).
struct AdamTensor {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* model;  // optional low-precision copy of p (nullptr: none)
  int64_t n;
  float decay;  // 1 - lr * wd
};
struct AdamChunk {
  int32_t tensor, chunk;
};
constexpr int64_t kAdamChunk = 65536;
struct AdamScalars {
  float w1, b2, one_minus_b2, neg_step, bc2_sqrt, eps;
};
// tensors/chunks: device copies of the tables. grad_scale: optional device float.
int adamw(DType grad_t, DType model_t, const AdamTensor* tensors, const AdamChunk* chunks, int64_t num_chunks,
          AdamScalars sc, const float* grad_scale, void* stream);

// Sum of squares: each block (one per chunk) writes its float32 partial to partial[block].
struct NormTensor {
  const void* p;
  int64_t n;
};
int sumsq(DType t, const NormTensor* tensors, const AdamChunk* chunks, int64_t num_chunks, float* partial,
          void* stream);

}  // namespace lf::kernels::cuda::launch

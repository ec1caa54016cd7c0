// Our CUDA kernels (kernels/cuda/*.cu, built with -DLOONGFORGE_CUDA=ON). Without CUDA in the build the declarations
// resolve to kernels/cuda/stubs.cpp: available() is false and every op throws.
//
// Two levels:
// - autograd-aware ops (rms_norm, add_rms_norm, rope, swiglu, linear_cross_entropy): torch::autograd::Functions whose
//   forward/backward run the raw kernels below (kernels/cuda/ops.cpp). The device-generic entry points
//   (kernels::rms_norm, kernels::add_rms_norm, kernels::apply_rope) route CUDA tensors here.
// - raw kernels (no autograd), for tests, benchmarks and other fused ops.
// Inputs live on one CUDA device; dtypes float32, bfloat16, float16 (statistics and accumulations in float32).
// supported(t) says whether a tensor is one the kernels take.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace lf::kernels::cuda {

// True when the library was compiled with LOONGFORGE_CUDA and a CUDA device is usable.
bool available();
// True when the library was compiled with LOONGFORGE_CUDA (whether or not a device is present).
bool compiled();
// Why no CUDA device is usable, e.g. "cudaGetDeviceCount error 35: CUDA driver version is insufficient for CUDA
// runtime version" or "this build has no CUDA support (LOONGFORGE_CUDA=OFF)"; empty when available().
std::string unavailable_reason();
// Peak bytes the CUDA caching allocator handed out on the current device (torch.cuda.max_memory_allocated); 0 without
// a usable device.
int64_t max_memory_allocated();
// CUDA devices usable by this process (0 without); set_device makes `index` the current device.
int device_count();
void set_device(int index);
// The device for a run that asks for CUDA (want_cuda) on GPU `index`: that GPU when one is usable, else the CPU
// after one line on stderr saying why (`train`, `eval` and `generate` fall back alike).
inline at::Device usable_device(bool want_cuda, int index = 0) {
  if (!want_cuda) return at::Device(at::kCPU);
  if (available()) return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  std::fprintf(stderr, "loongforge: device 'cuda' requested but no usable GPU (%s); running on the CPU\n",
               unavailable_reason().c_str());
  return at::Device(at::kCPU);
}
// "NVIDIA H200, 139.8 GiB, sm_90" for a usable device index (for `loongforge env`).
std::string device_description(int index);
// The CUDA runtime version LoongForge's kernels were built with, e.g. "13.0" (empty without CUDA).
std::string runtime_version();
// Blocks the host until the current device's work is done (no-op without a device).
void synchronize();
// t is a CUDA tensor of float32/bfloat16/float16.
bool supported(const at::Tensor& t);

// ---- autograd-aware ops -------------------------------------------------------------------------------------------
// y = w * (x * rsqrt(mean(x^2, -1) + eps)) as transformers' LlamaRMSNorm. x [..., N], w [N] (x's dtype).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
// s = x + residual; y = rms_norm(s, w, eps). Returns {s, y}; gradients flow into x and residual (the same) and w.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps);
// Rotary embedding, rotate-half layout as nn::apply_rotary: x*cos + rotate_half(x)*sin. x [B,H,T,D] (any strides
// with a contiguous last dim, e.g. q.transpose(1,2)), cos/sin [B,T,D] or [1,T,D] (float32 usually). Gradient for x
// only (cos/sin are constants). Output contiguous [B,H,T,D] in x's dtype.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// silu(g) * u; g, u of one shape (last dim contiguous; e.g. the two halves of a fused gate/up GEMM output).
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u);
// mean over rows with target != ignore_index of cross_entropy(x @ w^T, target), logits in float32 as transformers.
// x [..., D], w [V, D], target [...] int64. The [N, V] logits are never kept: the forward computes the per-row
// logsumexp over vocabulary chunks of chunk_size columns (0: automatic), the backward recomputes each chunk's
// logits and accumulates dX, dW. Returns a float32 scalar (NaN when every target is ignored, as torch).
at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& w, const at::Tensor& target,
                                int64_t ignore_index = -100, int64_t chunk_size = 0);

// Flash attention over packed documents (FlashAttention-2's varlen kernels through ATen, with gradients for q, k, v):
// q [N, H, D], k/v [N, Hkv, D] (bfloat16/float16; GQA: H a multiple of Hkv; D a multiple of 8 up to 256), the
// documents are the token ranges [cu_seqlens[i], cu_seqlens[i+1]) (int32 on q's device, 0 first, N last), each
// attended causally; window > 0 also hides keys `window` or more positions back (as nn::causal_attention). max_len:
// the longest document (an upper bound works too). Returns [N, H, D]. flash_varlen_supported(q, k): the dtypes,
// devices and shapes it takes (false without CUDA in the build).
at::Tensor flash_varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, int64_t max_len, double scale, int64_t window = 0);
bool flash_varlen_supported(const at::Tensor& q, const at::Tensor& k);

// ---- raw kernels ------------------------------------------------------------------------------------------------------
// RMSNorm forward: {y, rstd}; rstd [...] float32.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps);
// RMSNorm backward: {dx, dw}. ds (optional, may be undefined) is added to dx: the gradient that reaches the
// normalised input s from elsewhere (the residual stream of add_rms_norm).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& rstd, const at::Tensor& ds = {});
// Residual add + RMSNorm forward: {s, y, rstd} with s = x + residual (rounded to x's dtype as at::add).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor& x, const at::Tensor& residual,
                                                                    const at::Tensor& w, double eps);
// RoPE forward (backward = true: the transposed rotation, i.e. the gradient dx for dy = x).
at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward = false);
// SwiGLU forward y = silu(g) * u, and backward {dg, du}.
at::Tensor swiglu_forward(const at::Tensor& g, const at::Tensor& u);
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& dy, const at::Tensor& g, const at::Tensor& u);
// Fused linear + cross-entropy, x [N, D], w [V, D], target [N]. Forward: {loss (f32 scalar), lse [N] f32,
// n_valid (f32 scalar)}. Backward: {dx, dw} for the scalar upstream gradient dloss (f32 scalar tensor on the device).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_ce_forward(const at::Tensor& x, const at::Tensor& w,
                                                                 const at::Tensor& target, int64_t ignore_index,
                                                                 int64_t chunk_size);
std::tuple<at::Tensor, at::Tensor> linear_ce_backward(const at::Tensor& dloss, const at::Tensor& x,
                                                      const at::Tensor& w, const at::Tensor& target,
                                                      const at::Tensor& lse, const at::Tensor& n_valid,
                                                      int64_t ignore_index, int64_t chunk_size);
// FP8 tensorwise quantization's elementwise pass on the GPU: e4m3(x * scale) saturated to +-448 (as the composite
// clamp + cast), x a contiguous CUDA float32/bfloat16/float16 tensor, scale a float32 scalar on its device. Returns
// an Float8_e4m3fn tensor of x's shape.
at::Tensor fp8_e4m3_cast(const at::Tensor& x, const at::Tensor& scale);
// Vocabulary chunk the linear_ce functions use for chunk_size = 0.
int64_t linear_ce_auto_chunk(int64_t rows, int64_t vocab);

// ---- optimizer ----------------------------------------------------------------------------------------------------
// One AdamW step over many tensors in one launch, torch.optim.AdamW's arithmetic in float32 (as optim::AdamW):
//   p *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = v*b2 + (1-b2) g^2;  p += -(lr/bc1) m / (sqrt(v)/sqrt(bc2) + eps)
// params, exp_avg, exp_avg_sq: float32 contiguous (fp32 master weights); grads: contiguous, all float32 or all
// bfloat16/float16, each of its param's numel. weight_decay: one per tensor (or one for all). step: the step number
// after this update (1 for the first). grad_scale (optional): a float32 device scalar the gradients are multiplied by
// first (e.g. the clipping coefficient, no host sync). model_params (optional, empty: none): bf16/f16/f32 copies
// written with the updated parameters (the low-precision model weights).
struct AdamWHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  int64_t step = 1;
};
void multi_tensor_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq,
                        const AdamWHyper& hyper, const std::vector<double>& weight_decay,
                        const std::optional<at::Tensor>& grad_scale = std::nullopt,
                        const std::vector<at::Tensor>& model_params = {});
// Global 2-norm of many tensors (float32/bf16/f16, contiguous; undefined ones skipped) as a float32 device scalar,
// sums of squares in float32, one launch per dtype. With clip_coef(norm, max_norm) = min(1, max_norm/(norm+1e-6))
// (torch.nn.utils.clip_grad_norm_) as grad_scale for multi_tensor_adamw, clipping needs no host sync.
at::Tensor multi_tensor_l2norm(const std::vector<at::Tensor>& tensors);
at::Tensor clip_coef(const at::Tensor& norm, double max_norm);

// ---- FP8 (kernels/cuda/fp8.cpp: plain ATen, compiled in every build; the math runs on the CPU too) ------------------
// Tensorwise scaling: scale = fp8_max / max(amax(t), tiny); data = (t * scale) saturated to +-fp8_max and cast to fp8
// (at::kFloat8_e4m3fn: max 448; at::kFloat8_e5m2: max 57344). scale_inv = 1 / scale (float32 scalar) is what
// at::_scaled_mm takes to undo it: t ~= data.to(float) * scale_inv.
struct Fp8Tensor {
  at::Tensor data;       // fp8, t's shape
  at::Tensor scale_inv;  // float32 0-dim, t's device
};
Fp8Tensor fp8_quantize_tensorwise(const at::Tensor& t, at::ScalarType fp8 = at::kFloat8_e4m3fn);
// y = x @ w^T (+ bias) with both GEMM operands in e4m3 (tensorwise scales) through at::_scaled_mm, output in x's
// dtype (bf16 under autocast); backward: dX = dY @ W and dW = dY^T @ X as fp8 GEMMs too (dY in e4m3, tensorwise).
// x [..., K], w [N, K], K and N multiples of 16 (_scaled_mm's rule; fp8_linear_supported says whether it applies).
// Autograd-aware (gradients for x, w, bias). CPU tensors work (ATen's reference _scaled_mm), for tests.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias = {});
bool fp8_linear_supported(const at::Tensor& x, const at::Tensor& w);

// Blockwise scaling (DeepSeek-V3's recipe): one scale per block of 1 x 128 (activations and gradients: per row, 128
// consecutive elements of the contraction dimension) or 128 x 128 (weights). t [R, C] with C (and for 128 x 128
// blocks R) a multiple of 128; scale_inv [R / block_rows, C / 128] float32, contiguous: t ~= data * scale_inv of
// its block.
Fp8Tensor fp8_quantize_blockwise(const at::Tensor& t, int64_t block_rows, at::ScalarType fp8 = at::kFloat8_e4m3fn);
// data.to(float32) times its blocks' scale_inv: what the blockwise GEMMs multiply.
at::Tensor fp8_dequantize_blockwise(const Fp8Tensor& q);
// fp8_linear with blockwise scales: forward x (1 x 128) times w (128 x 128); dX = dY (1 x 128 along N) times w;
// dW = dY^T times x, both 1 x 128 along the rows M. On CUDA at::_scaled_mm (cuBLASLt's block-scaled FP8 GEMMs,
// CUDA >= 12.9 on Hopper); on the CPU the same products of the dequantized operands in float32 (tests). M, K and N
// multiples of 128 (fp8_linear_blockwise_supported).
at::Tensor fp8_linear_blockwise(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias = {});
bool fp8_linear_blockwise_supported(const at::Tensor& x, const at::Tensor& w);

}  // namespace lf::kernels::cuda

// The ATen side of the CUDA kernels (declared in kernels/cuda_ops.h): checks, allocation, strides, the cuBLAS GEMMs
// of the fused linear + cross-entropy, the tables of the multi-tensor ops, and the autograd Functions. The kernels
// themselves are in *.cu (launch.h). Compiled only with LOONGFORGE_CUDA; kernels/cuda/stubs.cpp stands in otherwise.
#if defined(LOONGFORGE_CUDA) && LOONGFORGE_CUDA
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <torch/csrc/autograd/custom_function.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "loongforge/kernels/cuda/launch.h"
#include "loongforge/kernels/cuda_ops.h"

namespace lf::kernels::cuda {
namespace {

using launch::DType;

DType dtype_of(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK(false, "LoongForge CUDA kernels: float32/bfloat16/float16 expected, got ", s);
  }
}

void check(int rc) { C10_CUDA_CHECK(static_cast<cudaError_t>(rc)); }
void* stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void require(const at::Tensor& t, const char* what) {
  TORCH_CHECK(supported(t), what, ": a float32/bfloat16/float16 CUDA tensor expected");
}

void check_rms(const at::Tensor& x, const at::Tensor& w) {
  require(x, "rms_norm");
  TORCH_CHECK(w.dim() == 1 && x.dim() >= 1 && x.size(-1) == w.size(0), "rms_norm: weight must be [x.size(-1)]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.device() == x.device(),
              "rms_norm: weight must have x's dtype and device");
}

std::vector<int64_t> lead_shape(const at::Tensor& x) {
  auto s = x.sizes().vec();
  s.pop_back();
  return s;
}

// Row stride of t seen as [rows, t.size(-1)] with a contiguous last dim, or -1 when its leading dims do not collapse
// into one stride.
int64_t row_stride(const at::Tensor& t) {
  if (t.dim() == 0 || (t.stride(-1) != 1 && t.size(-1) != 1)) return -1;
  if (t.dim() == 1) return t.size(0);
  const int64_t rs = t.stride(-2);
  int64_t expect = rs;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) != 1 && t.stride(d) != expect) return -1;
    expect *= t.size(d);
  }
  return rs;
}

// Uploads a host byte table to the device (pinned staging, asynchronous on the current stream).
at::Tensor upload(const void* data, size_t bytes, const at::Device& dev) {
  at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), data, bytes);
  return host.to(dev, /*non_blocking=*/true);
}

}  // namespace

bool compiled() { return true; }

bool available() {
  static const bool ok = [] {
    try {
      return c10::cuda::device_count() > 0;
    } catch (...) {
      return false;
    }
  }();
  return ok;
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error the failed query leaves behind
    return "cudaGetDeviceCount error " + std::to_string(static_cast<int>(rc)) + ": " + cudaGetErrorString(rc);
  }
  if (n == 0) return "cudaGetDeviceCount found no device";
  if (!available()) return "c10::cuda::device_count() is 0";
  return "";
}

int64_t max_memory_allocated() {
  if (!available()) return 0;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

void synchronize() {
  if (available()) c10::cuda::device_synchronize();
}

int device_count() { return available() ? static_cast<int>(c10::cuda::device_count()) : 0; }

void set_device(int index) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }

std::string device_description(int index) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s, %.1f GiB, sm_%d%d", p->name,
                static_cast<double>(p->totalGlobalMem) / (1024.0 * 1024.0 * 1024.0), p->major, p->minor);
  return buf;
}

std::string runtime_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

bool supported(const at::Tensor& t) {
  if (!t.defined() || !t.is_cuda()) return false;
  auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

// ---- RMSNorm ------------------------------------------------------------------------------------------------------
namespace {
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_forward_impl(const at::Tensor& x_in, const at::Tensor* res_in,
                                                                const at::Tensor& w_in, double eps) {
  check_rms(x_in, w_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), res, s;
  if (res_in) {
    TORCH_CHECK(res_in->sizes() == x_in.sizes() && res_in->scalar_type() == x_in.scalar_type() &&
                    res_in->device() == x_in.device(),
                "add_rms_norm: residual must have x's shape, dtype and device");
    res = res_in->contiguous();
    s = at::empty_like(x);
  }
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty(lead_shape(x), x.options().dtype(at::kFloat));
  check(launch::rms_forward(dtype_of(x.scalar_type()), x.const_data_ptr(), res_in ? res.const_data_ptr() : nullptr,
                            w.const_data_ptr(), y.mutable_data_ptr(), res_in ? s.mutable_data_ptr() : nullptr,
                            rstd.mutable_data_ptr<float>(), rows, n, static_cast<float>(eps), stream()));
  return {s, y, rstd};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto [s, y, rstd] = rms_forward_impl(x, nullptr, w, eps);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor& x, const at::Tensor& residual,
                                                                    const at::Tensor& w, double eps) {
  return rms_forward_impl(x, &residual, w, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                     const at::Tensor& w_in, const at::Tensor& rstd_in,
                                                     const at::Tensor& ds_in) {
  check_rms(x_in, w_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), rstd = rstd_in.contiguous();
  TORCH_CHECK(dy_in.sizes() == x.sizes(), "rms_norm_backward: dy must have x's shape");
  at::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  at::Tensor ds;
  if (ds_in.defined()) {
    TORCH_CHECK(ds_in.sizes() == x.sizes(), "rms_norm_backward: ds must have x's shape");
    ds = ds_in.to(x.scalar_type()).contiguous();
  }
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows,
              "rms_norm_backward: rstd must be the forward's float32 [rows]");
  at::Tensor dx = at::empty_like(x);
  if (rows == 0) return {dx, at::zeros_like(w)};
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t grid = std::min<int64_t>(rows, 4LL * sms);
  at::Tensor part = at::zeros({grid, n}, x.options().dtype(at::kFloat));
  check(launch::rms_backward(dtype_of(x.scalar_type()), dy.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr(),
                             rstd.const_data_ptr<float>(), ds.defined() ? ds.const_data_ptr() : nullptr,
                             dx.mutable_data_ptr(), part.mutable_data_ptr<float>(), rows, n, grid, stream()));
  return {dx, part.sum(0).to(w.scalar_type())};
}

// ---- RoPE -----------------------------------------------------------------------------------------------------------
at::Tensor rope_apply(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, bool backward) {
  require(x_in, "rope");
  require(cos_in, "rope (cos)");
  require(sin_in, "rope (sin)");
  TORCH_CHECK(x_in.dim() == 4 && x_in.size(-1) % 2 == 0, "rope: x must be [B, H, T, D] with D even");
  TORCH_CHECK(cos_in.dim() == 3 && cos_in.sizes() == sin_in.sizes() && cos_in.scalar_type() == sin_in.scalar_type(),
              "rope: cos and sin must be [B, T, D] of one dtype");
  TORCH_CHECK(cos_in.scalar_type() == at::kFloat || cos_in.scalar_type() == x_in.scalar_type(),
              "rope: cos/sin must be float32 or x's dtype");
  const int64_t B = x_in.size(0), H = x_in.size(1), T = x_in.size(2), D = x_in.size(3);
  TORCH_CHECK((cos_in.size(0) == B || cos_in.size(0) == 1) && cos_in.size(1) == T && cos_in.size(2) == D,
              "rope: cos/sin must be [B or 1, T, D] for x [B, H, T, D]");
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  at::Tensor c = cos_in.stride(2) == 1 ? cos_in : cos_in.contiguous();
  at::Tensor s = sin_in.stride(2) == 1 ? sin_in : sin_in.contiguous();
  if (c.strides() != s.strides()) {
    c = c.contiguous();
    s = s.contiguous();
  }
  at::Tensor y = at::empty({B, H, T, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  launch::RopeShape shp{B, H, T, D / 2, x.stride(0), x.stride(1), x.stride(2),
                        c.size(0) == 1 ? 0 : c.stride(0), c.stride(1)};
  check(launch::rope(dtype_of(x.scalar_type()), dtype_of(c.scalar_type()), x.const_data_ptr(), c.const_data_ptr(),
                     s.const_data_ptr(), y.mutable_data_ptr(), shp, backward, stream()));
  return y;
}

// ---- SwiGLU ---------------------------------------------------------------------------------------------------------
namespace {
void check_pair(const at::Tensor& g, const at::Tensor& u) {
  require(g, "swiglu");
  TORCH_CHECK(g.dim() >= 1 && g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type() &&
                  g.device() == u.device(),
              "swiglu: g and u must have one shape, dtype and device");
}
}  // namespace

at::Tensor swiglu_forward(const at::Tensor& g_in, const at::Tensor& u_in) {
  check_pair(g_in, u_in);
  c10::cuda::CUDAGuard guard(g_in.device());
  at::Tensor g = row_stride(g_in) < 0 ? g_in.contiguous() : g_in;
  at::Tensor u = row_stride(u_in) < 0 ? u_in.contiguous() : u_in;
  at::Tensor y = at::empty(g.sizes(), g.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t F = g.size(-1), rows = F == 0 ? 0 : g.numel() / F;
  check(launch::swiglu_forward(dtype_of(g.scalar_type()), g.const_data_ptr(), u.const_data_ptr(),
                               y.mutable_data_ptr(), rows, F, row_stride(g), row_stride(u), stream()));
  return y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& dy_in, const at::Tensor& g_in,
                                                   const at::Tensor& u_in) {
  check_pair(g_in, u_in);
  TORCH_CHECK(dy_in.sizes() == g_in.sizes(), "swiglu_backward: dy must have g's shape");
  c10::cuda::CUDAGuard guard(g_in.device());
  at::Tensor g = row_stride(g_in) < 0 ? g_in.contiguous() : g_in;
  at::Tensor u = row_stride(u_in) < 0 ? u_in.contiguous() : u_in;
  at::Tensor dy = dy_in.to(g.scalar_type()).contiguous();
  auto opts = g.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor dg = at::empty(g.sizes(), opts), du = at::empty(g.sizes(), opts);
  const int64_t F = g.size(-1), rows = F == 0 ? 0 : g.numel() / F;
  check(launch::swiglu_backward(dtype_of(g.scalar_type()), dy.const_data_ptr(), g.const_data_ptr(),
                                u.const_data_ptr(), dg.mutable_data_ptr(), du.mutable_data_ptr(), rows, F,
                                row_stride(g), row_stride(u), stream()));
  return {dg, du};
}

// ---- fused linear + cross-entropy -----------------------------------------------------------------------------------
int64_t linear_ce_auto_chunk(int64_t rows, int64_t vocab) {
  // About 64 Mi logits elements per chunk (128 MiB in bf16), at least 1024 columns, at most the vocabulary.
  int64_t c = rows > 0 ? (64LL << 20) / rows : vocab;
  c = std::max<int64_t>(1024, c / 256 * 256);
  return std::max<int64_t>(1, std::min(c, vocab));
}

namespace {
void check_ce(const at::Tensor& x, const at::Tensor& w, const at::Tensor& target) {
  require(x, "linear_cross_entropy");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_cross_entropy: x [N, D] and w [V, D] expected");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.device() == x.device(),
              "linear_cross_entropy: w must have x's dtype and device");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == x.size(0) && target.scalar_type() == at::kLong &&
                  target.device() == x.device(),
              "linear_cross_entropy: target must be int64 [N] on x's device");
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_ce_forward(const at::Tensor& x_in, const at::Tensor& w_in,
                                                                 const at::Tensor& target_in, int64_t ignore_index,
                                                                 int64_t chunk_size) {
  check_ce(x_in, w_in, target_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), target = target_in.contiguous();
  const int64_t N = x.size(0), V = w.size(0);
  const int64_t C = chunk_size > 0 ? std::min(chunk_size, V) : linear_ce_auto_chunk(N, V);
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor m = at::full({N}, -INFINITY, f32), s = at::zeros({N}, f32), tl = at::zeros({N}, f32);
  const DType dt = dtype_of(x.scalar_type());
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    at::Tensor logits = at::mm(x, w.narrow(0, v0, c).t());  // [N, c], cuBLAS
    check(launch::ce_chunk_stats(dt, logits.const_data_ptr(), target.const_data_ptr<int64_t>(),
                                 m.mutable_data_ptr<float>(), s.mutable_data_ptr<float>(),
                                 tl.mutable_data_ptr<float>(), N, c, v0, stream()));
  }
  at::Tensor lse = m + at::log(s);
  at::Tensor valid = target.ne(ignore_index);
  at::Tensor n_valid = valid.sum().to(at::kFloat);
  at::Tensor loss = at::where(valid, lse - tl, at::zeros({}, f32)).sum() / n_valid;
  return {loss, lse, n_valid};
}

std::tuple<at::Tensor, at::Tensor> linear_ce_backward(const at::Tensor& dloss_in, const at::Tensor& x_in,
                                                      const at::Tensor& w_in, const at::Tensor& target_in,
                                                      const at::Tensor& lse_in, const at::Tensor& n_valid_in,
                                                      int64_t ignore_index, int64_t chunk_size) {
  check_ce(x_in, w_in, target_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), target = target_in.contiguous();
  at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  at::Tensor dloss = dloss_in.to(x.device(), at::kFloat).reshape({}).contiguous();
  at::Tensor n_valid = n_valid_in.to(x.device(), at::kFloat).reshape({}).contiguous();
  const int64_t N = x.size(0), V = w.size(0);
  const int64_t C = chunk_size > 0 ? std::min(chunk_size, V) : linear_ce_auto_chunk(N, V);
  const bool f32 = x.scalar_type() == at::kFloat;
  at::Tensor dx = at::zeros({N, x.size(1)}, x.options().dtype(at::kFloat));
  at::Tensor dw = at::empty_like(w);
  const DType dt = dtype_of(x.scalar_type());
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    at::Tensor wc = w.narrow(0, v0, c);
    at::Tensor logits = at::mm(x, wc.t());
    check(launch::ce_chunk_grad(dt, logits.mutable_data_ptr(), target.const_data_ptr<int64_t>(),
                                lse.const_data_ptr<float>(), dloss.const_data_ptr<float>(),
                                n_valid.const_data_ptr<float>(), N, c, v0, ignore_index, stream()));
    at::Tensor dwc = dw.narrow(0, v0, c);  // rows of a contiguous [V, D]: contiguous
    at::mm_out(dwc, logits.t(), x);
    if (f32) dx.addmm_(logits, wc);
    else dx.add_(at::mm(logits, wc));
  }
  return {dx.to(x.scalar_type()), dw};
}

// ---- FP8 ----------------------------------------------------------------------------------------------------------------
at::Tensor fp8_e4m3_cast(const at::Tensor& x_in, const at::Tensor& scale_in) {
  require(x_in, "fp8_e4m3_cast");
  TORCH_CHECK(scale_in.numel() == 1 && scale_in.scalar_type() == at::kFloat && scale_in.device() == x_in.device(),
              "fp8_e4m3_cast: scale must be one float32 on x's device");
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), scale = scale_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  check(launch::fp8_e4m3_cast(dtype_of(x.scalar_type()), x.const_data_ptr(), scale.const_data_ptr<float>(),
                              out.mutable_data_ptr(), x.numel(), stream()));
  return out;
}

// ---- optimizer --------------------------------------------------------------------------------------------------------
void multi_tensor_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq,
                        const AdamWHyper& h, const std::vector<double>& weight_decay,
                        const std::optional<at::Tensor>& grad_scale, const std::vector<at::Tensor>& model_params) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n,
              "multi_tensor_adamw: params, grads, exp_avg, exp_avg_sq must have one entry per tensor");
  TORCH_CHECK(weight_decay.size() == n || weight_decay.size() == 1,
              "multi_tensor_adamw: one weight decay per tensor (or one for all)");
  TORCH_CHECK(model_params.empty() || model_params.size() == n,
              "multi_tensor_adamw: model_params must be empty or one per tensor");
  TORCH_CHECK(h.step >= 1, "multi_tensor_adamw: step counts from 1");
  if (n == 0) return;
  const at::Device dev = params[0].device();
  TORCH_CHECK(dev.is_cuda(), "multi_tensor_adamw: CUDA tensors expected");
  c10::cuda::CUDAGuard guard(dev);
  const DType gt = dtype_of(grads[0].scalar_type());
  const DType mt = model_params.empty() ? DType::f32 : dtype_of(model_params[0].scalar_type());
  std::vector<launch::AdamTensor> tensors;
  std::vector<launch::AdamChunk> chunks;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &p = params[i], &g = grads[i], &m = exp_avg[i], &v = exp_avg_sq[i];
    for (const at::Tensor* t : {&p, &m, &v})
      TORCH_CHECK(t->device() == dev && t->scalar_type() == at::kFloat && t->is_contiguous(),
                  "multi_tensor_adamw: params and states must be contiguous float32 on one CUDA device");
    TORCH_CHECK(g.device() == dev && dtype_of(g.scalar_type()) == gt && g.is_contiguous() && g.numel() == p.numel(),
                "multi_tensor_adamw: grads must be contiguous, of one dtype, on the params' device, one per param");
    TORCH_CHECK(m.numel() == p.numel() && v.numel() == p.numel(), "multi_tensor_adamw: state size mismatch");
    void* model = nullptr;
    if (!model_params.empty()) {
      const at::Tensor& mp = model_params[i];
      TORCH_CHECK(mp.device() == dev && dtype_of(mp.scalar_type()) == mt && mp.is_contiguous() &&
                      mp.numel() == p.numel(),
                  "multi_tensor_adamw: model_params must be contiguous, of one dtype, one per param");
      model = mp.data_ptr();
    }
    const double wd = weight_decay.size() == 1 ? weight_decay[0] : weight_decay[i];
    const int64_t numel = p.numel();
    if (numel == 0) continue;
    const int32_t idx = static_cast<int32_t>(tensors.size());
    tensors.push_back({p.data_ptr<float>(), g.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(), model, numel,
                       static_cast<float>(1 - h.lr * wd)});
    const int64_t nchunks = (numel + launch::kAdamChunk - 1) / launch::kAdamChunk;
    for (int64_t c = 0; c < nchunks; ++c) chunks.push_back({idx, static_cast<int32_t>(c)});
  }
  if (chunks.empty()) return;
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(h.step));
  launch::AdamScalars sc{static_cast<float>(1 - h.beta1), static_cast<float>(h.beta2),
                         static_cast<float>(1 - h.beta2), static_cast<float>(-(h.lr / bc1)),
                         static_cast<float>(std::sqrt(bc2)), static_cast<float>(h.eps)};
  const size_t tb = tensors.size() * sizeof(launch::AdamTensor), cb = chunks.size() * sizeof(launch::AdamChunk);
  std::vector<uint8_t> table(tb + cb);
  std::memcpy(table.data(), tensors.data(), tb);
  std::memcpy(table.data() + tb, chunks.data(), cb);
  at::Tensor dev_table = upload(table.data(), table.size(), dev);
  at::Tensor scale;
  if (grad_scale && grad_scale->defined()) {
    scale = grad_scale->to(dev, at::kFloat).reshape({}).contiguous();
  }
  const auto* base = static_cast<const uint8_t*>(dev_table.const_data_ptr());
  check(launch::adamw(gt, mt, reinterpret_cast<const launch::AdamTensor*>(base),
                      reinterpret_cast<const launch::AdamChunk*>(base + tb), static_cast<int64_t>(chunks.size()), sc,
                      scale.defined() ? scale.const_data_ptr<float>() : nullptr, stream()));
}

at::Tensor multi_tensor_l2norm(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<DType, std::vector<const at::Tensor*>>> groups;
  std::optional<at::Device> dev;
  for (const auto& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    require(t, "multi_tensor_l2norm");
    TORCH_CHECK(t.is_contiguous(), "multi_tensor_l2norm: contiguous tensors expected");
    if (!dev) dev = t.device();
    TORCH_CHECK(t.device() == *dev, "multi_tensor_l2norm: tensors on one device expected");
    DType d = dtype_of(t.scalar_type());
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == d; });
    if (it == groups.end()) {
      groups.push_back({d, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(&t);
  }
  TORCH_CHECK(dev.has_value(), "multi_tensor_l2norm: no CUDA tensor with elements given");
  c10::cuda::CUDAGuard guard(*dev);
  std::vector<at::Tensor> partials;
  for (const auto& [d, ts] : groups) {
    std::vector<launch::NormTensor> meta;
    std::vector<launch::AdamChunk> chunks;
    for (const at::Tensor* t : ts) {
      const int32_t idx = static_cast<int32_t>(meta.size());
      meta.push_back({t->const_data_ptr(), t->numel()});
      const int64_t nchunks = (t->numel() + launch::kAdamChunk - 1) / launch::kAdamChunk;
      for (int64_t c = 0; c < nchunks; ++c) chunks.push_back({idx, static_cast<int32_t>(c)});
    }
    const size_t tb = meta.size() * sizeof(launch::NormTensor), cb = chunks.size() * sizeof(launch::AdamChunk);
    std::vector<uint8_t> table(tb + cb);
    std::memcpy(table.data(), meta.data(), tb);
    std::memcpy(table.data() + tb, chunks.data(), cb);
    at::Tensor dev_table = upload(table.data(), table.size(), *dev);
    at::Tensor partial = at::empty({static_cast<int64_t>(chunks.size())}, at::TensorOptions().device(*dev).dtype(at::kFloat));
    const auto* base = static_cast<const uint8_t*>(dev_table.const_data_ptr());
    check(launch::sumsq(d, reinterpret_cast<const launch::NormTensor*>(base),
                        reinterpret_cast<const launch::AdamChunk*>(base + tb), static_cast<int64_t>(chunks.size()),
                        partial.mutable_data_ptr<float>(), stream()));
    partials.push_back(partial);
  }
  return at::cat(partials).sum().sqrt();
}

at::Tensor clip_coef(const at::Tensor& norm, double max_norm) {
  return at::clamp_max(max_norm / (norm + 1e-6), 1.0).to(at::kFloat);
}


// ---- autograd Functions around the raw kernels ----------------------------------------------------------------------
namespace {
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

class RMSNormCuda : public torch::autograd::Function<RMSNormCuda> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps) {
    auto [y, rstd] = rms_norm_forward(x, w, eps);
    ctx->save_for_backward({x, w, rstd});
    return y;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto [dx, dw] = rms_norm_backward(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

class AddRMSNormCuda : public torch::autograd::Function<AddRMSNormCuda> {
 public:
  static tensor_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& res, const at::Tensor& w,
                             double eps) {
    auto [s, y, rstd] = add_rms_norm_forward(x, res, w, eps);
    ctx->save_for_backward({s, w, rstd});
    return {s, y};
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& s = saved[0];
    at::Tensor ds = grads[0], dy = grads[1].defined() ? grads[1] : at::zeros_like(s);
    auto [dsum, dw] = rms_norm_backward(dy, s, saved[1], saved[2], ds);
    return {dsum, dsum, dw, at::Tensor()};
  }
};

class RopeCuda : public torch::autograd::Function<RopeCuda> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rope_apply(x, cos, sin, /*backward=*/false);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    return {rope_apply(grads[0], saved[0], saved[1], /*backward=*/true), at::Tensor(), at::Tensor()};
  }
};

class SwiGLUCuda : public torch::autograd::Function<SwiGLUCuda> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    ctx->save_for_backward({g, u});
    return swiglu_forward(g, u);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto [dg, du] = swiglu_backward(grads[0], saved[0], saved[1]);
    return {dg, du};
  }
};

class LinearCECuda : public torch::autograd::Function<LinearCECuda> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& target,
                            int64_t ignore_index, int64_t chunk_size) {
    auto [loss, lse, n_valid] = linear_ce_forward(x, w, target, ignore_index, chunk_size);
    ctx->save_for_backward({x, w, target, lse, n_valid});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["chunk_size"] = chunk_size;
    return loss;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto [dx, dw] = linear_ce_backward(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                       ctx->saved_data["ignore_index"].toInt(),
                                       ctx->saved_data["chunk_size"].toInt());
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return RMSNormCuda::apply(x, w, eps); }

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  auto out = AddRMSNormCuda::apply(x, residual, w, eps);
  return {out[0], out[1]};
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return RopeCuda::apply(x, cos, sin);
}

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u) { return SwiGLUCuda::apply(g, u); }

at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& w, const at::Tensor& target,
                                int64_t ignore_index, int64_t chunk_size) {
  const int64_t D = x.size(-1);
  at::Tensor loss = LinearCECuda::apply(x.reshape({-1, D}), w, target.reshape({-1}), ignore_index, chunk_size);
  return loss;
}

}  // namespace lf::kernels::cuda
#endif  // LOONGFORGE_CUDA

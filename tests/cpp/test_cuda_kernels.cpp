// Our CUDA kernels (kernels/cuda_ops.h) against CPU references: the composite ATen versions or the existing CPU
// kernels, values and gradients. The CUDA tests skip without a device (CI: toolkit, no driver); the CPU-side
// dispatchers added with them (add_rms_norm, apply_rope) are tested everywhere.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <tuple>

#include "loongforge/kernels/add_rms_norm.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/kernels/linear_ce.h"
#include "loongforge/kernels/rms_norm.h"
#include "loongforge/kernels/rope.h"
#include "loongforge/kernels/swiglu.h"
#include "loongforge/nn/rotary.h"
#include "loongforge/optim/adamw.h"

namespace cu = lf::kernels::cuda;

namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!cu::available()) GTEST_SKIP() << "no CUDA device (LoongForge CUDA kernels compiled: " << cu::compiled() << ")"

// max |a - b| / max |b| (both brought to the CPU in float64).
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().cpu().to(at::kDouble), y = b.detach().cpu().to(at::kDouble);
  EXPECT_EQ(x.sizes(), y.sizes());
  double den = y.abs().max().item<double>();
  return (x - y).abs().max().item<double>() / (den > 0 ? den : 1.0);
}

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(); }
at::Tensor cuda(const at::Tensor& t, at::ScalarType dt) { return t.detach().to(at::kCUDA, dt).requires_grad_(); }

// Float32 tolerance: a few ulps per element, more where sums over rows/vocabulary are involved.
constexpr double kF32 = 2e-5;
constexpr double kBF16 = 2e-2;

}  // namespace

TEST(CudaKernels, CompiledFlagMatchesBuild) {
#if defined(LOONGFORGE_CUDA) && LOONGFORGE_CUDA
  EXPECT_TRUE(cu::compiled());
#else
  EXPECT_FALSE(cu::compiled());
  EXPECT_FALSE(cu::available());
#endif
  EXPECT_FALSE(cu::supported(at::ones({2})));  // a CPU tensor never goes to the CUDA kernels
}

// CPU: the dispatcher (x + residual, then the CPU RMSNorm kernel) against the composite, values and gradients.
TEST(CudaKernels, AddRMSNormCpuMatchesComposite) {
  at::manual_seed(0);
  at::Tensor x = at::randn({4, 5, 24}, at::kDouble), r = at::randn({4, 5, 24}, at::kDouble);
  at::Tensor w = at::randn({24}, at::kDouble) * 0.3 + 1, a = at::randn({4, 5, 24}, at::kDouble),
             b = at::randn({4, 5, 24}, at::kDouble);
  at::Tensor x1 = leaf(x), r1 = leaf(r), w1 = leaf(w), x2 = leaf(x), r2 = leaf(r), w2 = leaf(w);
  auto [s1, y1] = lf::kernels::add_rms_norm(x1, r1, w1, 1e-6);
  auto [s2, y2] = lf::kernels::add_rms_norm_reference(x2, r2, w2, 1e-6);
  EXPECT_LT(rel_err(s1, s2), 1e-14);
  EXPECT_LT(rel_err(y1, y2), 1e-12);
  auto g1 = torch::autograd::grad({(s1 * a).sum() + (y1 * b).sum()}, {x1, r1, w1});
  auto g2 = torch::autograd::grad({(s2 * a).sum() + (y2 * b).sum()}, {x2, r2, w2});
  for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g1[i], g2[i]), 1e-12) << i;
}

// CPU: the composite RoPE against nn::apply_rotary (the model's version), non-contiguous x as in attention.
TEST(CudaKernels, RopeReferenceMatchesNnRotary) {
  at::manual_seed(1);
  at::Tensor x = at::randn({2, 6, 3, 8}).transpose(1, 2);  // [B=2, H=3, T=6, D=8]
  at::Tensor cos = at::randn({2, 6, 8}), sin = at::randn({2, 6, 8});
  EXPECT_LT(rel_err(lf::kernels::apply_rope(x, cos, sin), lf::nn::apply_rotary(x, cos, sin)), 1e-7);
}

TEST(CudaKernels, RMSNormMatchesCpuKernel) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(2);
  at::Tensor x = at::randn({6, 37, 768}), w = at::randn({768}) * 0.2 + 1, dy = at::randn({6, 37, 768});
  at::Tensor xc = leaf(x), wc = leaf(w);
  at::Tensor y = lf::kernels::rms_norm(xc, wc, 1e-5);  // CPU kernel
  auto g = torch::autograd::grad({y}, {xc, wc}, {dy});
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const double tol = dt == at::kFloat ? kF32 : kBF16;
    at::Tensor xg = cuda(x, dt), wg = cuda(w, dt);
    at::Tensor yg = lf::kernels::rms_norm(xg, wg, 1e-5);  // dispatches to the CUDA kernel
    ASSERT_NE(yg.grad_fn(), nullptr);
    EXPECT_NE(yg.grad_fn()->name().find("RMSNormCuda"), std::string::npos) << yg.grad_fn()->name();
    EXPECT_EQ(yg.scalar_type(), dt);
    auto gg = torch::autograd::grad({yg}, {xg, wg}, {dy.to(at::kCUDA, dt)});
    EXPECT_LT(rel_err(yg, y), tol) << dt;
    EXPECT_LT(rel_err(gg[0], g[0]), tol) << dt;
    EXPECT_LT(rel_err(gg[1], g[1]), tol) << dt;
  }
}

TEST(CudaKernels, RMSNormOddWidthMatchesComposite) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(3);
  at::Tensor x = at::randn({5, 1001}), w = at::randn({1001}), dy = at::randn({5, 1001});
  at::Tensor xc = leaf(x), wc = leaf(w), xg = cuda(x, at::kFloat), wg = cuda(w, at::kFloat);
  at::Tensor y = lf::kernels::rms_norm_reference(xc, wc, 1e-6), yg = cu::rms_norm(xg, wg, 1e-6);
  auto g = torch::autograd::grad({y}, {xc, wc}, {dy});
  auto gg = torch::autograd::grad({yg}, {xg, wg}, {dy.cuda()});
  EXPECT_LT(rel_err(yg, y), kF32);
  EXPECT_LT(rel_err(gg[0], g[0]), kF32);
  EXPECT_LT(rel_err(gg[1], g[1]), kF32);
}

TEST(CudaKernels, AddRMSNormMatchesComposite) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(4);
  at::Tensor x = at::randn({3, 50, 512}), r = at::randn({3, 50, 512}), w = at::randn({512}) * 0.2 + 1;
  at::Tensor a = at::randn({3, 50, 512}), b = at::randn({3, 50, 512});
  at::Tensor xc = leaf(x), rc = leaf(r), wc = leaf(w);
  auto [s, y] = lf::kernels::add_rms_norm_reference(xc, rc, wc, 1e-5);
  auto g = torch::autograd::grad({(s * a).sum() + (y * b).sum()}, {xc, rc, wc});
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const double tol = dt == at::kFloat ? kF32 : kBF16;
    at::Tensor xg = cuda(x, dt), rg = cuda(r, dt), wg = cuda(w, dt);
    auto [sg, yg] = lf::kernels::add_rms_norm(xg, rg, wg, 1e-5);
    at::Tensor loss = (sg.to(at::kFloat) * a.cuda()).sum() + (yg.to(at::kFloat) * b.cuda()).sum();
    auto gg = torch::autograd::grad({loss}, {xg, rg, wg});
    EXPECT_LT(rel_err(sg, s), tol) << dt;
    EXPECT_LT(rel_err(yg, y), tol) << dt;
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(gg[i], g[i]), tol) << dt << " grad " << i;
  }
  // Only y used downstream (undefined gradient for s).
  at::Tensor xg = cuda(x, at::kFloat), rg = cuda(r, at::kFloat), wg = cuda(w, at::kFloat);
  auto [sg, yg] = cu::add_rms_norm(xg, rg, wg, 1e-5);
  auto g1 = torch::autograd::grad({(yg * b.cuda()).sum()}, {xg});
  at::Tensor xc2 = leaf(x), rc2 = leaf(r), wc2 = leaf(w);
  auto [s2, y2] = lf::kernels::add_rms_norm_reference(xc2, rc2, wc2, 1e-5);
  auto g2 = torch::autograd::grad({(y2 * b).sum()}, {xc2});
  EXPECT_LT(rel_err(g1[0], g2[0]), kF32);
}

TEST(CudaKernels, RopeMatchesComposite) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(5);
  // General cos/sin (halves differ) to test the full formula; x non-contiguous as q.transpose(1, 2).
  at::Tensor x = at::randn({2, 17, 4, 64}).transpose(1, 2), dy = at::randn({2, 4, 17, 64});
  at::Tensor cos = at::randn({2, 17, 64}), sin = at::randn({2, 17, 64});
  at::Tensor xc = leaf(x);
  at::Tensor y = lf::kernels::apply_rope_reference(xc, cos, sin);
  auto g = torch::autograd::grad({y}, {xc}, {dy});
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const double tol = dt == at::kFloat ? kF32 : kBF16;
    at::Tensor xg = x.detach().to(at::kCUDA, dt).requires_grad_();  // keeps the transposed strides
    at::Tensor xt = xg.transpose(1, 2).contiguous().transpose(1, 2);
    at::Tensor yg = lf::kernels::apply_rope(xt, cos.cuda(), sin.cuda());
    auto gg = torch::autograd::grad({yg}, {xg}, {dy.to(at::kCUDA, dt)});
    EXPECT_LT(rel_err(yg, y), tol) << dt;
    EXPECT_LT(rel_err(gg[0], g[0]), tol) << dt;
  }
  // Broadcast cos/sin over the batch ([1, T, D]).
  at::Tensor c1 = cos.narrow(0, 0, 1), s1 = sin.narrow(0, 0, 1);
  EXPECT_LT(rel_err(cu::rope(x.cuda(), c1.cuda(), s1.cuda()), lf::kernels::apply_rope_reference(x, c1, s1)), kF32);
}

TEST(CudaKernels, SwiGLUMatchesComposite) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(6);
  at::Tensor gu = at::randn({3, 29, 2 * 344}) * 3, dy = at::randn({3, 29, 344});
  at::Tensor guc = leaf(gu);
  at::Tensor y = at::silu(guc.narrow(-1, 0, 344)) * guc.narrow(-1, 344, 344);
  auto g = torch::autograd::grad({y}, {guc}, {dy});
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const double tol = dt == at::kFloat ? kF32 : kBF16;
    at::Tensor gug = cuda(gu, dt);
    // The two halves of a fused gate/up output: strided rows, no copy.
    at::Tensor yg = cu::swiglu(gug.narrow(-1, 0, 344), gug.narrow(-1, 344, 344));
    auto gg = torch::autograd::grad({yg}, {gug}, {dy.to(at::kCUDA, dt)});
    EXPECT_LT(rel_err(yg, y), tol) << dt;
    EXPECT_LT(rel_err(gg[0], g[0]), tol) << dt;
  }
}

TEST(CudaKernels, LinearCrossEntropyMatchesComposite) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(7);
  const int64_t N = 96, D = 64, V = 1000;
  at::Tensor x = at::randn({N, D}), w = at::randn({V, D}) * 0.1;
  at::Tensor target = at::randint(0, V, {N}, at::kLong);
  target.narrow(0, 0, 7).fill_(-100);  // ignored rows
  at::Tensor xc = leaf(x), wc = leaf(w);
  at::Tensor loss = at::cross_entropy_loss(at::mm(xc, wc.t()).to(at::kFloat), target, {}, at::Reduction::Mean, -100);
  auto g = torch::autograd::grad({loss * 1.7}, {xc, wc});
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t chunk : {int64_t{128}, int64_t{0}}) {  // 1000 = 7*128 + 104; 0: automatic (one chunk here)
      const double tol = dt == at::kFloat ? kF32 : kBF16 * 2;
      at::Tensor xg = cuda(x, dt), wg = cuda(w, dt);
      at::Tensor lg = cu::linear_cross_entropy(xg, wg, target.cuda(), -100, chunk);
      EXPECT_EQ(lg.scalar_type(), at::kFloat);
      auto gg = torch::autograd::grad({lg * 1.7}, {xg, wg});
      EXPECT_LT(rel_err(lg, loss), dt == at::kFloat ? 1e-5 : 1e-2) << dt << " chunk " << chunk;
      EXPECT_LT(rel_err(gg[0], g[0]), tol) << dt << " chunk " << chunk;
      EXPECT_LT(rel_err(gg[1], g[1]), tol) << dt << " chunk " << chunk;
    }
  }
  // [B, T, D] inputs flatten like the composite.
  at::Tensor l3 = cu::linear_cross_entropy(x.cuda().view({4, 24, D}), w.cuda(), target.cuda().view({4, 24}), -100, 300);
  EXPECT_LT(rel_err(l3, loss), 1e-5);
}

TEST(CudaKernels, MultiTensorAdamWMatchesCpuAdamW) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(8);
  // Sizes across the 65536-element chunks, and a tiny one.
  std::vector<std::vector<int64_t>> shapes = {{300, 257}, {5}, {64, 1024}, {1}};
  std::vector<at::Tensor> cpu_params, gpu_params, gpu_m, gpu_v, model;
  for (const auto& s : shapes) {
    at::Tensor p = at::randn(s);
    cpu_params.push_back(leaf(p));
    gpu_params.push_back(p.cuda().contiguous());
    gpu_m.push_back(at::zeros_like(gpu_params.back()));
    gpu_v.push_back(at::zeros_like(gpu_params.back()));
    model.push_back(at::empty_like(gpu_params.back(), at::kBFloat16));
  }
  std::vector<double> wd = {0.1, 0.0, 0.1, 0.05};
  lf::optim::AdamWOptions o;
  o.lr = 3e-3, o.beta1 = 0.9, o.beta2 = 0.95, o.eps = 1e-8;
  lf::optim::AdamW ref(cpu_params, o, wd);
  const double scale = 0.37;
  for (int64_t step = 1; step <= 4; ++step) {
    std::vector<at::Tensor> grads_gpu;
    for (auto& p : cpu_params) {
      // bf16-representable values, so float32 and bfloat16 gradients carry the same numbers.
      grads_gpu.push_back(at::randn(p.sizes()).to(at::kBFloat16).to(at::kCUDA, at::kFloat));
      p.mutable_grad() = grads_gpu.back().cpu() * static_cast<float>(scale);  // the CPU reference: scaled gradient
    }
    ref.step();
    std::vector<at::Tensor> grads_bf16;
    for (auto& gr : grads_gpu) grads_bf16.push_back(gr.to(at::kBFloat16));
    cu::AdamWHyper h{o.lr, o.beta1, o.beta2, o.eps, step};
    at::Tensor sc = at::full({}, scale, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
    // Alternate float32 and bfloat16 gradients (same values); grad_scale applied in the kernel.
    if (step % 2) cu::multi_tensor_adamw(gpu_params, grads_bf16, gpu_m, gpu_v, h, wd, sc, model);
    else cu::multi_tensor_adamw(gpu_params, grads_gpu, gpu_m, gpu_v, h, wd, sc, model);
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_LT(rel_err(gpu_params[i], cpu_params[i]), 1e-6) << i;
    EXPECT_LT(rel_err(gpu_m[i], ref.exp_avg()[i]), 1e-6) << i;
    EXPECT_LT(rel_err(gpu_v[i], ref.exp_avg_sq()[i]), 1e-6) << i;
    EXPECT_TRUE(at::equal(model[i], gpu_params[i].to(at::kBFloat16))) << i;
  }
}

TEST(CudaKernels, GlobalGradNormMatchesComposite) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(9);
  std::vector<at::Tensor> ts = {at::randn({300, 300}), at::randn({7}), at::randn({70000}).to(at::kBFloat16),
                                at::randn({3, 3}).to(at::kBFloat16)};
  std::vector<at::Tensor> gpu;
  double ss = 0;
  for (const auto& t : ts) {
    gpu.push_back(t.cuda());
    ss += t.to(at::kDouble).pow(2).sum().item<double>();
  }
  gpu.push_back(at::Tensor());  // undefined: skipped
  at::Tensor norm = cu::multi_tensor_l2norm(gpu);
  EXPECT_TRUE(norm.is_cuda());
  EXPECT_NEAR(norm.item<double>(), std::sqrt(ss), 1e-5 * std::sqrt(ss));
  EXPECT_NEAR(cu::clip_coef(norm, 1.0).item<double>(), 1.0 / (std::sqrt(ss) + 1e-6), 1e-6);
  EXPECT_EQ(cu::clip_coef(norm, 1e9).item<double>(), 1.0);
}

// ---- FP8 (kernels/cuda/fp8.cpp): plain ATen, so the scaling math and the GEMMs run on the CPU too ------------------
namespace {
// The fp8 value back in float64 with its scale.
at::Tensor dequant(const cu::Fp8Tensor& q) { return q.data.to(at::kDouble) * q.scale_inv.to(at::kDouble); }
}  // namespace

TEST(Fp8, TensorwiseScaleMapsAmaxToFp8Max) {
  at::manual_seed(3);
  at::Tensor t = at::randn({37, 29}) * 5;
  const double amax = t.abs().max().item<double>();
  for (auto [type, mx, rel] : {std::tuple{at::kFloat8_e4m3fn, 448.0, 1.0 / 16}, std::tuple{at::kFloat8_e5m2, 57344.0, 1.0 / 8}}) {
    cu::Fp8Tensor q = cu::fp8_quantize_tensorwise(t, type);
    EXPECT_EQ(q.data.scalar_type(), type);
    EXPECT_EQ(q.data.sizes(), t.sizes());
    EXPECT_NEAR(q.scale_inv.item<double>(), amax / mx, amax / mx * 1e-6);
    EXPECT_NEAR(q.data.to(at::kDouble).abs().max().item<double>(), mx, 0.0);  // the largest element lands on fp8 max
    // Every element within half an ulp of its fp8 value (relative), tiny ones within the smallest normal's scale.
    at::Tensor err = (dequant(q) - t.to(at::kDouble)).abs();
    at::Tensor bound = t.to(at::kDouble).abs() * rel + amax / mx * 0.02;
    EXPECT_TRUE(err.le(bound).all().item<bool>()) << "max err " << err.max().item<double>();
  }
  cu::Fp8Tensor z = cu::fp8_quantize_tensorwise(at::zeros({16}));  // all zeros: no division by zero
  EXPECT_TRUE(z.data.to(at::kFloat).eq(0).all().item<bool>());
  EXPECT_TRUE(std::isfinite(z.scale_inv.item<double>()));
}

// fp8_linear's forward and backward against float64 GEMMs of the dequantized operands (the reference for what an FP8
// GEMM with float32 accumulation computes), and loosely against the unquantized float64 products.
TEST(Fp8, LinearMatchesDequantizedReference) {
  at::manual_seed(4);
  at::Tensor x = at::randn({2, 16, 48}), w = at::randn({32, 48}) * 0.2, bias = at::randn({32}), dy = at::randn({2, 16, 32});
  ASSERT_TRUE(cu::fp8_linear_supported(x, w));
  EXPECT_FALSE(cu::fp8_linear_supported(at::randn({3, 48}), w));  // 3 rows: not a multiple of 16
  at::Tensor x1 = leaf(x), w1 = leaf(w), b1 = leaf(bias);
  at::Tensor y = cu::fp8_linear(x1, w1, b1);
  EXPECT_EQ(y.sizes(), (at::IntArrayRef{2, 16, 32}));
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  auto g = torch::autograd::grad({(y * dy).sum()}, {x1, w1, b1});

  at::Tensor x2 = x.reshape({-1, 48}), dy2 = dy.reshape({-1, 32});
  cu::Fp8Tensor qx = cu::fp8_quantize_tensorwise(x2), qw = cu::fp8_quantize_tensorwise(w),
                qdy = cu::fp8_quantize_tensorwise(dy2);
  at::Tensor y_ref = at::mm(dequant(qx), dequant(qw).t()) + bias.to(at::kDouble);
  at::Tensor dx_ref = at::mm(dequant(qdy), dequant(qw)), dw_ref = at::mm(dequant(qdy).t(), dequant(qx));
  EXPECT_LT(rel_err(y.reshape({-1, 32}), y_ref), 1e-5);
  EXPECT_LT(rel_err(g[0].reshape({-1, 48}), dx_ref), 1e-5);
  EXPECT_LT(rel_err(g[1], dw_ref), 1e-5);
  EXPECT_LT(rel_err(g[2], dy2.sum(0)), 1e-6);
  // The quantization itself: a few per cent of the exact products.
  at::Tensor xd = x2.to(at::kDouble), wd = w.to(at::kDouble), dyd = dy2.to(at::kDouble);
  EXPECT_LT(rel_err(y.reshape({-1, 32}), at::mm(xd, wd.t()) + bias.to(at::kDouble)), 0.08);
  EXPECT_LT(rel_err(g[0].reshape({-1, 48}), at::mm(dyd, wd)), 0.08);
  EXPECT_LT(rel_err(g[1], at::mm(dyd.t(), xd)), 0.08);
}

// Tensorwise and blockwise (cuBLASLt's block-scaled GEMMs on the GPU, dequantized products on the CPU).
TEST(CudaKernels, Fp8LinearMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(5);
  at::Tensor x = at::randn({128, 256}), w = at::randn({384, 256}) * 0.1, dy = at::randn({128, 384});
  for (bool blockwise : {false, true}) {
    auto f = [&](const at::Tensor& a, const at::Tensor& b) {
      return blockwise ? cu::fp8_linear_blockwise(a, b) : cu::fp8_linear(a, b);
    };
    at::Tensor xc = leaf(x), wc = leaf(w), xg = cuda(x, at::kFloat), wg = cuda(w, at::kFloat);
    at::Tensor yc = f(xc, wc), yg = f(xg, wg);
    auto gc = torch::autograd::grad({(yc * dy).sum()}, {xc, wc});
    auto gg = torch::autograd::grad({(yg * dy.to(at::kCUDA)).sum()}, {xg, wg});
    EXPECT_LT(rel_err(yg, yc), 1e-4) << blockwise;
    EXPECT_LT(rel_err(gg[0], gc[0]), 1e-4) << blockwise;
    EXPECT_LT(rel_err(gg[1], gc[1]), 1e-4) << blockwise;
  }
}

// Tensorwise quantization on the GPU (one reduction + our saturating cast kernel) gives the CPU composite's bytes and
// scale: float32 and bfloat16 inputs, an odd length (the grid-stride tail), zeros and both signs.
TEST(CudaKernels, Fp8QuantizeMatchesCpuBitwise) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(9);
  at::Tensor t = at::randn({1001, 77}) * at::rand({1001, 1}) * 30;
  t.index_put_({at::indexing::Slice(0, 5)}, 0.0);
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor c = t.to(dt);
    const cu::Fp8Tensor qc = cu::fp8_quantize_tensorwise(c), qg = cu::fp8_quantize_tensorwise(c.to(at::kCUDA));
    ASSERT_EQ(qg.data.scalar_type(), at::kFloat8_e4m3fn);
    EXPECT_TRUE(at::equal(qg.data.cpu().view(at::kByte), qc.data.view(at::kByte))) << dt;
    EXPECT_EQ(qg.scale_inv.item<float>(), qc.scale_inv.item<float>()) << dt;
  }
}

// Blockwise scales: each 1 x 128 (or 128 x 128) block's largest element lands on fp8 max, every element within half
// an ulp of its block's grid; an all-zero block keeps a finite scale; shapes that do not tile are an error.
TEST(Fp8, BlockwiseScalesPerBlock) {
  at::manual_seed(6);
  // rows and column blocks of very different magnitudes
  at::Tensor t = at::randn({256, 384}) * at::pow(10.0, at::randint(-3, 3, {256, 1}).to(at::kFloat)) *
                 at::tensor({1.0f, 30.0f, 0.01f}).repeat_interleave(128).unsqueeze(0);
  t.narrow(0, 5, 1).narrow(1, 128, 128).zero_();
  for (int64_t br : {1, 128}) {
    cu::Fp8Tensor q = cu::fp8_quantize_blockwise(t, br);
    ASSERT_EQ(q.scale_inv.sizes(), (at::IntArrayRef{256 / br, 3}));
    at::Tensor amax = t.abs().reshape({256 / br, br, 3, 128}).amax({1, 3}).to(at::kDouble);
    at::Tensor qmax = q.data.to(at::kDouble).abs().reshape({256 / br, br, 3, 128}).amax({1, 3});
    at::Tensor nonzero = amax.gt(0);
    EXPECT_TRUE(qmax.masked_select(nonzero).eq(448.0).all().item<bool>()) << br;
    EXPECT_TRUE(at::isfinite(q.scale_inv).all().item<bool>()) << br;
    at::Tensor deq = cu::fp8_dequantize_blockwise(q).to(at::kDouble);
    at::Tensor step = (amax / 448.0).repeat_interleave(br, 0).repeat_interleave(128, 1);
    at::Tensor err = (deq - t.to(at::kDouble)).abs();
    EXPECT_TRUE(err.le(t.to(at::kDouble).abs() / 16 + step * 0.02).all().item<bool>()) << br << " max err " << err.max().item<double>();
  }
  EXPECT_THROW(cu::fp8_quantize_blockwise(at::randn({256, 100}), 1), c10::Error);
  EXPECT_THROW(cu::fp8_quantize_blockwise(at::randn({100, 128}), 128), c10::Error);
}

// fp8_linear_blockwise's forward and backward against float64 products of the blockwise-dequantized operands, and,
// on inputs whose rows differ in magnitude by up to 1e6, every row within a few per cent of the exact product, where
// tensorwise scaling flushes the smallest rows to zero.
TEST(Fp8, LinearBlockwiseMatchesDequantizedReference) {
  at::manual_seed(7);
  at::Tensor x = at::randn({2, 128, 256}) * at::pow(10.0, at::randint(-3, 4, {2, 128, 1}).to(at::kFloat));
  at::Tensor w = at::randn({384, 256}) * 0.1, bias = at::randn({384}), dy = at::randn({2, 128, 384});
  ASSERT_TRUE(cu::fp8_linear_blockwise_supported(x, w));
  EXPECT_FALSE(cu::fp8_linear_blockwise_supported(at::randn({1, 64, 256}), w));  // 64 rows: not a multiple of 128
  at::Tensor x1 = leaf(x), w1 = leaf(w), b1 = leaf(bias);
  at::Tensor y = cu::fp8_linear_blockwise(x1, w1, b1);
  EXPECT_EQ(y.sizes(), (at::IntArrayRef{2, 128, 384}));
  auto g = torch::autograd::grad({(y * dy).sum()}, {x1, w1, b1});

  at::Tensor x2 = x.reshape({-1, 256}), dy2 = dy.reshape({-1, 384});
  auto dq = [](const cu::Fp8Tensor& q) { return cu::fp8_dequantize_blockwise(q).to(at::kDouble); };
  at::Tensor y_ref = at::mm(dq(cu::fp8_quantize_blockwise(x2, 1)), dq(cu::fp8_quantize_blockwise(w, 128)).t()) +
                     bias.to(at::kDouble);
  at::Tensor dx_ref = at::mm(dq(cu::fp8_quantize_blockwise(dy2, 1)), dq(cu::fp8_quantize_blockwise(w, 128)));
  at::Tensor dw_ref = at::mm(dq(cu::fp8_quantize_blockwise(dy2.t().contiguous(), 1)),
                             dq(cu::fp8_quantize_blockwise(x2.t().contiguous(), 1)).t());
  EXPECT_LT(rel_err(y.reshape({-1, 384}), y_ref), 1e-5);
  EXPECT_LT(rel_err(g[0].reshape({-1, 256}), dx_ref), 1e-5);
  EXPECT_LT(rel_err(g[1], dw_ref), 1e-5);
  EXPECT_LT(rel_err(g[2], dy2.sum(0)), 1e-6);
  // Against the exact product, row by row (relative to each row's size): blockwise keeps every row's precision,
  // tensorwise loses the small rows to the large ones' scale (e4m3 spans ~2^17 from its smallest subnormal to 448).
  at::Tensor exact = at::mm(x2.to(at::kDouble), w.to(at::kDouble).t());
  at::Tensor yt = cu::fp8_linear(x2, w);
  auto worst_row = [&](const at::Tensor& got) {
    at::Tensor e = (got.to(at::kDouble) - exact).abs().amax(1) / exact.abs().amax(1);
    return e.max().item<double>();
  };
  const double blockwise = worst_row(cu::fp8_linear_blockwise(x2, w)), tensorwise = worst_row(yt);
  EXPECT_LT(blockwise, 0.1);
  EXPECT_GT(tensorwise, 0.5) << blockwise << " vs " << tensorwise;
}

// What the trainer calls on CUDA tensors: the device-generic entry points route to our kernels; compare with the
// CPU versions of the same entry points.
TEST(CudaKernels, TrainerEntryPointsMatchCpu) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(6);
  // SwiGLU (kernels::swiglu), values and gradients.
  at::Tensor g = at::randn({4, 7, 96}), u = at::randn({4, 7, 96}), dy = at::randn({4, 7, 96});
  at::Tensor g1 = leaf(g), u1 = leaf(u), g2 = cuda(g, at::kFloat), u2 = cuda(u, at::kFloat);
  at::Tensor y1 = lf::kernels::swiglu(g1, u1), y2 = lf::kernels::swiglu(g2, u2);
  EXPECT_LT(rel_err(y2, y1), kF32);
  auto d1 = torch::autograd::grad({(y1 * dy).sum()}, {g1, u1});
  auto d2 = torch::autograd::grad({(y2 * dy.to(at::kCUDA)).sum()}, {g2, u2});
  EXPECT_LT(rel_err(d2[0], d1[0]), kF32);
  EXPECT_LT(rel_err(d2[1], d1[1]), kF32);
  // Fused linear + CE (kernels::linear_cross_entropy): loss sum and count as the CPU version, with ignored rows.
  at::Tensor x = at::randn({3, 40, 64}), w = at::randn({1000, 64}) * 0.1;
  at::Tensor t = at::randint(0, 1000, {3, 40}, at::kLong);
  t.index_put_({0, at::indexing::Slice(0, 5)}, -100);
  at::Tensor x1 = leaf(x), w1 = leaf(w), x2 = cuda(x, at::kFloat), w2 = cuda(w, at::kFloat);
  auto [l1, c1] = lf::kernels::linear_cross_entropy(x1, w1, t);
  auto [l2, c2] = lf::kernels::linear_cross_entropy(x2, w2, t.to(at::kCUDA));
  EXPECT_EQ(c2.item<int64_t>(), c1.item<int64_t>());
  EXPECT_LT(rel_err(l2, l1), kF32);
  auto e1 = torch::autograd::grad({l1}, {x1, w1});
  auto e2 = torch::autograd::grad({l2}, {x2, w2});
  EXPECT_LT(rel_err(e2[0], e1[0]), 1e-4);
  EXPECT_LT(rel_err(e2[1], e1[1]), 1e-4);
  // nn::apply_rotary on CUDA (the fused RoPE) against its CPU composite.
  at::Tensor q = at::randn({2, 4, 9, 16}), pos = at::arange(9, at::kLong).unsqueeze(0);
  at::Tensor ang = pos.to(at::kFloat).unsqueeze(-1) * at::rand({8});
  at::Tensor cos = at::cat({ang, ang}, -1).cos(), sin = at::cat({ang, ang}, -1).sin();
  EXPECT_LT(rel_err(lf::nn::apply_rotary(q.to(at::kCUDA), cos.to(at::kCUDA), sin.to(at::kCUDA)),
                    lf::nn::apply_rotary(q, cos, sin)),
            kF32);
}

// optim::AdamW and optim::clip_grad_norm on CUDA parameters (the multi-tensor kernels) against the same on the CPU.
TEST(CudaKernels, OptimOnCudaParamsMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(7);
  std::vector<at::Tensor> pc, pg;
  for (int64_t n : {17, 300, 5000}) {
    at::Tensor p = at::randn({n});
    pc.push_back(leaf(p));
    pg.push_back(cuda(p, at::kFloat));
  }
  lf::optim::AdamW oc(pc, {1e-2, 0.9, 0.95, 1e-8, 0.1}, {0.1, 0.0, 0.1});
  lf::optim::AdamW og(pg, {1e-2, 0.9, 0.95, 1e-8, 0.1}, {0.1, 0.0, 0.1});
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < pc.size(); ++i) {
      at::Tensor gr = at::randn(pc[i].sizes()) * 3;
      pc[i].mutable_grad() = gr;
      pg[i].mutable_grad() = gr.to(at::kCUDA);
    }
    const double nc = lf::optim::clip_grad_norm(pc, 1.0), ng = lf::optim::clip_grad_norm(pg, 1.0);
    EXPECT_NEAR(ng, nc, nc * 1e-5);
    oc.step(1e-2 * (step + 1));
    og.step(1e-2 * (step + 1));
  }
  for (size_t i = 0; i < pc.size(); ++i) EXPECT_LT(rel_err(pg[i], pc[i]), 1e-5) << i;
}

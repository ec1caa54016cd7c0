// Our CUDA kernels (kernels/cuda_ops.h) against CPU references: the composite ATen versions or the existing CPU
// kernels, values and gradients. The CUDA tests skip without a device (CI: toolkit, no driver); the CPU-side
// dispatchers added with them (add_rms_norm, apply_rope) are tested everywhere.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/add_rms_norm.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/kernels/rms_norm.h"
#include "loongforge/kernels/rope.h"
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

// Fused SwiGLU, fused linear + cross-entropy, RoPE, the causal convolution + SiLU, top-k sparse attention and the row-split linear (CPU) against float64 finite differences and against their composite
// ATen versions.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "loongforge/kernels/causal_conv.h"
#include "loongforge/kernels/cpu/blas.h"
#include "loongforge/kernels/linear.h"
#include "loongforge/kernels/linear_ce.h"
#include "loongforge/kernels/rope.h"
#include "loongforge/kernels/sparse_attention.h"
#include "loongforge/kernels/swiglu.h"
#include "loongforge/nn/rotary.h"
#include "test_util.h"

namespace {

double max_abs(const at::Tensor& a) { return a.abs().max().item<double>(); }
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return max_abs(a.to(at::kDouble) - b.to(at::kDouble)) / std::max(1e-30, max_abs(b.to(at::kDouble)));
}

// ---- SwiGLU ---------------------------------------------------------------------------------------------------

TEST(SwiGLUKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(0);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor g = (at::randn({3, 5, 7}, opts) * 3).requires_grad_(), u = at::randn({3, 5, 7}, opts).requires_grad_();
  at::Tensor dy = at::randn({3, 5, 7}, opts);
  at::Tensor y = lf::kernels::swiglu(g, u);
  at::Tensor gd = g.detach().clone(), ud = u.detach().clone();
  auto f = [&] { return lf::kernels::swiglu_reference(gd, ud); };
  EXPECT_LT(max_abs(y - f()), 1e-12);
  auto grads = torch::autograd::grad({y}, {g, u}, {dy});
  EXPECT_LT(max_abs(grads[0] - lf::test::numeric_grad(f, gd, dy)), 1e-7);
  EXPECT_LT(max_abs(grads[1] - lf::test::numeric_grad(f, ud, dy)), 1e-7);
}

// float32, sizes that are not multiples of the vector width or of the parallel grain, extreme gate values.
TEST(SwiGLUKernel, MatchesCompositeFloat32) {
  at::manual_seed(1);
  for (auto shape : {std::vector<int64_t>{3, 37, 129}, std::vector<int64_t>{5}, std::vector<int64_t>{70001}}) {
    at::Tensor g = (at::randn(shape) * 4).requires_grad_(), u = at::randn(shape).requires_grad_();
    at::Tensor dy = at::randn(shape);
    {
      at::NoGradGuard ng;
      g.view({-1})[0] = 95.f;  // beyond the exp clamp
      if (g.numel() > 1) g.view({-1})[1] = -95.f;
    }
    at::Tensor y = lf::kernels::swiglu(g, u);
    auto gr = torch::autograd::grad({y}, {g, u}, {dy});
    at::Tensor g2 = g.detach().clone().requires_grad_(), u2 = u.detach().clone().requires_grad_();
    at::Tensor y2 = lf::kernels::swiglu_reference(g2, u2);
    auto gr2 = torch::autograd::grad({y2}, {g2, u2}, {dy});
    EXPECT_LT(rel_err(y, y2), 1e-6);
    EXPECT_LT(rel_err(gr[0], gr2[0]), 1e-6);
    EXPECT_LT(rel_err(gr[1], gr2[1]), 1e-6);
    EXPECT_EQ(y.sizes(), y2.sizes());
  }
}

// ---- GeGLU (tanh GELU; Gemma's MLP in π0) -----------------------------------------------------------------------

// float64: the fused Function against central differences of transformers' composite (gelu tanh * up), and its
// values to the composite's.
TEST(GeGLUKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(10);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor g = (at::randn({3, 5, 7}, opts) * 3).requires_grad_(), u = at::randn({3, 5, 7}, opts).requires_grad_();
  at::Tensor dy = at::randn({3, 5, 7}, opts);
  at::Tensor y = lf::kernels::geglu_tanh(g, u);
  EXPECT_NE(y.grad_fn()->name().find("GatedFunction"), std::string::npos) << y.grad_fn()->name();
  at::Tensor gd = g.detach().clone(), ud = u.detach().clone();
  auto f = [&] { return lf::kernels::geglu_tanh_reference(gd, ud); };
  EXPECT_LT(max_abs(y - f()), 1e-12);
  auto grads = torch::autograd::grad({y}, {g, u}, {dy});
  EXPECT_LT(max_abs(grads[0] - lf::test::numeric_grad(f, gd, dy)), 1e-7);
  EXPECT_LT(max_abs(grads[1] - lf::test::numeric_grad(f, ud, dy)), 1e-7);
}

// float32 (the AVX2 path where the CPU has it) and bfloat16 against the composite: sizes off the vector width and the
// parallel grain, gates far out on both sides, a NaN that propagates.
TEST(GeGLUKernel, MatchesCompositeFloat32AndBFloat16) {
  at::manual_seed(11);
  for (auto shape : {std::vector<int64_t>{3, 37, 129}, std::vector<int64_t>{5}, std::vector<int64_t>{70001}}) {
    at::Tensor g = (at::randn(shape) * 4).requires_grad_(), u = at::randn(shape).requires_grad_();
    at::Tensor dy = at::randn(shape);
    {
      at::NoGradGuard ng;
      g.view({-1})[0] = 40.f;
      if (g.numel() > 1) g.view({-1})[1] = -40.f;
    }
    at::Tensor y = lf::kernels::geglu_tanh(g, u);
    auto gr = torch::autograd::grad({y}, {g, u}, {dy});
    // against the float64 composite (the float32 composite itself is ~1e-6 off in dg)
    at::Tensor g2 = g.detach().to(at::kDouble).requires_grad_(), u2 = u.detach().to(at::kDouble).requires_grad_();
    at::Tensor y2 = lf::kernels::geglu_tanh_reference(g2, u2);
    auto gr2 = torch::autograd::grad({y2}, {g2, u2}, {dy.to(at::kDouble)});
    EXPECT_LT(rel_err(y, y2), 1e-6);
    EXPECT_LT(rel_err(gr[0], gr2[0]), 1e-6);
    EXPECT_LT(rel_err(gr[1], gr2[1]), 1e-6);
    EXPECT_EQ(y.scalar_type(), at::kFloat);
    at::Tensor gb = g.detach().to(at::kBFloat16), ub = u.detach().to(at::kBFloat16);
    EXPECT_LT(rel_err(lf::kernels::geglu_tanh(gb, ub), lf::kernels::geglu_tanh_reference(gb, ub)), 1e-2);
  }
  at::Tensor gn = at::randn({9});
  gn[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(lf::kernels::geglu_tanh(gn, at::ones({9}))[3].item<float>()));
}

// GELU's tanh form alone (ViT / SigLIP MLPs, DiT's feed-forward): float64 gradients against finite differences of
// ATen's gelu(x, "tanh"), float32 and bfloat16 against it (float32: against the float64 values), a NaN propagating.
TEST(GeluTanhKernel, MatchesAtenAndFiniteDifferences) {
  at::manual_seed(12);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = (at::randn({4, 37}, opts) * 3).requires_grad_();
  at::Tensor dy = at::randn({4, 37}, opts);
  at::Tensor y = lf::kernels::gelu_tanh(x);
  EXPECT_NE(y.grad_fn()->name().find("GeluTanhFunction"), std::string::npos) << y.grad_fn()->name();
  at::Tensor xd = x.detach().clone();
  auto f = [&] { return at::gelu(xd, "tanh"); };
  EXPECT_LT(max_abs(y - f()), 1e-12);
  EXPECT_LT(max_abs(torch::autograd::grad({y}, {x}, {dy})[0] - lf::test::numeric_grad(f, xd, dy)), 1e-7);
  for (int64_t n : {5, 129, 70001}) {
    at::Tensor xf = (at::randn({n}) * 4).requires_grad_(), df = at::randn({n});
    {
      at::NoGradGuard ng;
      xf[0] = 40.f;
      if (n > 1) xf[1] = -40.f;
    }
    at::Tensor yf = lf::kernels::gelu_tanh(xf);
    at::Tensor x64 = xf.detach().to(at::kDouble).requires_grad_();
    at::Tensor y64 = at::gelu(x64, "tanh");
    EXPECT_LT(rel_err(yf, y64), 1e-6);
    // the gradient within twice ATen's own float32 error (or 1e-6)
    const at::Tensor g64 = torch::autograd::grad({y64}, {x64}, {df.to(at::kDouble)})[0];
    at::Tensor xa = xf.detach().clone().requires_grad_();
    const double aten = rel_err(torch::autograd::grad({at::gelu(xa, "tanh")}, {xa}, {df})[0], g64);
    EXPECT_LT(rel_err(torch::autograd::grad({yf}, {xf}, {df})[0], g64), std::max(2 * aten, 1e-6)) << "ATen " << aten;
    at::Tensor xb = xf.detach().to(at::kBFloat16);
    EXPECT_LT(rel_err(lf::kernels::gelu_tanh(xb), at::gelu(xb, "tanh")), 1e-2);
  }
  at::Tensor xn = at::randn({9});
  xn[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(lf::kernels::gelu_tanh(xn)[3].item<float>()));
}

TEST(SwiGLUKernel, NonContiguousAndNaN) {
  at::manual_seed(2);
  at::Tensor g = at::randn({16, 24}).t(), u = at::randn({24, 16});
  EXPECT_LT(rel_err(lf::kernels::swiglu(g, u), lf::kernels::swiglu_reference(g, u)), 1e-6);
  at::Tensor gn = at::randn({9});
  gn[3] = std::numeric_limits<float>::quiet_NaN();
  at::Tensor y = lf::kernels::swiglu(gn, at::ones({9}));
  EXPECT_TRUE(std::isnan(y[3].item<float>()));
  EXPECT_FALSE(std::isnan(y[2].item<float>()));
}

// bf16 inputs compute in float32 and round once: the result is the float32 result rounded to bf16.
TEST(SwiGLUKernel, BFloat16ComputesInFloat32) {
  at::manual_seed(3);
  at::Tensor g = (at::randn({4, 300}) * 3).to(at::kBFloat16).requires_grad_();
  at::Tensor u = at::randn({4, 300}).to(at::kBFloat16).requires_grad_();
  at::Tensor dy = at::randn({4, 300}).to(at::kBFloat16);
  at::Tensor y = lf::kernels::swiglu(g, u);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  auto gr = torch::autograd::grad({y}, {g, u}, {dy});
  at::Tensor gf = g.detach().to(at::kFloat).requires_grad_(), uf = u.detach().to(at::kFloat).requires_grad_();
  at::Tensor yf = lf::kernels::swiglu_reference(gf, uf);
  auto grf = torch::autograd::grad({yf}, {gf, uf}, {dy.to(at::kFloat)});
  // one bf16 rounding: relative 2^-8 of each element
  auto close = [](const at::Tensor& a, const at::Tensor& ref) {
    at::Tensor d = (a.to(at::kFloat) - ref).abs(), tol = ref.abs() * (1.0 / 256) + 1e-6;
    return (d <= tol).all().item<bool>();
  };
  EXPECT_TRUE(close(y, yf));
  EXPECT_TRUE(close(gr[0], grf[0]));
  EXPECT_TRUE(close(gr[1], grf[1]));
  // and it is at least as close to float32 as the composite bf16 version
  at::Tensor yb = lf::kernels::swiglu_reference(g.detach(), u.detach());
  EXPECT_LE(max_abs(y.to(at::kFloat) - yf), max_abs(yb.to(at::kFloat) - yf) + 1e-6);
}

// ---- linear + cross-entropy ------------------------------------------------------------------------------------

TEST(LinearCEKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(4);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({7, 5}, opts).requires_grad_(), w = at::randn({11, 5}, opts).requires_grad_();
  at::Tensor t = at::randint(0, 11, {7}, at::kLong);
  t[2] = -100;
  t[5] = -100;
  // chunk of 2 rows: counted rows 5 -> chunks 2 + 2 + 1
  auto [loss, count] = lf::kernels::linear_cross_entropy(x, w, t, -100, 2);
  EXPECT_EQ(count.item<int64_t>(), 5);
  at::Tensor xd = x.detach().clone(), wd = w.detach().clone();
  auto f = [&] { return std::get<0>(lf::kernels::linear_cross_entropy_reference(xd, wd, t)); };
  EXPECT_LT(std::abs(loss.item<double>() - f().item<double>()), 1e-12);
  at::Tensor dy = at::scalar_tensor(0.37, opts);
  auto grads = torch::autograd::grad({loss}, {x, w}, {dy});
  at::Tensor nx = lf::test::numeric_grad(f, xd, dy), nw = lf::test::numeric_grad(f, wd, dy);
  EXPECT_LT(max_abs(grads[0] - nx), 1e-7);
  EXPECT_LT(max_abs(grads[1] - nw), 1e-7);
  EXPECT_EQ(max_abs(grads[0][2]), 0.0);  // ignored rows get no gradient
}

// float32 against at::cross_entropy_loss(x W^T): chunk boundaries (N not a multiple of the chunk), ignored rows,
// a leading batch shape, the default chunk, a vocabulary that is not a multiple of 8.
TEST(LinearCEKernel, MatchesCompositeFloat32) {
  at::manual_seed(5);
  for (int64_t chunk : {0, 7, 64, 1000}) {
    for (int64_t v : {203, 256}) {
      at::Tensor x = at::randn({3, 37, 48}).requires_grad_(), w = (at::randn({v, 48}) * 0.3).requires_grad_();
      at::Tensor t = at::randint(0, v, {3, 37}, at::kLong);
      t.index_put_({at::rand({3, 37}) < 0.3}, -100);
      auto [loss, count] = lf::kernels::linear_cross_entropy(x, w, t, -100, chunk);
      auto g = torch::autograd::grad({loss}, {x, w}, {at::scalar_tensor(0.01f)});
      at::Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
      auto [loss2, count2] = lf::kernels::linear_cross_entropy_reference(x2, w2, t);
      auto g2 = torch::autograd::grad({loss2}, {x2, w2}, {at::scalar_tensor(0.01f)});
      EXPECT_EQ(loss.scalar_type(), at::kFloat);
      EXPECT_EQ(count.item<int64_t>(), count2.item<int64_t>());
      EXPECT_LT(std::abs(loss.item<double>() - loss2.item<double>()) / loss2.item<double>(), 2e-6) << chunk << " " << v;
      EXPECT_LT(rel_err(g[0], g2[0]), 2e-5) << chunk << " " << v;
      EXPECT_LT(rel_err(g[1], g2[1]), 2e-5) << chunk << " " << v;
      EXPECT_EQ(g[0].sizes(), x.sizes());
    }
  }
}

// Only the gradients asked for; the same results; eval mode (no grad) gives the same loss.
TEST(LinearCEKernel, PartialGradientsAndNoGrad) {
  at::manual_seed(6);
  at::Tensor x = at::randn({50, 16}), w = at::randn({40, 16});
  at::Tensor t = at::randint(0, 40, {50}, at::kLong);
  auto [l_ref, c_ref, dx_ref, dw_ref] = lf::kernels::linear_cross_entropy_cpu(x, w, t, -100, 16, true, true);
  auto [l1, c1, dx1, dw1] = lf::kernels::linear_cross_entropy_cpu(x, w, t, -100, 16, true, false);
  EXPECT_FALSE(dw1.defined());
  EXPECT_TRUE(at::equal(dx1, dx_ref));
  at::Tensor xr = x.clone().requires_grad_();  // frozen weight (LoRA): only dx
  auto [l2, c2] = lf::kernels::linear_cross_entropy(xr, w, t, -100, 16);
  l2.backward();
  EXPECT_TRUE(at::allclose(xr.grad(), dx_ref));
  {
    at::NoGradGuard ng;
    auto [l3, c3] = lf::kernels::linear_cross_entropy(x, w, t, -100, 16);
    EXPECT_EQ(l3.item<float>(), l_ref.item<float>());
    EXPECT_FALSE(l3.requires_grad());
  }
}

// Tied embeddings: the weight also feeds an embedding lookup; the gradients add up as with the composite version.
TEST(LinearCEKernel, TiedWeightAccumulates) {
  at::manual_seed(7);
  at::Tensor emb = at::randn({30, 12}).requires_grad_();
  at::Tensor ids = at::randint(0, 30, {20}, at::kLong), t = at::randint(0, 30, {20}, at::kLong);
  auto run = [&](bool fused) {
    at::Tensor e = emb.detach().clone().requires_grad_();
    at::Tensor h = at::embedding(e, ids) * 1.5;
    at::Tensor loss = fused ? std::get<0>(lf::kernels::linear_cross_entropy(h, e, t, -100, 8))
                            : std::get<0>(lf::kernels::linear_cross_entropy_reference(h, e, t));
    loss.backward();
    return e.grad();
  };
  EXPECT_LT(rel_err(run(true), run(false)), 1e-5);
}

TEST(LinearCEKernel, AllIgnoredBFloat16AndErrors) {
  at::manual_seed(8);
  at::Tensor x = at::randn({6, 8}).requires_grad_(), w = at::randn({10, 8}).requires_grad_();
  at::Tensor t = at::full({6}, -100, at::kLong);
  auto [loss, count] = lf::kernels::linear_cross_entropy(x, w, t);
  EXPECT_EQ(count.item<int64_t>(), 0);
  EXPECT_EQ(loss.item<float>(), 0.f);
  loss.backward();
  EXPECT_EQ(max_abs(x.grad()), 0.0);
  EXPECT_EQ(max_abs(w.grad()), 0.0);
  // bf16: GEMMs in bf16, softmax in float32, as the composite version under autocast.
  at::Tensor xb = at::randn({33, 64}).to(at::kBFloat16).requires_grad_();
  at::Tensor wb = (at::randn({100, 64}) * 0.2).to(at::kBFloat16).requires_grad_();
  at::Tensor tb = at::randint(0, 100, {33}, at::kLong);
  auto [lb, cb] = lf::kernels::linear_cross_entropy(xb, wb, tb, -100, 10);
  auto gb = torch::autograd::grad({lb}, {xb, wb});
  at::Tensor xb2 = xb.detach().clone().requires_grad_(), wb2 = wb.detach().clone().requires_grad_();
  auto [lb2, cb2] = lf::kernels::linear_cross_entropy_reference(xb2, wb2, tb);
  auto gb2 = torch::autograd::grad({lb2}, {xb2, wb2});
  EXPECT_EQ(gb[0].scalar_type(), at::kBFloat16);
  EXPECT_LT(std::abs(lb.item<double>() - lb2.item<double>()) / lb2.item<double>(), 1e-3);
  EXPECT_LT(rel_err(gb[0], gb2[0]), 2e-2);
  EXPECT_LT(rel_err(gb[1], gb2[1]), 2e-2);
  // a target outside the vocabulary is an error
  at::Tensor bad = at::zeros({6}, at::kLong);
  bad[1] = 10;
  EXPECT_THROW(lf::kernels::linear_cross_entropy(x, w, bad), c10::Error);
}

// ---- RoPE ------------------------------------------------------------------------------------------------------

// float64 gradient of x against finite differences of the composite version; cos/sin per batch row.
TEST(RopeKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(20);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({2, 3, 5, 6}, opts).requires_grad_(), dy = at::randn({2, 3, 5, 6}, opts);
  at::Tensor ang = at::randn({2, 5, 6}, opts);
  at::Tensor cos = ang.cos(), sin = ang.sin() * 1.3;  // scaled sin: not a pure rotation
  at::Tensor y = lf::kernels::apply_rope(x, cos, sin);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_NE(y.grad_fn()->name().find("Rope"), std::string::npos);  // the fused Function ran
  at::Tensor xd = x.detach().clone();
  auto f = [&] { return lf::kernels::apply_rope_reference(xd, cos, sin); };
  EXPECT_LT(max_abs(y - f()), 1e-14);
  auto g = torch::autograd::grad({y}, {x}, {dy});
  EXPECT_LT(max_abs(g[0] - lf::test::numeric_grad(f, xd, dy)), 1e-8);
}

// float32 as the attention uses it: q/k are [B,T,H,D] memory viewed as [B,H,T,D], cos/sin float32 [1,T,D]; values
// and gradients equal the composite's bit for bit, the output keeps x's layout.
TEST(RopeKernel, MatchesCompositeFloat32Strided) {
  at::manual_seed(21);
  for (int64_t d : {32, 6, 64}) {
    at::Tensor base = at::randn({3, 7, 4, d});  // [B,T,H,D]
    at::Tensor x = base.transpose(1, 2).requires_grad_();
    at::Tensor ang = at::arange(7, at::kFloat).unsqueeze(-1) * at::rand({d}) * 3;
    at::Tensor cos = ang.cos().unsqueeze(0), sin = ang.sin().unsqueeze(0);
    at::Tensor dy = at::randn({3, 7, 4, d}).transpose(1, 2);
    at::Tensor y = lf::kernels::apply_rope(x, cos, sin);
    auto g = torch::autograd::grad({y}, {x}, {dy});
    at::Tensor x2 = x.detach().clone().requires_grad_();
    at::Tensor y2 = lf::kernels::apply_rope_reference(x2, cos, sin);
    auto g2 = torch::autograd::grad({y2}, {x2}, {dy});
    EXPECT_TRUE(at::equal(y, y2)) << d;
    EXPECT_TRUE(at::equal(g[0], g2[0])) << d;
    EXPECT_EQ(y.strides(), x.strides());
    // a non-dense x (a slice of the head dim's neighbours) and a contiguous dy
    at::Tensor wide = at::randn({2, 3, 5, 2 * d}), xs = wide.narrow(-1, 0, d);
    at::Tensor c5 = cos.narrow(1, 0, 5), s5 = sin.narrow(1, 0, 5);
    EXPECT_TRUE(at::equal(lf::kernels::apply_rope(xs, c5, s5), lf::kernels::apply_rope_reference(xs, c5, s5)));
    at::Tensor dyc = at::randn({2, 3, 5, d});
    at::Tensor xr = xs.clone().requires_grad_();
    auto gr = torch::autograd::grad({lf::kernels::apply_rope_reference(xr, c5, s5)}, {xr}, {dyc});
    EXPECT_TRUE(at::equal(lf::kernels::rope_backward_cpu(dyc, c5, s5), gr[0]));
  }
}

// Inputs the kernel does not take fall back to the composite version (gradients for cos/sin, bf16, 3-d x).
TEST(RopeKernel, FallsBackToComposite) {
  at::manual_seed(22);
  at::Tensor x = at::randn({1, 2, 4, 8}), ang = at::randn({1, 4, 8}).requires_grad_();
  at::Tensor y = lf::kernels::apply_rope(x, ang.cos(), ang.sin());
  auto g = torch::autograd::grad({y.sum()}, {ang});
  at::Tensor a2 = ang.detach().clone().requires_grad_();
  auto g2 = torch::autograd::grad({lf::kernels::apply_rope_reference(x, a2.cos(), a2.sin()).sum()}, {a2});
  EXPECT_TRUE(at::allclose(g[0], g2[0]));
  at::Tensor xb = x.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(lf::kernels::apply_rope(xb, ang.detach().cos(), ang.detach().sin()),
                        lf::kernels::apply_rope_reference(xb, ang.detach().cos(), ang.detach().sin())));
  EXPECT_THROW(lf::kernels::rope_forward_cpu(x.squeeze(0), ang.detach().cos(), ang.detach().sin()), c10::Error);
}

// Multimodal RoPE (Qwen2-VL's mrope_section): [3, B, T] positions with three equal rows give the 1D tables; otherwise
// each frequency section turns with its own row (temporal, height, width, then again from temporal).
TEST(Rotary, MultimodalSectionsTakeTheirOwnRows) {
  lf::nn::RopeSpec spec;
  spec.head_dim = 12;
  spec.max_position_embeddings = 64;
  spec.mrope_section = {2, 1, 3};
  lf::nn::Rotary rope(spec);
  at::Tensor pos = at::arange(10, at::kLong).view({2, 5});
  auto [c1, s1] = rope.cos_sin(pos);
  auto [c3, s3] = rope.cos_sin(pos.unsqueeze(0).expand({3, 2, 5}));
  EXPECT_TRUE(at::equal(c1, c3) && at::equal(s1, s3));
  at::Tensor rows = at::stack({pos, pos * 2 + 1, pos * 3 + 7});
  auto [c, s] = rope.cos_sin(rows);
  ASSERT_EQ(c.sizes(), c1.sizes());
  const int64_t row_of_freq[6] = {0, 0, 1, 2, 2, 2};
  for (int64_t f = 0; f < 6; ++f) {
    auto [cr, sr] = rope.cos_sin(rows[row_of_freq[f]]);
    for (int64_t half : {0, 6}) {
      EXPECT_TRUE(at::equal(c.select(-1, f + half), cr.select(-1, f + half))) << f;
      EXPECT_TRUE(at::equal(s.select(-1, f + half), sr.select(-1, f + half))) << f;
    }
  }
}

// ---- Linear with row-split GEMMs -----------------------------------------------------------------------------------

// Restores the split mode (tests force it to 2 so that small products split too).
struct SplitMode {
  int saved = lf::kernels::linear_split_mode();
  explicit SplitMode(int m) { lf::kernels::set_linear_split_mode(m); }
  ~SplitMode() { lf::kernels::set_linear_split_mode(saved); }
};

TEST(LinearSplit, GradientsMatchFiniteDifferencesFloat64) {
  SplitMode forced(2);
  at::manual_seed(30);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({3, 13, 5}, opts).requires_grad_(), w = at::randn({7, 5}, opts).requires_grad_();
  at::Tensor b = at::randn({7}, opts).requires_grad_(), dy = at::randn({3, 13, 7}, opts);
  at::Tensor y = lf::kernels::linear(x, w, b);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_NE(y.grad_fn()->name().find("Linear"), std::string::npos);  // the split Function ran
  at::Tensor xd = x.detach().clone(), wd = w.detach().clone(), bd = b.detach().clone();
  auto f = [&] { return at::linear(xd, wd, bd); };
  EXPECT_LT(max_abs(y - f()), 1e-12);
  auto g = torch::autograd::grad({y}, {x, w, b}, {dy});
  EXPECT_LT(max_abs(g[0] - lf::test::numeric_grad(f, xd, dy)), 1e-7);
  EXPECT_LT(max_abs(g[1] - lf::test::numeric_grad(f, wd, dy)), 1e-7);
  EXPECT_LT(max_abs(g[2] - lf::test::numeric_grad(f, bd, dy)), 1e-7);
}

// float32 against at::linear: row counts that are not multiples of the blocks, non-contiguous x, no bias, a frozen
// weight (only dx) and a frozen input (only dW); with splitting off the op is at::linear itself.
TEST(LinearSplit, MatchesAtLinearFloat32) {
  SplitMode forced(2);
  at::manual_seed(31);
  for (int64_t rows : {1, 17, 203}) {
    at::Tensor x = at::randn({48, rows}).t().requires_grad_(), w = at::randn({40, 48}).requires_grad_();
    at::Tensor dy = at::randn({rows, 40});
    at::Tensor y = lf::kernels::linear(x, w, at::Tensor());
    auto g = torch::autograd::grad({y}, {x, w}, {dy});
    at::Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    at::Tensor y2 = at::linear(x2, w2);
    auto g2 = torch::autograd::grad({y2}, {x2, w2}, {dy});
    EXPECT_LT(rel_err(y, y2), 1e-6) << rows;
    EXPECT_LT(rel_err(g[0], g2[0]), 1e-6) << rows;
    EXPECT_LT(rel_err(g[1], g2[1]), 1e-6) << rows;
    EXPECT_EQ(y.sizes(), y2.sizes());
    // only dx (frozen weight), only dW (input without grad)
    at::Tensor gx = torch::autograd::grad({lf::kernels::linear(x, w.detach(), at::Tensor())}, {x}, {dy})[0];
    EXPECT_LT(rel_err(gx, g2[0]), 1e-6);
    at::Tensor gw = torch::autograd::grad({lf::kernels::linear(x.detach(), w, at::Tensor())}, {w}, {dy})[0];
    EXPECT_LT(rel_err(gw, g2[1]), 1e-6);
  }
  SplitMode off(0);
  const lf::kernels::cpu::BlasBackend chosen = lf::kernels::cpu::blas_backend();
  lf::kernels::cpu::set_blas_backend(lf::kernels::cpu::BlasBackend::kMkl);
  at::Tensor x = at::randn({9, 12}), w = at::randn({5, 12});
  EXPECT_TRUE(at::equal(lf::kernels::linear(x, w, at::Tensor()), at::linear(x, w)));
  lf::kernels::cpu::set_blas_backend(chosen);
}

// With OpenBLAS as the float32 BLAS (AMD CPUs with AVX-512), every float32 product of kernels::linear runs through it
// (our Function: at::linear would take MKL's AVX2 path), few rows or many, with bias, gradients as at::linear's.
TEST(LinearSplit, OpenBlasBackendRunsEveryFloat32Product) {
  SplitMode off(0);
  const lf::kernels::cpu::BlasBackend chosen = lf::kernels::cpu::blas_backend();
  lf::kernels::cpu::set_blas_backend(lf::kernels::cpu::BlasBackend::kOpenBlas);
  at::manual_seed(32);
  for (int64_t rows : {3, 64, 300}) {
    at::Tensor x = at::randn({2, rows, 48}).requires_grad_(), w = at::randn({40, 48}).requires_grad_();
    at::Tensor b = at::randn({40}).requires_grad_(), dy = at::randn({2, rows, 40});
    at::Tensor y = lf::kernels::linear(x, w, b);
    ASSERT_NE(y.grad_fn(), nullptr);
    EXPECT_NE(y.grad_fn()->name().find("Linear"), std::string::npos) << y.grad_fn()->name();
    auto g = torch::autograd::grad({y}, {x, w, b}, {dy});
    at::Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    at::Tensor b2 = b.detach().clone().requires_grad_();
    at::Tensor y2 = at::linear(x2, w2, b2);
    auto g2 = torch::autograd::grad({y2}, {x2, w2, b2}, {dy});
    EXPECT_LT(rel_err(y, y2), 1e-6) << rows;
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g[i], g2[i]), 1e-6) << rows << " input " << i;
  }
  lf::kernels::cpu::set_blas_backend(chosen);
}

// The raw split GEMM: block counts that do not divide the rows, transposed operands, more blocks than rows allow.
TEST(LinearSplit, SplitRowsMatchesMm) {
  at::manual_seed(32);
  at::Tensor a = at::randn({301, 33}), b = at::randn({45, 33}).t();
  at::Tensor ref = at::mm(a.to(at::kDouble), b.to(at::kDouble));
  for (int64_t parts : {1, 2, 3, 7, 64}) EXPECT_LT(rel_err(lf::kernels::mm_split_rows(a, b, parts), ref), 1e-6) << parts;
  EXPECT_LT(rel_err(lf::kernels::mm_split_rows(a.t().contiguous().t(), b, 2), ref), 1e-6);
  EXPECT_THROW(lf::kernels::mm_split_rows(a, a), c10::Error);
}

// The fused linear + cross-entropy with its GEMMs split gives the composite's loss and gradients.
TEST(LinearSplit, LinearCrossEntropySplitMatchesComposite) {
  SplitMode forced(2);
  at::manual_seed(33);
  at::Tensor x = at::randn({2, 61, 24}).requires_grad_(), w = (at::randn({77, 24}) * 0.3).requires_grad_();
  at::Tensor t = at::randint(0, 77, {2, 61}, at::kLong);
  auto [loss, count] = lf::kernels::linear_cross_entropy(x, w, t, -100, 50);
  auto g = torch::autograd::grad({loss}, {x, w});
  at::Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
  auto [loss2, count2] = lf::kernels::linear_cross_entropy_reference(x2, w2, t);
  auto g2 = torch::autograd::grad({loss2}, {x2, w2});
  EXPECT_LT(std::abs(loss.item<double>() - loss2.item<double>()) / loss2.item<double>(), 2e-6);
  EXPECT_LT(rel_err(g[0], g2[0]), 2e-5);
  EXPECT_LT(rel_err(g[1], g2[1]), 2e-5);
}

// ---- causal depthwise convolution + SiLU ------------------------------------------------------------------------

// float64: x and w gradients against finite differences of the composite version, padded and continued (unpadded).
TEST(CausalConvKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(4);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  for (bool pad : {true, false}) {
    at::Tensor x = (at::randn({2, 7, 5}, opts) * 2).requires_grad_(), w = at::randn({5, 1, 4}, opts).requires_grad_();
    at::Tensor y = lf::kernels::causal_conv1d_silu(x, w, pad);
    at::Tensor dy = at::randn(y.sizes(), opts);
    at::Tensor xd = x.detach().clone(), wd = w.detach().clone();
    auto f = [&] { return lf::kernels::causal_conv1d_silu_reference(xd, wd, pad); };
    ASSERT_EQ(y.sizes(), f().sizes());
    EXPECT_LT(max_abs(y - f()), 1e-12);
    auto grads = torch::autograd::grad({y}, {x, w}, {dy});
    EXPECT_LT(max_abs(grads[0] - lf::test::numeric_grad(f, xd, dy)), 1e-7) << "pad " << pad;
    EXPECT_LT(max_abs(grads[1] - lf::test::numeric_grad(f, wd, dy)), 1e-7) << "pad " << pad;
  }
}

// float32 against the composite: channel counts off the vector width, sequences shorter than the kernel, a long
// sequence over several dw blocks, saturating pre-activations; results do not depend on the thread count.
TEST(CausalConvKernel, MatchesCompositeFloat32AndThreadCount) {
  at::manual_seed(5);
  struct Case { int64_t b, t, c, k; bool pad; };
  for (Case cs : {Case{2, 37, 1024, 4, true}, Case{1, 3, 13, 4, true}, Case{3, 200, 21, 4, false},
                  Case{2, 4, 9, 4, false}, Case{1, 65, 8, 1, true}, Case{2, 70, 30, 6, true}}) {
    at::Tensor x = (at::randn({cs.b, cs.t, cs.c}) * 3).requires_grad_();
    at::Tensor w = at::randn({cs.c, 1, cs.k}).requires_grad_();
    {
      at::NoGradGuard ng;
      x.view({-1})[0] = 60.f;
      x.view({-1})[1] = -60.f;
    }
    at::Tensor y = lf::kernels::causal_conv1d_silu(x, w, cs.pad);
    at::Tensor dy = at::randn(y.sizes());
    auto gr = torch::autograd::grad({y}, {x, w}, {dy});
    at::Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    at::Tensor y2 = lf::kernels::causal_conv1d_silu_reference(x2, w2, cs.pad);
    auto gr2 = torch::autograd::grad({y2}, {x2, w2}, {dy});
    ASSERT_EQ(y.sizes(), y2.sizes());
    EXPECT_LT(rel_err(y, y2), 1e-6) << cs.t << " x " << cs.c;
    EXPECT_LT(rel_err(gr[0], gr2[0]), 1e-5) << cs.t << " x " << cs.c;
    EXPECT_LT(rel_err(gr[1], gr2[1]), 1e-5) << cs.t << " x " << cs.c;
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    auto [dx1, dw1] = lf::kernels::causal_conv1d_silu_backward_cpu(dy, x.detach(), w.detach(), cs.pad);
    at::set_num_threads(2);
    auto [dx2, dw2] = lf::kernels::causal_conv1d_silu_backward_cpu(dy, x.detach(), w.detach(), cs.pad);
    at::set_num_threads(threads);
    EXPECT_TRUE(at::equal(dx1, dx2) && at::equal(dw1, dw2)) << "thread count changed the gradients";
  }
}

// bf16 (and other dtypes) take the composite path; non-contiguous inputs are fine.
TEST(CausalConvKernel, OtherDtypesAndLayouts) {
  at::manual_seed(6);
  at::Tensor x = at::randn({2, 12, 16}), w = at::randn({16, 1, 4});
  at::Tensor xb = x.to(at::kBFloat16), wb = w.to(at::kBFloat16);
  EXPECT_EQ(lf::kernels::causal_conv1d_silu(xb, wb, true).scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(lf::kernels::causal_conv1d_silu(xb, wb, true),
                        lf::kernels::causal_conv1d_silu_reference(xb, wb, true)));
  at::Tensor xt = at::randn({2, 16, 12}).transpose(1, 2);
  EXPECT_LT(rel_err(lf::kernels::causal_conv1d_silu(xt, w, true), lf::kernels::causal_conv1d_silu_reference(xt, w, true)),
            1e-6);
}

// ---- top-k sparse attention ---------------------------------------------------------------------------------------

// Picked key positions [B, Tq, K] of Tk keys: query i picks among keys <= i (causal), some rows fewer than K (-1), one
// key picked twice in a row.
at::Tensor picks(int64_t b, int64_t tq, int64_t tk, int64_t k, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor idx = at::full({b, tq, k}, -1, at::kLong);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t i = 0; i < tq; ++i) {
      const int64_t visible = std::min(tk, i + 1 + (tk - tq)), n = std::min(k, visible);
      at::Tensor chosen = at::randperm(visible, at::kLong).narrow(0, 0, n);
      idx[r][i].narrow(0, 0, n).copy_(chosen);
    }
  idx[0][tq - 1][k - 1] = idx[0][tq - 1][0];  // a duplicate: counted twice
  return idx;
}

// float64: q, k, v gradients against finite differences of the composite version; grouped key/value heads.
TEST(SparseAttentionKernel, GradientsMatchFiniteDifferencesFloat64) {
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(7);
  at::Tensor q = at::randn({2, 4, 6, 5}, opts).requires_grad_(), k = at::randn({2, 2, 9, 5}, opts).requires_grad_();
  at::Tensor v = at::randn({2, 2, 9, 3}, opts).requires_grad_();
  const at::Tensor idx = picks(2, 6, 9, 4, 8);
  const double scale = 0.7;
  at::Tensor y = lf::kernels::sparse_attention(q, k, v, idx, scale);
  at::Tensor qd = q.detach().clone(), kd = k.detach().clone(), vd = v.detach().clone();
  auto f = [&] { return lf::kernels::sparse_attention_reference(qd, kd, vd, idx, scale); };
  ASSERT_EQ(y.sizes(), f().sizes());
  EXPECT_LT(max_abs(y - f()), 1e-12);
  at::Tensor dy = at::randn(y.sizes(), opts);
  auto g = torch::autograd::grad({y}, {q, k, v}, {dy});
  EXPECT_LT(max_abs(g[0] - lf::test::numeric_grad(f, qd, dy)), 1e-7);
  EXPECT_LT(max_abs(g[1] - lf::test::numeric_grad(f, kd, dy)), 1e-7);
  EXPECT_LT(max_abs(g[2] - lf::test::numeric_grad(f, vd, dy)), 1e-7);
}

// float32 against the composite (head dims off the vector width and DeepSeek's 192 / 128), and against the dense
// masked softmax of a keep mask through keep_to_index; gradients do not depend on the thread count.
TEST(SparseAttentionKernel, MatchesCompositeFloat32AndThreadCount) {
  struct Case { int64_t b, h, hk, tq, tk, d, dv, k; };
  for (Case c : {Case{1, 4, 4, 40, 40, 192, 128, 8}, Case{2, 3, 1, 17, 25, 13, 7, 5}, Case{1, 2, 2, 64, 64, 16, 16, 64}}) {
    at::manual_seed(9);
    at::Tensor q = at::randn({c.b, c.h, c.tq, c.d}).requires_grad_(), k = at::randn({c.b, c.hk, c.tk, c.d}).requires_grad_();
    at::Tensor v = at::randn({c.b, c.hk, c.tk, c.dv}).requires_grad_();
    const at::Tensor idx = picks(c.b, c.tq, c.tk, c.k, 10);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    at::Tensor y = lf::kernels::sparse_attention(q, k, v, idx, scale);
    at::Tensor dy = at::randn(y.sizes());
    auto g = torch::autograd::grad({y}, {q, k, v}, {dy});
    at::Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
    at::Tensor v2 = v.detach().clone().requires_grad_();
    at::Tensor y2 = lf::kernels::sparse_attention_reference(q2, k2, v2, idx, scale);
    auto g2 = torch::autograd::grad({y2}, {q2, k2, v2}, {dy});
    EXPECT_LT(rel_err(y, y2), 1e-5) << c.d;
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g[i], g2[i]), 1e-5) << c.d << " grad " << i;
    // the same picks as a keep mask (duplicates dropped), through keep_to_index = dense masked attention
    const at::Tensor slot = at::where(idx >= 0, idx, at::full_like(idx, c.tk));  // -1 -> a column cut off below
    const at::Tensor keep = at::zeros({c.b, c.tq, c.tk + 1}, at::kBool).scatter_(-1, slot, true).narrow(-1, 0, c.tk);
    const at::Tensor ki = lf::kernels::keep_to_index(keep);
    EXPECT_EQ(ki.size(-1), keep.sum(-1).max().item<int64_t>());
    at::Tensor kr = k.detach().repeat_interleave(c.h / c.hk, 1), vr = v.detach().repeat_interleave(c.h / c.hk, 1);
    at::Tensor s = at::matmul(q.detach(), kr.transpose(-1, -2)) * scale;
    s = s.masked_fill(keep.logical_not().unsqueeze(1), -std::numeric_limits<double>::infinity());
    EXPECT_LT(rel_err(lf::kernels::sparse_attention(q.detach(), k.detach(), v.detach(), ki, scale),
                      at::matmul(at::softmax(s, -1), vr)), 1e-5) << c.d;
    auto [out, lse] = lf::kernels::sparse_attention_forward_cpu(q.detach(), k.detach(), v.detach(), idx, scale);
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    auto one = lf::kernels::sparse_attention_backward_cpu(dy, q.detach(), k.detach(), v.detach(), idx, lse, scale);
    at::set_num_threads(2);
    auto two = lf::kernels::sparse_attention_backward_cpu(dy, q.detach(), k.detach(), v.detach(), idx, lse, scale);
    at::set_num_threads(threads);
    EXPECT_TRUE(at::equal(std::get<0>(one), std::get<0>(two)) && at::equal(std::get<1>(one), std::get<1>(two)) &&
                at::equal(std::get<2>(one), std::get<2>(two))) << "thread count changed the gradients";
  }
}

// bf16 takes the composite path; a position past the keys is an error.
TEST(SparseAttentionKernel, OtherDtypesAndBadPositions) {
  at::manual_seed(11);
  at::Tensor q = at::randn({1, 2, 5, 8}), k = at::randn({1, 2, 7, 8}), v = at::randn({1, 2, 7, 8});
  const at::Tensor idx = picks(1, 5, 7, 3, 12);
  const at::Tensor qb = q.to(at::kBFloat16), kb = k.to(at::kBFloat16), vb = v.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(lf::kernels::sparse_attention(qb, kb, vb, idx, 0.3),
                        lf::kernels::sparse_attention_reference(qb, kb, vb, idx, 0.3)));
  at::Tensor bad = idx.clone();
  bad[0][0][0] = 7;
  EXPECT_THROW(lf::kernels::sparse_attention(q, k, v, bad, 0.3), std::exception);
}

}  // namespace

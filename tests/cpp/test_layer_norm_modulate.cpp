// Fused adaptive LayerNorm (kernels/layer_norm_modulate.h, DiT's adaLN-Zero modulation) against float64 finite
// differences and against its composite ATen version.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/layer_norm_modulate.h"
#include "test_util.h"

namespace {

using lf::kernels::layer_norm_modulate;
using lf::kernels::layer_norm_modulate_reference;

double max_abs(const at::Tensor& a) { return a.abs().max().item<double>(); }
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return max_abs(a.to(at::kDouble) - b.to(at::kDouble)) / std::max(1e-30, max_abs(b.to(at::kDouble)));
}

// Outputs and gradients (x, shift, scale) by autograd through the composite version.
std::vector<at::Tensor> reference(const at::Tensor& x, const at::Tensor& sh, const at::Tensor& sc, const at::Tensor& dy,
                                  double eps) {
  at::Tensor x2 = x.detach().clone().requires_grad_(), sh2 = sh.detach().clone().requires_grad_();
  at::Tensor sc2 = sc.detach().clone().requires_grad_();
  at::Tensor y = layer_norm_modulate_reference(x2, sh2, sc2, eps);
  auto g = torch::autograd::grad({y}, {x2, sh2, sc2}, {dy});
  return {y.detach(), g[0], g[1], g[2]};
}

// float64: the autograd Function's gradients against central differences of its own forward, and the forward against
// the composite version; rows per sample 1 and several, a single sample (chunked backward), a 4-d x.
TEST(LayerNormModulateKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(0);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  for (auto shape : {std::vector<int64_t>{3, 5, 7}, std::vector<int64_t>{1, 6, 9}, std::vector<int64_t>{2, 1, 4},
                     std::vector<int64_t>{2, 3, 2, 5}}) {
    const int64_t B = shape[0], N = shape.back();
    at::Tensor x = (at::randn(shape, opts) * 2 + 0.5).requires_grad_();
    at::Tensor sh = at::randn({B, N}, opts).requires_grad_(), sc = at::randn({B, N}, opts).requires_grad_();
    at::Tensor dy = at::randn(shape, opts);
    const double eps = 1e-6;
    at::Tensor y = layer_norm_modulate(x, sh, sc, eps);
    auto ref = reference(x, sh, sc, dy, eps);
    EXPECT_LT(max_abs(y - ref[0]), 1e-12);
    auto g = torch::autograd::grad({y}, {x, sh, sc}, {dy});
    for (int i = 0; i < 3; ++i) EXPECT_LT(max_abs(g[i] - ref[i + 1]), 1e-12) << "input " << i;
    at::Tensor xd = x.detach().clone(), shd = sh.detach().clone(), scd = sc.detach().clone();
    auto f = [&] { return layer_norm_modulate(xd, shd, scd, eps); };
    EXPECT_LT(max_abs(g[0] - lf::test::numeric_grad(f, xd, dy)), 1e-7);
    EXPECT_LT(max_abs(g[1] - lf::test::numeric_grad(f, shd, dy)), 1e-7);
    EXPECT_LT(max_abs(g[2] - lf::test::numeric_grad(f, scd, dy)), 1e-7);
  }
}

// float32 against the composite: widths that are and are not multiples of the vector width, shift / scale as the
// model passes them (column chunks of one [B, 6N] tensor), rows with a large mean, inside and outside a parallel
// region's thread count.
TEST(LayerNormModulateKernel, MatchesCompositeFloat32) {
  at::manual_seed(1);
  for (auto [B, T, N] : {std::tuple<int64_t, int64_t, int64_t>{8, 64, 256}, {3, 17, 37}, {1, 40, 1152}, {5, 1, 8}}) {
    at::Tensor x = (at::randn({B, T, N}) * 3 + 10).requires_grad_();
    at::Tensor m = at::randn({B, 6 * N}).requires_grad_();
    auto parts = m.chunk(6, 1);
    at::Tensor dy = at::randn({B, T, N});
    at::Tensor y = layer_norm_modulate(x, parts[0], parts[1], 1e-6);
    auto g = torch::autograd::grad({y}, {x, m}, {dy});
    at::Tensor x2 = x.detach().clone().requires_grad_(), m2 = m.detach().clone().requires_grad_();
    auto p2 = m2.chunk(6, 1);
    at::Tensor y2 = layer_norm_modulate_reference(x2, p2[0], p2[1], 1e-6);
    auto g2 = torch::autograd::grad({y2}, {x2, m2}, {dy});
    const std::string what = std::to_string(B) + " x " + std::to_string(T) + " x " + std::to_string(N);
    EXPECT_LT(rel_err(y, y2), 1e-5) << what;
    EXPECT_LT(rel_err(g[0], g2[0]), 1e-4) << what;
    EXPECT_LT(rel_err(g[1], g2[1]), 1e-5) << what;
    EXPECT_EQ(y.sizes(), y2.sizes());
  }
}

// What the kernel does not take (bf16, mixed dtypes) goes to the composite version, with gradients.
TEST(LayerNormModulateKernel, FallsBackToComposite) {
  at::manual_seed(2);
  at::Tensor x = at::randn({2, 3, 8}).to(at::kBFloat16).requires_grad_();
  at::Tensor sh = at::randn({2, 8}).to(at::kBFloat16), sc = at::randn({2, 8}).to(at::kBFloat16);
  at::Tensor y = layer_norm_modulate(x, sh, sc, 1e-5);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y, layer_norm_modulate_reference(x, sh, sc, 1e-5)));
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
  at::Tensor xf = at::randn({2, 3, 8});
  at::Tensor yd = layer_norm_modulate(xf, at::randn({2, 8}, at::kDouble), at::randn({2, 8}, at::kDouble), 1e-5);
  EXPECT_EQ(yd.sizes(), xf.sizes());
  EXPECT_THROW(lf::kernels::layer_norm_modulate_forward_cpu(xf, at::randn({3, 8}), at::randn({3, 8}), 1e-5),
               c10::Error);
}

}  // namespace

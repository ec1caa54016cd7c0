// Fused kernels against float64 finite differences and against the composite ATen version.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/add_rms_norm.h"
#include "loongforge/kernels/rms_norm.h"
#include "test_util.h"

namespace {

TEST(RMSNormKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(0);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({3, 4, 7}, opts).requires_grad_();
  at::Tensor w = (at::randn({7}, opts) * 0.5 + 1).requires_grad_();
  at::Tensor dy = at::randn({3, 4, 7}, opts);
  const double eps = 1e-6;
  at::Tensor y = lf::kernels::rms_norm(x, w, eps);
  auto grads = torch::autograd::grad({y}, {x, w}, {dy});
  at::Tensor xd = x.detach().clone(), wd = w.detach().clone();
  auto f = [&] { return lf::kernels::rms_norm_reference(xd, wd, eps); };
  // Central differences in float64 have error ~h^2 * f''' + roundoff/h ~ 1e-9 here.
  EXPECT_LT((grads[0] - lf::test::numeric_grad(f, xd, dy)).abs().max().item<double>(), 1e-7);
  EXPECT_LT((grads[1] - lf::test::numeric_grad(f, wd, dy)).abs().max().item<double>(), 1e-7);
}

TEST(RMSNormKernel, MatchesCompositeFloat32) {
  at::manual_seed(1);
  at::Tensor x = at::randn({8, 33, 96}).requires_grad_();
  at::Tensor w = (at::randn({96}) * 0.2 + 1).requires_grad_();
  at::Tensor dy = at::randn({8, 33, 96});
  at::Tensor y = lf::kernels::rms_norm(x, w, 1e-5);
  auto g = torch::autograd::grad({y}, {x, w}, {dy});
  at::Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
  at::Tensor y2 = lf::kernels::rms_norm_reference(x2, w2, 1e-5);
  auto g2 = torch::autograd::grad({y2}, {x2, w2}, {dy});
  // float32: per-element rounding (~1e-7 relative); dw sums 264 rows, so a few ulps more.
  EXPECT_LT((y - y2).abs().max().item<double>(), 1e-5);
  EXPECT_LT((g[0] - g2[0]).abs().max().item<double>(), 1e-5);
  EXPECT_LT(((g[1] - g2[1]).abs().max() / g2[1].abs().max()).item<double>(), 1e-5);
}

TEST(RMSNormKernel, FallsBackForOtherDtypes) {
  at::Tensor x = at::randn({2, 16}).to(at::kBFloat16);
  at::Tensor w = at::ones({16}).to(at::kBFloat16);
  at::Tensor y = lf::kernels::rms_norm(x, w, 1e-6);
  EXPECT_TRUE(at::equal(y, lf::kernels::rms_norm_reference(x, w, 1e-6)));
}

// Residual add + RMSNorm (CPU Function): both outputs used (the residual stream s and the normalised y), gradients
// for x, residual and weight against float64 finite differences of the composite version.
TEST(AddRMSNormKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(2);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({2, 5, 11}, opts).requires_grad_(), r = at::randn({2, 5, 11}, opts).requires_grad_();
  at::Tensor w = (at::randn({11}, opts) * 0.5 + 1).requires_grad_();
  at::Tensor ds = at::randn({2, 5, 11}, opts), dy = at::randn({2, 5, 11}, opts);
  auto [s, y] = lf::kernels::add_rms_norm(x, r, w, 1e-6);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_NE(y.grad_fn()->name().find("AddRMSNorm"), std::string::npos);
  auto g = torch::autograd::grad({s, y}, {x, r, w}, {ds, dy});
  at::Tensor xd = x.detach().clone(), rd = r.detach().clone(), wd = w.detach().clone();
  // one scalar function of both outputs: sum(s * ds) + sum(y * dy)
  auto f = [&] {
    auto [s2, y2] = lf::kernels::add_rms_norm_reference(xd, rd, wd, 1e-6);
    return (s2 * ds + y2 * dy).sum();
  };
  at::Tensor one = at::ones({}, opts);
  EXPECT_LT((g[0] - lf::test::numeric_grad(f, xd, one)).abs().max().item<double>(), 1e-7);
  EXPECT_LT((g[1] - lf::test::numeric_grad(f, rd, one)).abs().max().item<double>(), 1e-7);
  EXPECT_LT((g[2] - lf::test::numeric_grad(f, wd, one)).abs().max().item<double>(), 1e-7);
}

// float32 against the composite: row lengths with and without a tail of the 8-lane loops; only y used, only s used.
TEST(AddRMSNormKernel, MatchesCompositeFloat32) {
  at::manual_seed(3);
  for (int64_t n : {96, 100, 5}) {
    at::Tensor x = at::randn({4, 33, n}).requires_grad_(), r = at::randn({4, 33, n}).requires_grad_();
    at::Tensor w = (at::randn({n}) * 0.2 + 1).requires_grad_();
    at::Tensor ds = at::randn({4, 33, n}), dy = at::randn({4, 33, n});
    at::Tensor x2 = x.detach().clone().requires_grad_(), r2 = r.detach().clone().requires_grad_();
    at::Tensor w2 = w.detach().clone().requires_grad_();
    auto [s, y] = lf::kernels::add_rms_norm(x, r, w, 1e-5);
    auto [s2, y2] = lf::kernels::add_rms_norm_reference(x2, r2, w2, 1e-5);
    EXPECT_TRUE(at::equal(s, s2)) << n;
    EXPECT_LT((y - y2).abs().max().item<double>(), 1e-5) << n;
    auto g = torch::autograd::grad({s, y}, {x, r, w}, {ds, dy}, /*retain_graph=*/true);
    auto g2 = torch::autograd::grad({s2, y2}, {x2, r2, w2}, {ds, dy}, /*retain_graph=*/true);
    for (int i = 0; i < 3; ++i)
      EXPECT_LT(((g[i] - g2[i]).abs().max() / g2[i].abs().max()).item<double>(), 1e-5) << n << " " << i;
    auto gy = torch::autograd::grad({y}, {x, r, w}, {dy}, /*retain_graph=*/true);
    auto gy2 = torch::autograd::grad({y2}, {x2, r2, w2}, {dy}, /*retain_graph=*/true);
    for (int i = 0; i < 3; ++i)
      EXPECT_LT(((gy[i] - gy2[i]).abs().max() / gy2[i].abs().max()).item<double>(), 1e-5) << n << " " << i;
    auto gs = torch::autograd::grad({s}, {x, r, w}, {ds}, /*retain_graph=*/false, false, /*allow_unused=*/true);
    EXPECT_TRUE(at::equal(gs[0], ds));
    EXPECT_TRUE(at::equal(gs[1], ds));
    // rms_norm alone on the same rows
    at::Tensor yn = lf::kernels::rms_norm(x, w, 1e-5), yn2 = lf::kernels::rms_norm_reference(x2, w2, 1e-5);
    EXPECT_LT((yn - yn2).abs().max().item<double>(), 1e-5) << n;
    auto gn = torch::autograd::grad({yn}, {x, w}, {dy});
    auto gn2 = torch::autograd::grad({yn2}, {x2, w2}, {dy});
    EXPECT_LT((gn[0] - gn2[0]).abs().max().item<double>(), 1e-5) << n;
    EXPECT_LT(((gn[1] - gn2[1]).abs().max() / gn2[1].abs().max()).item<double>(), 1e-5) << n;
  }
}

}  // namespace


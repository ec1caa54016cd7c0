// Fused kernels against float64 finite differences and against the composite ATen version.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

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

}  // namespace


// The direct BLAS calls of the CPU kernels (kernels/cpu/blas.h) against at::mm in float64, and the float32 paths that
// use a packed weight (kernels::linear from kMinPackedRows rows, the linear + cross-entropy logits) against ATen's
// composite versions.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <limits>
#include <tuple>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/cpu/blas.h"
#include "loongforge/kernels/cpu/gemm.h"
#include "loongforge/kernels/linear.h"
#include "loongforge/kernels/linear_ce.h"

namespace {

namespace cpu = lf::kernels::cpu;

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor bd = b.to(at::kDouble);
  return (a.to(at::kDouble) - bd).abs().max().item<double>() / std::max(1e-30, bd.abs().max().item<double>());
}

// op(X) of a row-major buffer [r, c] (or [c, r] stored when transposed) with row stride ld, as a float64 matrix.
at::Tensor op(const at::Tensor& stored, bool t) { return (t ? stored.t() : stored).to(at::kDouble); }

TEST(Blas, GemmAllTranspositionsAndStrides) {
  at::manual_seed(40);
  const int64_t m = 37, n = 29, k = 19;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      // stored matrices with row strides wider than their rows (a column slice of a wider buffer)
      at::Tensor a = at::randn({ta ? k : m, (ta ? m : k) + 5}).narrow(1, 0, ta ? m : k);
      at::Tensor b = at::randn({tb ? n : k, (tb ? k : n) + 3}).narrow(1, 0, tb ? k : n);
      at::Tensor c0 = at::randn({m, n + 4});
      at::Tensor c = c0.clone();
      cpu::gemm<float>(ta, tb, m, n, k, 0.5f, a.data_ptr<float>(), a.stride(0), b.data_ptr<float>(), b.stride(0),
                       2.0f, c.data_ptr<float>(), c.stride(0));
      at::Tensor want = 0.5 * at::mm(op(a, ta), op(b, tb)) + 2.0 * c0.narrow(1, 0, n).to(at::kDouble);
      EXPECT_LT(rel_err(c.narrow(1, 0, n), want), 1e-6) << ta << tb;
      EXPECT_TRUE(at::equal(c.narrow(1, n, 4), c0.narrow(1, n, 4)));  // nothing written past the n columns
      at::Tensor ad = a.to(at::kDouble), bd = b.to(at::kDouble), cd = at::zeros({m, n}, at::kDouble);
      cpu::gemm<double>(ta, tb, m, n, k, 1.0, ad.data_ptr<double>(), ad.stride(0), bd.data_ptr<double>(), bd.stride(0),
                        0.0, cd.data_ptr<double>(), cd.stride(0));
      EXPECT_LT(rel_err(cd, at::mm(op(a, ta), op(b, tb))), 1e-12);
    }
  }
}

// Both float32 backends (MKL, OpenBLAS: blas.h) against at::mm in float64: every transposition with padded row
// strides, products large enough to be split over ATen's threads (by rows, and by columns when C is wide), and the
// row-split products of the kernels (mm_rows) on transposed views, with and without accumulation.
TEST(Blas, BothBackendsMatchMm) {
  const cpu::BlasBackend chosen = cpu::blas_backend();
  for (cpu::BlasBackend be : {cpu::BlasBackend::kMkl, cpu::BlasBackend::kOpenBlas}) {
    cpu::set_blas_backend(be);  // throws when libopenblas is missing: it is a Debian dependency (scripts/setup.sh)
    EXPECT_EQ(cpu::blas_backend(), be);
    EXPECT_FALSE(cpu::blas_backend_description().empty());
    at::manual_seed(39);
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{37, 29, 19}, {613, 301, 67}, {40, 900, 130}}) {
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          at::Tensor a = at::randn({ta ? k : m, (ta ? m : k) + 5}).narrow(1, 0, ta ? m : k);
          at::Tensor b = at::randn({tb ? n : k, (tb ? k : n) + 3}).narrow(1, 0, tb ? k : n);
          at::Tensor c0 = at::randn({m, n + 4});
          for (float beta : {0.0f, 1.0f}) {
            at::Tensor c = c0.clone();
            if (beta == 0.0f) c.narrow(1, 0, n).fill_(std::numeric_limits<float>::quiet_NaN());  // never read
            cpu::gemm<float>(ta, tb, m, n, k, 0.5f, a.data_ptr<float>(), a.stride(0), b.data_ptr<float>(),
                             b.stride(0), beta, c.data_ptr<float>(), c.stride(0));
            at::Tensor want = 0.5 * at::mm(op(a, ta), op(b, tb)) + beta * c0.narrow(1, 0, n).to(at::kDouble);
            EXPECT_LT(rel_err(c.narrow(1, 0, n), want), 1e-5) << int(be) << ta << tb << m << " beta " << beta;
            EXPECT_TRUE(at::equal(c.narrow(1, n, 4), c0.narrow(1, n, 4)));
          }
        }
      }
    }
    for (bool accumulate : {false, true}) {
      at::Tensor a = at::randn({300, 520}).t(), b = at::randn({300, 170});  // a^T [520, 300]
      at::Tensor out = at::randn({520, 170}), out0 = out.clone();
      cpu::mm_rows(out, a, b, 2, accumulate);
      at::Tensor want = at::mm(a.to(at::kDouble), b.to(at::kDouble));
      if (accumulate) want += out0.to(at::kDouble);
      EXPECT_LT(rel_err(out, want), 1e-5) << int(be) << accumulate;
    }
  }
  cpu::set_blas_backend(chosen);
}

// A packed B serves products of any row count up to the one it was packed for, with beta 0 or 1, and a second
// PackedB alive on the same thread (the thread's buffer is lent to the first) still computes its own product.
TEST(Blas, PackedBMatchesMm) {
  at::manual_seed(41);
  const int64_t n = 300, k = 72;
  for (bool trans : {true, false}) {
    at::Tensor b = trans ? at::randn({n, k}) : at::randn({k, n});
    cpu::PackedB pb(trans, 512, n, k, b.data_ptr<float>(), b.stride(0));
    EXPECT_EQ(pb.packed(), cpu::has_packed_gemm());
    at::Tensor b2 = at::randn({n, k});
    for (int64_t m : {1, 255, 512}) {
      at::Tensor a = at::randn({m, k + 8}).narrow(1, 0, k);
      at::Tensor c = at::randn({m, n});
      at::Tensor c_in = c.clone();
      pb.compute(m, a.data_ptr<float>(), a.stride(0), 1.0f, c.data_ptr<float>(), c.stride(0));
      at::Tensor want = at::mm(a.to(at::kDouble), op(b, trans)) + c_in.to(at::kDouble);
      EXPECT_LT(rel_err(c, want), 1e-6) << trans << " " << m;
      cpu::PackedB other(true, m, n, k, b2.data_ptr<float>(), k);  // while pb holds the thread's buffer
      at::Tensor c2 = at::empty({m, n});
      other.compute(m, a.data_ptr<float>(), a.stride(0), 0.0f, c2.data_ptr<float>(), n);
      EXPECT_LT(rel_err(c2, at::mm(a.to(at::kDouble), b2.t().to(at::kDouble))), 1e-6) << trans << " " << m;
    }
    at::Tensor a = at::randn({513, k});
    at::Tensor c = at::empty({513, n});
    EXPECT_THROW(pb.compute(513, a.data_ptr<float>(), k, 0.0f, c.data_ptr<float>(), n), c10::Error);
  }
}

// float32 linear with rows enough for the packed weight: our Function, against at::linear; bias, a non-contiguous
// input, only dx (frozen weight) and only dW.
TEST(Blas, PackedLinearMatchesAtLinear) {
  at::manual_seed(42);
  const int64_t rows = cpu::kMinPackedRows + 45;
  for (bool bias : {false, true}) {
    at::Tensor x = at::randn({96, rows}).t().view({1, rows, 96}).requires_grad_();
    at::Tensor w = (at::randn({130, 96}) * 0.1).requires_grad_();
    at::Tensor b = bias ? at::randn({130}).requires_grad_() : at::Tensor();
    at::Tensor dy = at::randn({1, rows, 130});
    at::Tensor y = lf::kernels::linear(x, w, b);
    ASSERT_NE(y.grad_fn(), nullptr);
    if (cpu::has_packed_gemm()) {
      EXPECT_NE(y.grad_fn()->name().find("Linear"), std::string::npos);
    }
    std::vector<at::Tensor> inputs = {x, w};
    if (bias) inputs.push_back(b);
    auto g = torch::autograd::grad({y}, inputs, {dy});
    at::Tensor xd = x.detach().to(at::kDouble).requires_grad_(), wd = w.detach().to(at::kDouble).requires_grad_();
    at::Tensor bd = bias ? b.detach().to(at::kDouble).requires_grad_() : at::Tensor();
    at::Tensor y2 = at::linear(xd, wd, bias ? std::optional<at::Tensor>(bd) : std::nullopt);
    std::vector<at::Tensor> inputs2 = {xd, wd};
    if (bias) inputs2.push_back(bd);
    auto g2 = torch::autograd::grad({y2}, inputs2, {dy.to(at::kDouble)});
    EXPECT_EQ(y.sizes(), y2.sizes());
    EXPECT_LT(rel_err(y, y2), 1e-6);
    for (size_t i = 0; i < g.size(); ++i) EXPECT_LT(rel_err(g[i], g2[i]), 1e-6) << i;
    at::Tensor gx = torch::autograd::grad({lf::kernels::linear(x, w.detach(), b.defined() ? b.detach() : b)}, {x}, {dy})[0];
    EXPECT_LT(rel_err(gx, g2[0]), 1e-6);
    at::Tensor gw = torch::autograd::grad({lf::kernels::linear(x.detach(), w, at::Tensor())}, {w}, {dy})[0];
    EXPECT_LT(rel_err(gw, g2[1]), 1e-6);
  }
}

// The cross-entropy logits through one packed W^T for every chunk (a short last chunk, ignored rows), against the
// composite version in float64.
TEST(Blas, PackedLinearCrossEntropyMatchesComposite) {
  at::manual_seed(43);
  const int64_t v = 515, h = 40;
  for (int64_t chunk : {0, 100}) {
    at::Tensor x = at::randn({3, 210, h}).requires_grad_(), w = (at::randn({v, h}) * 0.3).requires_grad_();
    at::Tensor t = at::randint(0, v, {3, 210}, at::kLong);
    t.index_put_({at::rand({3, 210}) < 0.1}, -100);
    auto [loss, count] = lf::kernels::linear_cross_entropy(x, w, t, -100, chunk);
    auto g = torch::autograd::grad({loss}, {x, w}, {at::scalar_tensor(0.25f)});
    at::Tensor x2 = x.detach().to(at::kDouble).requires_grad_(), w2 = w.detach().to(at::kDouble).requires_grad_();
    auto [loss2, count2] = lf::kernels::linear_cross_entropy_reference(x2, w2, t);
    auto g2 = torch::autograd::grad({loss2}, {x2, w2}, {at::scalar_tensor(0.25, at::kDouble)});
    EXPECT_EQ(count.item<int64_t>(), count2.item<int64_t>());
    EXPECT_LT(std::abs(loss.item<double>() - loss2.item<double>()) / loss2.item<double>(), 2e-6) << chunk;
    EXPECT_LT(rel_err(g[0], g2[0]), 2e-5) << chunk;
    EXPECT_LT(rel_err(g[1], g2[1]), 2e-5) << chunk;
  }
}

// The fused cross-entropy scales its saved gradients in place in backward: a second backward through the same graph
// is an error, never silently scaled twice.
TEST(Blas, LinearCrossEntropySecondBackwardIsAnError) {
  at::manual_seed(44);
  at::Tensor x = at::randn({20, 8}).requires_grad_(), w = at::randn({30, 8}).requires_grad_();
  at::Tensor t = at::randint(0, 30, {20}, at::kLong);
  at::Tensor loss = std::get<0>(lf::kernels::linear_cross_entropy(x, w, t));
  auto g1 = torch::autograd::grad({loss * 3.0}, {x, w}, {}, /*retain_graph=*/true);
  EXPECT_THROW(torch::autograd::grad({loss * 3.0}, {x, w}), c10::Error);
}

}  // namespace

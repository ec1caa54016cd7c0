// AdamW and gradient clipping against torch.optim.AdamW, using the reference in tests/fixtures/hf_llama (made by
// PyTorch): feeding the reference gradients to our AdamW must reproduce the reference parameters.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "loongforge/io/safetensors.h"
#include "loongforge/optim/adamw.h"

TEST(AdamW, ReproducesTorchAdamWOnReferenceGradients) {
  const std::string dir = std::string(LF_SOURCE_DIR) + "/tests/fixtures/hf_llama/";
  auto model = lf::io::SafetensorsFile::open(dir + "model.safetensors");
  auto ref = lf::io::SafetensorsFile::open(dir + "reference.safetensors");
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto& e : model->entries()) {
    at::Tensor p = model->tensor(e.name).clone();
    p.mutable_grad() = ref->tensor("grad." + e.name);
    params.push_back(p);
    names.push_back(e.name);
  }
  lf::optim::AdamW opt(params, lf::optim::AdamWOptions::parse("lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1"));
  opt.step();
  double worst = 0;
  for (size_t i = 0; i < params.size(); ++i)
    worst = std::max(worst, (params[i] - ref->tensor("after_adamw." + names[i])).abs().max().item<double>());
  EXPECT_LE(worst, 1e-6);
}

TEST(AdamW, ParseRejectsUnknownKeys) {
  EXPECT_THROW(lf::optim::AdamWOptions::parse("lr=1e-3,betta=0.9"), std::runtime_error);
  EXPECT_THROW(lf::optim::AdamWOptions::parse("lr=abc"), std::runtime_error);
}

TEST(ClipGradNorm, ScalesToMaxNorm) {
  at::Tensor a = at::zeros({2}), b = at::zeros({1});
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  double norm = lf::optim::clip_grad_norm({a, b}, 1.0);
  EXPECT_NEAR(norm, 5.0, 1e-6);
  EXPECT_NEAR(a.grad()[0].item<double>(), 3.0 / (5.0 + 1e-6), 1e-6);
  EXPECT_NEAR(b.grad()[0].item<double>(), 4.0 / (5.0 + 1e-6), 1e-6);
}

// The vectorised CPU update is bitwise the scalar loop (one-element tensors take only the scalar loop) on sizes
// around the vector width; fusing the clipping coefficient into the step equals clipping in place first, bitwise; and
// both follow the formula in ATen ops (torch's single-tensor AdamW) to float32 rounding.
TEST(AdamW, VectorPathAndFusedClipMatch) {
  at::manual_seed(11);
  const auto opts = lf::optim::AdamWOptions::parse("lr=1e-2,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1");
  for (int64_t n : {1, 7, 8, 9, 2048 + 13, 20001}) {
    at::Tensor p0 = at::randn({n}), g = at::randn({n}) * 3;
    at::Tensor a = p0.clone(), b = p0.clone(), c = p0.clone();
    std::vector<at::Tensor> singles;
    for (int64_t i = 0; i < std::min<int64_t>(n, 64); ++i) singles.push_back(p0.narrow(0, i, 1).clone());
    lf::optim::AdamW fused({a}, opts), clipped({b}, opts), scalar(singles, opts);
    at::Tensor m = at::zeros({n}), v = at::zeros({n});
    for (int step = 1; step <= 3; ++step) {
      at::Tensor gs = g * step;
      a.mutable_grad() = gs.clone();
      b.mutable_grad() = gs.clone();
      auto [norm, coef] = lf::optim::grad_norm_and_clip_coef({a}, 1.0);
      EXPECT_EQ(norm, lf::optim::clip_grad_norm({b}, 1.0));  // b's gradient clipped in place
      for (size_t i = 0; i < singles.size(); ++i)
        singles[i].mutable_grad() = b.grad().narrow(0, static_cast<int64_t>(i), 1).clone();
      ASSERT_LT(coef, 1.0);
      EXPECT_TRUE(at::equal(a.grad(), gs));  // a's gradient untouched until the step
      fused.step(1e-2, coef);
      clipped.step(1e-2);
      scalar.step(1e-2);
      EXPECT_TRUE(at::equal(a, b)) << n << " step " << step;
      for (size_t i = 0; i < singles.size(); ++i)
        ASSERT_TRUE(at::equal(singles[i], b.narrow(0, static_cast<int64_t>(i), 1))) << n << " element " << i;
      // torch's single-tensor AdamW in ATen ops on the clipped gradient
      at::NoGradGuard ng;
      const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
      const at::Tensor& gc = b.grad();
      c.mul_(1 - 1e-2 * 0.1);
      m.lerp_(gc, 1 - 0.9);
      v.mul_(0.95).addcmul_(gc, gc, 1 - 0.95);
      c.addcdiv_(m, (v.sqrt() / std::sqrt(bc2)).add_(1e-8), -(1e-2 / bc1));
      EXPECT_LE((a - c).abs().max().item<double>(), 1e-6 * c.abs().max().item<double>()) << n;
    }
  }
}

// zero_grad(false) zeroes the gradients where they are (a CUDA graph accumulates into the captured addresses);
// the default drops them.
TEST(AdamW, ZeroGradInPlaceKeepsStorage) {
  std::vector<at::Tensor> ps = {at::randn({5}).requires_grad_(), at::randn({3, 4}).requires_grad_(),
                                at::randn({2}).requires_grad_()};
  for (size_t i = 0; i < 2; ++i) ps[i].mutable_grad() = at::randn(ps[i].sizes());  // ps[2] has none
  lf::optim::AdamW opt(ps, {});
  const void* where = ps[1].grad().data_ptr();
  opt.zero_grad(/*set_to_none=*/false);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(ps[i].grad().defined());
    EXPECT_EQ(ps[i].grad().abs().max().item<float>(), 0.0f);
  }
  EXPECT_EQ(ps[1].grad().data_ptr(), where);
  EXPECT_FALSE(ps[2].grad().defined());
  opt.zero_grad();
  for (const auto& p : ps) EXPECT_FALSE(p.grad().defined());
}

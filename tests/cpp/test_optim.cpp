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

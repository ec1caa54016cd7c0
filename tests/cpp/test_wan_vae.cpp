// Wan 2.1's VAE (diffusers' AutoencoderKLWan) on the contract: the causal cache makes the result independent of the
// chunking, so training (frame 0, then the rest of the clip at once) gives what diffusers' chunking gives (`dump`'s
// reference_forward, compared with diffusers in tests/python/test_wan_vae_parity.py): outputs and gradients; the
// LatentCodec's normalisation is Wan's pipelines' (z - mean) * (1 / std) and denormalisation its inverse.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "loongforge/models/registry.h"

namespace {

nlohmann::json tiny_config() {
  return {{"_class_name", "AutoencoderKLWan"},
          {"base_dim", 8},
          {"z_dim", 4},
          {"dim_mult", {1, 2, 2}},
          {"num_res_blocks", 1},
          {"temperal_downsample", {true, true}},
          {"latents_mean", {0.1, -0.2, 0.3, 0.0}},
          {"latents_std", {1.5, 0.7, 2.0, 1.1}}};
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs().max() / b.to(at::kDouble).abs().max()).item<double>();
}

std::map<std::string, at::Tensor> grads(lf::models::Model& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& p : m.named_parameters()) {
    out[p.key()] = p.value().grad().clone();
    p.value().mutable_grad() = at::Tensor();
  }
  return out;
}

}  // namespace

TEST(WanVae, WholeClipEqualsDiffusersChunking) {
  at::manual_seed(5);
  auto model = lf::models::build_model(tiny_config(), "config.json");
  model->init_weights(-1);
  {
    at::NoGradGuard g;
    for (auto& p : model->parameters()) p.add_(0.1 * at::randn_like(p));
  }
  // 9 frames: frame 0 and two chunks of 4 when chunked as diffusers; 3 latent frames decoded one at a time
  const at::Tensor x = 0.5 * at::randn({1, 3, 9, 8, 8});
  auto ref = model->reference_forward({{"sample", x}}, "batch.safetensors");
  ref.loss.backward();
  const auto ref_grads = grads(*model);
  const lf::models::Batch b{{"sample", x}};
  const at::Tensor decoded = model->embed(b);
  auto [sum, terms] = model->loss(b);
  EXPECT_EQ(terms, x.numel());
  (sum / static_cast<double>(terms)).backward();
  const auto whole_grads = grads(*model);
  EXPECT_EQ(decoded.sizes(), x.sizes());
  for (const auto& [name, t] : ref.outputs)
    if (name == "decoded") EXPECT_LE(rel(decoded, t), 1e-5);
  EXPECT_LE(rel(sum / static_cast<double>(terms), ref.loss), 1e-5);
  ASSERT_EQ(whole_grads.size(), ref_grads.size());
  for (const auto& [name, g] : ref_grads) EXPECT_LE(rel(whole_grads.at(name), g), 1e-4) << name;
}

TEST(WanVae, LatentCodec) {
  auto model = lf::models::build_model(tiny_config(), "config.json");
  lf::models::LatentCodec* codec = model->latent_codec();
  ASSERT_NE(codec, nullptr);
  EXPECT_TRUE(codec->video());
  EXPECT_EQ(codec->latent_channels(), 4);
  EXPECT_EQ(codec->pixel_channels(), 3);
  EXPECT_EQ(codec->spatial_factor(), 4);
  EXPECT_EQ(codec->temporal_factor(), 4);
  at::NoGradGuard g;
  const at::Tensor x = at::randn({1, 3, 5, 8, 8});
  auto [mean, logvar] = codec->encode_latents(x);
  EXPECT_EQ(mean.sizes(), (std::vector<int64_t>{1, 4, 2, 2, 2}));
  EXPECT_EQ(codec->decode_latents(mean).sizes(), x.sizes());
  const at::Tensor z = at::randn({2, 4, 3, 2, 2});
  const at::Tensor m = at::tensor({0.1, -0.2, 0.3, 0.0}, at::kFloat).view({1, 4, 1, 1, 1});
  const at::Tensor inv = 1.0 / at::tensor({1.5, 0.7, 2.0, 1.1}, at::kFloat).view({1, 4, 1, 1, 1});
  EXPECT_TRUE(at::allclose(codec->normalize_latents(z), (z - m) * inv, 0, 0));
  EXPECT_TRUE(at::allclose(codec->denormalize_latents(z), z / inv + m, 0, 0));
  EXPECT_LE(rel(codec->denormalize_latents(codec->normalize_latents(z)), z), 1e-6);
}

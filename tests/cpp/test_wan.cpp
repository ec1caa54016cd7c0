// Wan 2.1's transformer (diffusers' WanTransformer3DModel) on the contract: the loss splits by rows (the row-split
// and data-parallel engines), block_inputs holds the rotary tables and the conditions, and recomputing the blocks
// gives the gradients of a plain run, condition_embedder's included (the conditions go through the recomputation
// as side inputs, nn/recompute.h). Parity with diffusers: tests/python/test_wan_parity.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "loongforge/models/registry.h"

namespace {

nlohmann::json tiny_config() {
  return {{"_class_name", "WanTransformer3DModel"},
          {"patch_size", {1, 2, 2}},
          {"num_attention_heads", 2},
          {"attention_head_dim", 16},
          {"in_channels", 4},
          {"out_channels", 4},
          {"text_dim", 24},
          {"freq_dim", 32},
          {"ffn_dim", 48},
          {"num_layers", 2},
          {"cross_attn_norm", true},
          {"qk_norm", "rms_norm_across_heads"},
          {"eps", 1e-6},
          {"image_dim", nullptr},
          {"added_kv_proj_dim", nullptr},
          {"rope_max_seq_len", 32},
          {"pos_embed_seq_len", nullptr}};
}

lf::models::Batch tiny_batch() {
  return lf::models::Batch{{"hidden_states", at::randn({2, 4, 3, 8, 8})},
                           {"timestep", at::tensor({731.25, 3.5}, at::kFloat)},
                           {"encoder_hidden_states", at::randn({2, 5, 24})},
                           {"target", at::randn({2, 4, 3, 8, 8})}};
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs().max() / b.to(at::kDouble).abs().max()).item<double>();
}

std::map<std::string, at::Tensor> grads(lf::models::Model& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& p : m.named_parameters())
    if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
  return out;
}

}  // namespace

TEST(Wan, LossSplitsByRowsAndBlockInputs) {
  at::manual_seed(3);
  auto model = lf::models::build_model(tiny_config(), "config.json");
  model->init_weights(-1);
  const lf::models::Batch b = tiny_batch();
  auto [whole, terms] = model->loss(b);
  EXPECT_EQ(terms, 2 * 4 * 3 * 8 * 8);
  const at::Tensor parts = model->loss(b.rows(0, 1)).first + model->loss(b.rows(1, 1)).first;
  EXPECT_LE(rel(parts, whole), 1e-6);

  const at::Tensor h = model->embed(b);
  EXPECT_EQ(h.sizes(), at::IntArrayRef({2, 3 * 4 * 4, 32}));
  const lf::models::Batch in = model->block_inputs(b, h.scalar_type());
  EXPECT_EQ(in.at("cos").sizes(), at::IntArrayRef({48, 8}));
  EXPECT_EQ(in.at("timestep_proj").sizes(), at::IntArrayRef({2, 6, 32}));
  EXPECT_EQ(in.at("text").sizes(), at::IntArrayRef({2, 5, 32}));
  EXPECT_TRUE(in.at("text").requires_grad());
  // frame 0, row 0, column 1: the frame and height angles are 0, the width angles not
  EXPECT_TRUE(at::equal(in.at("cos")[1].slice(0, 0, 6), at::ones({6})));
  EXPECT_LT(in.at("cos")[1][6].item<double>(), 1.0);
}

TEST(Wan, RecomputationGivesThePlainGradients) {
  at::manual_seed(4);
  auto model = lf::models::build_model(tiny_config(), "config.json");
  model->init_weights(-1);
  for (auto& p : model->parameters()) p.data().add_(at::randn_like(p) * 0.1);  // no zero modulation tables
  const lf::models::Batch b = tiny_batch();
  model->loss(b).first.backward();
  const auto plain = grads(*model);
  model->zero_grad();
  model->set_recompute(1);
  model->loss(b).first.backward();
  const auto recomputed = grads(*model);
  ASSERT_EQ(plain.size(), recomputed.size());
  ASSERT_TRUE(plain.count("condition_embedder.time_proj.weight"));
  ASSERT_TRUE(plain.count("condition_embedder.text_embedder.linear_1.weight"));
  for (const auto& [n, g] : plain) EXPECT_LE(rel(recomputed.at(n), g), 1e-6) << n;
}

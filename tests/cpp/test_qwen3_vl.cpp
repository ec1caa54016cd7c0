// Qwen3-VL on the contract: the training path (embed running the tower, block_inputs handing the deepstack features
// to the first blocks as item fields) gives `dump`'s reference loss, splitting the batch by rows sums to the whole,
// and recomputing the blocks gives every gradient of a plain run (the deepstack features are added outside). Interleaved M-RoPE frequencies take
// their rows as transformers' Qwen3-VL recomposition. Parity with transformers: tests/python/test_qwen3_vl_parity.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>

#include "loongforge/core/error.h"
#include "loongforge/models/registry.h"
#include "loongforge/nn/rotary.h"
#include "test_util.h"

namespace {

nlohmann::json tiny_config() {
  return {{"model_type", "qwen3_vl"},
          {"image_token_id", 99},
          {"vision_config",
           {{"depth", 3}, {"hidden_size", 16}, {"intermediate_size", 24}, {"num_heads", 2}, {"patch_size", 2},
            {"spatial_merge_size", 2}, {"temporal_patch_size", 2}, {"out_hidden_size", 24},
            {"num_position_embeddings", 9}, {"deepstack_visual_indexes", {0, 2}}}},
          {"text_config",
           {{"vocab_size", 100}, {"hidden_size", 24}, {"intermediate_size", 32}, {"num_hidden_layers", 3},
            {"num_attention_heads", 2}, {"num_key_value_heads", 1}, {"head_dim", 12},
            {"rope_parameters", {{"rope_type", "default"}, {"mrope_section", {2, 1, 3}}, {"rope_theta", 10000.0}}}}}};
}

}  // namespace

TEST(Qwen3VL, TrainingLossEqualsReferenceAndSplitsByRows) {
  at::manual_seed(5);
  auto model = lf::models::build_model(tiny_config(), "config.json");
  model->init_weights(0.02);
  const lf::test::QwenVLBatch q = lf::test::qwen_vl_batch();
  const lf::models::Batch& b = q.batch;
  at::Tensor sum = lf::test::check_qwen_vl_loss(*model, q);
  sum.backward();
  for (const auto& p : model->named_parameters())
    if (p.key().find("deepstack_merger_list") != std::string::npos && p.key().ends_with("linear_fc2.weight")) {
      EXPECT_GT(p.value().grad().abs().max().item<double>(), 0) << p.key();
    }

  // the block inputs split by rows keep each row's deepstack features
  at::Tensor h = model->embed(b);
  lf::models::Batch in = model->block_inputs(b, h.scalar_type());
  EXPECT_EQ(in.at("deepstack.0").size(0), 12);
  EXPECT_EQ(in.rows(1, 1).at("deepstack.1").size(0), 6);

  // recomputed blocks: the deepstack features are added after each block, outside its recomputation, so every
  // gradient (the deepstack mergers' included) is the plain run's
  std::map<std::string, at::Tensor> plain;
  for (const auto& p : model->named_parameters())
    if (p.value().grad().defined()) plain[p.key()] = p.value().grad().clone();
  model->zero_grad();
  model->set_recompute(1);
  model->loss(b).first.backward();
  for (const auto& p : model->named_parameters()) {
    if (!plain.count(p.key())) continue;
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(at::allclose(p.value().grad(), plain[p.key()], 1e-5, 1e-7)) << p.key();
  }
}

// transformers' Qwen3VLTextRotaryEmbedding.recomposition_frequencies: frequency j from the height row when
// j % 3 == 1 and j < 3 * sections[1], from the width row when j % 3 == 2 and j < 3 * sections[2], else temporal.
TEST(Rotary, InterleavedMultimodalFrequencies) {
  lf::nn::RopeSpec spec;
  spec.head_dim = 12;
  spec.max_position_embeddings = 64;
  spec.mrope_section = {2, 1, 3};
  spec.mrope_interleaved = true;
  lf::nn::Rotary rope(spec);
  at::Tensor pos = at::arange(10, at::kLong).view({2, 5});
  at::Tensor rows = at::stack({pos, pos * 2 + 1, pos * 3 + 7});
  auto [c, s] = rope.cos_sin(rows);
  const int64_t row_of_freq[6] = {0, 1, 2, 0, 0, 2};
  for (int64_t f = 0; f < 6; ++f) {
    auto [cr, sr] = rope.cos_sin(rows[row_of_freq[f]].unsqueeze(0).expand({3, 2, 5}));
    for (int64_t half : {0, 6}) {
      EXPECT_TRUE(at::equal(c.select(-1, f + half), cr.select(-1, f + half))) << f;
      EXPECT_TRUE(at::equal(s.select(-1, f + half), sr.select(-1, f + half))) << f;
    }
  }
}

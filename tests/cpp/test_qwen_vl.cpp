// Qwen2.5-VL on the contract: the training path (embed with the images as item fields, block_inputs' multimodal
// rotary tables, the summed head loss) gives `dump`'s reference loss, and splitting the batch by rows (each row
// keeping its patches and grids) sums to the whole. Parity with transformers: tests/python/test_qwen_vl_parity.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "loongforge/core/error.h"
#include "loongforge/models/registry.h"

namespace {

nlohmann::json tiny_config() {
  return {{"model_type", "qwen2_5_vl"},
          {"image_token_id", 99},
          {"vision_config",
           {{"depth", 2}, {"hidden_size", 16}, {"intermediate_size", 24}, {"num_heads", 2}, {"patch_size", 2},
            {"spatial_merge_size", 2}, {"temporal_patch_size", 2}, {"window_size", 8}, {"out_hidden_size", 24},
            {"fullatt_block_indexes", {1}}}},
          {"text_config",
           {{"vocab_size", 100}, {"hidden_size", 24}, {"intermediate_size", 32}, {"num_hidden_layers", 2},
            {"num_attention_heads", 2}, {"num_key_value_heads", 1},
            {"rope_parameters", {{"rope_type", "default"}, {"mrope_section", {2, 2, 2}}, {"rope_theta", 10000.0}}}}}};
}

}  // namespace

TEST(QwenVL, TrainingLossEqualsReferenceAndSplitsByRows) {
  at::manual_seed(3);
  auto model = lf::models::build_model(tiny_config(), "config.json");
  model->init_weights(0.02);
  // row 0: an image of 4x6 patches (6 tokens), row 1: one of 6x4 patches (6 tokens); 16 tokens each
  at::Tensor ids = at::randint(3, 90, {2, 16}, at::kLong);
  ids.narrow(1, 2, 6).fill_(99);
  ids[1].narrow(0, 5, 6).fill_(99);
  ids[1].narrow(0, 2, 3).fill_(7);
  at::Tensor grid = at::tensor({1, 4, 6, 1, 6, 4}, at::kLong).view({2, 3});
  at::Tensor px = at::randn({48, 24});
  at::Tensor labels = ids.masked_fill(ids == 99, -100);
  at::Tensor targets = at::cat({labels.narrow(1, 1, 15), at::full({2, 1}, -100, at::kLong)}, 1);
  lf::models::Batch b{{"input_ids", ids}, {"targets", targets}};
  b.set_items("pixel_values", px, at::cat({at::zeros({24}, at::kLong), at::ones({24}, at::kLong)}));
  b.set_items("image_grid_thw", grid, at::tensor({0, 1}, at::kLong));

  auto [sum, terms] = model->loss(b);
  auto ref = model->reference_forward(
      {{"input_ids", ids}, {"labels", labels}, {"pixel_values", px}, {"image_grid_thw", grid}}, "batch.safetensors");
  EXPECT_NEAR(sum.item<double>() / static_cast<double>(terms), ref.loss.item<double>(), 1e-6);

  auto [s0, t0] = model->loss(b.rows(0, 1));
  auto [s1, t1] = model->loss(b.rows(1, 1));
  EXPECT_EQ(t0 + t1, terms);
  EXPECT_NEAR((s0 + s1).item<double>(), sum.item<double>(), 1e-5 * sum.item<double>());

  // an image token fewer than the grids give: one error naming the batch
  lf::models::Batch bad = b;
  at::Tensor short_ids = ids.clone();
  short_ids[0][2] = 5;
  bad.set("input_ids", short_ids);
  try {
    model->loss(bad);
    FAIL() << "no error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("11 image tokens"), std::string::npos) << e.what();
  }
}

// Qwen2.5-VL on the contract: the training path (embed with the images as item fields, block_inputs' multimodal
// rotary tables, the summed head loss) gives `dump`'s reference loss, and splitting the batch by rows (each row
// keeping its patches and grids) sums to the whole. Parity with transformers: tests/python/test_qwen_vl_parity.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "loongforge/core/error.h"
#include "loongforge/models/registry.h"
#include "test_util.h"

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
  const lf::test::QwenVLBatch q = lf::test::qwen_vl_batch();
  const lf::models::Batch& b = q.batch;
  const at::Tensor& ids = q.ids;
  lf::test::check_qwen_vl_loss(*model, q);

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

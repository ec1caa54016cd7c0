// π0 / π0.5 on the model contract (models/policy/pi0.h): the training loss the engines use (head_loss_sum over
// loss_terms rows) is dump's LeRobot loss and splits by rows; without the batch's draws the noise and Beta time are
// drawn; a model from init_weights samples a finite chunk. Parity with LeRobot: tests/python/test_pi0_parity.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "loongforge/core/error.h"
#include "loongforge/models/registry.h"

namespace {

nlohmann::json tiny_config(const std::string& type) {
  const nlohmann::json gemma = {{"width", 16}, {"depth", 2}, {"mlp_dim", 24}, {"num_heads", 2}, {"num_kv_heads", 1}, {"head_dim", 8}};
  nlohmann::json expert = gemma;
  expert["width"] = 12;
  return {{"type", type},
          {"input_features", {{"observation.state", {{"type", "STATE"}, {"shape", {3}}}},
                              {"observation.images.top", {{"type", "VISUAL"}, {"shape", {3, 16, 16}}}}}},
          {"output_features", {{"action", {{"type", "ACTION"}, {"shape", {2}}}}}},
          {"paligemma_variant", "tiny"}, {"action_expert_variant", "tiny_expert"},
          {"variant_sizes", {{"tiny", gemma}, {"tiny_expert", expert}}},
          {"vocab_size", 20},
          {"vision_config", {{"hidden_size", 8}, {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"patch_size", 8},
                             {"intermediate_size", 12}, {"projection_dim", 16}}},
          {"image_resolution", {16, 16}}, {"chunk_size", 4}, {"n_action_steps", 4}, {"max_state_dim", 4},
          {"max_action_dim", 3}, {"num_inference_steps", 2}};
}

std::map<std::string, at::Tensor> tiny_batch(bool draws) {
  const int64_t B = 3;
  std::map<std::string, at::Tensor> b = {
      {"observation.state", at::randn({B, 3})},
      {"observation.images.top", at::rand({B, 3, 12, 16})},
      {"observation.language.tokens", at::randint(0, 20, {B, 5})},
      {"observation.language.attention_mask", at::ones({B, 5}, at::kBool)},
      {"action", at::randn({B, 4, 2})},
  };
  b["observation.language.attention_mask"][2][4] = false;
  if (draws) {
    b["noise"] = at::randn({B, 4, 3});
    b["time"] = at::rand({B}) * 0.999 + 0.001;
    b["sample_noise"] = at::randn({B, 4, 3});
  }
  return b;
}

lf::models::Batch as_batch(const std::map<std::string, at::Tensor>& m) {
  lf::models::Batch b;
  for (const auto& [k, v] : m) b.set(k, v);
  return b;
}

}  // namespace

TEST(PI0, TrainingLossIsDumpsLossAndSplitsByRows) {
  for (const char* type : {"pi0", "pi05"}) {
    SCOPED_TRACE(type);
    at::manual_seed(7);
    auto model = lf::models::build_model(tiny_config(type), "config.json");
    model->init_weights(-1);
    const auto batch = tiny_batch(true);
    const auto ref = model->reference_forward(batch, "batch.safetensors");
    const lf::models::Batch b = as_batch(batch);
    auto [sum, terms] = model->loss(b);
    EXPECT_EQ(terms, 3);
    EXPECT_NEAR((sum / terms).item<double>(), ref.loss.item<double>(), 1e-6);
    const at::Tensor parts = model->loss(b.rows(0, 1)).first + model->loss(b.rows(1, 2)).first;
    EXPECT_NEAR(parts.item<double>(), sum.item<double>(), 1e-5);
    ASSERT_EQ(ref.outputs.size(), 1u);
    EXPECT_EQ(ref.outputs[0].second.sizes(), at::IntArrayRef({3, 4, 2}));
    EXPECT_TRUE(ref.outputs[0].second.isfinite().all().item<bool>());

    // without the draws: drawn (a different loss each time), finite, with gradients
    const lf::models::Batch nodraws = as_batch(tiny_batch(false));
    const at::Tensor l1 = model->loss(nodraws).first, l2 = model->loss(nodraws).first;
    EXPECT_TRUE(l1.isfinite().item<bool>());
    EXPECT_NE(l1.item<double>(), l2.item<double>());
    l1.backward();
    int64_t with_grad = 0;
    for (const auto& p : model->parameters()) with_grad += p.grad().defined();
    EXPECT_GT(with_grad, 0);
    try {
      model->reference_forward(tiny_batch(false), "batch.safetensors");
      ADD_FAILURE() << "dump without the draws should fail";
    } catch (const lf::Error& e) {
      EXPECT_NE(std::string(e.what()).find("batch.safetensors: field 'noise'"), std::string::npos) << e.what();
    }
  }
}

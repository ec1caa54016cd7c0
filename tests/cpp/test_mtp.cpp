// DeepSeek-V3 multi-token prediction (models/llama/mtp.h): the training loss is the main loss + w / K x the depths'
// summed cross-entropies with the targets k+1 tokens further (written here from the labels independently), its
// gradients against float64 finite differences for every parameter, the checkpoint names and dropping the layers a
// folder lacks. Parity with transformers' MtpModel, training runs and speculative decoding:
// tests/python/test_deepseek_mtp.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "loongforge/models/llama/model.h"
#include "loongforge/models/llama/mtp.h"
#include "loongforge/nn/loss.h"
#include "test_util.h"

namespace {

using lf::models::Batch;
using lf::models::llama::CausalLM;
using lf::models::llama::DecoderConfig;

nlohmann::json tiny_json() {
  return {{"model_type", "deepseek_v3"}, {"vocab_size", 24}, {"hidden_size", 8}, {"intermediate_size", 12},
          {"moe_intermediate_size", 6}, {"num_hidden_layers", 2}, {"num_attention_heads", 2},
          {"num_key_value_heads", 2}, {"kv_lora_rank", 4}, {"q_lora_rank", 6}, {"qk_nope_head_dim", 4},
          {"qk_rope_head_dim", 4}, {"v_head_dim", 6}, {"n_routed_experts", 4}, {"num_experts_per_tok", 2},
          {"n_group", 2}, {"topk_group", 1}, {"n_shared_experts", 1}, {"first_k_dense_replace", 1},
          {"num_nextn_predict_layers", 2}, {"max_position_embeddings", 64}};
}

CausalLM make_model() {
  at::manual_seed(0);
  CausalLM m(DecoderConfig::from_json(tiny_json()));
  m->to(at::kDouble);
  at::NoGradGuard ng;  // non-trivial norms, spread routers
  for (auto& p : m->parameters()) p.copy_(p.dim() == 1 ? 1 + 0.3 * at::randn_like(p) : 0.4 * at::randn_like(p));
  // the head's cross-entropy in float64 (the model's own runs in float32), through the layouts' hook
  m->vocab_loss_fn = [](const at::Tensor& h, const at::Tensor& w, const at::Tensor& t) {
    at::Tensor logits = at::linear(h, w);
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), t.reshape({-1}), {}, at::Reduction::Sum,
                                  lf::nn::kIgnoreIndex);
  };
  return m;
}

// input_ids [2,7]; labels with one ignored token; targets = labels shifted (the batch sources' form).
struct Data {
  at::Tensor ids, labels;
  Batch batch;
};

Data make_data() {
  at::manual_seed(1);
  Data d;
  d.ids = at::randint(0, 24, {2, 7}, at::kLong);
  d.labels = d.ids.clone();
  d.labels[1][4] = lf::nn::kIgnoreIndex;
  at::Tensor targets = at::full_like(d.labels, lf::nn::kIgnoreIndex);
  targets.narrow(1, 0, 6).copy_(d.labels.narrow(1, 1, 6));
  d.batch = Batch{{"input_ids", d.ids}, {"targets", targets}};
  return d;
}

TEST(Mtp, LossIsMainPlusWeightedDepthLosses) {
  CausalLM m = make_model();
  ASSERT_NE(m->mtp(), nullptr);
  EXPECT_EQ(m->set_mtp_loss_weight(0.6), "");
  Data d = make_data();
  at::Tensor loss = m->head_loss_sum(m->forward_hidden(d.batch), d.batch);
  // the same from the labels: depth k at position i predicts labels[i+k+2]
  at::Tensor h = m->hidden_states(d.ids);
  double want = m->vocab_loss_fn(h, m->output_weight(), d.batch.at("targets")).item<double>();
  const int64_t t = 7;
  at::Tensor pos = at::arange(t, at::kLong).unsqueeze(0).expand({2, t});
  double depth_sum = 0;
  for (int64_t k = 0; k < 2; ++k) {
    const int64_t n = t - k - 1;
    h = m->mtp_forward(k, h.narrow(1, 0, n), d.ids.narrow(1, k + 1, n), pos.narrow(1, k + 1, n));
    at::Tensor tk = at::full({2, n}, lf::nn::kIgnoreIndex, at::kLong);
    tk.narrow(1, 0, n - 1).copy_(d.labels.narrow(1, k + 2, n - 1));
    at::Tensor lp = at::log_softmax(m->logits(h), -1);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t i = 0; i < n; ++i)
        if (tk[b][i].item<int64_t>() != lf::nn::kIgnoreIndex) depth_sum -= lp[b][i][tk[b][i].item<int64_t>()].item<double>();
  }
  want += 0.6 / 2 * depth_sum;
  EXPECT_NEAR(loss.item<double>(), want, 1e-10 * std::abs(want));
  auto parts = m->take_loss_parts();
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].first, "mtp_loss");
  EXPECT_NEAR(parts[0].second, depth_sum / 2, 1e-10 * depth_sum);
  EXPECT_TRUE(m->take_loss_parts()[0].second == 0);  // taken
  // without gradients (validation) the loss is the main model's
  at::NoGradGuard ng;
  at::Tensor main = m->head_loss_sum(m->forward_hidden(d.batch), d.batch);
  EXPECT_NEAR(main.item<double>(), m->vocab_loss_fn(m->hidden_states(d.ids), m->output_weight(), d.batch.at("targets")).item<double>(), 1e-12);
}

TEST(Mtp, GradientsMatchFiniteDifferences) {
  CausalLM m = make_model();
  ASSERT_EQ(m->set_mtp_loss_weight(0.7), "");
  Data d = make_data();
  auto f = [&] { return m->head_loss_sum(m->forward_hidden(d.batch), d.batch); };
  m->zero_grad();
  f().backward();
  at::manual_seed(2);
  int checked = 0;
  double worst = 0;
  for (auto& item : m->named_parameters()) {
    at::Tensor p = item.value();
    ASSERT_TRUE(p.grad().defined()) << item.key();
    at::Tensor flat = p.detach().view(-1), g = p.grad().view(-1);
    for (int r = 0; r < 2; ++r) {
      const int64_t i = at::randint(0, flat.numel(), {1}, at::kLong).item<int64_t>();
      const double x = flat[i].item<double>(), eps = 1e-6;
      double lp, lm;
      {
        at::NoGradGuard ng;
        flat[i] = x + eps;
      }
      {
        at::AutoGradMode on(true);  // the MTP term is part of training forwards only
        lp = f().item<double>();
      }
      {
        at::NoGradGuard ng;
        flat[i] = x - eps;
      }
      lm = f().item<double>();
      {
        at::NoGradGuard ng;
        flat[i] = x;
      }
      const double fd = (lp - lm) / (2 * eps), an = g[i].item<double>();
      EXPECT_NEAR(an, fd, 1e-6 * std::max(1.0, std::abs(fd))) << item.key() << "[" << i << "]";
      worst = std::max(worst, std::abs(an - fd) / std::max(1.0, std::abs(fd)));
      ++checked;
    }
  }
  EXPECT_GT(checked, 40);
  std::printf("mtp gradients: %d entries, max |analytic - fd| / max(1, |fd|) = %.2e\n", checked, worst);
}

TEST(Mtp, CheckpointNamesAndAbsentLayers) {
  CausalLM m = make_model();
  std::set<std::string> names;
  for (const auto& e : m->checkpoint_tensors()) names.insert(e.name);
  for (const char* n : {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
                        "model.layers.3.shared_head.norm.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
                        "model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
                        "model.layers.2.input_layernorm.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"})
    EXPECT_TRUE(names.count(n)) << n;
  EXPECT_FALSE(std::any_of(names.begin(), names.end(), [](const std::string& n) { return n.starts_with("mtp."); }));
  EXPECT_TRUE(m->ignorable_checkpoint_tensor("model.layers.3.shared_head.head.weight"));
  EXPECT_TRUE(m->ignorable_checkpoint_tensor("model.layers.2.embed_tokens.weight"));
  EXPECT_FALSE(m->ignorable_checkpoint_tensor("model.layers.4.embed_tokens.weight"));
  // a folder holding only the main model (and DeepSeek's copies, which do not count): the MTP layers go
  m->drop_absent_parts({"model.embed_tokens.weight", "model.layers.2.embed_tokens.weight"});
  EXPECT_EQ(m->mtp(), nullptr);
  for (const auto& item : m->named_parameters()) EXPECT_FALSE(item.key().starts_with("mtp.")) << item.key();
  EXPECT_NE(m->set_mtp_loss_weight(0.5).find("model.layers.2.* absent"), std::string::npos);
  EXPECT_EQ(m->set_mtp_loss_weight(0), "");
  // a folder with them keeps them
  CausalLM kept = make_model();
  kept->drop_absent_parts({"model.layers.3.eh_proj.weight"});
  EXPECT_NE(kept->mtp(), nullptr);
}

TEST(Mtp, ConfigErrorsNameTheField) {
  nlohmann::json j = tiny_json();
  j["num_nextn_predict_layers"] = -1;
  EXPECT_EQ(lf::test::error_of([&] { CausalLM m(DecoderConfig::from_json(j)); }),
            "config.json: field 'num_nextn_predict_layers': expected an integer >= 0, got -1");
  j["num_nextn_predict_layers"] = 0;
  CausalLM none(DecoderConfig::from_json(j));
  EXPECT_EQ(none->mtp(), nullptr);
  EXPECT_NE(none->set_mtp_loss_weight(1.0).find("num_nextn_predict_layers = 0"), std::string::npos);
}

}  // namespace

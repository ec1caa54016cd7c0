// DeepSeek-V3 multi-head latent attention (models/llama/mla.h): gradients against float64 finite differences, the
// latent KV cache against the full-sequence forward, packed documents against separate runs, and the interleaved
// rotary against an element-wise pair rotation. Parity with transformers: tests/python/test_deepseek_parity.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <tuple>

#include "loongforge/core/error.h"
#include "loongforge/models/llama/mla.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/parallel/layout.h"
#include "test_util.h"

namespace {

using lf::models::llama::DecoderConfig;
using lf::models::llama::MLA;

nlohmann::json tiny_json(bool q_lora, bool interleave, bool yarn) {
  nlohmann::json j = {{"model_type", "deepseek_v3"}, {"vocab_size", 32}, {"hidden_size", 8}, {"intermediate_size", 16},
                      {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 2},
                      {"kv_lora_rank", 4}, {"qk_nope_head_dim", 4}, {"qk_rope_head_dim", 4}, {"v_head_dim", 6},
                      {"q_lora_rank", q_lora ? nlohmann::json(6) : nlohmann::json(nullptr)},
                      {"rope_interleave", interleave}, {"attention_bias", q_lora}, {"max_position_embeddings", 64},
                      {"first_k_dense_replace", 1}};
  if (yarn)
    j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 4.0},
                            {"original_max_position_embeddings", 16}, {"mscale", 0.9}, {"mscale_all_dim", 0.7}};
  return j;
}

struct Tiny {
  DecoderConfig c;
  MLA mla{nullptr};
  at::Tensor cos, sin;
};

Tiny make(bool q_lora, bool interleave, bool yarn, int64_t b, int64_t t, uint64_t seed = 0) {
  Tiny s;
  s.c = DecoderConfig::from_json(tiny_json(q_lora, interleave, yarn));
  at::manual_seed(seed);
  s.mla = MLA(s.c, 0);
  s.mla->to(at::kDouble);
  {
    at::NoGradGuard ng;  // non-trivial norms and biases, so their gradients are tested
    for (auto& p : s.mla->parameters()) p.copy_(p.dim() == 1 ? 1 + 0.3 * at::randn_like(p) : 0.4 * at::randn_like(p));
  }
  lf::nn::Rotary rot(lf::models::llama::rope_spec(s.c));
  at::Tensor pos = at::arange(t, at::kLong).unsqueeze(0).expand({b, t});
  auto [cos, sin] = rot.cos_sin(pos);
  s.cos = cos.to(at::kDouble);
  s.sin = sin.to(at::kDouble);
  return s;
}

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

void check_gradients(bool q_lora, bool interleave, bool yarn) {
  Tiny s = make(q_lora, interleave, yarn, 2, 5);
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({2, 5, 8}, opts).requires_grad_();
  at::Tensor dy = at::randn({2, 5, 8}, opts);
  at::Tensor y = s.mla->forward(x, s.cos, s.sin, nullptr);
  std::vector<at::Tensor> inputs = {x};
  std::vector<std::string> names = {"x"};
  for (auto& p : s.mla->named_parameters()) {
    inputs.push_back(p.value());
    names.push_back(p.key());
  }
  auto grads = torch::autograd::grad({y}, inputs, {dy});
  at::Tensor xd = x.detach().clone();
  at::Tensor* xin = &xd;
  auto f = [&] { return s.mla->forward(*xin, s.cos, s.sin, nullptr); };
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor target = i == 0 ? xd : inputs[i];
    at::Tensor num = lf::test::numeric_grad(f, target, dy);
    ASSERT_TRUE(grads[i].defined()) << names[i];
    EXPECT_LT(max_abs(grads[i] - num), 1e-6 * std::max(1.0, max_abs(num))) << names[i];
    EXPECT_GT(max_abs(num), 1e-6) << names[i] << ": a gradient that is zero tests nothing";
  }
}

TEST(MLA, GradientsMatchFiniteDifferencesLowRankQInterleavedYarn) { check_gradients(true, true, true); }

TEST(MLA, GradientsMatchFiniteDifferencesPlainQProj) { check_gradients(false, false, false); }

TEST(MLA, ChildNamesAreTransformers) {
  for (bool q_lora : {true, false}) {
    Tiny s = make(q_lora, true, false, 1, 2);
    std::vector<std::string> got;
    for (auto& p : s.mla->named_parameters()) got.push_back(p.key());
    std::vector<std::string> want =
        q_lora ? std::vector<std::string>{"q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight",
                                          "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight",
                                          "kv_b_proj.weight", "o_proj.weight", "o_proj.bias"}
               : std::vector<std::string>{"q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight",
                                          "kv_b_proj.weight", "o_proj.weight"};
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want);
  }
  // A DecoderLayer registers MLA as "self_attn".
  auto c = DecoderConfig::from_json(tiny_json(true, true, false));
  lf::models::llama::DecoderLayer layer(c, 0);
  bool found = false;
  for (auto& p : layer->named_parameters()) found |= p.key() == "self_attn.kv_b_proj.weight";
  EXPECT_TRUE(found);
  EXPECT_FALSE(layer->self_attn);
}

TEST(MLA, LatentCacheMatchesFullSequence) {
  const int64_t t = 7;
  Tiny s = make(true, true, true, 2, t, 3);
  at::NoGradGuard ng;
  at::Tensor x = at::randn({2, t, 8}, at::kDouble);
  at::Tensor full = s.mla->forward(x, s.cos, s.sin, nullptr);
  lf::nn::KVCache cache(1);
  std::vector<at::Tensor> parts;
  for (auto [begin, len] : {std::pair<int64_t, int64_t>{0, 4}, {4, 1}, {5, 2}}) {
    parts.push_back(s.mla->forward(x.narrow(1, begin, len), s.cos.narrow(1, begin, len), s.sin.narrow(1, begin, len), &cache));
  }
  EXPECT_EQ(cache.length(), t);
  EXPECT_EQ(cache.keys[0].size(-1), 4);    // kv_lora_rank: the latent, not per-head keys
  EXPECT_EQ(cache.values[0].size(-1), 4);  // qk_rope_head_dim
  EXPECT_LT(max_abs(at::cat(parts, 1) - full), 1e-12);
}

TEST(MLA, PackedDocumentsMatchSeparateRuns) {
  Tiny s = make(false, true, false, 1, 9, 4);
  at::NoGradGuard ng;
  at::Tensor x = at::randn({1, 9, 8}, at::kDouble);
  // Documents of 5 and 4 tokens, positions restarting at 0 in each (as the packed SFT batches).
  lf::nn::Rotary rot(lf::models::llama::rope_spec(s.c));
  at::Tensor pos = at::cat({at::arange(5, at::kLong), at::arange(4, at::kLong)}).unsqueeze(0);
  auto [cos, sin] = rot.cos_sin(pos);
  at::Tensor seg = at::cat({at::zeros({5}, at::kLong), at::ones({4}, at::kLong)}).unsqueeze(0);
  at::Tensor packed = s.mla->forward(x, cos.to(at::kDouble), sin.to(at::kDouble), nullptr, seg);
  at::Tensor a = s.mla->forward(x.narrow(1, 0, 5), s.cos.narrow(1, 0, 5).narrow(0, 0, 1), s.sin.narrow(1, 0, 5).narrow(0, 0, 1), nullptr);
  at::Tensor b = s.mla->forward(x.narrow(1, 5, 4), s.cos.narrow(1, 0, 4).narrow(0, 0, 1), s.sin.narrow(1, 0, 4).narrow(0, 0, 1), nullptr);
  EXPECT_LT(max_abs(packed - at::cat({a, b}, 1)), 1e-12);
}

TEST(MLA, InterleavedRotaryRotatesAdjacentPairs) {
  const int64_t d = 6, t = 3;
  at::Tensor x = at::randn({1, 2, t, d}, at::kDouble);
  at::Tensor theta = at::randn({1, t, d / 2}, at::kDouble);
  at::Tensor emb = at::cat({theta, theta}, -1);
  at::Tensor y = lf::models::llama::apply_rotary_interleaved(x, emb.cos(), emb.sin());
  // Pair i = (x[2i], x[2i+1]) rotated by theta_i; the result lists the rotated first members, then the second ones.
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t p = 0; p < t; ++p)
      for (int64_t i = 0; i < d / 2; ++i) {
        double a = x[0][h][p][2 * i].item<double>(), b = x[0][h][p][2 * i + 1].item<double>();
        double th = theta[0][p][i].item<double>();
        EXPECT_NEAR(y[0][h][p][i].item<double>(), a * std::cos(th) - b * std::sin(th), 1e-12);
        EXPECT_NEAR(y[0][h][p][i + d / 2].item<double>(), b * std::cos(th) + a * std::sin(th), 1e-12);
      }
}

TEST(MLA, ConfigFieldsAndErrors) {
  auto c = DecoderConfig::from_json(tiny_json(false, true, true));
  EXPECT_TRUE(c.mla);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.head_dim, 4);  // the rotary width
  // yarn with mscale_all_dim: qk_head_dim^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2
  const double m = 0.1 * 0.7 * std::log(4.0) + 1.0;
  EXPECT_NEAR(c.attention_scale, m * m / std::sqrt(8.0), 1e-15);
  auto no_yarn = DecoderConfig::from_json(tiny_json(true, true, false));
  EXPECT_NEAR(no_yarn.attention_scale, 1 / std::sqrt(8.0), 1e-15);
  auto j = tiny_json(true, true, false);
  j.erase("q_lora_rank");  // absent: transformers' default 1536
  EXPECT_EQ(DecoderConfig::from_json(j).q_lora_rank, 1536);
  j = tiny_json(true, true, false);
  j["num_key_value_heads"] = 1;
  try {
    DecoderConfig::from_json(j, "DIR/config.json");
    FAIL() << "expected an error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("DIR/config.json: field 'num_key_value_heads'"), std::string::npos) << e.what();
  }
  j = tiny_json(true, true, false);
  j["qk_rope_head_dim"] = 3;
  EXPECT_THROW(DecoderConfig::from_json(j), lf::Error);
}

TEST(MLA, DeepSeekMoEConfig) {
  auto j = tiny_json(true, true, false);
  j["num_hidden_layers"] = 3;
  j["first_k_dense_replace"] = 1;
  j["n_routed_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["n_group"] = 2;
  j["topk_group"] = 1;
  j["moe_intermediate_size"] = 4;
  j["n_shared_experts"] = 2;
  auto c = DecoderConfig::from_json(j);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1) && c.is_moe_layer(2));
  EXPECT_EQ(c.moe_scoring, "sigmoid");
  EXPECT_TRUE(c.moe_score_correction_bias);
  EXPECT_EQ(c.moe_n_group, 2);
  EXPECT_EQ(c.moe_topk_group, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);  // transformers' default
  // parameter count = the module tree's, without the multi-token prediction layer (transformers' count has none;
  // num_nextn_predict_layers defaults to 1, so the tree holds one under "mtp.")
  lf::models::llama::CausalLM m(c);
  int64_t n = 0, mtp = 0;
  for (auto& p : m->named_parameters()) (p.key().rfind("mtp.", 0) == 0 ? mtp : n) += p.value().numel();
  EXPECT_EQ(c.num_parameters(), n);
  EXPECT_GT(mtp, 0);
  bool bias_buffer = false;
  for (auto& b : m->named_buffers()) bias_buffer |= b.key() == "model.layers.1.mlp.gate.e_score_correction_bias";
  EXPECT_TRUE(bias_buffer);
  auto bad = [&](const char* field, int64_t value, const std::string& want) {
    auto k = j;
    k[field] = value;
    try {
      DecoderConfig::from_json(k, "DIR/config.json");
      ADD_FAILURE() << field << " " << value << ": expected an error";
    } catch (const lf::Error& e) {
      EXPECT_NE(std::string(e.what()).find("DIR/config.json: field '" + want + "'"), std::string::npos) << e.what();
    }
  };
  bad("n_group", 3, "n_group");          // does not divide 8 experts
  bad("topk_group", 3, "topk_group");    // more groups than n_group
  bad("num_experts_per_tok", 5, "num_experts_per_tok");  // only 1 group x 4 experts selectable
}

TEST(MLA, TensorAndContextParallelLayoutsAreAccepted) {
  lf::models::llama::CausalLM m(DecoderConfig::from_json(tiny_json(true, true, false)));
  for (auto [tp, cp, sp] : {std::tuple{2, 1, false}, {2, 1, true}, {1, 2, false}}) {
    lf::parallel::Layout l;
    l.tp = tp;
    l.cp = cp;
    l.sp = sp;
    EXPECT_NO_THROW(lf::parallel::validate(l, *m, 16, 1, false)) << l.describe();
  }
  lf::parallel::Layout l;
  l.tp = 3;  // 2 heads
  EXPECT_THROW(lf::parallel::validate(l, *m, 16, 1, false), lf::Error);
}

}  // namespace

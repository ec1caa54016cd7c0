// LoRA adapters (nn/lora.h) and PEFT folders (io/peft.h). LoraSave.PeftOracle does nothing (GTEST_SKIP) unless
// LF_LORA_SAVE_BASE (a HF model folder) and LF_LORA_SAVE_OUT are set: tests/python/test_lora.py drives it and loads
// the result with PeftModel.from_pretrained.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/peft.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/nn/lora.h"
#include "test_util.h"

namespace {

using lf::test::temp_dir;
namespace fs = std::filesystem;
using lf::models::llama::CausalLM;
using lf::models::llama::DecoderConfig;

CausalLM tiny_model(at::ScalarType dtype) {
  nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 50}, {"hidden_size", 32}, {"intermediate_size", 48},
                      {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false}};
  torch::manual_seed(0);
  CausalLM m(DecoderConfig::from_json(j));
  m->to(dtype);
  return m;
}

void randomize_b(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  at::NoGradGuard g;
  for (auto& [n, p] : params)
    if (n.find(".lora_B.") != std::string::npos) p.normal_(0, 0.1);
}


void remove_adapter_dir(const fs::path& d) {
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors"}) std::remove((d / f).c_str());
  ::rmdir(d.c_str());
}

TEST(Lora, NamesInitAndScaling) {
  auto m = tiny_model(at::kFloat);
  lf::nn::LoraConfig cfg;
  cfg.r = 4;
  cfg.alpha = 8;
  cfg.target_modules = {"q_proj", "mlp.down_proj"};
  auto params = lf::nn::apply_lora(*m, cfg);
  ASSERT_EQ(params.size(), 8u);  // 2 layers x 2 modules x (A, B)
  EXPECT_EQ(params[0].first, "model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(params[1].first, "model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_EQ(params[2].first, "model.layers.0.mlp.down_proj.lora_A.weight");
  EXPECT_EQ(params[0].second.sizes(), at::IntArrayRef({4, 32}));
  EXPECT_EQ(params[1].second.sizes(), at::IntArrayRef({32, 4}));
  EXPECT_EQ(params[3].second.sizes(), at::IntArrayRef({32, 4}));
  EXPECT_LE(params[0].second.abs().max().item<double>(), 1 / std::sqrt(32.0));
  EXPECT_GT(params[0].second.abs().max().item<double>(), 0);
  EXPECT_EQ(params[1].second.abs().max().item<double>(), 0);
  auto* q = m->model->layers[0]->as<lf::models::llama::DecoderLayerImpl>()->self_attn->q_proj.get();
  auto ad = std::dynamic_pointer_cast<lf::nn::LoraAdapter>(q->adapter);
  ASSERT_TRUE(ad);
  EXPECT_DOUBLE_EQ(ad->scaling, 2.0);
  cfg.use_rslora = true;
  EXPECT_DOUBLE_EQ(cfg.scaling(), 4.0);
  EXPECT_EQ(lf::nn::lora_modules(*m).size(), 4u);
  EXPECT_THROW(lf::nn::apply_lora(*m, cfg), lf::Error);  // already adapted
}

TEST(Lora, RegexTarget) {
  auto m = tiny_model(at::kFloat);
  lf::nn::LoraConfig cfg;
  cfg.target_modules = {"re:model\\.layers\\.1\\..*\\.(v_proj|up_proj)"};
  auto mods = (lf::nn::apply_lora(*m, cfg), lf::nn::lora_modules(*m));
  EXPECT_EQ(mods, (std::vector<std::string>{"model.layers.1.self_attn.v_proj", "model.layers.1.mlp.up_proj"}));
  // the regex must match the whole name: "v_proj" alone matches nothing
  auto m2 = tiny_model(at::kFloat);
  cfg.target_modules = {"re:v_proj", "nope"};
  try {
    lf::nn::apply_lora(*m2, cfg);
    FAIL() << "expected lf::Error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'re:v_proj', 'nope'"), std::string::npos) << e.what();
  }
  cfg.target_modules = {"re:(("};
  EXPECT_THROW(lf::nn::apply_lora(*m2, cfg), lf::Error);
}

TEST(Lora, MergeEqualsUnmerged) {
  auto m = tiny_model(at::kDouble);
  lf::nn::LoraConfig cfg;
  cfg.r = 3;
  cfg.alpha = 5;
  cfg.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"};
  randomize_b(lf::nn::apply_lora(*m, cfg));
  m->eval();
  at::Tensor ids = at::randint(0, 50, {2, 9}, at::kLong);
  at::NoGradGuard g;
  at::Tensor h_before = m->hidden_states(ids);
  at::Tensor lm_before = m->lm_head->forward(h_before);
  size_t n_before = m->parameters().size();
  lf::nn::merge_lora(*m);
  EXPECT_EQ(m->parameters().size(), n_before - 2 * 15);
  EXPECT_TRUE(lf::nn::lora_modules(*m).empty());
  at::Tensor h_after = m->hidden_states(ids);
  EXPECT_LE((h_after - h_before).abs().max().item<double>(), 1e-10 * h_before.abs().max().item<double>());
  at::Tensor lm_after = m->lm_head->forward(h_after);
  EXPECT_LE((lm_after - lm_before).abs().max().item<double>(), 1e-10 * lm_before.abs().max().item<double>());
}

TEST(Lora, DropoutOnlyWhenTraining) {
  auto m = tiny_model(at::kDouble);
  lf::nn::LoraConfig cfg;
  cfg.dropout = 0.5;
  cfg.target_modules = {"q_proj"};
  randomize_b(lf::nn::apply_lora(*m, cfg));
  auto& q = m->model->layers[0]->as<lf::models::llama::DecoderLayerImpl>()->self_attn->q_proj;
  at::Tensor x = at::randn({3, 32}, at::kDouble);
  at::NoGradGuard g;
  m->train();
  EXPECT_FALSE(at::allclose(q->forward(x), q->forward(x)));
  m->eval();
  EXPECT_TRUE(at::equal(q->forward(x), q->forward(x)));
}

TEST(Lora, PeftRoundTrip) {
  auto m = tiny_model(at::kFloat);
  lf::nn::LoraConfig cfg;
  cfg.r = 2;
  cfg.alpha = 3.5;
  cfg.use_rslora = true;
  cfg.target_modules = {"o_proj", "re:.*mlp\\.(gate|up)_proj"};
  auto params = lf::nn::apply_lora(*m, cfg);
  randomize_b(params);
  fs::path dir = temp_dir("roundtrip");
  lf::io::save_peft_adapter(dir.string(), *m, cfg, "some/base");
  auto j = lf::read_json_file((dir / "adapter_config.json").string());
  EXPECT_EQ(j["target_modules"], "(?:.*\\.)?o_proj|(?:.*mlp\\.(gate|up)_proj)");
  EXPECT_EQ(j["base_model_name_or_path"], "some/base");
  auto m2 = tiny_model(at::kFloat);
  auto loaded = lf::io::load_peft_adapter(dir.string(), *m2);
  ASSERT_EQ(loaded.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(loaded[i].first, params[i].first);
    EXPECT_TRUE(at::equal(loaded[i].second, params[i].second)) << params[i].first;
  }
  EXPECT_DOUBLE_EQ(lf::io::read_peft_config(dir.string()).scaling(), 3.5 / std::sqrt(2.0));
  EXPECT_EQ(lf::io::peft_name("model.layers.0.mlp.up_proj.lora_A.weight"),
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight");
  // A config that selects more modules than the file holds: the missing tensor is named.
  auto c2 = j;
  c2["target_modules"] = nlohmann::json::array({"o_proj", "gate_proj", "up_proj", "q_proj"});
  lf::write_file_atomic((dir / "adapter_config.json").string(), c2.dump());
  auto m3 = tiny_model(at::kFloat);
  try {
    lf::io::load_peft_adapter(dir.string(), *m3);
    FAIL() << "expected lf::Error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("adapter_model.safetensors: tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' missing"),
              std::string::npos) << e.what();
  }
  remove_adapter_dir(dir);
}

TEST(LoraSave, PeftOracle) {
  const char* base = std::getenv("LF_LORA_SAVE_BASE");
  const char* out = std::getenv("LF_LORA_SAVE_OUT");
  if (!base || !out) GTEST_SKIP() << "set LF_LORA_SAVE_BASE and LF_LORA_SAVE_OUT";
  auto m = std::dynamic_pointer_cast<lf::models::llama::CausalLMImpl>(lf::io::load_model(base, at::kFloat));
  ASSERT_TRUE(m);
  lf::nn::LoraConfig cfg;
  cfg.r = 4;
  cfg.alpha = 6;
  cfg.use_rslora = true;
  cfg.target_modules = {"q_proj", "v_proj", "re:model\\.layers\\.\\d+\\.mlp\\.(up|down)_proj"};
  torch::manual_seed(7);
  randomize_b(lf::nn::apply_lora(*m, cfg));
  lf::io::save_peft_adapter(out, *m, cfg, base);
}

}  // namespace

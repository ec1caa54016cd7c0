// LeRobot's processor files beside a policy (io/policy_processor.h): written files read back the same; the hook
// rewrites a folder LeRobot saved, for tests/python/test_act_parity.py to load with LeRobot.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/io/policy_processor.h"

namespace fs = std::filesystem;
using lf::data::robot::NormMode;

TEST(PolicyProcessor, WrittenFilesReadBack) {
  const fs::path dir = fs::temp_directory_path() / ("lf_policy_proc_" + std::to_string(::getpid()));
  lf::io::PolicyNormalization n;
  n.features = {{"observation.state", {{"type", "STATE"}, {"shape", {4}}}},
                {"observation.images.top", {{"type", "VISUAL"}, {"shape", {3, 8, 8}}}},
                {"action", {{"type", "ACTION"}, {"shape", {2}}}}};
  n.norm_map = {{"STATE", "MIN_MAX"}, {"VISUAL", "IDENTITY"}, {"ACTION", "QUANTILES"}};
  n.eps = 1e-6;
  n.stats["observation.state"] = {{"min", at::rand({4})}, {"max", at::rand({4}) + 1}};
  n.stats["action"] = {{"q01", at::rand({2})}, {"q99", at::rand({2}) + 1}};
  lf::io::write_policy_processors(dir.string(), n, {{"action", n.features["action"]}});
  const auto back = lf::io::read_policy_normalization(dir.string());
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->features, n.features);
  EXPECT_EQ(back->norm_map, n.norm_map);
  EXPECT_DOUBLE_EQ(back->eps, 1e-6);
  EXPECT_EQ(back->modes.at("observation.state"), NormMode::min_max);
  EXPECT_EQ(back->modes.at("observation.images.top"), NormMode::identity);
  EXPECT_EQ(back->modes.at("action"), NormMode::quantiles);
  for (const auto& [f, stats] : n.stats)
    for (const auto& [s, t] : stats) EXPECT_TRUE(at::equal(back->stats.at(f).at(s), t)) << f << "." << s;
  // a mode without statistics is one line naming the file and the step's field
  fs::remove(dir / "policy_preprocessor_step_3_normalizer_processor.safetensors");
  lf::io::PolicyNormalization empty = n;
  empty.stats.clear();
  lf::io::write_policy_processors(dir.string(), empty, {{"action", n.features["action"]}});
  try {
    lf::io::read_policy_normalization(dir.string());
    FAIL() << "no error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("policy_preprocessor.json: field 'steps[3].state_file'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(lf::io::read_policy_normalization((dir / "none").string()).has_value());
  lf::remove_tree(dir.string());
}

// LF_TEST_POLICY_PROC_SRC / _DST: read SRC's processors (as LeRobot saved them) and write them to DST.
TEST(PolicyProcessor, RewriteHook) {
  const char* src = std::getenv("LF_TEST_POLICY_PROC_SRC");
  const char* dst = std::getenv("LF_TEST_POLICY_PROC_DST");
  if (!src || !dst) GTEST_SKIP() << "LF_TEST_POLICY_PROC_SRC / _DST not set";
  const auto n = lf::io::read_policy_normalization(src);
  ASSERT_TRUE(n.has_value());
  nlohmann::json outputs = nlohmann::json::object();
  for (const auto& [name, f] : n->features.items())
    if (f.at("type") == "ACTION") outputs[name] = f;
  lf::io::write_policy_processors(dst, *n, outputs);
}

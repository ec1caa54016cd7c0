#include "loongforge/io/policy_processor.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/io/safetensors.h"

namespace lf::io {

namespace fs = std::filesystem;

namespace {
const char* kPre = "policy_preprocessor.json";
const char* kPost = "policy_postprocessor.json";
const char* kPreName = "policy_preprocessor";
const char* kPostName = "policy_postprocessor";

nlohmann::json device_step() { return {{"registry_name", "device_processor"}, {"config", {{"device", "cpu"}, {"float_dtype", nullptr}}}}; }

nlohmann::json norm_step(const char* registry, const PolicyNormalization& n, const nlohmann::json& features, const std::string& state_file) {
  return {{"registry_name", registry},
          {"config", {{"eps", n.eps}, {"features", features}, {"norm_map", n.norm_map}}},
          {"state_file", state_file}};
}

// "<feature>.<stat>" tensors of the features named in FEATURES, float32, in name order.
NamedTensors state_tensors(const PolicyNormalization& n, const nlohmann::json& features) {
  NamedTensors out;
  for (const auto& [feature, stats] : n.stats) {
    if (!features.contains(feature)) continue;
    for (const auto& [stat, t] : stats) out.emplace_back(feature + "." + stat, t.to(at::kFloat).contiguous());
  }
  return out;
}
}  // namespace

std::optional<PolicyNormalization> read_policy_normalization(const std::string& dir, bool own_steps) {
  const fs::path file = fs::path(dir) / kPre;
  if (!fs::exists(file)) return std::nullopt;
  const std::string f = file.string();
  const nlohmann::json j = read_json_file(f);
  JsonReader r(j, f);
  const nlohmann::json& steps = r.required("steps");
  if (!steps.is_array()) r.expected("steps", "a list of processor steps");
  for (size_t i = 0; i < steps.size(); ++i) {
    JsonReader step(steps[i], f, "steps[" + std::to_string(i) + "]");
    if (step.string("registry_name", "") != "normalizer_processor") continue;
    const JsonReader cfg = step.object("config");
    PolicyNormalization n;
    n.eps = cfg.number("eps", 1e-8);
    n.features = cfg.required("features");
    n.norm_map = cfg.required("norm_map");
    if (!n.features.is_object()) cfg.expected("features", "an object {name: {type, shape}}");
    if (!n.norm_map.is_object()) cfg.expected("norm_map", "an object {feature type: mode}");
    const JsonReader feats = cfg.object("features");
    const JsonReader map = cfg.object("norm_map");
    for (const auto& [name, feat] : n.features.items()) {
      const std::string type = feats.object(name).string("type");
      if (!n.norm_map.contains(type)) continue;  // LeRobot leaves a type without a mode unchanged
      try {
        n.modes[name] = data::robot::parse_norm_mode(map.string(type));
      } catch (const Error& e) {
        map.fail(type, e.what());
      }
    }
    const std::string state = step.string("state_file", "");
    if (!state.empty()) {
      const fs::path sf = fs::path(dir) / state;
      if (!fs::exists(sf)) step.fail("state_file", "'" + state + "' is missing beside " + f);
      auto st = SafetensorsFile::open(sf.string());
      for (const auto& e : st->entries()) {
        const size_t dot = e.name.rfind('.');
        if (dot == std::string::npos || dot == 0) throw file_error(sf.string(), e.name, "expected '<feature>.<stat>'");
        n.stats[e.name.substr(0, dot)][e.name.substr(dot + 1)] = st->tensor(e.name).clone();
      }
    }
    for (const auto& [name, mode] : n.modes)
      if (mode != data::robot::NormMode::identity && !n.stats.count(name))
        step.fail("state_file", "no statistics for feature '" + name + "' (its mode is " + data::robot::norm_mode_name(mode) + ")");
    return n;
  }
  if (own_steps) return std::nullopt;
  r.fail("steps", "no normalizer_processor step");
}

void write_policy_processors(const std::string& dir, const PolicyNormalization& n, const nlohmann::json& outputs,
                             const nlohmann::json& pre_steps, const nlohmann::json& post_steps) {
  fs::create_directories(dir);
  const nlohmann::json rename = {{"registry_name", "rename_observations_processor"}, {"config", {{"rename_map", nlohmann::json::object()}}}};
  const nlohmann::json batch = {{"registry_name", "to_batch_processor"}, {"config", nlohmann::json::object()}};
  nlohmann::json pre = pre_steps.is_null() ? nlohmann::json{rename, batch, device_step(), {{"registry_name", "normalizer_processor"}}} : pre_steps;
  nlohmann::json post = post_steps.is_null() ? nlohmann::json{{{"registry_name", "unnormalizer_processor"}}, device_step()} : post_steps;
  // the (un)normaliser steps filled in, their state files written as "<pipeline>_step_<i>_<registry>.safetensors"
  auto fill = [&](nlohmann::json& steps, const char* pipeline, const char* registry, const nlohmann::json& features) {
    for (size_t i = 0; i < steps.size(); ++i) {
      if (steps[i].value("registry_name", "") != registry) continue;
      const std::string file = std::string(pipeline) + "_step_" + std::to_string(i) + "_" + registry + ".safetensors";
      save_file((fs::path(dir) / file).string(), state_tensors(n, features));
      steps[i] = norm_step(registry, n, features, file);
    }
  };
  fill(pre, kPreName, "normalizer_processor", n.features);
  fill(post, kPostName, "unnormalizer_processor", outputs);
  // a policy's own steps that carry statistics: "stats_features" -> their state file
  auto fill_own = [&](nlohmann::json& steps, const char* pipeline) {
    for (size_t i = 0; i < steps.size(); ++i) {
      if (!steps[i].contains("stats_features")) continue;
      nlohmann::json features = nlohmann::json::object();
      for (const auto& f : steps[i]["stats_features"]) features[f.get<std::string>()] = true;
      steps[i].erase("stats_features");
      const std::string file = std::string(pipeline) + "_step_" + std::to_string(i) + "_" +
                               steps[i].value("registry_name", std::string("step")) + ".safetensors";
      save_file((fs::path(dir) / file).string(), state_tensors(n, features));
      steps[i]["state_file"] = file;
    }
  };
  fill_own(pre, kPreName);
  fill_own(post, kPostName);
  write_file_atomic((fs::path(dir) / kPre).string(), nlohmann::json{{"name", kPreName}, {"steps", pre}}.dump(2));
  write_file_atomic((fs::path(dir) / kPost).string(), nlohmann::json{{"name", kPostName}, {"steps", post}}.dump(2));
}

}  // namespace lf::io

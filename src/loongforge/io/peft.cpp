#include "loongforge/io/peft.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::io {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
const std::string kPrefix = "base_model.model.";

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

// Fields that change the arithmetic unless null/false/empty; we implement none of them.
const char* const kMustBeUnset[] = {
    "fan_in_fan_out", "modules_to_save", "use_dora", "layers_to_transform", "rank_pattern", "alpha_pattern",
    "exclude_modules", "trainable_token_indices", "alora_invocation_tokens", "use_qalora", "layer_replication",
    "lora_bias", "target_parameters", "use_bdlora", "arrow_config", "kasa_config", "velora_config",
    "monteclora_config"};

bool unset(const json& v) { return v.is_null() || (v.is_boolean() && !v.get<bool>()) || ((v.is_object() || v.is_array()) && v.empty()); }

// "(?:.*\.)?q_proj" for a plain name (PEFT's list rule as a regex)
std::string regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string(".^$|()[]{}*+?\\").find(c) != std::string::npos) out += '\\';
    out += c;
  }
  return out;
}

// PEFT key (with or without the ".default" adapter segment) -> our parameter name; "" if not a LoRA weight.
std::string our_name(std::string key) {
  if (key.rfind(kPrefix, 0) != 0) return "";
  key = key.substr(kPrefix.size());
  for (const char* part : {".lora_A", ".lora_B"}) {
    std::string with_default = std::string(part) + ".default.weight", plain = std::string(part) + ".weight";
    auto ends = [&](const std::string& suf) { return key.size() > suf.size() && key.compare(key.size() - suf.size(), suf.size(), suf) == 0; };
    if (ends(with_default)) return key.substr(0, key.size() - with_default.size()) + plain;
    if (ends(plain)) return key;
  }
  return "";
}
}  // namespace

std::string peft_name(const std::string& name) { return kPrefix + name; }

nn::LoraConfig read_peft_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "adapter_config.json").string();
  json j = read_json_file(path);
  if (!j.is_object()) throw file_error(path, "", "expected a JSON object");
  JsonReader rd(j, path);
  const json& type = rd.required("peft_type");
  if (!type.is_string() || type.get<std::string>() != "LORA")
    rd.fail("peft_type", "unsupported value " + type.dump() + " (only \"LORA\")");
  nn::LoraConfig cfg;
  const json& r = rd.required("r");
  if (!r.is_number_integer() || r.get<int64_t>() < 1) rd.expected("r", "an integer >= 1");
  cfg.r = r.get<int64_t>();
  cfg.alpha = j.contains("lora_alpha") ? rd.number("lora_alpha") : 8.0;  // PEFT's default; null fails in PEFT too
  cfg.dropout = 0;
  if (rd.has("lora_dropout")) {
    const json& d = j["lora_dropout"];
    if (!d.is_number() || d.get<double>() < 0 || d.get<double>() >= 1) rd.expected("lora_dropout", "a number in [0, 1)");
    cfg.dropout = d.get<double>();
  }
  cfg.use_rslora = rd.boolean("use_rslora", cfg.use_rslora);
  const json& tm = rd.required("target_modules");
  if (tm.is_string()) {
    std::string s = tm.get<std::string>();
    cfg.target_modules = {s == "all-linear" ? "re:(?!lm_head$).*" : "re:" + s};
  } else if (tm.is_array() && !tm.empty()) {
    for (const auto& t : tm) {
      if (!t.is_string()) rd.fail("target_modules", "expected strings, got " + t.dump());
      cfg.target_modules.push_back(t.get<std::string>());
    }
  } else {
    rd.fail("target_modules", "expected a non-empty list of module names or a regex string");
  }
  if (rd.has("bias") && j["bias"] != "none") rd.fail("bias", "unsupported value " + j["bias"].dump() + " (only \"none\")");
  for (const char* key : kMustBeUnset)
    if (j.contains(key) && !unset(j[key])) rd.fail(key, "unsupported value " + j[key].dump() + " (LoongForge loads plain LoRA only)");
  return cfg;
}

NamedTensors load_peft_adapter(const std::string& dir, torch::nn::Module& root) {
  const std::string cfg_path = (fs::path(dir) / "adapter_config.json").string();
  const std::string st_path = (fs::path(dir) / "adapter_model.safetensors").string();
  nn::LoraConfig cfg = read_peft_config(dir);
  for (auto& item : root.named_modules("", false))  // the LM head is applied as a plain matmul, not Linear::forward
    if (item.key() == "lm_head" && cfg.matches("lm_head"))
      throw file_error(cfg_path, "target_modules", "LoRA on lm_head is not supported");
  if (!fs::exists(st_path)) throw Error(st_path + ": missing (LoongForge reads adapters in safetensors format only)");
  auto file = SafetensorsFile::open(st_path);
  NamedTensors params;
  try {
    params = apply_lora(root, cfg);
  } catch (const Error& e) {
    throw file_error(cfg_path, "target_modules", e.what());
  }
  std::map<std::string, std::string> by_ours;  // our name -> the file's name
  for (const auto& e : file->entries()) {
    std::string ours = our_name(e.name);
    if (ours.empty() || by_ours.count(ours))
      throw Error(st_path + ": tensor '" + e.name + "' is not a LoRA weight LoongForge loads (only lora_A/lora_B of linear layers)");
    by_ours[ours] = e.name;
  }
  std::map<std::string, bool> used;
  at::NoGradGuard no_grad;
  for (auto& [name, p] : params) {
    auto it = by_ours.find(name);
    if (it == by_ours.end()) throw Error(st_path + ": tensor '" + peft_name(name) + "' missing");
    at::Tensor t = file->tensor(it->second);
    if (t.sizes() != p.sizes())
      throw Error(st_path + ": tensor '" + it->second + "': shape " + shape_str(t.sizes()) + " does not match the model's " +
                  shape_str(p.sizes()) + " (r=" + std::to_string(cfg.r) + ")");
    p.copy_(t);
    used[name] = true;
  }
  for (const auto& [ours, key] : by_ours)
    if (!used.count(ours))
      throw Error(st_path + ": tensor '" + key + "' has no matching module (adapter_config.json's target_modules do not select it)");
  return params;
}

void save_peft_adapter(const std::string& dir, torch::nn::Module& root, const nn::LoraConfig& cfg,
                       const std::string& base_model_name_or_path) {
  NamedTensors params = nn::lora_parameters(root);
  if (params.empty()) throw Error(dir + ": no LoRA adapters attached to the model");
  save_peft_tensors(dir, params, cfg, base_model_name_or_path);
}

void save_peft_tensors(const std::string& dir, const NamedTensors& params, const nn::LoraConfig& cfg,
                       const std::string& base_model_name_or_path, const std::string& task_type) {
  NamedTensors tensors;
  for (const auto& [name, t] : params) tensors.emplace_back(peft_name(name), t.detach().to(at::kCPU).contiguous());
  bool plain = true;
  for (const auto& t : cfg.target_modules) plain = plain && t.rfind("re:", 0) != 0;
  json targets;
  if (plain) {
    targets = cfg.target_modules;
  } else {
    std::string re;
    for (const auto& t : cfg.target_modules)
      re += (re.empty() ? "" : "|") + (t.rfind("re:", 0) == 0 ? "(?:" + t.substr(3) + ")" : "(?:.*\\.)?" + regex_escape(t));
    targets = re;
  }
  json c = {{"peft_type", "LORA"}, {"task_type", task_type.empty() ? json(nullptr) : json(task_type)}, {"r", cfg.r}, {"target_modules", targets},
            {"lora_dropout", cfg.dropout}, {"use_rslora", cfg.use_rslora}, {"bias", "none"}, {"fan_in_fan_out", false},
            {"modules_to_save", nullptr}, {"use_dora", false}, {"lora_bias", false}, {"rank_pattern", json::object()},
            {"alpha_pattern", json::object()}, {"layers_to_transform", nullptr}, {"layers_pattern", nullptr},
            {"exclude_modules", nullptr}, {"init_lora_weights", true}, {"inference_mode", true}, {"revision", nullptr}};
  if (cfg.alpha == static_cast<double>(static_cast<int64_t>(cfg.alpha))) c["lora_alpha"] = static_cast<int64_t>(cfg.alpha);
  else c["lora_alpha"] = cfg.alpha;
  c["base_model_name_or_path"] = base_model_name_or_path.empty() ? json(nullptr) : json(base_model_name_or_path);
  fs::create_directories(dir);
  save_file((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / "adapter_config.json").string(), c.dump(2) + "\n");
}

}  // namespace lf::io

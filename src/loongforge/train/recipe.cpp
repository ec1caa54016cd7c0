#include "loongforge/train/recipe.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <map>
#include <set>

#include "loongforge/core/error.h"

namespace lf::train {
namespace {
using nlohmann::json;

// The schema: every key a recipe may set, with its default. Lists hold one element that is the schema of their
// items. Keep docs/recipes.md in step.
const char* kDefaults = R"json({
  "output_dir": "runs/default",
  "seed": 1234,
  "precision": "fp32",
  "fp8_scaling": "tensorwise",
  "device": "cpu",
  "model": {"path": "", "config": "", "family": "", "tokenizer": "", "init_std": -1.0, "recompute": "none", "freeze": [""],
            "vision": {"path": "", "feature_layer": -2, "select_strategy": "default", "freeze": false,
                       "lr_multiplier": 1.0, "recompute": false},
            "projector": {"kind": "mlp2x_gelu", "freeze": false, "lr_multiplier": 1.0},
            "language": {"path": "", "freeze": false, "lr_multiplier": 1.0},
            "image_token": "", "vae": "", "mtp_loss_weight": 0.0,
            "indexer_loss_coef": 0.0, "indexer_dense_warmup": false},
  "data": {
    "format": "pretrain",
    "train": [{"path": "", "weight": 1.0}],
    "seq_len": 256,
    "valid_fraction": 0.0,
    "chat_template": "",
    "assistant_only_loss": true,
    "packing": true,
    "per_document_attention": false,
    "image_root": "",
    "image_backend": "pil",
    "skip_bad_samples": false,
    "balance": "none",
    "resolution": 256,
    "random_flip": false,
    "random_crop": false,
    "robot": {"episodes": [], "valid_episodes": 0, "threads": 2, "tolerance_s": 0.0001, "stats": "", "tokenizer": "",
              "image_transforms": {"enable": false, "max_num_transforms": 3, "random_order": false,
                                   "brightness": [0.8, 1.2], "contrast": [0.8, 1.2], "saturation": [0.5, 1.5],
                                   "hue": [-0.05, 0.05], "sharpness": [0.5, 1.5], "degrees": [-5.0, 5.0],
                                   "translate": [0.05, 0.05], "weights": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                                   "crop": [], "random_crop": false, "resize": [], "resize_align": "center",
                                   "pad_value": 0.0}}
  },
  "train": {"steps": 100, "micro_batch_size": 8, "grad_accum": 1, "threads": 0, "cpu_split": 0, "stop_at_step": 0,
            "cuda_graphs": false, "on_nonfinite": "stop"},
  "optim": {"lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1,
            "no_decay": ["norm", "bias", "embed_tokens"], "clip": 1.0,
            "lr_multipliers": [{"pattern": "", "multiplier": 1.0}]},
  "schedule": {"kind": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.1, "decay_steps": 0},
  "lora": {"enabled": false, "r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj"]},
  "moe": {"aux_loss_coef": -1.0, "seq_aux_loss_coef": 0.0, "z_loss_coef": 0.0, "bias_update_rate": 0.0,
          "capacity_factor": 0.0, "guest_slots": 0, "ranks_per_node": 0},
  "diffusion": {"objective": "none", "timestep_sampling": "uniform", "logit_mean": 0.0, "logit_std": 1.0,
                "mode_scale": 1.29, "loss_weighting": "none", "condition_dropout": 0.0, "vlb_weight": 1.0, "shift": 1.0,
                "num_train_timesteps": 1000, "beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02},
  "ema": {"decay": 0.0, "min_decay": 0.0, "update_after_step": 0, "warmup": "ramp", "inv_gamma": 1.0,
          "power": 0.6666666666666666},
  "checkpoint": {"every": 0, "keep": 2},
  "log": {"every": 1, "progress": "auto", "tensorboard": true, "plot": true, "peak_tflops": 0.0},
  "eval": {"every": 0, "batches": 4, "timestep_buckets": 0, "samples": 0, "sample_steps": 25, "sample_guidance": 1.0},
  "parallel": {"dp": 1, "tp": 1, "pp": 1, "vpp": 1, "cp": 1, "cp_mode": "ring", "ep": 1, "sp": false, "zero": 0,
               "backend": "auto",
               "hsdp_shard": 0, "pp_layout": [], "timeout_s": 300, "vocab_granule": 1}
})json";

// Keys whose value must be one of a few choices.
const std::map<std::string, std::vector<std::string>> kChoices = {
    {"precision", {"fp32", "bf16", "fp8"}},
    {"fp8_scaling", {"tensorwise", "blockwise"}},
    {"device", {"cpu", "cuda"}},
    {"model.recompute", {"none", "full", "per_layer"}},
    {"model.vision.select_strategy", {"default", "full"}},
    {"data.format", {"pretrain", "sft", "batch", "images", "latents", "robot"}},
    {"data.robot.image_transforms.resize_align", {"center", "top_left"}},
    {"data.image_backend", {"pil", "torchvision"}},
    {"data.balance", {"none", "cost"}},
    {"schedule.kind", {"cosine", "linear", "constant", "wsd"}},
    {"diffusion.objective", {"none", "flow_matching", "ddpm"}},
    {"diffusion.timestep_sampling", {"uniform", "logit_normal", "mode"}},
    {"diffusion.loss_weighting", {"none", "sigma_sqrt", "cosmap"}},
    {"diffusion.beta_schedule", {"linear", "scaled_linear", "squaredcos_cap_v2"}},
    {"log.progress", {"auto", "bar", "lines", "off"}},
    {"ema.warmup", {"ramp", "power", "none"}},
    {"parallel.cp_mode", {"ring", "a2a"}},
    {"parallel.backend", {"auto", "nccl", "gloo", "mpi"}},
    {"parallel.zero", {"0", "1", "3"}},
};

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

void collect_keys(const json& schema, const std::string& prefix, std::vector<std::string>& out) {
  for (auto& [k, v] : schema.items()) {
    std::string key = prefix.empty() ? k : prefix + "." + k;
    if (v.is_object()) collect_keys(v, key, out);
    else out.push_back(key);
  }
}

std::string nearest_key(const std::string& key) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const auto& k : recipe_keys()) {
    // compare with the full key and with its last component, so "stpes" finds "train.steps"
    size_t d = edit_distance(key, k);
    auto dot = k.rfind('.');
    if (dot != std::string::npos) d = std::min(d, edit_distance(key, k.substr(dot + 1)) + 1);
    if (d < best_d) best_d = d, best = k;
  }
  return best;
}

Error fail_unknown(const std::string& origin, const std::string& key) {
  return file_error(origin, key, "unknown key (did you mean '" + nearest_key(key) + "'?)");
}

json yaml_to_json(const YAML::Node& n, const std::string& origin) {
  switch (n.Type()) {
    case YAML::NodeType::Map: {
      json o = json::object();
      for (const auto& kv : n) {
        if (!kv.first.IsScalar())  // e.g. "[a, b]: x" (a list as a key)
          throw Error(origin + ": invalid YAML at line " + std::to_string(kv.first.Mark().line + 1) +
                      ": a mapping key must be a plain value");
        o[kv.first.Scalar()] = yaml_to_json(kv.second, origin);
      }
      return o;
    }
    case YAML::NodeType::Sequence: {
      json a = json::array();
      for (const auto& e : n) a.push_back(yaml_to_json(e, origin));
      return a;
    }
    case YAML::NodeType::Scalar: {
      json s = n.Scalar();
      if (n.Tag() == "!") s = json{{"__quoted__", n.Scalar()}};  // "quoted": always a string
      return s;
    }
    default:
      return nullptr;
  }
}

// Types the raw YAML value `v` by the schema `s`; `where` is "FILE: field 'KEY'" context for errors.
json conform(const json& v, const json& s, const std::string& key, const std::string& origin) {
  auto fail = [&](const std::string& what) { return file_error(origin, key, what); };
  if (s.is_object()) {
    if (!v.is_object()) throw fail("expected a mapping");
    json out = json::object();
    for (auto& [k, sub] : v.items()) {
      std::string full = key.empty() ? k : key + "." + k;
      if (!s.contains(k)) throw fail_unknown(origin, full);
      out[k] = conform(sub, s.at(k), full, origin);
    }
    return out;
  }
  if (s.is_array()) {
    if (v.is_null()) return json::array();
    if (!v.is_array()) throw fail("expected a list");
    json out = json::array();
    if (s.empty()) {  // a list of integers whose default is empty (parallel.pp_layout)
      for (const auto& e : v) out.push_back(conform(e, json(int64_t(0)), key, origin));
      return out;
    }
    const json& item = s.at(0);
    for (const auto& e : v) {
      if (item.is_object()) {  // merge each item over the item defaults
        json merged = item;
        json given = conform(e, item, key, origin);
        for (auto& [k, x] : given.items()) merged[k] = x;
        out.push_back(merged);
      } else {
        out.push_back(conform(e, item, key, origin));
      }
    }
    return out;
  }
  // scalars
  bool quoted = v.is_object() && v.contains("__quoted__");
  std::string text = quoted ? v["__quoted__"].get<std::string>() : v.is_string() ? v.get<std::string>() : "";
  if (!quoted && !v.is_string()) throw fail("expected a single value");
  json out;
  if (s.is_string()) {
    out = text;
  } else if (s.is_boolean()) {
    if (text == "true" || text == "True") out = true;
    else if (text == "false" || text == "False") out = false;
    else throw fail("expected true or false, got '" + text + "'");
  } else if (s.is_number_integer()) {
    try {
      size_t used = 0;
      long long x = std::stoll(text, &used);
      if (used != text.size()) throw std::invalid_argument(text);
      out = x;
    } catch (const std::exception&) {
      throw fail("expected an integer, got '" + text + "'");
    }
  } else {
    try {
      size_t used = 0;
      double x = std::stod(text, &used);
      if (used != text.size()) throw std::invalid_argument(text);
      out = x;
    } catch (const std::exception&) {
      throw fail("expected a number, got '" + text + "'");
    }
  }
  auto c = kChoices.find(key);
  if (c != kChoices.end() && std::find(c->second.begin(), c->second.end(), text) == c->second.end()) {
    std::string opts;
    for (const auto& o : c->second) opts += (opts.empty() ? "" : ", ") + o;
    throw fail("'" + text + "' is not one of: " + opts);
  }
  return out;
}

void overlay(json& base, const json& top) {
  for (auto& [k, v] : top.items()) {
    if (v.is_object() && base.contains(k) && base[k].is_object()) overlay(base[k], v);
    else base[k] = v;
  }
}

YAML::Node parse_yaml(const std::string& text, const std::string& origin) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(origin + ": invalid YAML at line " + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
}

}  // namespace

const json& recipe_defaults() {
  static const json d = json::parse(kDefaults);
  return d;
}

std::vector<std::string> recipe_keys() {
  std::vector<std::string> keys;
  collect_keys(recipe_defaults(), "", keys);
  return keys;
}

json load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  json recipe = recipe_defaults();
  // list items are templates in the schema, not defaults
  recipe["data"]["train"] = json::array();
  recipe["optim"]["lr_multipliers"] = json::array();
  recipe["model"]["freeze"] = json::array();
  recipe["lora"]["target_modules"] = json::array({"q_proj", "k_proj", "v_proj", "o_proj"});
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) throw Error(path + ": cannot open recipe");
    std::stringstream ss;
    ss << in.rdbuf();
    YAML::Node root = parse_yaml(ss.str(), path);
    if (root.IsDefined() && !root.IsNull()) {
      json raw = yaml_to_json(root, path);
      if (!raw.is_object()) throw Error(path + ": a recipe is a mapping of keys");
      overlay(recipe, conform(raw, recipe_defaults(), "", path));
    }
  }
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    std::string origin = "--set " + o;
    if (eq == std::string::npos || eq == 0) throw Error(origin + ": expected key=value");
    std::string key = o.substr(0, eq), value = o.substr(eq + 1);
    // build {a: {b: {c: value}}} and conform it like a file
    json raw = yaml_to_json(parse_yaml(value.empty() ? "''" : value, origin), origin);
    if (raw.is_null()) raw = "";
    std::vector<std::string> parts;
    for (size_t b = 0, e; b <= key.size(); b = e + 1) {
      e = key.find('.', b);
      if (e == std::string::npos) e = key.size();
      parts.push_back(key.substr(b, e - b));
    }
    json nested = raw;
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) nested = json{{*it, nested}};
    // an override of a mapping key with a scalar is caught by conform ("expected a mapping")
    overlay(recipe, conform(nested, recipe_defaults(), "", "--set"));
  }
  return recipe;
}

namespace {
void emit(YAML::Emitter& out, const json& v) {
  if (v.is_object()) {
    out << YAML::BeginMap;
    for (auto& [k, x] : v.items()) {
      out << YAML::Key << k << YAML::Value;
      emit(out, x);
    }
    out << YAML::EndMap;
  } else if (v.is_array()) {
    out << YAML::BeginSeq;
    for (const auto& x : v) emit(out, x);
    out << YAML::EndSeq;
  } else if (v.is_string()) {
    out << YAML::DoubleQuoted << v.get<std::string>();
  } else {
    out << v.dump();
  }
}
}  // namespace

std::string recipe_to_yaml(const json& recipe) {
  YAML::Emitter out;
  emit(out, recipe);
  return std::string(out.c_str()) + "\n";
}

std::string recipe_key_of(const std::string& option) {
  static const std::map<std::string, std::string> keys = {
      {"guest_slots", "moe.guest_slots"}, {"ranks_per_node", "moe.ranks_per_node"},
      {"bias_update_rate", "moe.bias_update_rate"}, {"capacity_factor", "moe.capacity_factor"},
      {"target_modules", "lora.target_modules"}, {"family", "model.family"}};
  auto it = keys.find(option);
  return it != keys.end() ? it->second : "parallel." + option;  // the layout's sizes and modes
}

Error recipe_error(const OptionError& e) { return file_error("recipe", recipe_key_of(e.option()), e.why()); }

}  // namespace lf::train

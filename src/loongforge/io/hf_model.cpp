#include "loongforge/io/hf_model.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/io/quantized.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/models/registry.h"

namespace lf::io {
namespace fs = std::filesystem;

namespace {
// Canonical name (Model::canonical_checkpoint_name) -> the name stored in the checkpoint; `dir` names it in errors.
// `prefix` goes before every stored name (a part's folder loaded into a composed model).
std::map<std::string, std::string> stored_names(const models::Model& model, const SafetensorsCheckpoint& ckpt,
                                                const std::string& dir, const std::string& prefix = "") {
  std::map<std::string, std::string> out;
  for (const auto& name : ckpt.names()) {
    auto [it, fresh] = out.emplace(model.canonical_checkpoint_name(prefix + name), name);
    if (!fresh)
      throw Error(dir + ": tensors '" + it->second + "' and '" + name + "' are both '" + it->first +
                  "' (two key layouts mixed in one checkpoint)");
  }
  return out;
}
}  // namespace

namespace {
// load_state / load_part: the checkpoint tensors of the model whose names start with one of `take` (none: all) and
// are not in `skip`, from DIR's tensors under prefix + their stored names.
void load_tensors(models::Model& model, const std::string& dir, const std::string& prefix,
                  const std::vector<std::string>& take = {}, const std::vector<std::string>& skip = {}) {
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  const Quantization quant = read_quantization(dir);
  const std::map<std::string, std::string> stored = stored_names(model, ckpt, dir, prefix);
  auto contains = [&](const std::string& n) { return stored.count(n) > 0; };
  at::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> targets;
  auto params = model.named_parameters(true);
  auto buffers = model.named_buffers(true);
  std::set<std::string> whole;
  for (const auto& e : model.checkpoint_tensors()) {
    if (!take.empty() && std::none_of(take.begin(), take.end(), [&](const auto& t) { return e.name.starts_with(t); }))
      continue;
    if (std::find(skip.begin(), skip.end(), e.name) != skip.end()) continue;
    // A parameter stored under its in-memory name (stacked experts whole, Mixtral's "mlp" block: checkpoints
    // written name for name from the model's parameters) loads from there; otherwise from the mapped names.
    if (e.name != e.param && !contains(e.name) && contains(e.param)) {
      if (whole.insert(e.param).second) targets.emplace_back(e.param, e.buffer ? buffers[e.param] : params[e.param]);
      continue;
    }
    targets.emplace_back(e.name, models::checkpoint_slice(e.buffer ? buffers[e.param] : params[e.param], e));
  }
  for (auto& item : targets) {
    const std::string& name = item.first;
    at::Tensor& p = item.second;
    if (!contains(name))
      throw Error(dir + ": tensor '" + (name.starts_with(prefix) ? name.substr(prefix.size()) : name) +
                  "' missing from the checkpoint" +
                  (prefix.empty() ? "" : " (the " + prefix.substr(0, prefix.size() - 1) + " part)"));
    const std::string& key = stored.at(name);
    const bool quantized = is_quantized(quant, ckpt, key);
    std::vector<int64_t> shape = quantized ? dequantized_shape(ckpt, key) : ckpt.shape(key);
    if (at::IntArrayRef(shape) != p.sizes()) {
      std::string want = "[", got = "[";
      for (auto d : p.sizes()) want += std::to_string(d) + ",";
      for (auto d : shape) got += std::to_string(d) + ",";
      want.back() = ']';
      got.back() = ']';
      throw Error(dir + ": tensor '" + key + "': shape " + got + " does not match the config's " + want);
    }
    p.copy_(quantized ? dequantize(quant, ckpt, key, dir + ": tensor '" + key + "'") : ckpt.tensor(key));
  }
}
}  // namespace

void load_state(models::Model& model, const std::string& dir) { load_tensors(model, dir, ""); }

void load_part(models::Model& model, const models::Composition::Part& part) {
  load_tensors(model, part.dir, part.prefix, part.take.empty() ? std::vector<std::string>{part.prefix} : part.take,
               part.skip);
}

std::shared_ptr<models::Model> load_composed(const models::Composition& c, double init_std, at::ScalarType dtype) {
  std::shared_ptr<models::Model> model = models::build_model(c.config, "the composed model");
  model->init_weights(init_std);
  model->to(dtype);
  for (const auto& part : c.parts) load_part(*model, part);
  return model;
}

std::shared_ptr<models::Model> load_model(const std::string& dir, at::ScalarType dtype, const std::string& family) {
  fs::path cfg = fs::path(dir) / "config.json";
  if (!fs::exists(cfg)) throw Error(cfg.string() + ": missing (expected a Hugging Face model folder)");
  std::shared_ptr<models::Model> model;
  std::optional<SafetensorsCheckpoint> opened;  // (the config's errors come before the weights')
  {
    const nlohmann::json config = read_json_file(cfg.string());
    const models::Family& fam = models::family_for(config, cfg.string(), family);
    if (fam.build_for_weights) {  // widths the config leaves open come from the stored shapes
      opened = SafetensorsCheckpoint::open(dir);
      models::Family::TensorShapes shapes;
      for (const auto& name : opened->names()) shapes[name] = opened->shape(name);
      model = fam.build_for_weights(config, cfg.string(), shapes);
    } else {
      model = fam.build(config, cfg.string());
    }
  }
  model->to(dtype);
  const SafetensorsCheckpoint ckpt = opened ? std::move(*opened) : SafetensorsCheckpoint::open(dir);
  std::set<std::string> stored;  // optional parts the folder lacks (multi-token prediction layers) are dropped
  for (const auto& item : stored_names(*model, ckpt, dir)) stored.insert(item.first);
  model->drop_absent_parts(stored);
  std::set<std::string> expected;
  for (const auto& e : model->checkpoint_tensors()) {
    expected.insert(e.name);
    expected.insert(e.param);  // stacked expert parameters may also be stored whole
  }
  const Quantization quant = read_quantization(dir);
  for (const auto& [name, key] : stored_names(*model, ckpt, dir)) {
    if (expected.count(name) || model->ignorable_checkpoint_tensor(name) || is_quantization_tensor(quant, ckpt, key))
      continue;
    throw Error(dir + ": tensor '" + key + "' is not a parameter of a " + model->model_type() +
                " model with this config.json");
  }
  load_state(*model, dir);
  return model;
}

void export_model(models::Model& model, const std::string& out_dir, at::ScalarType dtype, size_t max_shard_bytes,
                  const std::string& tokenizer_src) {
  fs::create_directories(out_dir);
  NamedTensors tensors;
  for (auto& item : models::checkpoint_targets(model)) {  // integer tensors (DeepSeek-V4's tid2eid) keep their type
    const at::Tensor& t = item.second;
    tensors.emplace_back(item.first, t.detach().to(at::kCPU, t.is_floating_point() ? dtype : t.scalar_type()).contiguous());
  }
  save_sharded(out_dir, tensors, max_shard_bytes, {{"format", "pt"}}, model.weights_file_stem());
  write_model_metadata(model, out_dir, dtype, tokenizer_src);
}

void write_model_metadata(const models::Model& model, const std::string& out_dir, at::ScalarType dtype,
                          const std::string& tokenizer_src) {
  nlohmann::json cfg = model.config_json();
  cfg.erase("quantization_config");  // the weights written are plain (a quantized source was dequantized on load)
  if (model.config_records_dtype()) {
    cfg["dtype"] = dtype_name(dtype) == "BF16" ? "bfloat16" : dtype_name(dtype) == "F16" ? "float16" : "float32";
    cfg.erase("torch_dtype");
  }
  write_file_atomic((fs::path(out_dir) / "config.json").string(), cfg.dump(2) + "\n");
  if (!tokenizer_src.empty()) {
    auto copy_beside = [&](const fs::path& src) {  // the file under its name in out_dir, unless it is that file
      const fs::path dst = fs::path(out_dir) / src.filename();
      if (fs::absolute(src) != fs::absolute(dst)) write_file_atomic(dst.string(), read_text_file(src.string()));
    };
    for (const char* f : {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                          "preprocessor_config.json", "processor_config.json", "chat_template.json",
                          "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt"}) {
      if (const fs::path src = fs::path(tokenizer_src) / f; fs::exists(src)) copy_beside(src);
    }
    // LeRobot's processor pipelines beside a policy (policy_preprocessor.json, its normaliser's
    // policy_preprocessor_step_N_normalizer_processor.safetensors, policy_postprocessor*)
    if (fs::is_directory(tokenizer_src))
      for (const auto& e : fs::directory_iterator(tokenizer_src)) {
        const std::string f = e.path().filename().string();
        if (e.is_regular_file() && (f.starts_with("policy_preprocessor") || f.starts_with("policy_postprocessor")))
          copy_beside(e.path());
      }
  }
}

}  // namespace lf::io

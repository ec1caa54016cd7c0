#include "loongforge/io/hf_model.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <set>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/io/safetensors.h"

namespace lf::io {
namespace fs = std::filesystem;

namespace {
// Tensors that transformers ignores on load (buffers older versions saved).
bool ignorable(const std::string& name) {
  return name.ends_with("rotary_emb.inv_freq");
}
}  // namespace

// The checkpoint tensors of a module and the model tensor (or slice) each fills: the model's declarative list
// (models::llama::checkpoint_tensors: per-expert checkpoint tensors <-> stacked parameters) for a CausalLM, the
// parameters by name otherwise.
std::vector<std::pair<std::string, at::Tensor>> checkpoint_targets(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (auto* lm = dynamic_cast<models::llama::CausalLMImpl*>(&module)) {
    auto params = module.named_parameters(true);
    auto buffers = module.named_buffers(true);
    for (const auto& e : models::llama::checkpoint_tensors(*lm)) {
      const at::Tensor& t = e.buffer ? buffers[e.param] : params[e.param];
      out.emplace_back(e.name, models::llama::checkpoint_slice(t, e));
    }
    return out;
  }
  for (auto& item : module.named_parameters(true)) out.emplace_back(item.key(), item.value());
  return out;
}

void load_state(torch::nn::Module& module, const std::string& dir) {
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  at::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> targets;
  if (auto* lm = dynamic_cast<models::llama::CausalLMImpl*>(&module)) {
    auto params = module.named_parameters(true);
    auto buffers = module.named_buffers(true);
    std::set<std::string> whole;
    for (const auto& e : models::llama::checkpoint_tensors(*lm)) {
      // A parameter stored under its in-memory name (stacked experts whole, Mixtral's "mlp" block: checkpoints
      // written name for name from the model's parameters) loads from there; otherwise from the mapped names.
      if (e.name != e.param && !ckpt.contains(e.name) && ckpt.contains(e.param)) {
        if (whole.insert(e.param).second) targets.emplace_back(e.param, e.buffer ? buffers[e.param] : params[e.param]);
        continue;
      }
      targets.emplace_back(e.name, models::llama::checkpoint_slice(e.buffer ? buffers[e.param] : params[e.param], e));
    }
  } else {
    targets = checkpoint_targets(module);
  }
  for (auto& item : targets) {
    const std::string& name = item.first;
    at::Tensor& p = item.second;
    if (!ckpt.contains(name)) throw Error(dir + ": tensor '" + name + "' missing from the checkpoint");
    std::vector<int64_t> shape = ckpt.shape(name);
    if (at::IntArrayRef(shape) != p.sizes()) {
      std::string want = "[", got = "[";
      for (auto d : p.sizes()) want += std::to_string(d) + ",";
      for (auto d : shape) got += std::to_string(d) + ",";
      want.back() = ']';
      got.back() = ']';
      throw Error(dir + ": tensor '" + name + "': shape " + got + " does not match the config's " + want);
    }
    p.copy_(ckpt.tensor(name));
  }
}

models::llama::CausalLM load_causal_lm(const std::string& dir, at::ScalarType dtype) {
  fs::path cfg = fs::path(dir) / "config.json";
  if (!fs::exists(cfg)) throw Error(cfg.string() + ": missing (expected a Hugging Face model folder)");
  auto config = models::llama::DecoderConfig::from_file(cfg.string());
  models::llama::CausalLM model(config);
  model->to(dtype);
  // Unexpected tensors: a tied checkpoint may still carry lm_head.weight (transformers ignores it).
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  std::set<std::string> expected;
  for (const auto& e : models::llama::checkpoint_tensors(*model)) {
    expected.insert(e.name);
    expected.insert(e.param);  // stacked expert parameters may also be stored whole
  }
  for (const auto& name : ckpt.names()) {
    if (expected.count(name) || ignorable(name)) continue;
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;
    throw Error(dir + ": tensor '" + name + "' is not a parameter of a " + config.model_type + " model with this config.json");
  }
  load_state(*model, dir);
  return model;
}

void export_hf(models::llama::CausalLMImpl& model, const std::string& out_dir, at::ScalarType dtype,
               size_t max_shard_bytes, const std::string& tokenizer_src) {
  fs::create_directories(out_dir);
  NamedTensors tensors;
  for (auto& item : checkpoint_targets(model))
    tensors.emplace_back(item.first, item.second.detach().to(at::kCPU, dtype).contiguous());
  save_sharded(out_dir, tensors, max_shard_bytes, {{"format", "pt"}});
  write_hf_metadata(model.config(), out_dir, dtype, tokenizer_src);
}

void write_hf_metadata(const models::llama::DecoderConfig& config, const std::string& out_dir, at::ScalarType dtype,
                       const std::string& tokenizer_src) {
  nlohmann::json cfg = config.raw;
  cfg["dtype"] = dtype_name(dtype) == "BF16" ? "bfloat16" : dtype_name(dtype) == "F16" ? "float16" : "float32";
  cfg.erase("torch_dtype");
  write_file_atomic((fs::path(out_dir) / "config.json").string(), cfg.dump(2) + "\n");
  if (!tokenizer_src.empty()) {
    for (const char* f : {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                          "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt"}) {
      fs::path src = fs::path(tokenizer_src) / f;
      if (fs::exists(src) && fs::absolute(src) != fs::absolute(fs::path(out_dir) / f))
        write_file_atomic((fs::path(out_dir) / f).string(), read_text_file(src.string()));
    }
  }
}

}  // namespace lf::io

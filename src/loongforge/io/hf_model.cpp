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

void load_state(torch::nn::Module& module, const std::string& dir) {
  SafetensorsCheckpoint ckpt = SafetensorsCheckpoint::open(dir);
  at::NoGradGuard no_grad;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
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
  for (auto& item : model->named_parameters()) expected.insert(item.key());
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
  for (auto& item : model.named_parameters()) tensors.emplace_back(item.key(), item.value().detach().to(at::kCPU, dtype).contiguous());
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

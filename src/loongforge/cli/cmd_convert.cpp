// loongforge convert: rewrite a model as a Hugging Face folder (dtype, sharding); training checkpoints join later.
#include <ATen/ATen.h>

#include <filesystem>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/peft.h"
#include "loongforge/nn/lora.h"

namespace lf::cli {
namespace {

struct ConvertArgs {
  std::string model, out, lora, dtype = "bf16", shard = "5GB";
};

size_t parse_size(const std::string& s) {
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) throw Error("--max-shard-size: expected a size like 5GB or 500MB, got '" + s + "'");
  double v = std::stod(s.substr(0, i));
  std::string unit = s.substr(i);
  double mult = unit.empty() || unit == "B" ? 1 : unit == "KB" ? 1e3 : unit == "MB" ? 1e6 : unit == "GB" ? 1e9
              : unit == "KiB" ? 1024.0 : unit == "MiB" ? 1048576.0 : unit == "GiB" ? 1073741824.0 : -1;
  if (mult < 0) throw Error("--max-shard-size: unknown unit '" + unit + "' (B, KB, MB, GB, KiB, MiB, GiB)");
  return static_cast<size_t>(v * mult);
}

void run_convert(const ConvertArgs& a) {
  namespace fs = std::filesystem;
  if (fs::exists(a.out) && fs::equivalent(a.model, a.out)) throw Error("--out: must differ from --model (" + a.out + ")");
  at::ScalarType dt = a.dtype == "fp32" ? at::kFloat : a.dtype == "fp16" ? at::kHalf : at::kBFloat16;
  auto model = io::load_model(a.model, at::kFloat);
  if (!a.lora.empty()) {
    io::load_peft_adapter(a.lora, *model);
    nn::merge_lora(*model);
  }
  io::export_model(*model, a.out, dt, parse_size(a.shard), a.model);
}

}  // namespace

void add_convert(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  auto* sub = app.add_subcommand("convert", "Write a model as a Hugging Face folder (config, safetensors, tokenizer)");
  sub->add_option("--model", args->model, "source: a Hugging Face model folder")->required();
  sub->add_option("--out", args->out, "destination folder")->required();
  sub->add_option("--lora", args->lora, "PEFT LoRA adapter folder to merge into the weights (W += scaling * B A)");
  sub->add_option("--dtype", args->dtype, "weight dtype")->check(CLI::IsMember({"fp32", "bf16", "fp16"}))->capture_default_str();
  sub->add_option("--max-shard-size", args->shard, "shard the weights above this size (like save_pretrained)")->capture_default_str();
  sub->callback([args] { run_convert(*args); });
}

}  // namespace lf::cli

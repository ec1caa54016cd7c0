// loongforge generate: text continuation from a Hugging Face checkpoint with a key/value cache (and, for a
// vision-language model, the images the prompt talks about).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/processor.h"
#include "loongforge/data/tokenizer/tokenizer.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/models/generate.h"

namespace lf::cli {
namespace {

struct GenerateArgs {
  std::string model, tokenizer, prompt, prompt_ids, device = "cpu";
  std::vector<std::string> images;
  models::GenerateOptions opts;
  bool print_ids = false;
};

std::vector<int64_t> parse_ids(const std::string& s, const std::string& flag) {
  std::vector<int64_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      ids.push_back(std::stoll(item));
    } catch (const std::exception&) {
      throw Error(flag + ": not an integer: '" + item + "'");
    }
  }
  return ids;
}

void run_generate(GenerateArgs a) {
  auto model = io::load_model(a.model, at::kFloat);
  model->eval();
  const at::Device device = kernels::cuda::usable_device(a.device == "cuda");  // as `train`
  if (device.is_cuda()) model->to(device);
  std::unique_ptr<data::Tokenizer> tok;
  std::vector<int64_t> prompt;
  if (!a.prompt_ids.empty()) {
    prompt = parse_ids(a.prompt_ids, "--prompt-ids");
  } else {
    tok = data::Tokenizer::load(a.tokenizer.empty() ? a.model : a.tokenizer);
    prompt = tok->encode(a.prompt, /*add_special_tokens=*/true);
  }
  if (!a.images.empty()) {  // a vision-language model: the model folder's image processor, as transformers'
    const auto it = model->image_tokens();
    if (!it) throw Error("generate --image: the " + model->family() + " family (" + model->model_type() + ") takes no images");
    const auto proc = data::image::ImageProcessor::from_pretrained(a.model);
    const data::image::ProcessedImages px = proc.preprocess_files(a.images);
    std::vector<int64_t> run(a.images.size(), it->per_image);
    a.opts.images.set("pixel_values", px.pixel_values);
    if (px.image_grid_thw.defined()) {  // patch models: each image's tokens from its merged grid
      a.opts.images.set("image_grid_thw", px.image_grid_thw);
      const at::Tensor n = px.image_grid_thw.prod(1) / (proc.config().merge_size * proc.config().merge_size);
      for (size_t i = 0; i < run.size(); ++i) run[i] = n[static_cast<int64_t>(i)].item<int64_t>();
    }
    for (int64_t n : run)
      if (n <= 0) throw Error("generate --image: the image processor of " + a.model + " makes patches, the model expects a fixed size");
    prompt = models::expand_image_tokens(*model, prompt, run);
  }
  if (prompt.empty()) throw Error("generate: the prompt is empty (give --prompt or --prompt-ids)");
  for (int64_t id : prompt)
    if (id < 0 || id >= models::vocab_size(*model)) throw Error("generate: prompt id " + std::to_string(id) + " outside the vocabulary");
  a.opts.stop_ids = models::eos_token_ids(*model);
  auto gen_cfg = std::filesystem::path(a.model) / "generation_config.json";
  if (std::filesystem::exists(gen_cfg)) {
    auto j = read_json_file(gen_cfg.string());
    if (j.contains("eos_token_id") && !j["eos_token_id"].is_null()) {
      auto e = j["eos_token_id"];
      if (e.is_number_integer()) a.opts.stop_ids.push_back(e.get<int64_t>());
      else if (e.is_array())
        for (auto& x : e)
          if (x.is_number_integer()) a.opts.stop_ids.push_back(x.get<int64_t>());
    }
  }
  models::DraftStats drafts;
  if (a.opts.mtp) a.opts.draft_stats = &drafts;
  std::vector<int64_t> out = models::generate(*model, prompt, a.opts);
  if (a.opts.mtp)  // speculative decoding's statistics (stderr: stdout stays the output)
    std::fprintf(stderr, "generate: mtp drafts accepted %lld of %lld (%.1f%%); %lld main-model forwards for %zu tokens\n",
                 static_cast<long long>(drafts.accepted), static_cast<long long>(drafts.drafted),
                 drafts.drafted ? 100.0 * static_cast<double>(drafts.accepted) / static_cast<double>(drafts.drafted) : 0.0,
                 static_cast<long long>(drafts.main_forwards), out.size());
  if (a.print_ids || !tok) {
    nlohmann::json j = out;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s%s\n", a.prompt.c_str(), tok->decode(out, /*skip_special_tokens=*/true).c_str());
  }
}

}  // namespace

void add_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  auto* sub = app.add_subcommand("generate", "Continue a prompt with a Hugging Face checkpoint (KV cache)");
  sub->add_option("--model", args->model, "Hugging Face model folder")->required();
  sub->add_option("--tokenizer", args->tokenizer, "tokenizer folder or file (default: the model folder)");
  auto* p = sub->add_option("--prompt", args->prompt, "prompt text");
  auto* pi = sub->add_option("--prompt-ids", args->prompt_ids, "prompt as token ids, 1,2,3 (no tokenizer needed)");
  p->excludes(pi);
  sub->add_option("--max-new-tokens", args->opts.max_new_tokens, "tokens to generate")->capture_default_str()->check(CLI::NonNegativeNumber);
  sub->add_option("--temperature", args->opts.temperature, "sampling temperature; 0 = greedy")->capture_default_str()->check(CLI::NonNegativeNumber);
  sub->add_option("--top-p", args->opts.top_p, "nucleus sampling mass")->capture_default_str()->check(CLI::Range(0.0, 1.0));
  sub->add_option("--seed", args->opts.seed, "sampling seed")->capture_default_str();
  sub->add_option("--device", args->device, "cpu or cuda (GPU 0, fp32; without a usable GPU: one line, then the CPU)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  sub->add_option("--image", args->images, "an image (JPEG/PNG) for a vision-language model, repeatable; each "
                                          "image token of the prompt (e.g. <image>) stands for one image, in order "
                                          "(none: the images come first); preprocessed as the folder's "
                                          "preprocessor_config.json says");
  sub->add_flag("--mtp", args->opts.mtp, "speculative decoding: the model's multi-token prediction layers draft, the "
                                        "main model verifies (greedy; same output as without; stats on stderr)");
  sub->add_flag("--ids", args->print_ids, "print the generated ids as a JSON array instead of text");
  sub->callback([args] { run_generate(*args); });
}

}  // namespace lf::cli

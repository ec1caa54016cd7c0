// loongforge sample: denoise a batch's noise with a diffusion model (diffusers' flow-matching Euler or DDIM
// schedule, classifier-free guidance) and write every intermediate sample, so users (and our tests) can compare
// with a diffusers sampling loop step by step.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/models/sample.h"

namespace lf::cli {
namespace {

struct SampleArgs {
  std::string model, batch, out, images, scheduler = "flow_match_euler";
  int64_t steps = 50;
  double shift = -1, guidance = 1.0;
};

// Final samples [B, 3, H, W] in [-1, 1] as DIR/sample_NN.png and DIR/grid.png (a grid of ceil(sqrt(B)) columns,
// 2-pixel gaps).
void write_images(const at::Tensor& x, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const at::Tensor img = ((x.clamp(-1, 1) + 1) * 127.5).round().to(at::kByte).permute({0, 2, 3, 1}).contiguous();
  const int64_t n = img.size(0), h = img.size(1), w = img.size(2);
  const int64_t cols = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n)))), rows = (n + cols - 1) / cols;
  at::Tensor grid = at::zeros({rows * (h + 2) + 2, cols * (w + 2) + 2, 3}, at::kByte);
  for (int64_t i = 0; i < n; ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "sample_%02lld.png", static_cast<long long>(i));
    data::image::write_png((std::filesystem::path(dir) / name).string(), img[i]);
    grid.narrow(0, 2 + (i / cols) * (h + 2), h).narrow(1, 2 + (i % cols) * (w + 2), w).copy_(img[i]);
  }
  data::image::write_png((std::filesystem::path(dir) / "grid.png").string(), grid);
}

void run_sample(const SampleArgs& a) {
  if (a.out.empty() && a.images.empty()) throw Error("sample: give --out, --images or both");
  auto model = io::load_model(a.model, at::kFloat);
  model->eval();
  std::map<std::string, at::Tensor> batch;
  {
    auto f = io::SafetensorsFile::open(a.batch);
    for (const auto& e : f->entries()) batch[e.name] = f->tensor(e.name).clone();
  }
  models::SampleOptions o;
  if (a.scheduler == "flow_match_euler" || a.scheduler == "ddim") {
    o.scheduler.kind = a.scheduler;
  } else {
    if (!std::filesystem::exists(a.scheduler))
      throw Error("--scheduler: expected flow_match_euler, ddim or a scheduler_config.json, got '" + a.scheduler + "'");
    o.scheduler = models::SchedulerConfig::from_json(read_json_file(a.scheduler), a.scheduler);
  }
  if (a.shift > 0) o.scheduler.shift = a.shift;
  o.steps = a.steps;
  o.guidance = a.guidance;
  if (!a.images.empty()) {
    auto it = batch.find("noise");
    if (it != batch.end() && (it->second.dim() != 4 || it->second.size(1) != 3))
      throw Error("--images: the samples are not RGB images [B, 3, H, W] (latents need a VAE to decode: not yet)");
  }
  models::SampleResult r = models::sample(*model, batch, o, a.batch);
  if (!a.out.empty())
    io::save_file(a.out, {{"samples", r.samples.contiguous()},
                          {"sigmas", r.schedule.sigmas.contiguous()},
                          {"timesteps", r.schedule.timesteps.contiguous()}});
  if (!a.images.empty()) write_images(r.samples[r.samples.size(0) - 1], a.images);
}

}  // namespace

void add_sample(CLI::App& app) {
  auto args = std::make_shared<SampleArgs>();
  auto* sub = app.add_subcommand("sample", "Denoise a batch's noise with a diffusion model, every step written");
  sub->add_option("--model", args->model, "a diffusers model folder (DiTTransformer2DModel, ...)")->required();
  sub->add_option("--batch", args->batch, "safetensors with noise [B, C, ...] and the conditions under the model's "
                                          "argument names (class_labels / encoder_hidden_states)")->required();
  sub->add_option("--out", args->out, "output safetensors: samples [steps + 1, ...] (0: the noise), sigmas, timesteps");
  sub->add_option("--images", args->images, "folder for the final samples as PNGs (sample_NN.png, grid.png): RGB "
                                            "pixel-space models");
  sub->add_option("--steps", args->steps, "denoising steps")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--scheduler", args->scheduler, "flow_match_euler, ddim, or a diffusers scheduler_config.json")->capture_default_str();
  sub->add_option("--shift", args->shift, "flow matching timestep shift (default: the scheduler's, 1)");
  sub->add_option("--guidance", args->guidance, "classifier-free guidance scale (1: off)")->capture_default_str();
  sub->callback([args] { run_sample(*args); });
}

}  // namespace lf::cli

// loongforge sample: denoise a batch's noise with a diffusion model (diffusers' flow-matching Euler or DDIM
// schedule, classifier-free guidance) and write every intermediate sample, so users (and our tests) can compare
// with a diffusers sampling loop step by step.
#include <ATen/ATen.h>

#include <filesystem>
#include <map>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/models/sample.h"

namespace lf::cli {
namespace {

struct SampleArgs {
  std::string model, batch, out, scheduler = "flow_match_euler";
  int64_t steps = 50;
  double shift = -1, guidance = 1.0;
};

void run_sample(const SampleArgs& a) {
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
  models::SampleResult r = models::sample(*model, batch, o, a.batch);
  io::save_file(a.out, {{"samples", r.samples.contiguous()},
                        {"sigmas", r.schedule.sigmas.contiguous()},
                        {"timesteps", r.schedule.timesteps.contiguous()}});
}

}  // namespace

void add_sample(CLI::App& app) {
  auto args = std::make_shared<SampleArgs>();
  auto* sub = app.add_subcommand("sample", "Denoise a batch's noise with a diffusion model, every step written");
  sub->add_option("--model", args->model, "a diffusers model folder (DiTTransformer2DModel, ...)")->required();
  sub->add_option("--batch", args->batch, "safetensors with noise [B, C, ...] and the conditions under the model's "
                                          "argument names (class_labels / encoder_hidden_states)")->required();
  sub->add_option("--out", args->out, "output safetensors: samples [steps + 1, ...] (0: the noise), sigmas, timesteps")->required();
  sub->add_option("--steps", args->steps, "denoising steps")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--scheduler", args->scheduler, "flow_match_euler, ddim, or a diffusers scheduler_config.json")->capture_default_str();
  sub->add_option("--shift", args->shift, "flow matching timestep shift (default: the scheduler's, 1)");
  sub->add_option("--guidance", args->guidance, "classifier-free guidance scale (1: off)")->capture_default_str();
  sub->callback([args] { run_sample(*args); });
}

}  // namespace lf::cli

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
#include "loongforge/io/hf_model.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/io/samples.h"
#include "loongforge/models/sample.h"

namespace lf::cli {
namespace {

struct SampleArgs {
  std::string model, batch, out, images, vae, scheduler = "flow_match_euler";
  int64_t steps = 50;
  double shift = -1, guidance = 1.0, fps = 16.0;
};

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
  std::shared_ptr<models::Model> vae;
  models::LatentCodec* codec = nullptr;
  if (!a.vae.empty()) {
    vae = io::load_model(a.vae, at::kFloat);
    vae->eval();
    codec = vae->latent_codec();
    if (!codec) throw Error("--vae: " + a.vae + " is not an autoencoder (" + vae->model_type() + ")");
  }
  if (!a.images.empty()) {
    auto it = batch.find("noise");
    if (it == batch.end()) throw file_error(a.batch, "noise", "missing");
    const at::Tensor& n = it->second;
    if (codec && n.size(1) != codec->latent_channels())
      throw file_error(a.batch, "noise", std::to_string(n.size(1)) + " channels, the VAE's latents have " +
                                             std::to_string(codec->latent_channels()));
    if (!codec && ((n.dim() != 4 && n.dim() != 5) || n.size(1) != 3))
      throw Error("--images: the samples are not RGB pixels [B, 3, ...]: latents need --vae DIR to decode");
  }
  models::SampleResult r = models::sample(*model, batch, o, a.batch);
  if (!a.out.empty())
    io::save_file(a.out, {{"samples", r.samples.contiguous()},
                          {"sigmas", r.schedule.sigmas.contiguous()},
                          {"timesteps", r.schedule.timesteps.contiguous()}});
  if (!a.images.empty()) {
    at::NoGradGuard no_grad;
    const at::Tensor last = r.samples[r.samples.size(0) - 1];
    io::write_sample_images(models::latents_to_pixels(codec, last), a.images, a.fps);
  }
}

}  // namespace

void add_sample(CLI::App& app) {
  auto args = std::make_shared<SampleArgs>();
  auto* sub = app.add_subcommand("sample", "Denoise a batch's noise with a diffusion model, every step written");
  sub->add_option("--model", args->model, "a diffusers model folder (DiTTransformer2DModel, ...)")->required();
  sub->add_option("--batch", args->batch, "safetensors with noise [B, C, ...] and the conditions under the model's "
                                          "argument names (class_labels / encoder_hidden_states)")->required();
  sub->add_option("--out", args->out, "output safetensors: samples [steps + 1, ...] (0: the noise), sigmas, timesteps");
  sub->add_option("--images", args->images, "folder for the final samples as PNGs (sample_NN.png, grid.png; clips: "
                                            "sample_NN/frame_MMM.png and sample_NN.mp4): decoded with --vae, or RGB pixel-space models");
  sub->add_option("--fps", args->fps, "frame rate of the clips' mp4s (--images, video models)")->capture_default_str();
  sub->add_option("--vae", args->vae, "the autoencoder folder (AutoencoderKL, AutoencoderKLWan) that decodes the "
                                      "latents for --images (its scaling undone first)");
  sub->add_option("--steps", args->steps, "denoising steps")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--scheduler", args->scheduler, "flow_match_euler, ddim, or a diffusers scheduler_config.json")->capture_default_str();
  sub->add_option("--shift", args->shift, "flow matching timestep shift (default: the scheduler's, 1)");
  sub->add_option("--guidance", args->guidance, "classifier-free guidance scale (1: off)")->capture_default_str();
  sub->callback([args] { run_sample(*args); });
}

}  // namespace lf::cli

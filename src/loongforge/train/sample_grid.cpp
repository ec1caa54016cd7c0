#include "loongforge/train/sample_grid.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/samples.h"
#include "loongforge/train/diffusion_source.h"

namespace lf::train {

SampleGrid::SampleGrid(const nlohmann::json& r, BatchSource& fresh) {
  const nlohmann::json& f = r["diffusion"];
  if (f["objective"] == "none")
    throw Error("recipe: field 'eval.samples': sample grids need a diffusion run (diffusion.objective)");
  auto* src = dynamic_cast<DiffusionObjectiveSource*>(&fresh);
  if (!src) throw Error("recipe: field 'eval.samples': sample grids need a diffusion run (diffusion.objective)");
  const int64_t n = r["eval"]["samples"];
  const Batch clean = src->clean(n);
  for (const auto& [name, t] : clean.tensors())
    if (name != "latents" && !Batch::is_item_index(name)) batch_[name] = t;
  if (r["eval"]["sample_guidance"].get<double>() != 1.0)
    for (const auto& [name, t] : src->null_conditions()) batch_["negative_" + name] = t;
  const at::Tensor x = clean.at("latents");
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(r["seed"].get<int64_t>()));
  batch_["noise"] = at::randn(x.sizes(), g, at::TensorOptions().dtype(at::kFloat));
  opts_.scheduler = src->objective().schedule;
  opts_.scheduler.kind = src->objective().kind == "ddpm" ? "ddim" : "flow_match_euler";
  opts_.steps = r["eval"]["sample_steps"];
  opts_.guidance = r["eval"]["sample_guidance"];
  if (opts_.steps <= 0) throw Error("recipe: field 'eval.sample_steps': must be positive");
  const std::string vae = r["model"]["vae"];
  if (!vae.empty()) {
    vae_ = io::load_model(vae, at::kFloat);
    vae_->eval();
    models::LatentCodec* codec = vae_->latent_codec();
    if (!codec) throw Error("recipe: field 'model.vae': " + vae + " is not an autoencoder (" + vae_->model_type() + ")");
    if (x.size(1) != codec->latent_channels())
      throw Error("recipe: field 'model.vae': its latents have " + std::to_string(codec->latent_channels()) +
                  " channels, the training rows " + std::to_string(x.size(1)));
  } else {
    opts_.scheduler.clip_sample = true;  // pixel space: DDIM clips its x0 estimates to [-1, 1]
    if (x.size(1) != 3)
      throw Error("recipe: field 'model.vae': the rows are latents (" + std::to_string(x.size(1)) +
                  " channels): give the VAE that decodes them");
  }
  if (vae_) opts_.scheduler.clip_sample = false;
}

std::string SampleGrid::write(models::Model& model, int64_t step, const std::string& dir) {
  at::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  models::SampleResult r;
  try {
    r = models::sample(model, batch_, opts_, "the sample grid's batch");
  } catch (...) {
    if (was_training) model.train();
    throw;
  }
  if (was_training) model.train();
  const at::Tensor last = r.samples[r.samples.size(0) - 1];
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return io::write_sample_images(models::latents_to_pixels(vae_ ? vae_->latent_codec() : nullptr, last),
                                 (std::filesystem::path(dir) / name).string());
}

}  // namespace lf::train

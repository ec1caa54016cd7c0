// What a diffusion run shows as it trains (eval.*): a grid of samples from fixed noise and fixed conditions every
// eval.every steps (OUTPUT_DIR/samples/step_NNNNNNNN.png, the weight average's when the run keeps one), and the
// validation loss per timestep bucket.
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>

#include "loongforge/models/model.h"
#include "loongforge/models/sample.h"
#include "loongforge/train/batch.h"

namespace lf::train {

class SampleGrid {
 public:
  // The conditions of eval.samples rows from the start of the training stream (`fresh`: a new source of it; their
  // clean latents give the noise's shape), noise from the run's seed, the sampler from diffusion.* (flow matching:
  // the Euler sampler with diffusion.shift; DDPM: DDIM on its betas), eval.sample_steps and eval.sample_guidance;
  // model.vae decodes latents. lf::Error naming the recipe key when the run is not a diffusion run.
  SampleGrid(const nlohmann::json& recipe, BatchSource& fresh);
  // Samples with `model` and writes the grid (and each sample's PNG) under DIR/step_NNNNNNNN/; returns the grid's path.
  std::string write(models::Model& model, int64_t step, const std::string& dir);

 private:
  std::map<std::string, at::Tensor> batch_;  // noise + conditions under the model's argument names
  models::SampleOptions opts_;
  std::shared_ptr<models::Model> vae_;
};

}  // namespace lf::train

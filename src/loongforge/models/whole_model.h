// The model contract for models that run as one piece, with no repeated blocks for engines to cut into pipeline
// stages or FSDP units, and no tensor-parallel plan: the components around a diffusion transformer (VAEs, text
// encoders). embed() is the whole forward; head_loss_sum() reads its output. They train and evaluate with the
// data-parallel layouts (one FSDP unit, replicated under tp).
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "loongforge/models/model.h"

namespace lf::models {

class WholeModel : public Model {
 public:
  at::Tensor embed(const Batch& b) override { return forward_whole(b); }
  Batch block_inputs(const Batch&, at::ScalarType) const override { return {}; }
  at::Tensor block_forward(const Batch&, const at::Tensor& h, int64_t) override { return h; }
  at::Tensor post_blocks(const at::Tensor& h) override { return h; }
  int64_t hidden_size() const override { return 0; }
  int64_t num_blocks() const override { return 0; }
  // Every top-level module is "before the blocks"; there are none.
  Split split() const override {
    Split s;
    for (const auto& item : named_children()) s.pre.push_back(item.key());
    return s;
  }
  TensorParallelSpec tensor_parallel_spec() const override { return {}; }
  std::vector<nn::AttentionHook*> attention_modules() override { return {}; }

 protected:
  // The whole forward on a training batch: what head_loss_sum reads.
  virtual at::Tensor forward_whole(const Batch& b) = 0;
};

// What `dump` compares for an autoencoder: the posterior of x (latent_mean, latent_logvar), the decode of its mean
// (decoded) and their mean squared error to x as the loss.
inline Model::ReferenceOutput autoencoder_reference(LatentCodec& codec, const at::Tensor& x) {
  auto [mean, logvar] = codec.encode_latents(x);
  at::Tensor decoded = codec.decode_latents(mean);
  Model::ReferenceOutput r;
  r.outputs = {{"latent_mean", mean}, {"latent_logvar", logvar}, {"decoded", decoded}};
  r.loss = at::mse_loss(decoded, x);
  return r;
}

}  // namespace lf::models

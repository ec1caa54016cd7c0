// The vision-language models' shared side of the contract (models/vlm/base.h).
#include "loongforge/models/vlm/base.h"

#include <ATen/ATen.h>

#include "loongforge/core/error.h"
#include "loongforge/nn/loss.h"

namespace lf::models::vlm {

at::Tensor VisionLanguageModel::head_loss_sum(const at::Tensor& h, const Batch& b) {
  if (vocab_loss_fn) return vocab_loss_fn(h, language_model->output_weight(), b.at("targets"));
  return language_model->head_loss_sum(h, b);
}

at::Tensor VisionLanguageModel::position_ids(const Batch& b) const {
  if (at::Tensor pos = b.get("position_ids"); pos.defined()) return pos;
  const at::Tensor& ids = b.at("input_ids");
  return at::arange(ids.size(1), ids.options().dtype(at::kLong)).unsqueeze(0).expand({ids.size(0), ids.size(1)});
}

VisionLanguageModel::Prefill VisionLanguageModel::prefill(const Batch& prompt, nn::KVCache& cache) {
  at::Tensor h = embed(prompt);
  const Batch in = block_inputs(prompt, h.scalar_type());
  for (int64_t i = 0; i < num_blocks(); ++i) h = block_extra(in, language_model->block_forward(in, h, i, &cache), i);
  const at::Tensor pos = position_ids(prompt);
  return {post_blocks(h), pos.max().item<int64_t>() + 1, pos.dim() == 3 ? pos.size(0) : 0};
}

Split VisionLanguageModel::split() const {
  Split s = language_model->split();
  for (auto* names : {&s.pre, &s.post, &s.tied})
    for (auto& n : *names) n = "language_model." + n;
  s.blocks = "language_model." + s.blocks;
  const std::vector<std::string> vision = vision_modules();
  s.pre.insert(s.pre.begin(), vision.begin(), vision.end());
  return s;
}

TensorParallelSpec VisionLanguageModel::tensor_parallel_spec() const {
  TensorParallelSpec t = language_model->tensor_parallel_spec();
  for (auto& rule : t.rules) rule.pattern = R"(language_model\.)" + rule.pattern;
  // the vision modules stay whole on every tp rank, computing on whole images (full gradients, also under sp)
  for (const auto& m : vision_modules()) t.rules.push_back({m, TpStyle::ReplicatedWhole});
  return t;
}

std::string VisionLanguageModel::cuda_graph_blocker() const {
  const std::string lm = language_model->cuda_graph_blocker();
  return lm.empty() ? "the image tokens of a batch are counted on the host (feature scatter)" : lm;
}

void VisionLanguageModel::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, dtype, non_blocking);
  language_model->to(device, dtype, non_blocking);  // its rotary tables
}

void VisionLanguageModel::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  language_model->to(device, non_blocking);
}

std::pair<at::Tensor, at::Tensor> VisionLanguageModel::reference_ids(const std::map<std::string, at::Tensor>& batch,
                                                                     const std::string& file) const {
  auto it = batch.find("input_ids");
  if (it == batch.end()) throw file_error(file, "input_ids", "missing");
  const at::Tensor ids = it->second;
  const int64_t vocab = language_model->config().vocab_size;
  if (ids.scalar_type() != at::kLong || ids.dim() != 2) throw file_error(file, "input_ids", "expected int64 [B,T]");
  if (ids.numel() && (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= vocab))
    throw file_error(file, "input_ids", "ids must lie in [0, " + std::to_string(vocab) + ")");
  at::Tensor labels = ids;
  if (auto l = batch.find("labels"); l != batch.end()) {
    labels = l->second;
    if (labels.scalar_type() != at::kLong || labels.sizes() != ids.sizes())
      throw file_error(file, "labels", "expected int64 with the shape of input_ids");
  }
  return {ids, labels};
}

Model::ReferenceOutput VisionLanguageModel::reference_output(const at::Tensor& h, const Batch& block_in,
                                                             const at::Tensor& labels) {
  at::Tensor logits = language_model->logits(post_blocks(run_blocks(block_in, h, 0, num_blocks())));
  return {{{"logits", logits}}, nn::causal_lm_loss(logits, labels)};
}

}  // namespace lf::models::vlm

// What every vision-language model of this family shares on the contract (models/model.h): a decoder language model
// (`language_model`, a llama::CausalLM module) after vision modules that run inside embed(). The blocks, the head,
// the loss, the split (the vision modules first, on stage 0), the tensor-parallel plan (the language model's rules
// under its prefix; the vision modules replicated) and the attention / MoE modules are the language model's.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/llama/model.h"
#include "loongforge/models/model.h"

namespace lf::models::vlm {

class VisionLanguageModel : public Model {
 public:
  // image features join the token embeddings in embed() (sequence parallelism cuts after that)
  bool merges_embeddings() const override { return true; }
  int64_t loss_terms(const Batch& b) const override { return language_model->loss_terms(b); }
  // the language model over the sequence; the vision modules per image token are small next to it
  double train_flops_per_sample(int64_t seq) const override { return language_model->train_flops_per_sample(seq); }
  at::Tensor block_forward(const Batch& in, const at::Tensor& h, int64_t i) override {
    return block_extra(in, language_model->block_forward(in, h, i), i);
  }
  at::Tensor block_body(const Batch& in, const at::Tensor& h, int64_t i) override {
    return language_model->block_forward(in, h, i);
  }
  at::Tensor block_after(const Batch& in, const at::Tensor& y, int64_t i) override { return block_extra(in, y, i); }
  at::Tensor post_blocks(const at::Tensor& h) override { return language_model->post_blocks(h); }
  at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) override;
  int64_t hidden_size() const override { return language_model->config().hidden_size; }
  int64_t num_blocks() const override { return language_model->config().num_hidden_layers; }
  torch::nn::Module& block(int64_t i) override { return language_model->block(i); }
  Split split() const override;
  TensorParallelSpec tensor_parallel_spec() const override;
  std::vector<nn::AttentionHook*> attention_modules() override { return language_model->attention_modules(); }
  std::vector<std::pair<int64_t, nn::MoEImpl*>> moe_layers() const override { return language_model->moe_layers(); }
  std::string cuda_graph_blocker() const override;
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  // The rotary position ids of a batch, as block_inputs turns them: [B,T] (position_ids, default 0..T-1), or
  // [3,B,T] for multimodal RoPE.
  virtual at::Tensor position_ids(const Batch& b) const;
  // Generation (models/generate.cpp): the prompt batch (input_ids [1,T] and its images as the schema says) through
  // embed() and every block, filling `cache`: the final hidden states [1,T,hidden], the position the next token
  // takes and the position planes (0: [B,T] positions; 3: multimodal).
  struct Prefill {
    at::Tensor hidden;
    int64_t next_position = 0;
    int64_t planes = 0;
  };
  Prefill prefill(const Batch& prompt, nn::KVCache& cache);

  llama::CausalLM language_model{nullptr};

 protected:
  // What a block adds after the language model's block i (Qwen3-VL's deepstack features); default: nothing.
  virtual at::Tensor block_extra(const Batch& in, at::Tensor y, int64_t i) { return y; }
  // The modules before the language model's embedding, in order (e.g. {"vision_tower", "multi_modal_projector"}).
  virtual std::vector<std::string> vision_modules() const = 0;
  // A dump batch's input_ids (int64 [B,T] within the vocabulary) and labels (absent: input_ids); errors name `file`.
  std::pair<at::Tensor, at::Tensor> reference_ids(const std::map<std::string, at::Tensor>& batch,
                                                  const std::string& file) const;
  // `dump`'s outputs from the merged embeddings h and the blocks' inputs: logits and transformers' causal-LM loss.
  ReferenceOutput reference_output(const at::Tensor& h, const Batch& block_in, const at::Tensor& labels);
};

}  // namespace lf::models::vlm

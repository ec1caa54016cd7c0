// The FSDP engine (ZeRO-3) and HSDP for any model of the contract (models/model.h), applied from outside.
//
// fully_shard splits the trainable parameters in units: one per block (Model::split) and a root unit (the pieces
// before and after the blocks: embeddings, final norm, output head). Each unit keeps only this rank's 1/shard.size() slice of its flat parameter vector (the
// optimizer's master copy); the module's parameters are empty tensors except while their unit is gathered.
//
//  - forward: the root is all-gathered at the start and stays gathered until the end of backward; each layer is
//    all-gathered before it runs (the next layer's all-gather is started meanwhile: prefetch), runs without
//    keeping activations, and is freed;
//  - backward: each layer is re-gathered (prefetching the one before), recomputed with autograd, freed; its
//    gradients are reduce-scattered (asynchronously) into the unit's gradient shard; the root's gradients are
//    reduce-scattered in finish_backward();
//  - HSDP: the gradient shards are then all-reduced over `replicate` (on the last micro-batch only).
// Gradients are summed over shard x replicate ranks. Gradient accumulation: every micro-batch is reduce-scattered
// into the (accumulating) gradient shards; set_sync(false) only defers the replicate all-reduce.
// Frozen parameters (requires_grad false) are left whole on every rank.
//
// Use: `auto fsdp = fully_shard(*model, shard, replicate)`; run `fsdp->forward_hidden(batch)` (not the model's own,
// whose blocks are empty) and `model->head_loss_sum(...)`, backward, `fsdp->finish_backward()`, then
// optim::DataParallelOptimizer(fsdp, ...) clips and steps. Activations are always recomputed (per layer).
#pragma once
#include <optional>
#include "loongforge/models/model.h"
#include "loongforge/parallel/data_parallel.h"

namespace lf::parallel {

struct FsdpOptions {
  bool prefetch = true;  // start the next layer's all-gather while the current one runs
  // Mixed precision (`precision: bf16`): kBFloat16 gives every gathered linear layer's weight (nn::Linear: the layers'
  // and lm_head; not embedding tables, norms, biases or other parameters, which need not feed a matmul) a bf16 copy
  // for compute, made once per gather
  // from the fp32 masters; the shards, the optimizer and the all-gather stay fp32 (so the embedding and norms see
  // the exact master values, as under autocast). The bf16 GEMMs' gradients are converted to fp32 before the
  // reduce-scatter (sums over ranks in fp32). kFloat: everything fp32.
  at::ScalarType compute_dtype = at::kFloat;
  // Where the shards (and so the gathered layers and their gradients) live; the model may still be on the CPU when it
  // is wrapped (each rank then moves only its shards and the unsharded buffers, not the whole model). Default: the
  // parameters' device.
  std::optional<at::Device> device;
};

class FullyShardedModel : public GradSync, public std::enable_shared_from_this<FullyShardedModel> {
 public:
  FullyShardedModel(models::Model& model, const Group& shard, const Group& replicate, FsdpOptions o);
  ~FullyShardedModel() override;
  FullyShardedModel(const FullyShardedModel&) = delete;
  FullyShardedModel& operator=(const FullyShardedModel&) = delete;

  // Model::forward_hidden under FSDP (same argument and result). The root unit (pre and post modules) stays
  // gathered until finish_backward, so the model's head (Model::head_loss_sum) runs on its output as usual.
  at::Tensor forward_hidden(const models::Batch& b);

  void finish_backward() override;
  void zero_grad() override;
  void after_step() override;  // frees every gathered copy (they are stale)
  // Switches FsdpOptions::compute_dtype (frees the gathered units first), e.g. fp32 for evaluation without autocast.
  void set_compute_dtype(at::ScalarType t);
  at::ScalarType compute_dtype() const { return opts_.compute_dtype; }

  // Collective over `shard`: every trainable parameter whole, by HF name, in host memory (for saving / export).
  std::map<std::string, at::Tensor> full_parameters() const;
  // Sets the shards from whole parameters (every rank passes the same values); missing names are an error.
  void load_full_parameters(const std::map<std::string, at::Tensor>& params);
  // Gathers every unit into the model (e.g. for evaluation or generation with the plain model) / frees them.
  void gather_all();
  void reshard();
  size_t num_units() const { return units_.size(); }
  models::Model& model() { return *model_; }

  // Losses made inside a layer (MoE router losses): called in the layer's backward, right after its forward is
  // recomputed with gradients, with the layer index; a defined scalar is backpropagated with the layer's output
  // (already scaled as the caller's loss is). Unset: none.
  std::function<at::Tensor(size_t layer)> layer_loss_fn;

  // internal (the per-layer autograd node)
  void unit_backward_begin(size_t u);
  void unit_grads(size_t u, const std::vector<at::Tensor>& grads);
  void gather(size_t u);  // waits for a prefetch or gathers now
  void prefetch(size_t u);
  void free_unit(size_t u);

 private:
  struct Unit {
    std::vector<size_t> members;  // indices into names()
    std::vector<size_t> shared;   // root-unit parameters inside this block (Split::shared): gradients to the root
    std::vector<bool> low;        // per member: a linear layer's weight (a compute_dtype copy under mixed precision)
    at::Tensor full;              // gathered flat parameters (undefined when freed)
    Pending gathering;
    bool gathered = false;
  };
  struct Reduction {
    Pending work;
    at::Tensor in, out;
    size_t unit;
  };
  void flush_root_grads();
  void drain(size_t keep);
  models::Model* model_;
  FsdpOptions opts_;
  std::vector<at::Tensor> params_;
  std::vector<Unit> units_;  // units_[0..L-1]: layers; units_.back(): root
  std::deque<Reduction> reductions_;
  bool reduced_ = false;
};

// Shards `model` over `shard` (replicated over `replicate`; a group of one for plain FSDP). Every rank must hold
// the same full parameters when called (same seed or same checkpoint).
std::shared_ptr<FullyShardedModel> fully_shard(models::Model& model, const Group& shard,
                                               const Group& replicate, FsdpOptions opts = {});

}  // namespace lf::parallel

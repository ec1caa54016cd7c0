// Pipeline parallelism for any model of the contract (models/model.h): the blocks are split over the ranks of a pp group in
// contiguous ranges ("stages"); the first stage also holds the embeddings, the last the final norm and the output
// head. Two schedules: 1F1B (warm-up, steady one-forward-one-backward, cool-down) and Megatron's interleaved 1F1B
// with vpp virtual stages ("model chunks") per rank: rank r holds virtual stages r, r+pp, r+2pp, ... in layer order.
//
// The stages run the model's pieces (Model::embed / block_inputs + run_blocks / post_blocks) so layouts applied through
// the model's hooks (tensor/sequence/context parallel) compose with this one. Activations and their gradients travel
// with Group::batch_p2p (each message has its own tag: (micro-batch, virtual stage, direction), which Gloo uses). As in
// Megatron, a rank communicates once per segment of its schedule (a warm-up forward, a steady-state forward + backward
// pair, a cool-down backward): one batch with the previous segment's sends and every receive of the next. Under NCCL
// the operations between two ranks run in order and a send waits for its receive, so a rank that sends before
// receiving from a peer doing the same would deadlock, and messages match in posting order (tags are ignored).
// pipeline_comm_plan lists every rank's batches; tests/cpp/test_pp.cpp plays them against each other under those
// rules, and forward_backward / forward_only check that what they posted is that plan.
//
// Parameters this rank does not hold are released (replaced by empty tensors with requires_grad false); the kept
// ones are owned_parameter_names(). With tied embeddings and pp > 1 the first stage (embedding) and the last stage
// (output head) each keep a copy of model.embed_tokens.weight; sync_tied_grads() sums their gradients so both copies
// receive the same update; norm_parameter_names() lists the copy once (for the gradient norm over the pp group).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/parallel/comm.h"

namespace lf::parallel {

// One micro-batch: the model's named tensors (models/batch.h).
using MicroBatch = models::Batch;

// Layers per virtual stage (pp * vpp entries, virtual stage s = chunk * pp + rank, in layer order). `explicit_counts`
// empty: an even split (layers must be a multiple of pp * vpp); otherwise pp * vpp counts, each >= 1, summing to
// `layers`. Errors are lf::Error naming 'parallel.pp', 'parallel.vpp' or 'parallel.pp_layout'.
std::vector<int64_t> pipeline_layer_counts(int64_t layers, int pp, int vpp, const std::vector<int64_t>& explicit_counts);

// One step of a rank's schedule: the forward or backward of `micro` through this rank's model chunk `chunk`.
struct PipelineOp {
  bool forward;
  int64_t micro;
  int chunk;
  bool operator==(const PipelineOp&) const = default;
};
// The order in which rank `rank` of pp runs its steps for `micros` micro-batches: 1F1B when vpp == 1, Megatron's
// interleaved order otherwise (micros must then be a multiple of pp: lf::Error naming 'parallel.pp').
std::vector<PipelineOp> pipeline_schedule(int pp, int vpp, int64_t micros, int rank);

// A message between virtual stages: the activation entering `stage` or the gradient going back to it, and a
// ChunkLoss carry's running sum (forward) or total (backward) travelling with them.
struct PipelineMessage {
  enum Kind : int { Activation, Gradient, CarryForward, CarryBackward };
  Kind kind;
  int64_t micro, stage;
  bool operator==(const PipelineMessage&) const = default;
};
struct PipelineTransfer {
  bool send;
  int peer;  // pp rank
  PipelineMessage message;
  bool operator==(const PipelineTransfer&) const = default;
};
// The point-to-point batches rank `rank` posts in forward_backward (forward_only: false) or forward_only, in order:
// before each segment of its schedule the sends of the previous segment and the receives of this one, then the last
// sends. `carry`: the chunks return a ChunkLoss carry. Messages a rank sends itself (pp == 1) are not listed.
std::vector<std::vector<PipelineTransfer>> pipeline_comm_plan(int pp, int vpp, int64_t micros, int rank, bool carry,
                                                              bool forward_only);

class Pipeline {
 public:
  // Splits `model` over `pp` (this rank's place: pp.rank()) with `vpp` chunks per rank and `layer_counts` layers per
  // virtual stage (pipeline_layer_counts), and releases the parameters this rank does not hold. `model` must outlive
  // the Pipeline. With tied embeddings the last stage's copy is overwritten by the first stage's.
  Pipeline(models::Model& model, const Group& pp, int vpp, std::vector<int64_t> layer_counts);

  // HF names of the parameters this rank keeps (model order); only these have storage and gradients.
  std::vector<std::string> owned_parameter_names() const { return owned_; }
  // The owned parameters (same order as owned_parameter_names()), for optimizers.
  std::vector<at::Tensor> owned_parameters() const;
  // owned_parameter_names() without the last stage's copy of a tied embedding (count it once in norms).
  std::vector<std::string> norm_parameter_names() const;
  // sqrt of the sum over the pp group of the squared gradients of norm_parameter_names() (identical on every rank).
  double grad_norm() const;

  bool is_first() const { return pp_.rank() == 0; }
  bool is_last() const { return pp_.rank() == pp_.size() - 1; }
  int vpp() const { return vpp_; }
  // Layers [begin, end) of this rank's model chunk `chunk` (virtual stage chunk * pp + rank).
  std::pair<int64_t, int64_t> chunk_layers(int chunk) const { return ranges_.at(static_cast<size_t>(chunk)); }

  // Runs forward and backward of every micro-batch (1F1B if vpp == 1, interleaved otherwise); gradients accumulate
  // in the owned parameters' .grad(). loss_fn(hidden_after_final_norm, micro) returns the summed token loss (a scalar
  // tensor) on the last stage; it is divided by loss_scale before backward. act_shape(micro) is the shape of the
  // [B,T,H] activations sent between stages (sequence/context parallel change it). Returns the sum of loss_fn's
  // values over the micro-batches (not divided by loss_scale), identical on every pp rank. Tied gradients are not
  // synchronized here: call sync_tied_grads() after the last forward_backward of a step (before the norm/optimizer).
  //
  // chunk_loss_fn (optional), called on every stage right after a chunk's forward with (micro, first layer, end
  // layer), returns the losses made inside those layers (MoE router losses) as a ChunkLoss; carry_size: the number of
  // elements of every chunk's carry (0: none), so receives can be posted before the chunks run.
  struct ChunkLoss {
    at::Tensor loss;   // scalar to backpropagate with the chunk's output (divided by loss_scale), or undefined
    double value = 0;  // added to the returned sum
    // Statistics pooled over the whole model (optional; every chunk of a step returns one of the same size, or
    // none does): `carry` (float64 [n]) is summed over the virtual stages in layer order, travelling with the
    // activations; the last stage's sum travels back with the gradients. finish (optional) is called right before
    // the chunk's backward with that sum (undefined without a carry): a loss to backpropagate with the chunk
    // (divided by loss_scale, or undefined) and its value.
    at::Tensor carry;
    std::function<std::pair<at::Tensor, double>(const at::Tensor& total)> finish;
  };
  using ChunkLossFn = std::function<ChunkLoss(size_t, int64_t, int64_t)>;
  double forward_backward(const std::vector<MicroBatch>& micro_batches,
                          const std::function<at::Tensor(const at::Tensor&, size_t)>& loss_fn, double loss_scale,
                          const std::function<std::vector<int64_t>(size_t)>& act_shape,
                          const ChunkLossFn& chunk_loss_fn = nullptr, int64_t carry_size = 0);
  // Forward only (validation: call under at::NoGradGuard): every micro-batch goes through the virtual stages in
  // order, no activations are kept and nothing flows backwards. Each rank walks (micro, chunk) in increasing order
  // and every receive waits for an earlier item of that order, so the schedule cannot deadlock. loss_fn as above
  // (called on the last stage); returns the sum of its values, identical on every pp rank.
  double forward_only(const std::vector<MicroBatch>& micro_batches,
                      const std::function<at::Tensor(const at::Tensor&, size_t)>& loss_fn,
                      const std::function<std::vector<int64_t>(size_t)>& act_shape);
  // Tied embeddings with pp > 1: sums the first and last stages' gradients of model.embed_tokens.weight (both end
  // with the same sum). No-op otherwise; every pp rank may call it.
  void sync_tied_grads();
  bool tied() const { return tied_; }
  // The batches the last forward_backward / forward_only posted (pipeline_comm_plan's form).
  const std::vector<std::vector<PipelineTransfer>>& last_comm() const { return comm_log_; }

 private:
  // Device and dtype of the activations sent between stages: the embedding's (held or released), read when used so
  // the model may move to its device after the split.
  at::TensorOptions act_opts() const { return act_param_.options().requires_grad(false); }
  // Layers [begin, end) of the micro-batch on h (positions 0..T-1 when the batch has none).
  at::Tensor run_chunk(const MicroBatch& mb, const at::Tensor& h, int64_t begin, int64_t end);

  void sync_tied_grad(at::Tensor w);
  models::Model& model_;
  std::vector<std::string> tied_names_;  // Split::tied
  at::Tensor act_param_;  // a parameter of the first piece (held or released): the activations' device and dtype
  const Group& pp_;
  int vpp_;
  std::vector<int64_t> counts_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // per local chunk
  std::vector<std::string> owned_;
  bool tied_ = false;
  std::vector<std::vector<PipelineTransfer>> comm_log_;
};

}  // namespace lf::parallel

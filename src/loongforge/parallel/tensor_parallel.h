// Megatron-style tensor parallelism (+ sequence parallelism) for any model of the contract, applied from outside to
// a plain model whose full weights every rank holds (same seed, or loaded before applying), from the plan the family
// gives as data (models::TensorParallelSpec: module-name patterns -> styles, models/model.h).
//
// Layout over the tp group (rank r of n keeps the r-th of n equal chunks along the split dimension):
//  - Colwise / ColwiseInside linears (dim 0, biases too): the attention modules' heads and key/value heads split
//    (nn::AttentionHook::heads/kv_heads become the local share), MLP gate/up projections, MLA's per-head
//    up-projections;
//  - Rowwise / RowwiseInside linears (dim 1): output projections; their biases stay whole and are added once, after
//    the reduction;
//  - VocabEmbedding (dim 0): ids outside this rank's slice give zeros, then a sum over tp (Model::embed_fn);
//    VocabHead (or a tied vocabulary embedding): the loss is vocab_parallel_loss_sum (Model::vocab_loss_fn), never
//    gathering full logits;
//  - ReplicatedEntry / ReplicatedInside: whole, with partial gradients (summed over tp): MLA's latent projections
//    and norms, per-head q/k norms;
//  - MoE blocks (nn/moe.h): every expert split along its ffn dimension (experts.gate_up_proj: this rank's chunk of
//    the gate half and of the up half, dim 1; experts.down_proj: dim 2), the shared experts by the plan (inside);
//    the block's input_fn/output_fn are the entry / exit of the whole block, so routing runs on whole (replicated)
//    tokens and the partial outputs of routed and shared experts are summed once. The router (gate.weight) stays
//    whole; its gradient is partial. Router losses are computed identically on every tp rank: weight them by 1/tp
//    in the loss that is backpropagated (the reported value stays whole). With expert parallelism on top, each ep
//    rank's experts are these tp shards.
//  - ReplicatedWhole: whole modules run on whole inputs before the sequence is cut (a VLM's vision tower): full
//    gradients on every rank, never summed over tp; also modules computing the same thing on every rank from whole
//    inputs (DeepSeek sparse attention's indexer: one top-k selection for all heads), whose WholeEntry linears read
//    the block's activation through a region entry (the whole sequence under sp);
//  - attention modules' head_sum_fn: a sum over tp of per-head sums (the indexer's KL target, the mean over all
//    heads of the attention probabilities);
//  - everything else replicated.
// Without sp, activations between regions are whole and replicated: copy_to at region entries, all-reduce at exits.
// With sp they are split along the sequence (dim 1 of [B,T,H]) over tp: all-gather (backward reduce-scatter) at
// entries, reduce-scatter (backward all-gather) at exits, the embedding output reduce-scattered. The sequence length
// must then be divisible by tp.
//
// Gradients: sharded parameters get their exact gradient on each rank. Replicated parameters listed in
// plan.partial_grad only get this rank's part (those inside regions always; with sp also those outside, e.g. the
// block norms and row-parallel biases, which see this rank's tokens): sum them over tp after backward (before
// clipping / data-parallel reduction). Other replicated parameters already hold the full, identical gradient on
// every tp rank.
//
// LoRA adapters (nn/lora.h) on the plan's linears: a column-parallel layer's lora_B splits its rows (dim 0), a
// row-parallel layer's lora_A its columns (dim 1); the other matrix stays whole and its gradient is partial. Adapters
// elsewhere (the output head) are an error. The Group must outlive the model.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/parallel/comm.h"

namespace lf::parallel {

struct TensorParallelPlan {
  int tp_size = 1, tp_rank = 0;
  bool sp = false;
  // Every parameter by HF name: the dimension split over tp, -1 when replicated.
  std::map<std::string, int64_t> shard_dim;
  // Replicated parameters whose gradients are partial on each tp rank (need a sum over tp).
  std::vector<std::string> partial_grad;
  // Parameters made of stacked blocks along their split dimension (MoE experts.gate_up_proj [E, 2f, d]: gate rows,
  // then up rows; a fused [q | k | v] projection): name -> the block sizes; each rank keeps its chunk of every
  // block, stacked the same way.
  std::map<std::string, std::vector<int64_t>> blocks;
  // Vocabulary-parallel parameters whose rows were padded (as Megatron pads the vocabulary to a multiple of tp x a
  // granule): name -> the real number of rows. The padding rows are zeros, never looked up, masked out of the loss
  // and logits, and cut off again by unshard (checkpoints and exports hold the real vocabulary only).
  std::map<std::string, int64_t> padded_rows;
  int64_t vocab = 0, padded_vocab = 0;  // the real and padded vocabulary (0: no vocabulary-parallel module)

  // Whether this rank adds the parameter's squared gradient to the global gradient norm: sharded parameters on
  // every tp rank, replicated ones on tp rank 0 only (then sum over tp and dp). Unknown name: lf::Error.
  bool counted_in_norm(const std::string& name) const;
  int64_t dim_of(const std::string& name) const;  // shard_dim.at(name) with an lf::Error naming it
};

// Throws lf::Error ("recipe: field 'parallel.tp': 3 does not divide num_attention_heads 8") unless tp divides
// every size the plan lists (TensorParallelSpec::divisible).
void check_tensor_parallel(const models::TensorParallelSpec& spec, int tp);

// Shards the model's parameters in place (set_data: the parameter tensors keep their identity, gradients are
// reset), sets the Linear input_fn/output_fn hooks, heads/kv_heads, embed_fn and vocab_loss_fn. Once per model.
// vocab_granule: the vocabulary-parallel rows are padded to a multiple of tp x vocab_granule (rows no rank needs,
// when the vocabulary is already a multiple).
TensorParallelPlan apply_tensor_parallel(models::Model& m, const Group& tp, bool sp, int64_t vocab_granule = 1);

// Sum of the token cross-entropies (float32; targets == ignore_index skipped) over the batch, the same value on
// every tp rank, differentiable. hidden: the hidden states before the head (sequence part under sp), weight: this
// rank's vocabulary rows of the output projection [V/tp, H], targets [B,T] whole (already shifted). Never forms
// [B,T,V] logits.
// vocab: the real vocabulary (< 0: every row); logits of padding rows past it are left out of the softmax.
at::Tensor vocab_parallel_loss_sum(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                   const Group& tp, bool sp, int64_t ignore_index = -100, int64_t vocab = -1);

// Whole logits [B,T,V] from hidden states (sequence part under sp) and this rank's vocabulary rows of the output
// weight; evaluation and generation only.
at::Tensor gather_full_logits(const at::Tensor& weight, const at::Tensor& hidden, const Group& tp, bool sp,
                              int64_t vocab = -1);

// Sums the gradients of plan.partial_grad over tp (one all-reduce; an undefined gradient counts as zeros).
void sync_sequence_parallel_grads(models::Model& m, const TensorParallelPlan& plan, const Group& tp);

// Whole tensors by HF name from the shards (every rank gets all; checkpoints and export).
std::map<std::string, at::Tensor> gather_full(models::Model& m, const TensorParallelPlan& plan,
                                              const Group& tp);
// The whole tensor of parameter (or optimizer moment) `name` from this rank's slice `local` (collective over tp;
// `local` itself when replicated).
at::Tensor unshard(const std::string& name, const at::Tensor& local, const TensorParallelPlan& plan, const Group& tp);
// This rank's slice of a whole tensor `full` of parameter `name` (a copy; `full` itself when replicated).
at::Tensor shard_of(const std::string& name, const at::Tensor& full, const TensorParallelPlan& plan, const Group& tp);

}  // namespace lf::parallel

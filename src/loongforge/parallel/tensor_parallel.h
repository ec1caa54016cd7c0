// Megatron-style tensor parallelism (+ sequence parallelism) for the dense decoder (models/llama), applied from
// outside to a plain model whose full weights every rank holds (same seed, or loaded from HF before applying).
//
// Layout over the tp group (rank r of n keeps the r-th of n equal chunks along the split dimension):
//  - column parallel (output rows split, dim 0): q/k/v_proj (heads and GQA key/value heads split: AttentionImpl::
//    heads/kv_heads become the local share), gate_proj/up_proj; their biases too;
//  - row parallel (input columns split, dim 1): o_proj, down_proj; their biases stay whole and are added once,
//    after the reduction;
//  - vocabulary parallel (dim 0): embed_tokens (ids outside this rank's slice give zeros, then a sum over tp) and
//    lm_head (or the tied embedding); the loss is computed by lm_loss_sum without ever gathering full logits;
//  - MoE blocks (nn/moe.h): every expert split along its ffn dimension (experts.gate_up_proj: this rank's chunk of
//    the gate half and of the up half, dim 1; experts.down_proj: dim 2) and the shared experts like a dense MLP; the
//    block's input_fn/output_fn are the column entry / row exit of the whole block, so routing runs on whole
//    (replicated) tokens and the partial outputs of routed and shared experts are summed once. The router (gate.weight)
//    stays whole; its gradient is partial (the routing weights multiply partial expert outputs). Router losses are
//    computed identically on every tp rank: weight them by 1/tp in the loss that is backpropagated (the reported
//    value stays whole). With expert parallelism on top, each ep rank's experts are these tp shards.
//  - everything else (RMSNorm weights, q_norm/k_norm, row-parallel biases) replicated.
// Without sp, activations between blocks are whole and replicated: copy_to before column-parallel layers,
// all-reduce after row-parallel ones. With sp they are split along the sequence (dim 1 of [B,T,H]) over tp:
// all-gather (backward reduce-scatter) before column-parallel layers, reduce-scatter (backward all-gather) after
// row-parallel ones, the embedding output reduce-scattered. The sequence length must then be divisible by tp.
//
// Gradients: sharded parameters get their exact gradient on each rank. Replicated parameters listed in
// plan.partial_grad only get this rank's part (q_norm/k_norm always: each rank sees its own heads; with sp also
// the RMSNorm weights and row-parallel biases, which see this rank's tokens): call sync_sequence_parallel_grads
// after backward (before clipping / data-parallel reduction). Other replicated parameters already hold the full,
// identical gradient on every tp rank.
//
// After apply_tensor_parallel, CausalLMImpl::hidden_states() returns this rank's sequence part under sp (the whole
// sequence otherwise), and CausalLMImpl::logits() returns this rank's vocabulary slice of the logits (of its
// hidden states); use lm_loss_sum for the loss and gather_full_logits when whole logits are really needed.
// LoRA adapters (nn/lora.h) on the layers' projections: a column-parallel layer's lora_B splits its rows (dim 0),
// a row-parallel layer's lora_A its columns (dim 1); the other matrix stays whole and its gradient is partial
// (listed in plan.partial_grad). Adapters elsewhere (lm_head) are an error. The Group must outlive the model.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "loongforge/models/llama/model.h"
#include "loongforge/parallel/comm.h"

namespace lf::parallel {

struct TensorParallelPlan {
  int tp_size = 1, tp_rank = 0;
  bool sp = false;
  // Every parameter by HF name: the dimension split over tp, -1 when replicated.
  std::map<std::string, int64_t> shard_dim;
  // Replicated parameters whose gradients are partial on each tp rank (need a sum over tp).
  std::vector<std::string> partial_grad;
  // Parameters made of two stacked halves along their split dimension (MoE experts.gate_up_proj [E, 2f, d]: gate
  // rows, then up rows): each rank keeps its chunk of each half, stacked the same way.
  std::set<std::string> halves;

  // Whether this rank adds the parameter's squared gradient to the global gradient norm: sharded parameters on
  // every tp rank, replicated ones on tp rank 0 only (then sum over tp and dp). Unknown name: lf::Error.
  bool counted_in_norm(const std::string& name) const;
  int64_t dim_of(const std::string& name) const;  // shard_dim.at(name) with an lf::Error naming it
};

// Throws lf::Error ("recipe: field 'parallel.tp': 3 does not divide num_attention_heads 8") unless tp divides
// the attention heads, key/value heads, intermediate size and vocabulary size.
void check_tensor_parallel(const models::llama::DecoderConfig& c, int tp);

// Shards the model's parameters in place (set_data: the parameter tensors keep their identity, gradients are
// reset), sets the Linear input_fn/output_fn hooks, heads/kv_heads and embed_fn. Once per model.
TensorParallelPlan apply_tensor_parallel(models::llama::CausalLMImpl& m, const Group& tp, bool sp);

// Sum of the token cross-entropies (float32; targets == ignore_index skipped) over the batch, the same value on
// every tp rank, differentiable. hidden: the output of final_norm (sequence part under sp), targets [B,T] whole
// (already shifted: targets[:, t] is the token predicted at t). Never forms [B,T,V] logits.
at::Tensor lm_loss_sum(models::llama::CausalLMImpl& m, const at::Tensor& hidden, const at::Tensor& targets,
                       const Group& tp, bool sp, int64_t ignore_index = -100);

// Whole logits [B,T,V] from hidden states (sequence part under sp); evaluation and generation only.
at::Tensor gather_full_logits(models::llama::CausalLMImpl& m, const at::Tensor& hidden, const Group& tp, bool sp);

// Sums the gradients of plan.partial_grad over tp (one all-reduce; an undefined gradient counts as zeros).
void sync_sequence_parallel_grads(models::llama::CausalLMImpl& m, const TensorParallelPlan& plan, const Group& tp);

// Whole tensors by HF name from the shards (every rank gets all; checkpoints and export).
std::map<std::string, at::Tensor> gather_full(models::llama::CausalLMImpl& m, const TensorParallelPlan& plan,
                                              const Group& tp);
// The whole tensor of parameter (or optimizer moment) `name` from this rank's slice `local` (collective over tp;
// `local` itself when replicated).
at::Tensor unshard(const std::string& name, const at::Tensor& local, const TensorParallelPlan& plan, const Group& tp);
// This rank's slice of a whole tensor `full` of parameter `name` (a copy; `full` itself when replicated).
at::Tensor shard_of(const std::string& name, const at::Tensor& full, const TensorParallelPlan& plan, const Group& tp);

}  // namespace lf::parallel

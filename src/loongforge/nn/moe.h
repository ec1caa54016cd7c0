// Mixture-of-experts block (layer nn; generic, no model includes): a router ("gate") picks top-k experts per token,
// the tokens are permuted so each expert's tokens are contiguous, all experts run as one grouped GEMM over stacked
// weights (at::_grouped_mm), and the results are unpermuted and combined with the routing weights. Parameter names
// and shapes are transformers 5's in-memory ones:
//   gate.weight                     [E, hidden]
//   gate.e_score_correction_bias    [E]            (buffer, only with score_correction_bias)
//   experts.gate_up_proj            [E, 2*ffn, hidden]   rows [0, ffn) = gate, [ffn, 2*ffn) = up
//   experts.down_proj               [E, hidden, ffn]
//   shared_experts.{gate,up,down}_proj.weight      (only with shared_ffn > 0, as DeepSeek-V3)
//
// Routing (route()):
//   softmax: probs = softmax(logits, fp32); top-k of probs; with norm_topk_prob the k weights are divided by their
//            sum (Qwen3-MoE, Mixtral). With n_group > 1 the top-k is limited to the topk_group best groups (a
//            group's score = sum of its 2 best probs; the others count as 0) and the sum gets + 1e-20 (Mistral 4).
//   sigmoid: scores = sigmoid(logits); selection on scores + e_score_correction_bias, limited to the topk_group
//            best of n_group groups (a group's score = sum of its 2 best); weights = scores of the chosen experts,
//            with norm_topk_prob divided by (sum + 1e-20) (DeepSeek-V3).
//   sqrtsoftplus: scores = sqrt(softplus(logits)) in the logits' dtype, otherwise as sigmoid (DeepSeek-V4).
//   Hash routing (hash_vocab > 0, DeepSeek-V4's hash_moe layers): the experts of a token are the fixed row
//            gate.tid2eid[token id] (buffer [hash_vocab, k], int64) instead of a top-k; the weights are the scores
//            of those experts as above. forward then needs the token ids; such a block makes no load-balancing
//            statistics (transformers records the router logits of its top-k routers only).
//   weights are finally multiplied by routed_scaling_factor.
// Capacity (capacity_factor > 0): capacity C = ceil(capacity_factor * N * k / E) assignments per expert. The
//   assignments of an expert are ranked by (token index, slot) — token order of the flattened [B*T] batch, then the
//   slot 0..k-1 — and those ranked >= C are dropped: their expert id becomes -1 and their weight 0 (the token keeps
//   its other experts; a token dropped everywhere passes through the residual only). capacity_factor 0: dropless.
//
// Training losses (kept from the last forward; `aux_loss` undefined when every coefficient is 0 or grad mode is
// off):
//   aux_loss_coef      load balancing as transformers' load_balancing_loss_func for this layer alone:
//                      E * sum_e (assignments_e / N) * mean_n p[n,e], p = softmax(logits) (sigmoid: scores / sum).
//                      The model-level sum over layers (CausalLM::aux_loss) instead combines the statistics
//                      below across layers exactly as transformers does (see lb_counts).
//   seq_aux_loss_coef  DeepSeek-V3 sequence-wise balance: mean over sequences of
//                      sum_e (E/(k*T) * count_e) * (1/T sum_t s'[t,e]), s' = scores / their sum over experts.
//   z_loss_coef        mean over tokens of logsumexp(logits)^2 (ST-MoE).
// Aux-loss-free balancing (bias_update_rate > 0, needs score_correction_bias): update_bias(), called after the
//   optimizer step, does bias_e += rate * sign(mean_load - load_e) over the assignments counted since the last call
//   (all micro-batches), then resets the count.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/nn/linear.h"

namespace lf::nn {

struct MoEOptions {
  int64_t num_experts = 0, top_k = 1, hidden = 0, expert_ffn = 0;
  std::string scoring = "softmax";  // softmax | sigmoid | sqrtsoftplus
  bool norm_topk_prob = true;
  int64_t n_group = 1, topk_group = 1;  // group-limited top-k (1, 1: plain top-k)
  bool score_correction_bias = false;   // buffer gate.e_score_correction_bias, used for selection only
  double routed_scaling_factor = 1.0;
  int64_t shared_ffn = 0;  // 0: no shared experts; else a SwiGLU "shared_experts" of this width
  std::string act = "silu";  // expert activation: silu (fused SwiGLU), gelu, gelu_pytorch_tanh, relu
  // Load balancing as transformers' load_balancing_loss_func on a router that is not a softmax one (MiniMax-M2):
  // p = softmax(logits) and the counts of p's own top-k, not of the experts the router chose.
  bool lb_softmax_topk = false;
  // SwiGLU clamps (> 0; 0: none): the gate projection clamped to <= limit and the up projection to [-limit, limit]
  // before silu(gate) * up, in the routed and the shared experts (DeepSeek-V4's swiglu_limit).
  double swiglu_limit = 0.0;
  int64_t hash_vocab = 0;  // > 0: hash routing through gate.tid2eid [hash_vocab, top_k]
  // training
  double aux_loss_coef = 0.0, seq_aux_loss_coef = 0.0, z_loss_coef = 0.0;
  double bias_update_rate = 0.0;
  double capacity_factor = 0.0;  // 0: dropless
};

struct Routing {
  at::Tensor expert_ids;  // [N,k] int64; -1 = dropped by capacity
  at::Tensor weights;     // [N,k] combine weights, dtype of x (softmax routers) or float32 (sigmoid)
  at::Tensor logits;      // [N,E] router logits
  at::Tensor probs;       // [N,E] softmax probabilities (softmax) or sigmoid scores (sigmoid), fp32
};

// Router logits -> expert choice. `bias` is the correction bias ([E]) or undefined; `fixed_ids` [N,k] (hash
// routing: sigmoid / sqrtsoftplus scoring) the chosen experts, or undefined.
Routing route(const at::Tensor& logits, const MoEOptions& o, const at::Tensor& bias = {}, const at::Tensor& fixed_ids = {});
// Capacity dropping as documented above: returns ids with -1 for dropped assignments and weights zeroed there.
std::pair<at::Tensor, at::Tensor> apply_capacity(const at::Tensor& expert_ids, const at::Tensor& weights,
                                                 int64_t num_experts, double capacity_factor);
int64_t expert_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts, double capacity_factor);

// Token permutation: the kept (id >= 0) assignments of expert_ids [N,k] sorted by expert (stable: token order within
// an expert). x_sorted = x[token_of_slot[order]].
struct Permutation {
  at::Tensor x;       // [M,d] tokens grouped by expert (M = kept assignments)
  at::Tensor slots;   // [M] int64: flat index n*k + j of each row in expert_ids
  at::Tensor tokens;  // [M] int64: token n of each row (slots / k)
  at::Tensor counts;  // [E] int64 rows per expert
  at::Tensor offsets; // [E] int32 cumulative row ends (at::_grouped_mm's offs)
  int64_t num_tokens = 0, top_k = 0;
};
// may_drop = false promises that no id is -1 (no capacity dropping): M is then N*k without reading the count of
// dropped assignments back from the device.
Permutation permute(const at::Tensor& x, const at::Tensor& expert_ids, int64_t num_experts, bool may_drop = true);
// Expert FFN over grouped rows: act(x Wg^T) * (x Wu^T) then Wd, each group with its expert's weights.
// gate_up [E, 2*ffn, d], down [E, d, ffn], offsets as in Permutation. Returns [M, d]. Under autocast the GEMMs run in
// the autocast dtype (x and weights cast, the result in that dtype), as autocast does for a Linear.
// swiglu_limit > 0: the clamps of MoEOptions::swiglu_limit.
at::Tensor grouped_expert_ffn(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                              const at::Tensor& offsets, const std::string& act = "silu", double swiglu_limit = 0.0);
// Weighted combine: out[n] = sum over kept slots j of weights[n,j] * y[row of (n,j)]. Returns [N, d].
at::Tensor unpermute(const at::Tensor& y, const Permutation& p, const at::Tensor& weights);
// The naive reference: a loop over experts with index_add (as transformers' eager experts), for tests.
at::Tensor experts_reference(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                             const at::Tensor& gate_up, const at::Tensor& down, const std::string& act = "silu");

class MoEGateImpl : public torch::nn::Module {
 public:
  MoEGateImpl(int64_t num_experts, int64_t hidden, bool correction_bias, int64_t hash_vocab = 0, int64_t top_k = 0);
  // tid2eid stays int64 when the module changes dtype
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override { torch::nn::Module::to(device, non_blocking); }
  at::Tensor weight, e_score_correction_bias, tid2eid;
};
TORCH_MODULE(MoEGate);

class MoEExpertsImpl : public torch::nn::Module {
 public:
  MoEExpertsImpl(int64_t num_experts, int64_t hidden, int64_t ffn);
  at::Tensor gate_up_proj, down_proj;
};
TORCH_MODULE(MoEExperts);

class SharedExpertImpl : public torch::nn::Module {
 public:
  SharedExpertImpl(int64_t hidden, int64_t ffn, std::string act, double swiglu_limit = 0.0);
  at::Tensor forward(const at::Tensor& x);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  std::string act;
  double limit;
};
TORCH_MODULE(SharedExpert);

class MoEImpl : public torch::nn::Module {
 public:
  explicit MoEImpl(MoEOptions o);
  // [B,T,d] -> [B,T,d]; token_ids [B,T]: the tokens' ids (hash routing only)
  at::Tensor forward(const at::Tensor& x, const at::Tensor& token_ids = {});

  // Router logits [N,E] of flattened tokens x [N,d] (sigmoid scoring: computed in fp32 as DeepSeek-V3).
  at::Tensor router_logits(const at::Tensor& x) const;
  // Aux-loss-free bias update (see above); a no-op unless bias_update_rate > 0. Call after the optimizer step.
  void update_bias();

  MoEOptions options;
  MoEGate gate{nullptr};
  MoEExperts experts{nullptr};
  SharedExpert shared_experts{nullptr};  // null unless shared_ffn > 0

  // Expert-parallel hook: when set, replaces permute + grouped_expert_ffn + unpermute on the local experts.
  // x [N,d], expert_ids [N,k] (-1 = dropped), weights [N,k]; returns [N,d] (shared experts are added outside).
  using ExpertsFn = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights)>;
  ExpertsFn experts_fn;
  // Tensor-parallel hooks (parallel/tensor_parallel.h): input_fn maps the block's input before routing (identity
  // forward / all-reduce backward, or the sequence all-gather under sp); output_fn maps the block's output (routed +
  // shared experts, a partial sum on each tp rank) to the whole result (all-reduce, or reduce-scatter under sp).
  std::function<at::Tensor(const at::Tensor&)> input_fn, output_fn;
  // Make the router statistics and losses in forwards without gradients too (FSDP runs each layer without a graph
  // and recomputes it with one in backward); bias-update loads are then counted in the forward without gradients.
  // Training mode only (evaluation forwards make none).
  bool force_stats = false;
  // Context parallelism: each rank holds part of every sequence's tokens. sequence_reduce sums the per-sequence
  // expert counts [B, E] over the ranks holding the other parts (in place) and returns how many ranks that is; the
  // sequence-level loss then takes the whole sequences' counts and lengths, and seq_loss is this rank's share (the
  // shares of those ranks add up to the loss). Unset: the block holds whole sequences.
  std::function<int64_t(at::Tensor&)> sequence_reduce;

  // State of the last forward:
  at::Tensor aux_loss;    // scalar: coef-weighted sum of this layer's terms (undefined when none apply)
  at::Tensor lb_loss;     // its load-balancing term (aux_loss_coef * this layer's loss) or undefined
  at::Tensor extra_loss;  // its sequence-level + z-loss terms or undefined (aux_loss = lb_loss + extra_loss)
  at::Tensor seq_loss, z_loss;  // the two terms of extra_loss (coefficient included) or undefined
  int64_t tokens_seen = 0, sequences_seen = 0;  // the forward's tokens N and sequences B (z / sequence means)
  int64_t sequence_parts = 1;  // ranks sharing those sequences (sequence_reduce's answer): B / parts count as this rank's
  at::Tensor lb_counts;   // [E] float32: assignments per expert before capacity (no grad)
  at::Tensor lb_prob_sum; // [E] float32: sum over tokens of p[n,e] (with grad); rows = lb_rows
  int64_t lb_rows = 0;
  at::Tensor load_since_update;  // [E] float32: assignments since the last update_bias()
};
TORCH_MODULE(MoE);

// transformers' load_balancing_loss_func over several layers (no padding mask): E * sum_e (sum of counts / rows) *
// (sum of prob sums / rows), each summed over the given layers. Undefined when `layers` is empty.
at::Tensor load_balancing_loss(const std::vector<const MoEImpl*>& layers);

}  // namespace lf::nn

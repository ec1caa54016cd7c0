// DeepSeek sparse attention (DSA) of DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa), as transformers'
// DeepseekV32Indexer / GlmMoeDsaIndexer: a "lightning indexer" beside each latent attention (models/llama/mla.h)
// scores every query against every visible key,
//   score[b,s,t] = sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t] * index_head_dim^-0.5),   w = weights_proj(x) * H^-0.5,
// with q = wq_b(q_resid) (q_resid: the attention's q_a_layernorm(q_a_proj(x))), k = LayerNorm(wk(x)), both rotated on
// their first qk_rope_head_dim features (DeepSeek-V3.2: rotate-half rope; GLM-5: interleaved pairs) with the model's
// cos / sin, and the attention then sees only the index_topk best visible keys of each query (all of them while a
// query sees fewer). The selection is not differentiable: the indexer runs without autograd (as transformers'), its
// parameters get no gradient and are kept frozen (requires_grad false: no optimizer touches them). GLM-5's "shared"
// layers (indexer_types) have no indexer and reuse the selection of the last "full" layer before them.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>

#include <memory>
#include <string>

#include "loongforge/core/json.h"
#include "loongforge/models/llama/config.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/sequence_parts.h"

namespace lf::models::llama {

bool is_dsa_family(const std::string& model_type);  // deepseek_v32, glm_moe_dsa
// The DSA fields (after parse_mla), with transformers' DeepseekV32Config / GlmMoeDsaConfig defaults: index_topk,
// index_head_dim, index_n_heads, mlp_layer_types (wins over first_k_dense_replace), GLM-5's indexer_types (or
// index_topk_pattern, or index_topk_freq / index_skip_topk_offset), and the families' other defaults.
void parse_dsa(const JsonReader& rd, DecoderConfig& c);
int64_t dsa_num_parameters(const DecoderConfig& c);  // the indexers' parameters
// GLM-5 configs whose "shared" layers read another layer's selection (that state makes thread splitting unsafe).
bool dsa_shares_selection(const DecoderConfig& c);
inline constexpr const char* dsa_pipeline_blocker =
    "its shared sparse-attention layers (indexer_types 'shared') reuse an earlier layer's selection of the same "
    "micro-batch, which pipeline schedules and their recomputation do not keep";

// Registered as the attention's "indexer" child with transformers' names (wq_b, wk, k_norm, weights_proj).
class IndexerImpl : public torch::nn::Module {
 public:
  explicit IndexerImpl(const DecoderConfig& c);
  // The index keys of x [B,T,hidden]: [B,1,T,index_head_dim] (cos/sin [B,T,qk_rope_head_dim]); no autograd. Under
  // tensor + sequence parallelism x is this rank's part of the sequence: wk / weights_proj gather it (their
  // WholeEntry), and the sizes come from q_resid [B,T,q_lora_rank], always whole.
  at::Tensor keys(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  // Which keys each query attends to: bool [B,T,Tk], true = kept (visible and among the index_topk best). keys
  // [B,1,Tk,D] (cached ones first); the queries sit at positions offset .. offset+T-1; segment_ids [B,T] (no cache)
  // keep queries within their document. No autograd.
  // Context parallelism (parts set): the queries are this rank's parts of the sequence (x, q_resid, cos, sin,
  // segment_ids local), keys the whole sequence's (gather_parts), and Tk the whole length.
  at::Tensor select(const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& keys, int64_t offset, const at::Tensor& segment_ids,
                    const nn::SequenceParts* parts = nullptr);

  // ---- training the indexer (DeepSeek-V3.2's objective; off by default: frozen) ----
  // loss_coef > 0: the training forwards (autograd on, no cache) make the indexer's KL loss, and its parameters
  // take gradients from it alone: the indexer reads x and q_resid detached, and the target is the attention's own
  // distribution, detached. For each query t, with S_t its kept keys (dense_warmup: every visible key, and the
  // attention is dense; else the index_topk selection, the attention sparse as in inference),
  //   p_t = (1/H) sum_h softmax_{S_t}(attention scores of head h)      (the heads' mean: an L1-normalised sum)
  //   KL_t = sum_{s in S_t} p_ts (log p_ts - log softmax_{S_t}(index scores of t)_s),
  // and the layer adds loss_coef * sum_t KL_t over every query of the micro-batch to take_kl().
  double loss_coef = 0;
  bool dense_warmup = false;
  // The kept keys of a training forward and the layer's KL term (target: the heads' mean attention probabilities
  // [B,T,Tk], p_t above, summed over every head also under tensor parallelism -> stored).
  at::Tensor train_keep(const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& segment_ids, const nn::SequenceParts* parts = nullptr);
  void add_kl(const at::Tensor& target);
  // The summed KL terms since the last call (times loss_coef; undefined when none), and clears them.
  at::Tensor take_kl();

  nn::Linear wq_b{nullptr}, wk{nullptr}, weights_proj{nullptr};
  torch::nn::LayerNorm k_norm{nullptr};
  int64_t n_heads, head_dim, rope_dim, topk;
  bool interleave;  // GLM-5: interleaved rope pairs

 private:
  at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;  // x [B,H,T,D]
  at::Tensor raw_keys(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  // index scores [B,T,Tk] (float32 or wider) of the queries against keys [B,1,Tk,D], autograd as the caller has it
  at::Tensor scores(const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& keys);
  at::Tensor train_scores_, train_keep_, kl_;  // the pending training forward's scores / kept keys; summed KL
};
TORCH_MODULE(Indexer);

// The selection a full layer made in its last forward, kept only when shared layers read it.
struct DsaSelection {
  at::Tensor keep;
  int64_t layer = 0;  // the layer that makes it
};

// softmax(q k^T * scale) v over the kept keys: q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv], keep [B,Tq,Tk] bool
// (every row keeps at least one key) -> [B,H,Tq,Dv]. On the CPU (float32 / float64, no probs) the fused kernel
// (kernels/sparse_attention.h: only the kept keys); otherwise dense scores with the rest masked, as transformers'
// eager path.
// probs: set to the attention probabilities [B,H,Tq,Tk] when given.
at::Tensor sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep,
                            double scale, at::Tensor* probs = nullptr);

// Context parallelism: the whole sequence, in order, of x [B,H,Tl,D] that holds this rank's parts along dim 2
// (differentiable: parts.gather), and the global positions [Tl] of this rank's tokens.
at::Tensor gather_parts(const at::Tensor& x, const nn::SequenceParts& parts);
at::Tensor part_positions(const nn::SequenceParts& parts, int64_t local_len, const at::TensorOptions& opts);

// Points every shared layer's attention at the selection of the last full layer before it (once, after building).
void link_dsa_layers(torch::nn::ModuleList& layers, const DecoderConfig& c);

}  // namespace lf::models::llama

// DeepSeek-V4 (deepseek_v4), as transformers' DeepseekV4ForCausalLM:
// - the residual is hc_mult streams [B,T,hc_mult,hidden] mixed by manifold-constrained hyper-connections (attn_hc,
//   ffn_hc: sigmoid pre / post weights and a Sinkhorn-normalised comb matrix); the hyper head (model.hc_head) collapses
//   the streams before the final norm;
// - attention: low-rank queries with an unweighted per-head RMSNorm, one shared key = value head (kv_proj, kv_norm),
//   interleaved rotary on the trailing rotary_dim features (the output rotated back), per-head sinks, a sliding window,
//   and a grouped low-rank output projection (o_a_proj per o_groups group, o_b_proj); per layer_types it also attends
//   to compressed entries: heavily compressed attention (HCA) pools every compress_rate tokens into one entry,
//   compressed sparse attention (CSA) pools overlapping windows and keeps, per query, the index_topk entries its
//   lightning indexer scores best (the indexer gets no gradient: its parameters are frozen);
// - MoE with sqrt(softplus) scores, a correction bias (top-k layers) or a fixed token -> experts table (tid2eid,
//   hash_moe layers), swiglu_limit clamps, one shared expert.
// Checkpoints use the names transformers' save_pretrained writes (attn.wq_a, ffn.experts.E.w1, hc_attn_fn, head, ...).
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <string>
#include <vector>

#include "loongforge/core/json.h"
#include "loongforge/models/llama/config.h"
#include "loongforge/models/model.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/moe.h"
#include "loongforge/nn/rms_norm.h"
#include "loongforge/nn/rotary.h"
#include "loongforge/nn/sequence_parts.h"

namespace lf::models::llama {

// Every field of a deepseek_v4 config.json (from_json hands the whole parse here).
void parse_deepseek_v4(const JsonReader& rd, DecoderConfig& c);
int64_t deepseek_v4_num_parameters(const DecoderConfig& c);
int64_t deepseek_v4_active_parameters(const DecoderConfig& c);

// Interleaved rotary of the trailing features of x [B,H,T,D] by cos / sin [B,T,rotary_dim/2].
at::Tensor v4_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The two rotaries of the model: "main" (sliding layers) and "compress" (compressed layers, compressors, indexers).
struct V4Rotary {
  explicit V4Rotary(const DecoderConfig& c);
  // cos, sin [B,T,rotary_dim/2] of positions [B,T], in dtype
  std::pair<at::Tensor, at::Tensor> main(const at::Tensor& pos, at::ScalarType dtype) const;
  std::pair<at::Tensor, at::Tensor> compress(const at::Tensor& pos, at::ScalarType dtype) const;
  void to(const at::Device& d);
  nn::Rotary main_, compress_;
};

// The generation state of one compressor (or CSA indexer) in a key/value cache: the compressed entries so far
// [B,n,dim], the projected kv / gate rows of the incomplete window (pending, gate without its position bias) and,
// for overlapping windows, the first-half features of the last complete window (prev, gate with its bias). The
// pointers name slots of an nn::KVCache (v4_cache_state); undefined tensors: nothing yet.
struct V4CompressorState {
  at::Tensor *entries, *pending_kv, *pending_gate, *prev_kv, *prev_gate;
};
// DeepSeek-V4's generation cache inside an nn::KVCache (grown to 1 + 6 x layers slots on first use): keys[0] holds
// the ids so far [B,1,T] (KVCache::length()); per layer the last sliding_window - 1 rotated keys [B,1,<W,D]
// (v4_cache_keys) and the states of its compressor and indexer.
at::Tensor& v4_cache_keys(nn::KVCache& cache, int64_t layer);
V4CompressorState v4_cache_state(nn::KVCache& cache, int64_t layer, bool indexer);
void v4_cache_reserve(nn::KVCache& cache, int64_t layers);

// A layer's compressor (kind 1: CSA, overlapping windows, with its indexer; kind 2: HCA), or (kind 3) the CSA
// indexer: a compressor of its own at index_head_dim plus the query projection and head weights that score entries.
class V4CompressorImpl : public torch::nn::Module {
 public:
  V4CompressorImpl(const DecoderConfig& c, int64_t kind);
  // The compressed entries [B,n,dim] of the complete windows of x [B,T,hidden], rotated at their windows' first
  // positions by the compress rotary.
  // With a state (generation): x holds the tokens after those the state has seen (positions go on from there);
  // returns every entry so far, the state updated.
  at::Tensor compress(const at::Tensor& x, const V4Rotary& rot, const V4CompressorState* state = nullptr);
  // The same from the whole sequence's projections kv_proj(x), gate_proj(x) [B,T,w] (context parallelism gathers
  // them from every rank).
  at::Tensor pool(const at::Tensor& kv_all, const at::Tensor& gate_all, const V4Rotary& rot);
  // The indexer's top index_topk entries per query [B,T,k] (-1: none) over its entries, no autograd. pos [B,T];
  // cos / sin: the compress rotary at pos.
  at::Tensor select(const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& pos, const at::Tensor& cos,
                    const at::Tensor& sin, const V4Rotary& rot, const V4CompressorState* state = nullptr);
  // The same over given entries keys [B,n,dim] (the queries x, q_resid, pos: any tokens of the sequence).
  at::Tensor select_from(const at::Tensor& keys, const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& pos,
                         const at::Tensor& cos, const at::Tensor& sin);
  nn::Linear kv_proj{nullptr}, gate_proj{nullptr};
  at::Tensor position_bias;
  nn::RMSNorm kv_norm{nullptr};
  std::shared_ptr<V4CompressorImpl> indexer;  // CSA
  nn::Linear q_b_proj{nullptr}, weights_proj{nullptr};  // the indexer (weights_proj under "scorer")
  int64_t rate, dim, heads = 0, topk = 0;
  bool overlap;
};
TORCH_MODULE(V4Compressor);

// Context parallelism (nn::SequencePartsHook, parts set): x holds this rank's parts of the load-balanced layout; the
// shared key / value head and the compressors' (and indexer's) projections are gathered over the whole sequence (one
// all-gather, gradients reduce-scattered back), every rank pools the whole sequence's compressed entries, and its
// queries attend to them and to the whole sequence's keys through the sliding window at their global positions.
class V4AttentionImpl : public torch::nn::Module, public nn::AttentionHook, public nn::SequencePartsHook {
 public:
  V4AttentionImpl(const DecoderConfig& c, int64_t layer_idx);
  // x [B,T,hidden]; pos [B,T]; cos/sin of this layer's rotary at pos, cos_c/sin_c of the compress one. cache: the
  // generation cache (x: the tokens after those it holds).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& cos_c, const at::Tensor& sin_c, const V4Rotary& rot, nn::KVCache* cache = nullptr);
  nn::Linear q_a_proj{nullptr}, q_b_proj{nullptr}, kv_proj{nullptr}, o_a_proj{nullptr}, o_b_proj{nullptr};
  nn::RMSNorm q_a_norm{nullptr}, kv_norm{nullptr};
  at::Tensor sinks;
  V4Compressor compressor{nullptr};
  int64_t kind, head_dim, groups, layer_idx;
  int64_t total_heads;  // the config's heads (heads: this rank's under tensor parallelism; groups split with them)
  double eps;
};
TORCH_MODULE(V4Attention);

// The options of a layer's routed MoE block (nn::MoE: sqrt(softplus) or sigmoid scores, a correction bias or, with
// `hash`, the fixed token -> experts table gate.tid2eid; the swiglu clamps; one shared expert; load balancing as
// transformers' load_balancing_loss_func over the top-k routers' logits).
nn::MoEOptions v4_moe_options(const DecoderConfig& c, bool hash);

class V4HyperConnectionImpl : public torch::nn::Module {
 public:
  V4HyperConnectionImpl(const DecoderConfig& c, bool head);
  // (post [B,T,N], comb [B,T,N,N], collapsed [B,T,hidden]) of the streams h [B,T,N,hidden]
  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& h);
  at::Tensor collapse(const at::Tensor& h);  // the hyper head (head: parameters hc_fn, hc_base, hc_scale)
  at::Tensor fn, base, scale;
  int64_t n, iters;
  double eps, hc_eps;
};
TORCH_MODULE(V4HyperConnection);

class V4DecoderLayerImpl : public torch::nn::Module {
 public:
  V4DecoderLayerImpl(const DecoderConfig& c, int64_t layer_idx);
  // h [B,T,hc_mult,hidden]; cache: the generation cache (h: the tokens after those it holds)
  at::Tensor forward(const at::Tensor& h, const Batch& in, const V4Rotary& rot, nn::KVCache* cache = nullptr);
  V4Attention self_attn{nullptr};
  nn::MoE mlp{nullptr};  // expert parallelism and the router losses reach it as any MoE block (model.h moe_layers)
  nn::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  V4HyperConnection attn_hc{nullptr}, ffn_hc{nullptr};
  bool compress_rope;
};
TORCH_MODULE(V4DecoderLayer);

// The block inputs: positions, input_ids (hash routing), the main and compress rotaries' cos / sin, segment_ids (packed
// documents: each document's attention on its own).
Batch v4_block_inputs(const V4Rotary& rot, const at::Tensor& input_ids, const at::Tensor& pos, at::ScalarType dtype,
                      const at::Tensor& segment_ids = {});
// transformers' init of the V4 parameters the generic init does not cover (sinks, hc bases / scales, position biases).
void v4_init_weights(torch::nn::Module& m);
// The checkpoint name of an in-memory name (transformers' save_pretrained names).
std::string v4_checkpoint_name(const std::string& memory_name);
// DeepSeek's original layout (the Hub's files: embed.weight, layers.N.*, norm.weight, hc_head_fn, ...) -> the
// save_pretrained names; other names unchanged.
std::string v4_canonical_name(const std::string& stored);
std::vector<CheckpointTensor> v4_checkpoint_tensors(const torch::nn::Module& m, const DecoderConfig& c);

}  // namespace lf::models::llama

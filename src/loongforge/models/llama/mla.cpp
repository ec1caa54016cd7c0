#include "loongforge/models/llama/mla.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/nn/rotary.h"

namespace lf::models::llama {

at::Tensor apply_rotary_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // Pair i = (x[2i], x[2i+1]) rotates by angle i; cos/sin are cat(freqs, freqs), so de-interleaving x into
  // [evens | odds] turns this into the usual rotate-half form with the same cos/sin.
  const int64_t d = x.size(-1);
  at::Tensor de = at::cat({x.slice(-1, 0, d, 2), x.slice(-1, 1, d, 2)}, -1);
  return nn::apply_rotary(de, cos, sin);
}

MLAImpl::MLAImpl(const DecoderConfig& c, int64_t idx)
    : nn::AttentionHook(c.num_attention_heads, c.num_attention_heads, 0), layer_idx(idx), kv_lora_rank(c.kv_lora_rank), qk_nope_head_dim(c.qk_nope_head_dim),
      qk_rope_head_dim(c.qk_rope_head_dim), v_head_dim(c.v_head_dim), all_heads(c.num_attention_heads), rope_interleave(c.rope_interleave), rope(c.mla_rope),
      scale(c.attention_scale > 0 ? c.attention_scale
                                  : 1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim))) {
  const int64_t d = c.hidden_size, qk = qk_nope_head_dim + qk_rope_head_dim;
  // transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps (1e-6), not rms_norm_eps.
  constexpr double latent_eps = 1e-6;
  if (c.q_lora_rank > 0) {
    q_a_proj = register_module("q_a_proj", nn::Linear(d, c.q_lora_rank, c.q_bias));
    q_a_layernorm = register_module("q_a_layernorm", nn::RMSNorm(c.q_lora_rank, latent_eps));
    q_b_proj = register_module("q_b_proj", nn::Linear(c.q_lora_rank, heads * qk, false));
  } else {
    q_proj = register_module("q_proj", nn::Linear(d, heads * qk, false));
  }
  kv_a_proj_with_mqa = register_module("kv_a_proj_with_mqa", nn::Linear(d, kv_lora_rank + qk_rope_head_dim, c.k_bias));
  kv_a_layernorm = register_module("kv_a_layernorm", nn::RMSNorm(kv_lora_rank, latent_eps));
  kv_b_proj = register_module("kv_b_proj", nn::Linear(kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), false));
  o_proj = register_module("o_proj", nn::Linear(heads * v_head_dim, d, c.o_bias));
  if (c.dsa) {  // DeepSeek sparse attention (dsa.h); shared layers get their selection from link_dsa_layers
    if (c.layer_indexer.at(idx)) indexer = register_module("indexer", Indexer(c));
    selection = indexer ? std::make_shared<DsaSelection>(DsaSelection{{}, idx}) : nullptr;
  }
}

at::Tensor MLAImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, nn::KVCache* cache,
                            const at::Tensor& segment_ids, const at::Tensor& q_scale) {
  const int64_t qk = qk_nope_head_dim + qk_rope_head_dim;
  at::Tensor q_resid = q_proj ? at::Tensor() : q_a_layernorm->forward(q_a_proj->forward(x));
  at::Tensor q = q_proj ? q_proj->forward(x) : q_b_proj->forward(q_resid);
  // b, t from the projection (a sequence-parallel entry gathers the sequence: t can exceed x.size(1)).
  const int64_t b = q.size(0), t = q.size(1);
  q = q.view({b, t, heads, qk}).transpose(1, 2);  // [B,H,T,qk]
  at::Tensor q_pass = q.narrow(-1, 0, qk_nope_head_dim), q_rot = q.narrow(-1, qk_nope_head_dim, qk_rope_head_dim);

  at::Tensor ckv = kv_a_proj_with_mqa->forward(x);  // [B,T,kv_lora_rank + rope]
  at::Tensor latent = kv_a_layernorm->forward(ckv.narrow(-1, 0, kv_lora_rank)).unsqueeze(1);  // [B,1,T,kv_lora_rank]
  at::Tensor k_rot = ckv.narrow(-1, kv_lora_rank, qk_rope_head_dim).unsqueeze(1);            // [B,1,T,rope]
  if (!rope) {
  } else if (rope_interleave) {
    q_rot = apply_rotary_interleaved(q_rot, cos, sin);
    k_rot = apply_rotary_interleaved(k_rot, cos, sin);
  } else {
    q_rot = nn::apply_rotary(q_rot, cos, sin);
    k_rot = nn::apply_rotary(k_rot, cos, sin);
  }
  int64_t offset = 0;
  // a training forward of a trained indexer (dsa.h) computes its keys with autograd itself (IndexerImpl::train_keep)
  const bool train_indexer = indexer && indexer->loss_coef > 0 && at::GradMode::is_enabled() && !cache;
  at::Tensor index_keys = indexer && !train_indexer ? indexer->keys(x, cos, sin) : at::Tensor();  // [B,1,T,index_head_dim]
  if (selection && parts) {  // context parallelism (sparse attention): the whole sequence's latents and keys
    if (cache) throw Error("context parallel: a key/value cache (generation) is not supported");
    const int64_t w = kv_lora_rank + qk_rope_head_dim;
    std::vector<at::Tensor> local = {latent, k_rot};
    if (index_keys.defined()) local.push_back(index_keys.to(latent.scalar_type()));
    const at::Tensor all = gather_parts(at::cat(local, -1), *parts);
    latent = all.narrow(-1, 0, kv_lora_rank);
    k_rot = all.narrow(-1, kv_lora_rank, qk_rope_head_dim);
    if (index_keys.defined()) index_keys = all.narrow(-1, w, all.size(-1) - w).detach().to(index_keys.scalar_type());
  } else if (cache) {  // the cache keeps the compressed latent and the rotated shared key (DSA: and the index key)
    offset = cache->keys[layer_idx].defined() ? cache->keys[layer_idx].size(2) : 0;
    at::Tensor kv_rest = indexer ? at::cat({k_rot, index_keys.to(k_rot.scalar_type())}, -1) : k_rot;
    std::tie(latent, kv_rest) = cache->append(static_cast<size_t>(layer_idx), latent, kv_rest);
    k_rot = kv_rest.narrow(-1, 0, qk_rope_head_dim);
    if (indexer) index_keys = kv_rest.narrow(-1, qk_rope_head_dim, kv_rest.size(-1) - qk_rope_head_dim);
  }
  const int64_t tk = latent.size(2);
  at::Tensor kv = kv_b_proj->forward(latent).view({b, tk, heads, qk_nope_head_dim + v_head_dim}).transpose(1, 2);
  at::Tensor k_nope = kv.narrow(-1, 0, qk_nope_head_dim), v = kv.narrow(-1, qk_nope_head_dim, v_head_dim);
  at::Tensor k = at::cat({k_nope, k_rot.expand({b, heads, tk, qk_rope_head_dim})}, -1);
  q = at::cat({q_pass, q_rot}, -1);
  if (q_scale.defined()) q = q * q_scale.to(q.scalar_type()).unsqueeze(1).unsqueeze(-1);  // [B,1,T,1]
  at::Tensor o = selection ? dsa_attend(q, k, v, x, q_resid, cos, sin, index_keys, offset, segment_ids, train_indexer)
                           : attend(q, k, v, offset, scale, segment_ids);  // [B,H,T,v_head_dim]
  return o_proj->forward(o.transpose(1, 2).reshape({b, t, heads * v_head_dim}));
}

at::Tensor MLAImpl::dsa_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& x,
                               const at::Tensor& q_resid, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& index_keys, int64_t offset, const at::Tensor& segment_ids,
                               bool train_indexer) {
  const std::string where = "DeepSeek sparse attention (layer " + std::to_string(layer_idx) + ")";
  if (attention_fn)
    throw Error(where + ": attention replacements (the document-attention kernels) are not supported (it masks the "
                        "keys its indexer did not select)");
  at::Tensor keep;
  // a training forward of a trained indexer (dsa.h): its KL term from this attention's probabilities, their mean
  // over every head (under tensor parallelism a sum over the ranks' heads)
  if (train_indexer) {
    keep = indexer->train_keep(x, q_resid, cos, sin, segment_ids, parts ? &*parts : nullptr);
    if (selection.use_count() > 1) selection->keep = keep;
    at::Tensor probs;
    at::Tensor o = sparse_attention(q, k, v, keep, scale, &probs);
    indexer->add_kl(sum_over_heads(probs.detach().sum(1)) / static_cast<double>(all_heads));
    return o;
  }
  if (indexer) {
    keep = indexer->select(x, q_resid, cos, sin, index_keys, offset, segment_ids, parts ? &*parts : nullptr);
    if (selection.use_count() > 1) selection->keep = keep;  // GLM-5's shared layers after this one read it
  } else {
    keep = selection->keep;
    if (!keep.defined() || keep.size(0) != q.size(0) || keep.size(1) != q.size(2) || keep.size(2) != k.size(2))
      throw Error(where + ": reuses the selection of layer " + std::to_string(selection->layer) +
                  ", which did not run just before on these tokens (pipeline stages must keep a shared layer with "
                  "the indexer layer before it)");
  }
  return sparse_attention(q, k, v, keep, scale);
}

}  // namespace lf::models::llama

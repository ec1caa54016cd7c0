#include "loongforge/models/llama/gated_deltanet.h"

#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/nn/gated_delta.h"
#include "loongforge/nn/sequence_parts.h"

namespace lf::models::llama {

DepthwiseConvWeightImpl::DepthwiseConvWeightImpl(int64_t channels, int64_t kernel) {
  weight = register_parameter("weight", at::empty({channels, 1, kernel}).normal_(0.0, 0.02));
}

LinearCacheState linear_cache_state(const nn::KVCache* cache, int64_t layer) {
  const size_t li = static_cast<size_t>(layer);
  if (!cache || !cache->keys[li].defined()) return {};
  return {cache->keys[li].select(2, 0), cache->values[li]};
}

void store_linear_cache_state(nn::KVCache& cache, int64_t layer, int64_t t, const at::Tensor& conv, const at::Tensor& recurrent) {
  const size_t li = static_cast<size_t>(layer);
  const int64_t seen = (cache.keys[li].defined() ? cache.keys[li].size(2) : 0) + t;
  cache.keys[li] = conv.unsqueeze(2).expand({conv.size(0), conv.size(1), seen, conv.size(2)});
  cache.values[li] = recurrent;
}

std::vector<std::pair<int64_t, int64_t>> packed_documents(const at::Tensor& segment_ids) {
  if (!segment_ids.defined()) return {};
  at::Tensor cu = nn::document_ranges(segment_ids.cpu()).first.to(at::kLong).cpu();
  const int64_t n = cu.numel() - 1;
  if (n == segment_ids.size(0)) return {};
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t* c = cu.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) out.push_back({c[i], c[i + 1]});
  return out;
}

at::Tensor per_document(const std::vector<std::pair<int64_t, int64_t>>& docs, const std::vector<at::Tensor>& xs,
                        const std::function<at::Tensor(const std::vector<at::Tensor>&)>& f) {
  const int64_t b = xs[0].size(0), t = xs[0].size(1);
  std::vector<at::Tensor> outs;
  for (auto [lo, hi] : docs) {
    std::vector<at::Tensor> slices;
    for (const at::Tensor& x : xs) slices.push_back(x.flatten(0, 1).narrow(0, lo, hi - lo).unsqueeze(0));
    outs.push_back(f(slices).squeeze(0));
  }
  at::Tensor y = at::cat(outs, 0);
  std::vector<int64_t> shape{b, t};
  for (int64_t d = 1; d < y.dim(); ++d) shape.push_back(y.size(d));
  return y.view(shape);
}

LinearLayout::LinearLayout(const nn::AttentionHook& hook, const at::Tensor& segment_ids,
                           const std::optional<nn::SequenceParts>& parts, nn::KVCache* cache, int64_t layer)
    : docs_(parts ? std::vector<std::pair<int64_t, int64_t>>{} : packed_documents(segment_ids)), parts_(parts ? &*parts : nullptr),
      part_segments_(parts ? segment_ids : at::Tensor()), cache_(cache), layer_(layer),
      past_(linear_cache_state(cache, layer)) {
  if (hook.attention_fn)
    throw Error("linear-attention layer " + std::to_string(layer) + ": attention replacements are not supported");
  if (parts_ && cache_) throw Error("context parallel: a key/value cache (generation) is not supported");
  if (!docs_.empty() && cache_)
    throw Error("linear-attention layer " + std::to_string(layer) + ": packed documents (segment_ids) are not "
                "supported with a cache (generation)");
}

at::Tensor LinearLayout::conv(const at::Tensor& x, const at::Tensor& weight) {
  if (parts_) return nn::parts_causal_conv_silu(x, weight, *parts_, part_segments_);
  if (!docs_.empty())
    return per_document(docs_, {x}, [&](const std::vector<at::Tensor>& m) {
      return nn::causal_depthwise_conv_silu(m[0], weight).first;
    });
  at::Tensor y;
  std::tie(y, conv_state_) = nn::causal_depthwise_conv_silu(x, weight, past_.conv);
  return y;
}

at::Tensor LinearLayout::delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                    const at::Tensor& beta, int64_t chunk) const {
  if (parts_) return nn::parts_gated_delta_rule(q, k, v, g, beta, *parts_, chunk, part_segments_);
  if (!docs_.empty())
    return per_document(docs_, {q, k, v, g, beta}, [&](const std::vector<at::Tensor>& d) {
      return nn::chunk_gated_delta_rule(d[0], d[1], d[2], d[3], d[4], {}, chunk).first;
    });
  auto [core, state] = past_.recurrent.defined() && q.size(1) == 1
                           ? nn::recurrent_gated_delta_rule(q, k, v, g, beta, past_.recurrent)
                           : nn::chunk_gated_delta_rule(q, k, v, g, beta, past_.recurrent, chunk, cache_ != nullptr);
  if (cache_) store_linear_cache_state(*cache_, layer_, q.size(1), conv_state_, state);
  return core;
}

GatedDeltaNetImpl::GatedDeltaNetImpl(const DecoderConfig& c, int64_t idx)
    : nn::AttentionHook(c.linear_num_value_heads, c.linear_num_key_heads, 0), layer_idx(idx), key_heads(c.linear_num_key_heads), value_heads(c.linear_num_value_heads),
      key_dim(c.linear_key_head_dim), value_dim(c.linear_value_head_dim), kernel(c.linear_conv_kernel_dim) {
  const int64_t d = c.hidden_size, kd = key_heads * key_dim, vd = value_heads * value_dim;
  if (c.linear_split_projections) {
    in_proj_qkv = register_module("in_proj_qkv", nn::Linear(d, 2 * kd + vd, false));
    in_proj_z = register_module("in_proj_z", nn::Linear(d, vd, false));
    in_proj_b = register_module("in_proj_b", nn::Linear(d, value_heads, false));
    in_proj_a = register_module("in_proj_a", nn::Linear(d, value_heads, false));
  } else {
    in_proj_qkvz = register_module("in_proj_qkvz", nn::Linear(d, 2 * kd + 2 * vd, false));
    in_proj_ba = register_module("in_proj_ba", nn::Linear(d, 2 * value_heads, false));
  }
  conv1d = register_module("conv1d", DepthwiseConvWeight(2 * kd + vd, kernel));
  dt_bias = register_parameter("dt_bias", at::ones({value_heads}));
  A_log = register_parameter("A_log", at::empty({value_heads}).uniform_(0.01, 16.0).log_());
  norm = register_module("norm", nn::RMSNorm(value_dim, c.rms_norm_eps));
  out_proj = register_module("out_proj", nn::Linear(vd, d, false));
}

at::Tensor GatedDeltaNetImpl::forward(const at::Tensor& x, nn::KVCache* cache, const at::Tensor& segment_ids) {
  // this rank's heads (AttentionHook::heads / kv_heads: value / key heads, divided by tensor parallelism)
  const int64_t key_heads = kv_heads, value_heads = heads;
  const int64_t kd = key_heads * key_dim, vd = value_heads * value_dim;
  int64_t b = 0, t = 0;  // from the projections (a sequence-parallel input_fn gathers the sequence: t can exceed x's)
  at::Tensor mixed, z, beta_in, a;  // mixed: the convolution's input [q | k | v] over all heads
  if (in_proj_qkv) {
    mixed = in_proj_qkv->forward(x);
    b = mixed.size(0);
    t = mixed.size(1);
    z = in_proj_z->forward(x);
    beta_in = in_proj_b->forward(x);
    a = in_proj_a->forward(x);
  } else {
    // Qwen3-Next packs per key head: [q (Dk), k (Dk), v (r x Dv), z (r x Dv)] and [b (r), a (r)], r value heads per
    // key head; the value heads of a key head are consecutive.
    const int64_t r = value_heads / key_heads;
    at::Tensor proj = in_proj_qkvz->forward(x);
    b = proj.size(0);
    t = proj.size(1);
    at::Tensor qkvz = proj.view({b, t, key_heads, 2 * key_dim + 2 * r * value_dim});
    at::Tensor ba = in_proj_ba->forward(x).view({b, t, key_heads, 2 * r});
    auto pieces = qkvz.split_with_sizes({key_dim, key_dim, r * value_dim, r * value_dim}, 3);
    mixed = at::cat({pieces[0].reshape({b, t, kd}), pieces[1].reshape({b, t, kd}), pieces[2].reshape({b, t, vd})}, -1);
    z = pieces[3];
    beta_in = ba.narrow(3, 0, r).reshape({b, t, value_heads});
    a = ba.narrow(3, r, r).reshape({b, t, value_heads});
  }
  z = z.reshape({b, t, value_heads, value_dim});
  LinearLayout layout(*this, segment_ids, parts, cache, layer_idx);
  at::Tensor conv = layout.conv(mixed, conv1d->weight);
  auto qkv = conv.split_with_sizes({kd, kd, vd}, -1);
  at::Tensor q = qkv[0].reshape({b, t, key_heads, key_dim}), k = qkv[1].reshape({b, t, key_heads, key_dim});
  at::Tensor v = qkv[2].reshape({b, t, value_heads, value_dim});
  // q and k L2-normalised in the compute dtype (float32 unless float64), q scaled by Dk^-1/2, as transformers
  const at::ScalarType ct = v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  q = nn::l2_normalize(q.to(ct)) * (1.0 / std::sqrt(static_cast<double>(key_dim)));
  k = nn::l2_normalize(k.to(ct));
  at::Tensor beta = at::sigmoid(beta_in);
  at::Tensor g = -A_log.to(ct).exp() * at::softplus(a.to(ct) + dt_bias);
  at::Tensor core = layout.delta_rule(q, k, v, g, beta, chunk);
  at::Tensor o = nn::gated_rms_norm(core, z, norm->weight, norm->eps);
  return out_proj->forward(o.reshape({b, t, vd}));
}

}  // namespace lf::models::llama

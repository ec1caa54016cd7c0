#include "loongforge/models/llama/gated_deltanet.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/nn/gated_delta.h"

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

at::Tensor cached_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, const LinearCacheState& past, const at::Tensor& conv_state,
                             nn::KVCache* cache, int64_t layer, int64_t chunk) {
  auto [core, state] = past.recurrent.defined() && q.size(1) == 1
                           ? nn::recurrent_gated_delta_rule(q, k, v, g, beta, past.recurrent)
                           : nn::chunk_gated_delta_rule(q, k, v, g, beta, past.recurrent, chunk, cache != nullptr);
  if (cache) store_linear_cache_state(*cache, layer, q.size(1), conv_state, state);
  return core;
}

void refuse_attention_fn(const nn::AttentionHook& hook, int64_t layer, const char* kind) {
  if (hook.attention_fn)
    throw Error("linear-attention layer " + std::to_string(layer) +
                ": context parallelism (parallel.cp) and attention replacements are not supported by " + kind +
                " layers yet (their recurrent state would have to pass between ranks)");
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

at::Tensor GatedDeltaNetImpl::forward(const at::Tensor& x, nn::KVCache* cache) {
  refuse_attention_fn(*this, layer_idx, "Gated DeltaNet");
  const int64_t b = x.size(0), t = x.size(1), kd = key_heads * key_dim, vd = value_heads * value_dim;
  at::Tensor mixed, z, beta_in, a;  // mixed: the convolution's input [q | k | v] over all heads
  if (in_proj_qkv) {
    mixed = in_proj_qkv->forward(x);
    z = in_proj_z->forward(x);
    beta_in = in_proj_b->forward(x);
    a = in_proj_a->forward(x);
  } else {
    // Qwen3-Next packs per key head: [q (Dk), k (Dk), v (r x Dv), z (r x Dv)] and [b (r), a (r)], r value heads per
    // key head; the value heads of a key head are consecutive.
    const int64_t r = value_heads / key_heads;
    at::Tensor qkvz = in_proj_qkvz->forward(x).view({b, t, key_heads, 2 * key_dim + 2 * r * value_dim});
    at::Tensor ba = in_proj_ba->forward(x).view({b, t, key_heads, 2 * r});
    auto parts = qkvz.split_with_sizes({key_dim, key_dim, r * value_dim, r * value_dim}, 3);
    mixed = at::cat({parts[0].reshape({b, t, kd}), parts[1].reshape({b, t, kd}), parts[2].reshape({b, t, vd})}, -1);
    z = parts[3];
    beta_in = ba.narrow(3, 0, r).reshape({b, t, value_heads});
    a = ba.narrow(3, r, r).reshape({b, t, value_heads});
  }
  z = z.reshape({b, t, value_heads, value_dim});
  const LinearCacheState past = linear_cache_state(cache, layer_idx);
  auto [conv, conv_state] = nn::causal_depthwise_conv_silu(mixed, conv1d->weight, past.conv);
  auto qkv = conv.split_with_sizes({kd, kd, vd}, -1);
  at::Tensor q = qkv[0].reshape({b, t, key_heads, key_dim}), k = qkv[1].reshape({b, t, key_heads, key_dim});
  at::Tensor v = qkv[2].reshape({b, t, value_heads, value_dim});
  // q and k L2-normalised in the compute dtype (float32 unless float64), q scaled by Dk^-1/2, as transformers
  const at::ScalarType ct = v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  q = nn::l2_normalize(q.to(ct)) * (1.0 / std::sqrt(static_cast<double>(key_dim)));
  k = nn::l2_normalize(k.to(ct));
  at::Tensor beta = at::sigmoid(beta_in);
  at::Tensor g = -A_log.to(ct).exp() * at::softplus(a.to(ct) + dt_bias);
  at::Tensor core = cached_delta_rule(q, k, v, g, beta, past, conv_state, cache, layer_idx, chunk);
  at::Tensor o = nn::gated_rms_norm(core, z, norm->weight, norm->eps);
  return out_proj->forward(o.reshape({b, t, vd}));
}

}  // namespace lf::models::llama

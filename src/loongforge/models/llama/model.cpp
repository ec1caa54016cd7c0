#include "loongforge/models/llama/model.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/kernels/add_rms_norm.h"
#include "loongforge/kernels/rms_norm.h"
#include "loongforge/kernels/swiglu.h"
#include "loongforge/models/llama/deepseek_v4.h"
#include "loongforge/models/llama/mtp.h"
#include "loongforge/nn/recompute.h"

namespace lf::models::llama {

namespace {
nn::Linear linear(int64_t in, int64_t out, bool bias) { return nn::Linear(in, out, bias); }

// The factor of an RMSNorm: its weight, or 1 + weight for a zero-centred one (Qwen3-Next; its weight starts at 0).
at::Tensor norm_scale(const nn::RMSNorm& n, bool zero_centered) { return zero_centered ? n->weight + 1.0 : n->weight; }
}  // namespace

at::Tensor apply_norm(const nn::RMSNorm& n, const at::Tensor& x, bool zero_centered) {
  return kernels::rms_norm(x, norm_scale(n, zero_centered), n->eps);  // = RMSNormImpl::forward when not
}

nn::RopeSpec rope_spec(const DecoderConfig& c) {
  nn::RopeSpec s;
  s.type = c.rope.type;
  s.theta = c.rope.theta;
  s.factor = c.rope.factor;
  s.head_dim = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim;  // partial rotary: only these features rotate
  s.max_position_embeddings = c.max_position_embeddings;
  s.original_max_position_embeddings = c.rope.original_max_position_embeddings;
  s.low_freq_factor = c.rope.low_freq_factor;
  s.high_freq_factor = c.rope.high_freq_factor;
  s.beta_fast = c.rope.beta_fast;
  s.beta_slow = c.rope.beta_slow;
  s.attention_factor = c.rope.attention_factor.value_or(-1);
  s.mscale = c.rope.mscale.value_or(0);
  s.mscale_all_dim = c.rope.mscale_all_dim.value_or(0);
  s.truncate = c.rope.truncate;
  s.mrope_section = c.rope.mrope_section;
  s.mrope_interleaved = c.rope.mrope_interleaved;
  return s;
}

nn::MoEOptions moe_options(const DecoderConfig& c) {
  nn::MoEOptions o;
  o.num_experts = c.num_experts;
  o.top_k = c.num_experts_per_tok;
  o.hidden = c.hidden_size;
  o.expert_ffn = c.moe_intermediate_size;
  o.scoring = c.moe_scoring;
  o.norm_topk_prob = c.norm_topk_prob;
  o.n_group = c.moe_n_group;
  o.topk_group = c.moe_topk_group;
  o.score_correction_bias = c.moe_score_correction_bias;
  o.routed_scaling_factor = c.routed_scaling_factor;
  o.shared_ffn = c.n_shared_experts * c.moe_intermediate_size;
  o.act = c.hidden_act;
  o.lb_softmax_topk = c.lb_softmax_topk;
  // Collect the load-balancing statistics in training; CausalLM::aux_loss pools them across layers.
  o.aux_loss_coef = c.router_aux_loss_coef;
  return o;
}

AttentionImpl::AttentionImpl(const DecoderConfig& c, int64_t idx)
    : nn::AttentionHook(c.num_attention_heads, c.num_key_value_heads, c.layer_window.at(idx)), layer_idx(idx),
      head_dim(c.head_dim), output_gate(c.attn_output_gate), zero_centered(c.zero_centered_norm) {
  q_proj = register_module("q_proj", linear(c.hidden_size, heads * head_dim * (output_gate ? 2 : 1), c.q_bias));
  k_proj = register_module("k_proj", linear(c.hidden_size, kv_heads * head_dim, c.k_bias));
  v_proj = register_module("v_proj", linear(c.hidden_size, kv_heads * head_dim, c.v_bias));
  o_proj = register_module("o_proj", linear(heads * head_dim, c.hidden_size, c.o_bias));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", nn::RMSNorm(head_dim, c.rms_norm_eps));
    k_norm = register_module("k_norm", nn::RMSNorm(head_dim, c.rms_norm_eps));
  }
  if (c.qk_norm_whole) {
    qk_norm_whole = true;
    q_norm = register_module("q_norm", nn::RMSNorm(heads * head_dim, c.rms_norm_eps));
    k_norm = register_module("k_norm", nn::RMSNorm(kv_heads * head_dim, c.rms_norm_eps));
  }
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  nn::KVCache* cache, const at::Tensor& segment_ids) {
  at::Tensor q = q_proj->forward(x);
  // b, t from the projection (a sequence-parallel input_fn gathers the sequence: t can exceed x.size(1)).
  const int64_t b = q.size(0), t = q.size(1);
  at::Tensor gate;
  if (output_gate) {
    at::Tensor qg = q.view({b, t, heads, 2 * head_dim});
    gate = qg.narrow(3, head_dim, head_dim).reshape({b, t, heads * head_dim});
    q = qg.narrow(3, 0, head_dim);
  }
  at::Tensor k = k_proj->forward(x);
  if (qk_norm_whole) {
    q = q_norm->forward(q);
    k = k_norm->forward(k);
  }
  q = q.view({b, t, heads, head_dim});
  k = k.view({b, t, kv_heads, head_dim});
  at::Tensor v = v_proj->forward(x).view({b, t, kv_heads, head_dim}).transpose(1, 2);
  if (q_norm && !qk_norm_whole) {
    q = apply_norm(q_norm, q, zero_centered);
    k = apply_norm(k_norm, k, zero_centered);
  }
  q = nn::apply_rotary(q.transpose(1, 2), cos, sin);
  k = nn::apply_rotary(k.transpose(1, 2), cos, sin);
  int64_t offset = 0;
  if (cache) {
    offset = cache->keys[layer_idx].defined() ? cache->keys[layer_idx].size(2) : 0;
    std::tie(k, v) = cache->append(static_cast<size_t>(layer_idx), k, v);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  at::Tensor o = attend(q, k, v, offset, scale, segment_ids);
  if (output_gate) return o_proj->forward(o.transpose(1, 2).reshape({b, t, heads * head_dim}) * at::sigmoid(gate));
  return o_proj->forward(o.transpose(1, 2).reshape({b, t, heads * head_dim}));
}

MLPImpl::MLPImpl(const DecoderConfig& c) : act(c.hidden_act) {
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size, c.mlp_bias));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  at::Tensor g = gate_proj->forward(x);
  if (act == "silu") return down_proj->forward(kernels::swiglu(g, up_proj->forward(x)));  // fused silu(g) * u
  if (act == "gelu_pytorch_tanh") return down_proj->forward(kernels::geglu_tanh(g, up_proj->forward(x)));
  if (act == "gelu") g = at::gelu(g);
  else g = at::relu(g);
  return down_proj->forward(g * up_proj->forward(x));
}

DecoderLayerImpl::DecoderLayerImpl(const DecoderConfig& c, int64_t idx) {
  if (c.is_linear_layer(idx) && DecoderConfig::kda_family(c.model_type)) kda = register_module("self_attn", KimiDeltaAttention(c, idx));
  else if (c.is_linear_layer(idx)) linear_attn = register_module("linear_attn", GatedDeltaNet(c, idx));
  else if (c.mla) mla = register_module("self_attn", MLA(c, idx));
  else self_attn = register_module("self_attn", Attention(c, idx));
  if (c.is_moe_layer(idx)) moe = register_module(c.moe_module_name, nn::MoE(moe_options(c)));
  else mlp = register_module("mlp", MLP(c));
  if (moe && c.shared_expert_intermediate_size > 0) {
    shared_expert = moe->register_module("shared_expert", nn::SharedExpert(c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act));
    shared_expert_gate = moe->register_module("shared_expert_gate", linear(c.hidden_size, 1, false));
  }
  input_layernorm = register_module("input_layernorm", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  zero_centered = c.zero_centered_norm;
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                     nn::KVCache* cache, const at::Tensor& segment_ids, const at::Tensor& q_scale) {
  at::Tensor a = apply_norm(input_layernorm, x, zero_centered);
  at::Tensor attn = linear_attn ? linear_attn->forward(a, cache, segment_ids)
                    : kda       ? kda->forward(a, cache, segment_ids)
                    : mla       ? mla->forward(a, cos, sin, cache, segment_ids, q_scale)
                                : self_attn->forward(a, cos, sin, cache, segment_ids);
  at::Tensor h, n;
  if (attn.scalar_type() == x.scalar_type() && attn.sizes() == x.sizes()) {  // fused residual add + RMSNorm
    std::tie(h, n) = kernels::add_rms_norm(attn, x, norm_scale(post_attention_layernorm, zero_centered), post_attention_layernorm->eps);
  } else {
    h = x + attn;
    n = apply_norm(post_attention_layernorm, h, zero_centered);
  }
  if (shared_expert) return h + (moe->forward(n) + at::sigmoid(shared_expert_gate->forward(n)) * shared_expert->forward(n));
  return h + (moe ? moe->forward(n) : mlp->forward(n));
}

DecoderModelImpl::DecoderModelImpl(const DecoderConfig& c) {
  auto eopts = torch::nn::EmbeddingOptions(c.vocab_size, c.hidden_size);
  if (c.pad_token_id) eopts.padding_idx(*c.pad_token_id);
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(eopts));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.deepseek_v4) layers->push_back(V4DecoderLayer(c, i));
    else layers->push_back(DecoderLayer(c, i));
  }
  link_dsa_layers(layers, c);  // GLM-5's shared sparse-attention layers read an earlier layer's selection (dsa.h)
  norm = register_module("norm", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (c.deepseek_v4) hc_head = register_module("hc_head", V4HyperConnection(c, true).ptr());
}

CausalLMImpl::CausalLMImpl(DecoderConfig c) : config_(std::move(c)), rotary_(rope_spec(config_)) {
  router_aux_loss_coef_ = config_.router_aux_loss_coef;
  model = register_module("model", DecoderModel(config_));
  if (config_.deepseek_v4) v4_rotary_ = std::make_shared<V4Rotary>(config_);
  if (!config_.tie_word_embeddings) lm_head = register_module("lm_head", linear(config_.hidden_size, config_.vocab_size, false));
  if (mtp_layers_declared(config_) > 0) mtp_ = register_module("mtp", std::make_shared<MtpImpl>(config_));  // mtp.h
  if (config_.zero_centered_norm) zero_centered_norms_to_zero();
}

void CausalLMImpl::zero_centered_norms_to_zero() {
  at::NoGradGuard no_grad;
  for (auto& item : named_parameters())
    if (item.key().ends_with("norm.weight") && item.key().find("linear_attn.") == std::string::npos) item.value().zero_();
}

void CausalLMImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, dtype, non_blocking);
  rotary_.to(device);
  if (v4_rotary_) v4_rotary_->to(device);
}

void CausalLMImpl::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  rotary_.to(device);
  if (v4_rotary_) v4_rotary_->to(device);
}

at::Tensor CausalLMImpl::hidden_states(const at::Tensor& input_ids, const at::Tensor& position_ids_in,
                                       nn::KVCache* cache, const at::Tensor& segment_ids) {
  if (config_.deepseek_v4) {
    return v4_hidden_states(input_ids, position_ids_in, cache, segment_ids);
  }
  at::Tensor position_ids = position_ids_in;
  if (!position_ids.defined()) {
    int64_t past = cache ? cache->length() : 0;
    position_ids = at::arange(past, past + input_ids.size(1), input_ids.options().dtype(at::kLong))
                       .unsqueeze(0).expand({input_ids.size(0), input_ids.size(1)});
  }
  return hidden_states_from(embed(input_ids), position_ids, cache, segment_ids);
}

at::Tensor CausalLMImpl::hidden_states_from(at::Tensor h, const at::Tensor& position_ids_in, nn::KVCache* cache,
                                            const at::Tensor& segment_ids) {
  at::Tensor position_ids = position_ids_in;
  if (!position_ids.defined()) {
    int64_t past = cache ? cache->length() : 0;
    position_ids = at::arange(past, past + h.size(1), h.options().dtype(at::kLong)).unsqueeze(0).expand({h.size(0), h.size(1)});
  }
  auto [cos, sin] = rotary(position_ids, h.scalar_type());
  h = run_layers(h, cos, sin, 0, config_.num_hidden_layers, cache, segment_ids, query_scale(position_ids, h.scalar_type()));
  return final_norm(h);
}

at::Tensor CausalLMImpl::embed(const at::Tensor& input_ids) {
  return embed_fn ? embed_fn(input_ids) : model->embed_tokens->forward(input_ids);
}

std::pair<at::Tensor, at::Tensor> CausalLMImpl::rotary(const at::Tensor& position_ids, at::ScalarType dtype) const {
  auto [cos, sin] = rotary_.cos_sin(position_ids);
  return {cos.to(dtype), sin.to(dtype)};
}

at::Tensor CausalLMImpl::run_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, int64_t begin,
                                    int64_t end, nn::KVCache* cache, const at::Tensor& segment_ids,
                                    const at::Tensor& q_scale) {
  if (!cache) {
    Batch in{{"cos", cos}, {"sin", sin}, {"segment_ids", segment_ids}};
    if (q_scale.defined()) in.set("q_scale", q_scale);
    return run_blocks(in, h, begin, end);
  }
  for (int64_t i = begin; i < end; ++i)
    h = (*model->layers)[static_cast<size_t>(i)]->as<DecoderLayerImpl>()->forward(h, cos, sin, cache, segment_ids, q_scale);
  return h;
}

at::Tensor CausalLMImpl::query_scale(const at::Tensor& position_ids, at::ScalarType dtype) const {
  if (config_.llama4_scaling_original <= 0) return {};
  // as transformers: float32 division of the positions, floor, log; then the query's dtype
  at::Tensor p = position_ids.to(at::kFloat) / static_cast<double>(config_.llama4_scaling_original);
  return (1.0 + config_.llama4_scaling_beta * at::log(1.0 + at::floor(p))).to(dtype);
}

std::vector<std::pair<int64_t, nn::MoEImpl*>> CausalLMImpl::moe_layers() const {
  std::vector<std::pair<int64_t, nn::MoEImpl*>> out;
  for (size_t i = 0; i < model->layers->size(); ++i) {
    if (auto* v4 = model->layers->ptr(i)->as<V4DecoderLayerImpl>()) {  // DeepSeek-V4: every layer's routed MoE
      out.emplace_back(static_cast<int64_t>(i), v4->mlp.get());
      continue;
    }
    auto* l = model->layers->ptr(i)->as<DecoderLayerImpl>();
    if (l && l->moe) out.emplace_back(static_cast<int64_t>(i), l->moe.get());
  }
  return out;
}

std::vector<CheckpointTensor> CausalLMImpl::checkpoint_tensors() const {
  if (config_.deepseek_v4) return v4_checkpoint_tensors(*this, config_);
  std::vector<CheckpointTensor> out;
  const DecoderConfig& c = config_;
  const auto& m = *this;
  const bool mixtral = c.model_type == "mixtral" || c.model_type == "minimax_m2" || c.model_type == "kimi_linear";  // w1 / w3 / w2
  const int64_t f = c.moe_intermediate_size;
  for (const auto& item : m.named_parameters()) {
    const std::string& name = item.key();
    const std::string stem = ".experts.gate_up_proj", down = ".experts.down_proj";
    const bool is_gu = name.ends_with(stem), is_down = name.ends_with(down);
    // the block's checkpoint name (Mixtral: "block_sparse_moe" for the in-memory "mlp")
    const std::string from = "." + c.moe_module_name + ".", to = "." + c.moe_checkpoint_name + ".";
    std::string ck = name;
    if (from != to && (is_gu || is_down || name.ends_with(from + "gate.weight") || (c.moe_checkpoint_all_mlps && ck.find(from) != std::string::npos)))
      ck.replace(ck.rfind(from), from.size(), to);
    if (DecoderConfig::kda_family(c.model_type)) {  // the forget gate's tensors directly under self_attn; q/k/v convs
      const std::string fg = ".self_attn.forget_gate.";
      if (const size_t p = ck.find(fg); p != std::string::npos) ck.replace(p, fg.size(), ".self_attn.");
      if (ck.ends_with(".self_attn.conv1d.weight")) {
        const std::string stem = ck.substr(0, ck.size() - std::string("conv1d.weight").size());
        const int64_t third = c.linear_num_value_heads * c.linear_value_head_dim;  // (the whole tensor's: a
                                                                                    // tensor-parallel rank holds less)
        for (int64_t i = 0; i < 3; ++i) out.push_back({stem + "qkv"[i] + "_conv1d.weight", name, -1, i * third, (i + 1) * third});
        continue;
      }
    }
    if ((!is_gu && !is_down) || c.moe_stacked_checkpoint) {  // Mistral 4: stacked experts under their own names
      out.push_back({ck, name});
      continue;
    }
    const std::string prefix = ck.substr(0, ck.size() - (is_gu ? stem.size() : down.size())) + ".experts.";
    // every expert of the config (a rank's expert-parallel slice of the parameter holds only some of them)
    const int64_t experts = c.num_experts > 0 ? c.num_experts : item.value().size(0);
    for (int64_t e = 0; e < experts; ++e) {
      const std::string p = prefix + std::to_string(e) + ".";
      if (is_gu) {
        out.push_back({p + (mixtral ? "w1" : "gate_proj") + ".weight", name, e, 0, f});
        out.push_back({p + (mixtral ? "w3" : "up_proj") + ".weight", name, e, f, 2 * f});
      } else {
        out.push_back({p + (mixtral ? "w2" : "down_proj") + ".weight", name, e, 0, c.hidden_size});
      }
    }
  }
  for (const auto& item : m.named_buffers()) {
    if (!item.key().ends_with("e_score_correction_bias")) continue;
    std::string ck = item.key();
    if (c.moe_checkpoint_all_mlps) {  // Kimi Linear: <block_sparse_moe>.gate.e_score_correction_bias
      const std::string from = "." + c.moe_module_name + ".", to = "." + c.moe_checkpoint_name + ".";
      ck.replace(ck.rfind(from), from.size(), to);
    }
    if (c.moe_bias_on_block) {  // MiniMax-M2: the block's bias, <block>.e_score_correction_bias
      const std::string in = "." + c.moe_module_name + ".gate.", to = "." + c.moe_checkpoint_name + ".";
      ck.replace(ck.rfind(in), in.size(), to);
    }
    out.push_back({ck, item.key(), -1, 0, 0, true});
  }
  for (auto& e : out) e.name = mtp_checkpoint_name(e.name, c);  // MTP layers (mtp.h)
  return out;
}

at::Tensor CausalLMImpl::final_norm(const at::Tensor& h) {
  if (model->hc_head) return model->norm->forward(model->hc_head->as<V4HyperConnectionImpl>()->collapse(h));
  return apply_norm(model->norm, h, config_.zero_centered_norm);
}

at::Tensor CausalLMImpl::v4_hidden_states(const at::Tensor& ids, const at::Tensor& position_ids, nn::KVCache* cache,
                                          const at::Tensor& segment_ids) {
  at::Tensor pos = position_ids;
  if (cache) {  // generation: ids go on from the cached ones (positions too); each layer's state grows by them
    v4_cache_reserve(*cache, config_.num_hidden_layers);
    at::Tensor& held = cache->keys.at(0);  // the ids so far [B,1,T]: KVCache::length()
    const int64_t past = held.defined() ? held.size(2) : 0;
    held = past ? at::cat({held, ids.unsqueeze(1)}, 2) : ids.unsqueeze(1);
    pos = at::arange(past, past + ids.size(1), ids.options()).unsqueeze(0).expand({ids.size(0), ids.size(1)});
  }
  if (!pos.defined()) pos = at::arange(ids.size(1), ids.options()).unsqueeze(0).expand({ids.size(0), ids.size(1)});
  at::Tensor h = embed(ids);
  h = h.unsqueeze(2).expand({h.size(0), h.size(1), config_.hc_mult, h.size(2)}).contiguous();
  Batch in = v4_block_inputs(*v4_rotary_, ids, pos, h.scalar_type(), segment_ids);
  if (!cache) h = run_blocks(in, h, 0, config_.num_hidden_layers);
  else
    for (int64_t i = 0; i < config_.num_hidden_layers; ++i) h = block_forward(in, h, i, cache);
  return final_norm(h);
}

at::Tensor CausalLMImpl::output_weight() const {
  return lm_head ? lm_head->weight : model->embed_tokens->weight;
}

at::Tensor CausalLMImpl::logits(const at::Tensor& hidden) {
  return lm_head ? lm_head->forward(hidden) : at::linear(hidden, model->embed_tokens->weight);
}

}  // namespace lf::models::llama

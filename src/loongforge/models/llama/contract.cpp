// The decoder LM's side of the model contract (models/model.h): batches, losses, FLOPs, how it splits (blocks,
// tensor-parallel plan, attention and MoE modules), and its registry entry.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/kernels/linear_ce.h"
#include "loongforge/models/llama/deepseek_v4.h"
#include "loongforge/models/llama/family.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/models/llama/mtp.h"
#include "loongforge/nn/loss.h"

namespace lf::models::llama {

namespace {

nlohmann::json describe(const DecoderConfig& c) {
  return {{"family", "decoder_lm"},
          {"model_type", c.model_type},
          {"parameters", c.num_parameters()},
          {"layers", c.num_hidden_layers},
          {"hidden_size", c.hidden_size},
          {"heads", c.num_attention_heads},
          {"kv_heads", c.num_key_value_heads},
          {"head_dim", c.head_dim},
          {"vocab_size", c.vocab_size},
          {"tied_embeddings", c.tie_word_embeddings},
          {"rope", c.rope.type},
          {"active_parameters", c.num_active_parameters()},
          {"train_flops_per_token_excl_attention", 6 * c.num_active_parameters()}};
}

// A [B,T] int64 tensor of a dump batch (the shape of `like` when given).
at::Tensor batch_tensor(const std::map<std::string, at::Tensor>& batch, const std::string& file, const std::string& name,
                        const at::Tensor& like = {}) {
  auto it = batch.find(name);
  if (it == batch.end()) throw file_error(file, name, "missing");
  const at::Tensor& t = it->second;
  if (t.scalar_type() != at::kLong || t.dim() != 2)
    throw file_error(file, name, "expected int64 [B,T], got " + std::string(c10::toString(t.scalar_type())) + " with " +
                                     std::to_string(t.dim()) + " dims");
  if (like.defined() && t.sizes() != like.sizes()) throw file_error(file, name, "shape differs from input_ids");
  return t;
}

}  // namespace

Model::ReferenceOutput CausalLMImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                      const std::string& file) {
  at::Tensor ids = batch_tensor(batch, file, "input_ids");
  at::Tensor labels = batch.count("labels") ? batch_tensor(batch, file, "labels", ids) : ids;
  const int64_t vocab = config_.vocab_size;
  if (ids.numel() && (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= vocab))
    throw file_error(file, "input_ids", "ids must lie in [0, " + std::to_string(vocab) + ")");
  const at::Tensor h = hidden_states(ids);
  at::Tensor lg = logits(h);
  ReferenceOutput out{{{"logits", lg}}, nn::causal_lm_loss(lg, labels)};  // transformers' causal-LM loss: shifted inside
  // DeepSeek-V4 with output_router_logits: + router_aux_loss_coef x load_balancing_loss_func over its top-k routers
  // (the config's coefficient is 0 otherwise), as transformers adds it to the loss
  if (config_.deepseek_v4 && at::GradMode::is_enabled())
    if (const at::Tensor a = aux_loss(); a.defined()) out.loss = out.loss + a.to(out.loss.scalar_type());
  if ((indexer_loss_coef_ > 0 || (mtp_ && mtp_loss_weight_ > 0)) && at::GradMode::is_enabled()) {
    // trained extra parts: their summed losses over the counted tokens, as a training step weighs them
    const at::Tensor targets = at::cat({labels.narrow(1, 1, labels.size(1) - 1),
                                        at::full({labels.size(0), 1}, nn::kIgnoreIndex, labels.options())}, 1);
    const double terms = std::max<double>(static_cast<double>((targets != nn::kIgnoreIndex).sum().item<int64_t>()), 1);
    if (at::Tensor kl = take_indexer_kl(); kl.defined())  // DeepSeek sparse attention's indexer KL terms (dsa.h)
      out.loss = out.loss + kl.to(out.loss.scalar_type()) / terms;
    if (mtp_ && mtp_loss_weight_ > 0)  // the multi-token prediction loss (mtp.h)
      out.loss = out.loss + mtp_loss_part(h, Batch{{"input_ids", ids}, {"targets", targets}}).to(out.loss.scalar_type()) / terms;
  }
  add_mtp_outputs(*this, ids, out.outputs);  // mtp_logits.k when the model has MTP layers (mtp.h)
  take_indexer_kl();  // that forward's terms are not part of the loss
  return out;
}

// transformers' _init_weights for these models: normal(0, std) for Linear and Embedding (padding row zero), zeros
// for biases, ones for norms.
void CausalLMImpl::init_weights(double std) {
  if (std < 0) std = config_.raw.value("initializer_range", 0.02);
  at::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& n = item.key();
    at::Tensor& p = item.value();
    if (n.find("norm.weight") != std::string::npos) p.fill_(1.0);
    else if (n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0) p.zero_();
    else p.normal_(0.0, std);
  }
  if (config_.pad_token_id) model->embed_tokens->weight[*config_.pad_token_id].zero_();
  // Qwen3-Next / Qwen3.5: zero-centred norms start at 0; linear attention's dt_bias at 1 and A_log = log U(0.01, 16)
  if (config_.zero_centered_norm) zero_centered_norms_to_zero();
  if (config_.deepseek_v4) v4_init_weights(*this);  // sinks, hyper-connection bases / scales, position biases
  for (auto& item : named_modules()) {
    if (auto* la = item.value()->as<GatedDeltaNetImpl>()) {
      la->dt_bias.fill_(1.0);
      la->A_log.uniform_(0.01, 16.0).log_();
    }
    // Kimi Linear (FLA's initialisation, as transformers): A_log = log U(1, 16); dt_bias = softplus^-1(dt) with
    // dt = exp(U(log 1e-3, log 1e-1)), at least 1e-4
    if (auto* fg = item.value()->as<KdaForgetGateImpl>()) {
      fg->A_log.uniform_(1.0, 16.0).log_();
      at::Tensor dt = fg->dt_bias.uniform_(std::log(1e-3), std::log(1e-1)).exp().clamp_min(1e-4);
      fg->dt_bias.copy_(dt + at::log(-at::expm1(-dt)));
    }
  }
}

BatchSchema CausalLMImpl::batch_schema() const {
  auto field = [](const char* name, bool required, bool positions, const char* doc) {
    BatchField f;
    f.name = name;
    f.required = required;
    f.sequence = true;
    f.positions = positions;
    f.doc = doc;
    return f;
  };
  return {field("input_ids", true, false, "token ids [B,T]"),
          field("targets", true, false, "the token each position predicts (shifted), -100 not counted"),
          field("position_ids", false, true, "positions [B,T] (absent: 0..T-1)"),
          field("segment_ids", false, false, "packed documents [B,T]: attention stays within a document")};
}

int64_t CausalLMImpl::loss_terms(const Batch& b) const { return (b.at("targets") != nn::kIgnoreIndex).sum().item<int64_t>(); }

double CausalLMImpl::train_flops_per_sample(int64_t seq) const {
  const DecoderConfig& c = config_;
  const double s = static_cast<double>(seq);
  // 6 x the parameters a token goes through (MoE: its top_k experts) + the attention products.
  const double per_token = 6.0 * static_cast<double>(c.num_active_parameters()) +
                           12.0 * static_cast<double>(c.num_hidden_layers * c.num_attention_heads * c.head_dim) * s;
  return per_token * s;
}

at::Tensor CausalLMImpl::embed(const Batch& b) {
  at::Tensor h = embed(b.at("input_ids"));
  if (!config_.deepseek_v4) return h;
  return h.unsqueeze(2).expand({h.size(0), h.size(1), config_.hc_mult, h.size(2)}).contiguous();  // the hc streams
}

Batch CausalLMImpl::block_inputs(const Batch& b, at::ScalarType dtype) const {
  at::Tensor pos = b.get("position_ids");
  if (!pos.defined()) {
    const at::Tensor& ids = b.at("input_ids");
    pos = at::arange(ids.size(1), ids.options().dtype(at::kLong)).unsqueeze(0).expand({ids.size(0), ids.size(1)});
  }
  if (config_.deepseek_v4) {
    return v4_block_inputs(*v4_rotary_, b.at("input_ids"), pos, dtype, b.get("segment_ids"));
  }
  auto [cos, sin] = rotary(pos, dtype);
  Batch in{{"cos", cos}, {"sin", sin}, {"segment_ids", b.get("segment_ids")}};
  if (at::Tensor s = query_scale(pos, dtype); s.defined()) in.set("q_scale", s);  // Mistral 4
  return in;
}

at::Tensor CausalLMImpl::block_forward(const Batch& in, const at::Tensor& h, int64_t i) {
  return block_forward(in, h, i, nullptr);
}

at::Tensor CausalLMImpl::block_forward(const Batch& in, const at::Tensor& h, int64_t i, nn::KVCache* cache) {
  if (config_.deepseek_v4) return (*model->layers)[static_cast<size_t>(i)]->as<V4DecoderLayerImpl>()->forward(h, in, *v4_rotary_, cache);
  return (*model->layers)[static_cast<size_t>(i)]->as<DecoderLayerImpl>()->forward(h, in.at("cos"), in.at("sin"),
                                                                                  cache, in.get("segment_ids"), in.get("q_scale"));
}

at::Tensor CausalLMImpl::main_head_loss_sum(const at::Tensor& hidden, const Batch& b) {
  const at::Tensor& targets = b.at("targets");
  if (vocab_loss_fn) return vocab_loss_fn(hidden, output_weight(), targets);
  // The fused linear + cross-entropy (no [N, V] logits kept) computes what logits + cross_entropy compute, as long
  // as nothing hooks lm_head (LoRA adapter, layout input/output functions) and it has no bias. Below 1M logits the
  // composite version costs next to nothing, and staying on it keeps tiny runs bitwise equal to `dump` (the fused
  // one rounds differently: the gradient is scaled after the GEMMs).
  const auto& head = lm_head;
  const bool large = targets.numel() * output_weight().size(0) >= (int64_t(1) << 20);
  if (large && (!head || (!head->adapter && !head->input_fn && !head->output_fn && !head->bias.defined()))) {
    at::Tensor h = hidden, w = output_weight();
    const auto dev_type = h.device().type();
    if (at::autocast::is_autocast_enabled(dev_type)) {  // bf16 GEMMs as autocast would run them, softmax in float32
      const auto dt = at::autocast::get_autocast_dtype(dev_type);
      h = h.to(dt);
      w = w.to(dt);
    }
    return std::get<0>(kernels::linear_cross_entropy(h, w, targets, nn::kIgnoreIndex));
  }
  return nn::token_loss_sum(logits(hidden), targets);
}

Split CausalLMImpl::split() const {
  Split s;
  s.pre = {"model.embed_tokens"};
  s.blocks = "model.layers";
  s.post = {"model.norm"};
  if (model->hc_head) s.post.insert(s.post.begin(), "model.hc_head");
  if (lm_head) s.post.push_back("lm_head");
  else s.tied = {"model.embed_tokens.weight"};
  return s;
}

TensorParallelSpec CausalLMImpl::tensor_parallel_spec() const {
  const DecoderConfig& c = config_;
  // (asked for only when parallel.tp > 1)
  TensorParallelSpec t;
  const std::string L = R"(model\.layers\.\d+\.)";
  // every family: vocabulary-parallel embedding and head; MoE shared experts inside the MoE block's region (its entry
  // and exit: parallel/tensor_parallel.h)
  const std::vector<TpRule> vocab = {{"model.embed_tokens", TpStyle::VocabEmbedding}, {"lm_head", TpStyle::VocabHead}};
  const std::vector<TpRule> shared_experts = {
      {L + R"(\w+\.shared_experts\.(gate_proj|up_proj))", TpStyle::ColwiseInside},
      {L + R"(\w+\.shared_experts\.down_proj)", TpStyle::RowwiseInside}};
  if (c.deepseek_v4) {
    // DeepSeek-V4: query heads split, with their sinks and their groups of the grouped output projection; the query
    // latent, the one shared key/value head and the compressors' entries stay whole (their outputs feed every head:
    // partial gradients, summed); the lightning indexers whole on every rank, which all make the same selection (no
    // gradient reaches them); hyper-connections and norms outside the regions replicated; the MoE as every family's.
    t.rules = vocab;
    t.rules.insert(t.rules.end(), {
        {L + R"(self_attn\.(q_a_proj|kv_proj))", TpStyle::ReplicatedEntry},
        {L + R"(self_attn\.(q_a_norm|kv_norm))", TpStyle::ReplicatedInside},
        {L + R"(self_attn\.(q_b_proj|o_a_proj))", TpStyle::ColwiseInside},
        {L + R"(self_attn\.o_b_proj)", TpStyle::Rowwise},
        {L + R"(self_attn)", TpStyle::ShardedInside},  // sinks [heads]
        {L + R"(self_attn\.compressor\.indexer\.(kv_proj|gate_proj|scorer\.weights_proj))", TpStyle::WholeEntry},
        {L + R"(self_attn\.compressor\.indexer)", TpStyle::ReplicatedWhole},
        {L + R"(self_attn\.compressor\.(kv_proj|gate_proj))", TpStyle::ReplicatedEntry},
        {L + R"(self_attn\.compressor(\.kv_norm)?)", TpStyle::ReplicatedInside},  // position_bias, kv_norm
    });
    t.rules.insert(t.rules.end(), shared_experts.begin(), shared_experts.end());
    t.divisible = {{"num_attention_heads", c.num_attention_heads}, {"o_groups", c.o_groups},
                   {"moe_intermediate_size", c.moe_intermediate_size}};
    return t;
  }
  t.rules = vocab;
  t.rules.insert(t.rules.end(), {
      // attention (MHA/GQA): heads split
      {L + R"(self_attn\.[qkv]_proj)", TpStyle::Colwise},
      {L + R"(self_attn\.[qk]_norm)", TpStyle::ReplicatedInside},
      // multi-head latent attention: the latent projections stay whole (their outputs feed every head), the
      // per-head up-projections split
      {L + R"(self_attn\.(q_a_proj|kv_a_proj_with_mqa))", TpStyle::ReplicatedEntry},
      {L + R"(self_attn\.(q_a_layernorm|kv_a_layernorm))", TpStyle::ReplicatedInside},
      {L + R"(self_attn\.(q_b_proj|kv_b_proj))", TpStyle::ColwiseInside},
      {L + R"(self_attn\.o_proj)", TpStyle::Rowwise},
      // DeepSeek sparse attention's indexer (dsa.h): whole on every rank, which all make the same top-k selection
      // from the whole hidden states (wk, weights_proj: an entry, the sequence gathered under sp) and the whole query
      // latent; its KL loss (if trained) is the same on every rank too, so its gradients are complete, never summed
      {L + R"(self_attn\.indexer\.(wk|weights_proj))", TpStyle::WholeEntry},
      {L + R"(self_attn\.indexer)", TpStyle::ReplicatedWhole},
      // dense MLP
      {L + R"(mlp\.(gate_proj|up_proj))", TpStyle::Colwise},
      {L + R"(mlp\.down_proj)", TpStyle::Rowwise},
  });
  t.rules.insert(t.rules.end(), shared_experts.begin(), shared_experts.end());
  // Gated DeltaNet (linear attention): heads split; the [q | k | v] channels of the fused projection and of the
  // depthwise convolution as three blocks (Qwen3-Next's in_proj_qkvz / in_proj_ba are packed per key head already).
  if (DecoderConfig::gated_deltanet_family(c.model_type) && std::count(c.layer_linear.begin(), c.layer_linear.end(), 1) > 0) {
    const int64_t kd = c.linear_num_key_heads * c.linear_key_head_dim, vd = c.linear_num_value_heads * c.linear_value_head_dim;
    t.rules.push_back({L + R"(linear_attn\.in_proj_qkv)", TpStyle::Colwise, {kd, kd, vd}});
    t.rules.push_back({L + R"(linear_attn\.in_proj_(qkvz|ba|z|b|a))", TpStyle::Colwise});
    t.rules.push_back({L + R"(linear_attn\.conv1d)", TpStyle::ShardedInside, {kd, kd, vd}});
    t.rules.push_back({L + R"(linear_attn)", TpStyle::ShardedInside});  // dt_bias, A_log [value heads]
    t.rules.push_back({L + R"(linear_attn\.norm)", TpStyle::ReplicatedInside});
    t.rules.push_back({L + R"(linear_attn\.out_proj)", TpStyle::Rowwise});
    t.divisible.push_back({"linear_num_key_heads", c.linear_num_key_heads});
  }
  // KDA (Kimi Linear's linear attention, under self_attn): heads split as Gated DeltaNet's (q/k/v and o_proj by the
  // attention rules above); the low-rank forget-gate and output-gate entries stay whole, their up-projections split
  // by heads; the forget gate's dt_bias [H D] and A_log [1, 1, H, 1] by heads.
  if (DecoderConfig::kda_family(c.model_type) && std::count(c.layer_linear.begin(), c.layer_linear.end(), 1) > 0) {
    const int64_t hd = c.linear_num_value_heads * c.linear_value_head_dim;
    t.rules.push_back({L + R"(self_attn\.b_proj)", TpStyle::Colwise});
    t.rules.push_back({L + R"(self_attn\.(forget_gate\.f_a_proj|g_a_proj))", TpStyle::ReplicatedEntry});
    t.rules.push_back({L + R"(self_attn\.(forget_gate\.f_b_proj|g_b_proj))", TpStyle::ColwiseInside});
    t.rules.push_back({L + R"(self_attn\.conv1d)", TpStyle::ShardedInside, {hd, hd, hd}});
    t.rules.push_back({L + R"(self_attn\.forget_gate)", TpStyle::ShardedInside});
    t.rules.push_back({L + R"(self_attn\.o_norm)", TpStyle::ReplicatedInside});
    t.divisible.push_back({"linear_attn_config.num_heads", c.linear_num_value_heads});
  }
  t.divisible.insert(t.divisible.begin(), {"num_attention_heads", c.num_attention_heads});
  // MiniMax-M2's q/k norms span all heads of the projection: its attention does not split (tp must be 1)
  if (c.qk_norm_whole) t.divisible.push_back({"the whole-projection q/k norms of minimax_m2 (tp must be 1):", 1});
  if (!c.mla) t.divisible.push_back({"num_key_value_heads", c.num_key_value_heads});
  bool dense = false, moe = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) (c.is_moe_layer(i) ? moe : dense) = true;
  if (dense) t.divisible.push_back({"intermediate_size", c.intermediate_size});
  // (the vocabulary needs no such care: tensor parallelism pads it, parallel/tensor_parallel.h)
  if (moe) t.divisible.push_back({"moe_intermediate_size", c.moe_intermediate_size});
  return t;
}

std::vector<nn::AttentionHook*> CausalLMImpl::attention_modules() {
  std::vector<nn::AttentionHook*> out;
  for (auto& m : *model->layers) {
    if (auto* v4 = m->as<V4DecoderLayerImpl>()) {  // (its window refuses context parallelism)
      out.push_back(v4->self_attn.get());
      continue;
    }
    auto* l = m->as<DecoderLayerImpl>();
    if (l->mla) out.push_back(l->mla.get());
    else if (l->linear_attn) out.push_back(l->linear_attn.get());  // refuses an attention_fn (context parallelism)
    else if (l->kda) out.push_back(l->kda.get());                  // the same
    else out.push_back(l->self_attn.get());
  }
  return out;
}

std::string CausalLMImpl::cuda_graph_blocker() const {
  if (config_.deepseek_v4) return "deepseek_v4's experts are picked on the host each step";
  if (!moe_layers().empty())
    return "a mixture-of-experts step cannot be captured (the tokens per expert reach the host each step)";
  if (config_.rope.type == "dynamic") return "rope_scaling 'dynamic' reads the longest position on the host each step";
  return "";
}

std::string CausalLMImpl::reference_name(const std::string& n) const {
  if (config_.deepseek_v4) {  // the in-memory name the checkpoint name comes from
    for (const auto& e : checkpoint_tensors())
      if (e.name == n) return e.param;
    return n;
  }
  const std::string from = "." + config_.moe_checkpoint_name + ".", to = "." + config_.moe_module_name + ".";
  std::string out = n;
  if (const size_t p = out.find(from); from != to && p != std::string::npos) out = out.substr(0, p) + to + out.substr(p + from.size());
  if (DecoderConfig::kda_family(config_.model_type)) {  // KDA's checkpoint layout -> transformers' modules
    for (const char* leaf : {"f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"})
      if (out.ends_with(std::string(".self_attn.") + leaf)) return out.substr(0, out.size() - std::string(leaf).size()) + "forget_gate." + leaf;
    for (const char* conv : {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"})
      if (out.ends_with(std::string(".self_attn.") + conv)) return out.substr(0, out.size() - std::string(conv).size()) + "conv1d.weight";
  }
  return out;
}

bool CausalLMImpl::ignorable_checkpoint_tensor(const std::string& name) const {
  // DeepSeek-V3.2's and GLM-5's multi-token-prediction layers (model.layers.<num_hidden_layers + i>.*): transformers
  // skips them too (its MtpModel does not serve these families)
  if (config_.dsa && name.starts_with("model.layers.")) {
    const std::string rest = name.substr(13);
    const size_t dot = rest.find('.');
    if (dot != std::string::npos && dot > 0 && rest.substr(0, dot).find_first_not_of("0123456789") == std::string::npos &&
        std::stoll(rest.substr(0, dot)) >= config_.num_hidden_layers)
      return true;
  }
  // Qwen3-Next's MTP head when the config declares none (mtp_num_hidden_layers absent; transformers skips it too)
  if (!mtp_ && DecoderConfig::gated_deltanet_family(config_.model_type) && name.starts_with("mtp.")) return true;
  // DeepSeek-V4's multi-token-prediction layers (transformers ignores them too)
  if (config_.deepseek_v4 && (name.starts_with("mtp.") || name.find(".mtp.") != std::string::npos)) return true;
  // buffers older transformers versions saved; a tied checkpoint may still carry lm_head.weight
  return name.ends_with("rotary_emb.inv_freq") || (config_.tie_word_embeddings && name == "lm_head.weight") ||
         mtp_shared_copy(name, config_);  // DeepSeek's embedding / head copies beside the MTP layers (mtp.h)
}

Family family() {
  Family f;
  f.name = "decoder_lm";
  f.model_types = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "minimax_m2",
                   "mistral4"};
  for (const char* t : {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v32", "glm_moe_dsa", "kimi_linear", "deepseek_v4"})
    f.model_types.push_back(t);
  f.build = [](const nlohmann::json& j, const std::string& file) -> std::shared_ptr<Model> {
    return CausalLM(DecoderConfig::from_json(j, file)).ptr();
  };
  f.describe = [](const nlohmann::json& j, const std::string& file) { return describe(DecoderConfig::from_json(j, file)); };
  return f;
}

}  // namespace lf::models::llama

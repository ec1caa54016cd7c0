#include "loongforge/models/llama/config.h"

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/llama/deepseek_v4.h"
#include "loongforge/models/llama/dsa.h"

#include <algorithm>
#include <cmath>

namespace lf::models::llama {

using nlohmann::json;

RopeConfig parse_rope(const json& j, const std::string& file, int64_t max_pos) {
  JsonReader top(j, file);
  RopeConfig r;
  // transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; transformers 4 wrote rope_theta at the top
  // level and rope_scaling {type|rope_type, factor, ...}. The scaling block wins, as in transformers.
  std::string block;
  if (top.has("rope_scaling")) block = "rope_scaling";
  else if (top.has("rope_parameters")) block = "rope_parameters";
  r.theta = top.number("rope_theta", 10000.0);
  if (top.has("partial_rotary_factor")) {
    r.partial_rotary_factor = top.number("partial_rotary_factor");
    r.partial_rotary_field = "partial_rotary_factor";
  }
  if (block.empty()) return r;
  JsonReader rd = top.object(block);
  if (rd.has("partial_rotary_factor")) {  // the block's value wins, as transformers' standardisation
    r.partial_rotary_factor = rd.number("partial_rotary_factor");
    r.partial_rotary_field = block + ".partial_rotary_factor";
  }
  r.theta = rd.number("rope_theta", r.theta);
  r.type = rd.has("rope_type") ? rd.string("rope_type") : rd.string("type", std::string("default"));
  if (r.type == "mrope") r.type = "default";  // Qwen2-VL's older spelling (transformers reads it as default)
  if (rd.has("mrope_section")) r.mrope_section = rd.int_list("mrope_section");
  const std::string type_field = block + (rd.has("rope_type") ? ".rope_type" : ".type");
  if (r.type == "default") return r;
  if (r.type != "linear" && r.type != "dynamic" && r.type != "llama3" && r.type != "yarn")
    throw file_error(file, type_field, "unsupported rope type '" + r.type + "' (supported: default, linear, dynamic, llama3, yarn)");
  r.factor = rd.number("factor", r.type == "yarn" ? std::optional<double>(-1.0) : std::nullopt);
  if (r.type == "llama3" || r.type == "yarn") {
    // transformers: a top-level original_max_position_embeddings wins, else the block's, else max_position_embeddings
    if (top.has("original_max_position_embeddings")) r.original_max_position_embeddings = top.integer("original_max_position_embeddings");
    else r.original_max_position_embeddings = rd.integer("original_max_position_embeddings", max_pos);
  }
  if (r.type == "llama3") {
    r.low_freq_factor = rd.number("low_freq_factor");
    r.high_freq_factor = rd.number("high_freq_factor");
  }
  if (r.type == "yarn") {
    if (r.factor < 0) r.factor = static_cast<double>(max_pos) / static_cast<double>(r.original_max_position_embeddings);
    r.attention_factor = rd.opt_number("attention_factor");
    r.mscale = rd.opt_number("mscale");
    r.mscale_all_dim = rd.opt_number("mscale_all_dim");
    if (rd.has("beta_fast")) r.beta_fast = rd.number("beta_fast");
    if (rd.has("beta_slow")) r.beta_slow = rd.number("beta_slow");
    r.truncate = rd.boolean("truncate", true);
  }
  return r;
}

namespace {

// Mixture-of-experts fields of qwen3_moe and mixtral, with transformers' config defaults.
void parse_moe(const JsonReader& rd, DecoderConfig& c) {
  const std::string& file = rd.file();
  const int64_t layers = c.num_hidden_layers;
  c.layer_moe.assign(layers, 1);
  if (c.model_type == "qwen3_moe") {
    // transformers 5 writes num_local_experts (num_experts is its alias); older configs write num_experts
    c.num_experts = rd.has("num_local_experts") ? rd.integer("num_local_experts") : rd.integer("num_experts", 128);
    c.num_experts_per_tok = rd.integer("num_experts_per_tok", 8);
    c.moe_intermediate_size = rd.integer("moe_intermediate_size", 768);
    c.norm_topk_prob = rd.boolean("norm_topk_prob", false);
    c.router_aux_loss_coef = rd.number("router_aux_loss_coef", 0.001);
    const int64_t step = rd.integer("decoder_sparse_step", 1);
    if (step <= 0) throw file_error(file, "decoder_sparse_step", "must be positive, got " + std::to_string(step));
    std::vector<int64_t> dense = rd.int_list("mlp_only_layers");
    for (int64_t i : dense)
      if (i < 0 || i >= layers) throw file_error(file, "mlp_only_layers", "layer " + std::to_string(i) + " out of range");
    for (int64_t i = 0; i < layers; ++i) {
      bool only = std::find(dense.begin(), dense.end(), i) != dense.end();
      c.layer_moe[i] = (!only && c.num_experts > 0 && (i + 1) % step == 0) ? 1 : 0;
    }
    c.moe_module_name = "mlp";
  } else {  // mixtral: every layer, expert width intermediate_size, always renormalized top-k
    c.num_experts = rd.integer("num_local_experts", 8);
    c.num_experts_per_tok = rd.integer("num_experts_per_tok", 2);
    c.moe_intermediate_size = c.intermediate_size;
    c.norm_topk_prob = true;
    c.router_aux_loss_coef = rd.number("router_aux_loss_coef", 0.001);
    if (rd.has("router_jitter_noise") && rd.number("router_jitter_noise") != 0.0)
      throw file_error(file, "router_jitter_noise", "router jitter noise is not supported (must be 0)");
    c.moe_checkpoint_name = "block_sparse_moe";
  }
  const char* experts_field = c.model_type == "mixtral" || rd.has("num_local_experts") ? "num_local_experts" : "num_experts";
  if (c.num_experts < 0) throw file_error(file, experts_field, "must not be negative");
  if (c.num_experts > 0 && (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.num_experts))
    throw file_error(file, "num_experts_per_tok", "must be in [1, " + std::string(experts_field) + " = " +
                                                      std::to_string(c.num_experts) + "], got " + std::to_string(c.num_experts_per_tok));
  if (c.num_experts > 0 && c.moe_intermediate_size <= 0)
    throw file_error(file, c.model_type == "mixtral" ? "intermediate_size" : "moe_intermediate_size", "must be positive");
  if (c.num_experts == 0) c.layer_moe.assign(layers, 0);
}

// Defaults of the DeepSeek-style fields (latent attention, routed experts) where a family's transformers config
// differs from DeepseekV3Config's.
struct MlaMoeDefaults {
  int64_t q_lora_rank = 1536, kv_lora_rank = 512, qk_rope_head_dim = 64, qk_nope_head_dim = 128, v_head_dim = 128;
  int64_t first_k_dense_replace = 3, n_routed_experts = 256, num_experts_per_tok = 8, moe_intermediate_size = 2048;
  int64_t n_shared_experts = 1, n_group = 8, topk_group = 4;
  double routed_scaling_factor = 2.5;
  // Kimi Linear: its config writes the MoE fields under transformers' attribute-map aliases (num_experts,
  // num_experts_per_token, num_shared_experts, moe_renormalize, num_expert_group) and may list mlp_layer_types
  bool kimi_names = false;
};

void parse_routed_moe(const JsonReader& rd, DecoderConfig& c, const MlaMoeDefaults& d);
// GlmMoeDsaConfig's (GLM-5); DeepseekV32Config's are DeepseekV3Config's.
const MlaMoeDefaults kGlmMoeDsaDefaults{.q_lora_rank = 2048, .qk_nope_head_dim = 192, .v_head_dim = 256, .n_group = 1, .topk_group = 1};

// DeepSeek-V3 multi-head latent attention fields, with transformers' DeepseekV3Config defaults (d: another family's).
void parse_mla(const JsonReader& rd, DecoderConfig& c, const MlaMoeDefaults& d = {}) {
  const std::string& file = rd.file();
  c.mla = true;
  // q_lora_rank: null = a plain q_proj; absent = the default 1536.
  c.q_lora_rank = rd.json().contains("q_lora_rank") && rd.json().at("q_lora_rank").is_null() ? 0 : rd.integer("q_lora_rank", d.q_lora_rank);
  c.kv_lora_rank = rd.integer("kv_lora_rank", d.kv_lora_rank);
  c.qk_rope_head_dim = rd.integer("qk_rope_head_dim", d.qk_rope_head_dim);
  c.qk_nope_head_dim = rd.integer("qk_nope_head_dim", d.qk_nope_head_dim);
  c.v_head_dim = rd.integer("v_head_dim", d.v_head_dim);
  for (auto [k, v] : {std::pair{"q_lora_rank", c.q_lora_rank}, {"kv_lora_rank", c.kv_lora_rank},
                      {"qk_rope_head_dim", c.qk_rope_head_dim}, {"qk_nope_head_dim", c.qk_nope_head_dim},
                      {"v_head_dim", c.v_head_dim}})
    if (v < 0 || (v == 0 && std::string(k) != "q_lora_rank" && std::string(k) != "qk_nope_head_dim"))
      throw file_error(file, k, "must be positive, got " + std::to_string(v));
  if (c.qk_rope_head_dim % 2) throw file_error(file, "qk_rope_head_dim", "must be even, got " + std::to_string(c.qk_rope_head_dim));
  if (c.num_key_value_heads != c.num_attention_heads)
    throw file_error(file, "num_key_value_heads", "must equal num_attention_heads for " + c.model_type + " (latent attention expands keys per head), got " +
                                                      std::to_string(c.num_key_value_heads));
  c.head_dim = c.qk_rope_head_dim;
  c.rope_interleave = rd.boolean("rope_interleave", true);
  c.q_bias = c.k_bias = c.o_bias = rd.boolean("attention_bias", false);
  parse_routed_moe(rd, c, d);
}

// The DeepSeek-style mixture of experts (nn/moe.h): layers >= first_k_dense_replace; sigmoid scores, selection on
// scores + e_score_correction_bias among the topk_group best of n_group groups (the caller changes the scoring for
// families that differ), shared experts of n_shared_experts * moe_intermediate_size, weights times
// routed_scaling_factor. No auxiliary loss in transformers' forward.
void parse_routed_moe(const JsonReader& rd, DecoderConfig& c, const MlaMoeDefaults& d) {
  const std::string& file = rd.file();
  const auto str = [](int64_t v) { return std::to_string(v); };
  // the field as the file names it: Kimi Linear's alias unless the file has only the standard name
  const auto name = [&](const char* standard, const char* alias) -> std::string {
    return d.kimi_names && (rd.has(alias) || !rd.has(standard)) ? alias : standard;
  };
  const int64_t first_dense = rd.integer("first_k_dense_replace", d.first_k_dense_replace);
  if (first_dense < 0) throw file_error(file, "first_k_dense_replace", "must not be negative, got " + str(first_dense));
  // num_local_experts: the attribute-map alias of n_routed_experts (GLM-4-MoE, Mistral 4); Kimi Linear's
  // num_local_experts is itself aliased as num_experts
  const std::string experts_field = d.kimi_names ? name("num_local_experts", "num_experts")
                                    : rd.has("n_routed_experts") || !rd.has("num_local_experts") ? "n_routed_experts"
                                                                                                 : "num_local_experts";
  c.num_experts = rd.integer(experts_field, d.n_routed_experts);
  const std::string per_tok = name("num_experts_per_tok", "num_experts_per_token"), groups = name("n_group", "num_expert_group");
  c.num_experts_per_tok = rd.integer(per_tok, d.num_experts_per_tok);
  c.moe_intermediate_size = rd.integer("moe_intermediate_size", d.moe_intermediate_size);
  c.n_shared_experts = rd.integer(name("n_shared_experts", "num_shared_experts"), d.n_shared_experts);
  c.norm_topk_prob = rd.boolean(name("norm_topk_prob", "moe_renormalize"), true);
  c.routed_scaling_factor = rd.number("routed_scaling_factor", d.routed_scaling_factor);
  c.moe_scoring = "sigmoid";
  c.moe_score_correction_bias = true;
  c.moe_n_group = rd.integer(groups, d.n_group);
  c.moe_topk_group = rd.integer("topk_group", d.topk_group);
  c.router_aux_loss_coef = 0.0;
  c.moe_module_name = "mlp";
  c.layer_moe.assign(c.num_hidden_layers, 0);
  for (int64_t i = first_dense; i < c.num_hidden_layers; ++i) c.layer_moe[i] = 1;
  if (d.kimi_names && rd.has("mlp_layer_types")) {  // Kimi Linear: "dense" / "sparse" per layer, over first_k_dense_replace
    const json& lt = rd.json().at("mlp_layer_types");
    if (!lt.is_array() || static_cast<int64_t>(lt.size()) != c.num_hidden_layers)
      throw file_error(file, "mlp_layer_types", "expected a list of num_hidden_layers strings");
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string t = lt[i].is_string() ? lt[i].get<std::string>() : "";
      if (t != "dense" && t != "sparse") throw file_error(file, "mlp_layer_types", "unsupported MLP type " + lt[i].dump() + " (dense, sparse)");
      c.layer_moe[i] = t == "sparse";
    }
  }
  // every layer dense: the MoE fields are unused
  if (std::find(c.layer_moe.begin(), c.layer_moe.end(), 1) == c.layer_moe.end()) return;
  const int64_t e = c.num_experts;
  if (e <= 0) throw file_error(file, experts_field, "must be positive, got " + str(e));
  if (c.moe_intermediate_size <= 0) throw file_error(file, "moe_intermediate_size", "must be positive, got " + str(c.moe_intermediate_size));
  if (c.n_shared_experts < 0)
    throw file_error(file, name("n_shared_experts", "num_shared_experts"), "must not be negative, got " + str(c.n_shared_experts));
  if (c.moe_n_group < 1 || e % c.moe_n_group)
    throw file_error(file, groups, str(c.moe_n_group) + " does not divide " + experts_field + " " + str(e));
  if (e / c.moe_n_group < 2)
    throw file_error(file, groups, "each group needs at least 2 experts (a group's score is its 2 best), got " + str(e / c.moe_n_group));
  if (c.moe_topk_group < 1 || c.moe_topk_group > c.moe_n_group)
    throw file_error(file, "topk_group", "must be in [1, " + groups + " = " + str(c.moe_n_group) + "], got " + str(c.moe_topk_group));
  const int64_t selectable = c.moe_topk_group * (e / c.moe_n_group);
  if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > selectable)
    throw file_error(file, per_tok, "must be in [1, topk_group x experts per group = " + str(selectable) +
                                        "], got " + str(c.num_experts_per_tok));
}

// transformers' yarn_apply_mscale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the rope block is
// not "default" and has a non-zero mscale_all_dim.
double mla_softmax_scale(const json& j, const DecoderConfig& c) {
  double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim));
  const char* block = j.contains("rope_scaling") && !j.at("rope_scaling").is_null() ? "rope_scaling" : "rope_parameters";
  if (c.rope.type == "default" || !j.contains(block) || !j.at(block).is_object()) return scale;
  const json& p = j.at(block);
  double all_dim = p.contains("mscale_all_dim") && p.at("mscale_all_dim").is_number() ? p.at("mscale_all_dim").get<double>() : 0.0;
  if (all_dim == 0.0) return scale;
  const double factor = c.rope.factor;
  const double m = factor <= 1 ? 1.0 : 0.1 * all_dim * std::log(factor) + 1.0;
  return scale * m * m;
}

// layer_types of the hybrid linear-attention families into c.layer_linear (1 = linear_attention); false (all full
// attention so far) when the file has none.
bool parse_linear_layer_types(const JsonReader& rd, DecoderConfig& c) {
  const std::string& file = rd.file();
  const int64_t layers = c.num_hidden_layers;
  c.layer_linear.assign(layers, 0);
  if (!rd.has("layer_types")) return false;
  const json& lt = rd.json().at("layer_types");
  if (!lt.is_array() || static_cast<int64_t>(lt.size()) != layers)
    throw file_error(file, "layer_types", "expected a list of num_hidden_layers strings");
  for (int64_t i = 0; i < layers; ++i) {
    const std::string t = lt[i].is_string() ? lt[i].get<std::string>() : "";
    if (t == "linear_attention") c.layer_linear[i] = 1;
    else if (t != "full_attention")
      throw file_error(file, "layer_types", "unsupported layer type " + lt[i].dump() + " (linear_attention, full_attention)");
  }
  return true;
}

// Qwen3-Next / Qwen3.5 text decoders, with transformers' config defaults: layer kinds, linear-attention shapes,
// gated attention, zero-centred norms and (qwen3_next, qwen3_5_moe_text) MoE with a gated shared expert.
void parse_gated_deltanet(const JsonReader& rd, DecoderConfig& c) {
  const std::string& file = rd.file();
  const auto str = [](int64_t v) { return std::to_string(v); };
  const int64_t layers = c.num_hidden_layers;
  if (!rd.has("head_dim")) c.head_dim = 256;
  if (!rd.has("max_position_embeddings")) c.max_position_embeddings = 32768;
  c.q_bias = c.k_bias = c.v_bias = c.o_bias = rd.boolean("attention_bias", false);
  c.qk_norm = c.attn_output_gate = c.zero_centered_norm = true;
  c.linear_split_projections = c.model_type != "qwen3_next";
  if (c.hidden_act != "silu")  // the short convolution's activation is hidden_act; only SiLU is implemented
    throw file_error(file, "hidden_act", "must be silu for " + c.model_type + ", got '" + c.hidden_act + "'");
  c.linear_conv_kernel_dim = rd.integer("linear_conv_kernel_dim", 4);
  c.linear_key_head_dim = rd.integer("linear_key_head_dim", 128);
  c.linear_value_head_dim = rd.integer("linear_value_head_dim", 128);
  c.linear_num_key_heads = rd.integer("linear_num_key_heads", 16);
  c.linear_num_value_heads = rd.integer("linear_num_value_heads", 32);
  for (auto [k, v] : {std::pair{"linear_conv_kernel_dim", c.linear_conv_kernel_dim}, {"linear_key_head_dim", c.linear_key_head_dim},
                      {"linear_value_head_dim", c.linear_value_head_dim}, {"linear_num_key_heads", c.linear_num_key_heads},
                      {"linear_num_value_heads", c.linear_num_value_heads}})
    if (v <= 0) throw file_error(file, k, "must be positive, got " + str(v));
  if (c.linear_num_value_heads % c.linear_num_key_heads)
    throw file_error(file, "linear_num_value_heads", str(c.linear_num_value_heads) + " is not a multiple of linear_num_key_heads " +
                                                         str(c.linear_num_key_heads));
  if (!parse_linear_layer_types(rd, c)) {  // transformers: every full_attention_interval-th layer is full attention
    const int64_t every = rd.integer("full_attention_interval", 4);
    if (every <= 0) throw file_error(file, "full_attention_interval", "must be positive, got " + str(every));
    for (int64_t i = 0; i < layers; ++i) c.layer_linear[i] = (i + 1) % every ? 1 : 0;
  }
  if (c.model_type == "qwen3_5_text") return;  // dense MLPs
  const bool next = c.model_type == "qwen3_next";
  c.num_experts = rd.integer("num_experts", next ? 512 : 256);
  c.num_experts_per_tok = rd.integer("num_experts_per_tok", next ? 10 : 8);
  c.moe_intermediate_size = rd.integer("moe_intermediate_size", 512);
  c.shared_expert_intermediate_size = rd.integer("shared_expert_intermediate_size", 512);
  c.norm_topk_prob = next ? rd.boolean("norm_topk_prob", true) : true;  // Qwen3.5-MoE always renormalises
  c.router_aux_loss_coef = rd.number("router_aux_loss_coef", 0.001);
  c.layer_moe.assign(layers, next ? 0 : 1);
  if (next) {  // qwen3_moe's rule: MoE unless in mlp_only_layers, every decoder_sparse_step-th layer
    const int64_t step = rd.integer("decoder_sparse_step", 1);
    if (step <= 0) throw file_error(file, "decoder_sparse_step", "must be positive, got " + str(step));
    const std::vector<int64_t> dense = rd.int_list("mlp_only_layers");
    for (int64_t i : dense)
      if (i < 0 || i >= layers) throw file_error(file, "mlp_only_layers", "layer " + str(i) + " out of range");
    for (int64_t i = 0; i < layers; ++i)
      c.layer_moe[i] = std::find(dense.begin(), dense.end(), i) == dense.end() && c.num_experts > 0 && (i + 1) % step == 0;
  }
  if (c.num_experts <= 0) {
    if (!next) throw file_error(file, "num_experts", "must be positive, got " + str(c.num_experts));
    c.num_experts = 0;
    return;
  }
  if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.num_experts)
    throw file_error(file, "num_experts_per_tok", "must be in [1, num_experts = " + str(c.num_experts) + "], got " + str(c.num_experts_per_tok));
  if (c.moe_intermediate_size <= 0) throw file_error(file, "moe_intermediate_size", "must be positive, got " + str(c.moe_intermediate_size));
  if (c.shared_expert_intermediate_size <= 0)
    throw file_error(file, "shared_expert_intermediate_size", "must be positive, got " + str(c.shared_expert_intermediate_size));
}

// ---- GLM-4-MoE, MiniMax-M2, Mistral 4 ----

// transformers builds GLM-4-MoE's and Mistral 4's shared expert whatever n_shared_experts is (0: zero-width tensors in
// the checkpoint, which this model does not have).
void require_shared_experts(const JsonReader& rd, const DecoderConfig& c) {
  if (c.n_shared_experts == 0 && std::find(c.layer_moe.begin(), c.layer_moe.end(), 1) != c.layer_moe.end())
    throw file_error(rd.file(), "n_shared_experts", "0 is not supported for " + c.model_type + " (must be positive)");
}

// GLM-4-MoE (GLM-4.5 / 4.6, transformers' Glm4MoeConfig defaults): GQA attention with q/k/v biases (attention_bias;
// o_proj has none), optional per-head q/k RMSNorm (use_qk_norm), DeepSeek-style sigmoid routing with the correction
// bias after first_k_dense_replace dense layers. Its num_nextn_predict_layers multi-token prediction layers are
// DeepSeek-V3's (mtp.h).
void parse_glm4_moe(const JsonReader& rd, DecoderConfig& c) {
  c.q_bias = c.k_bias = c.v_bias = rd.boolean("attention_bias", false);
  c.qk_norm = rd.boolean("use_qk_norm", false);
  if (!rd.has("rms_norm_eps")) c.rms_norm_eps = 1e-5;
  parse_routed_moe(rd, c, {.first_k_dense_replace = 1, .n_routed_experts = 128, .moe_intermediate_size = 1408,
                           .n_group = 1, .topk_group = 1, .routed_scaling_factor = 1.0});
  require_shared_experts(rd, c);
}

// MiniMax-M2 (transformers' MiniMaxM2Config defaults): GQA attention without biases, q_norm / k_norm RMSNorms over
// the whole q / k projections; every layer a MoE of num_local_experts experts of width intermediate_size, sigmoid
// scores, selection on scores + the block's e_score_correction_bias, top-k weights always renormalised, no shared
// experts. Checkpoints use Mixtral's names (block_sparse_moe, w1 / w3 / w2).
void parse_minimax_m2(const JsonReader& rd, DecoderConfig& c) {
  const std::string& file = rd.file();
  if (!rd.has("head_dim")) c.head_dim = 128;
  c.qk_norm_whole = true;
  const char* experts_field = rd.has("num_local_experts") || !rd.has("num_experts") ? "num_local_experts" : "num_experts";
  c.num_experts = rd.integer(experts_field, 256);
  c.num_experts_per_tok = rd.integer("num_experts_per_tok", 8);
  c.moe_intermediate_size = c.intermediate_size;
  c.norm_topk_prob = true;
  c.moe_scoring = "sigmoid";
  c.moe_score_correction_bias = c.moe_bias_on_block = true;
  c.router_aux_loss_coef = rd.number("router_aux_loss_coef", 0.001);
  c.lb_softmax_topk = true;
  if (rd.has("router_jitter_noise") && rd.number("router_jitter_noise") != 0.0)
    throw file_error(file, "router_jitter_noise", "router jitter noise is not supported (must be 0)");
  c.moe_checkpoint_name = "block_sparse_moe";
  c.layer_moe.assign(c.num_hidden_layers, 1);
  if (c.num_experts <= 0) throw file_error(file, experts_field, "must be positive, got " + std::to_string(c.num_experts));
  if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts)
    throw file_error(file, "num_experts_per_tok", "must be in [1, " + std::string(experts_field) + " = " +
                                                      std::to_string(c.num_experts) + "], got " + std::to_string(c.num_experts_per_tok));
}

// Mistral 4 (transformers' Mistral4Config defaults): DeepSeek's latent attention with queries scaled by position
// (llama_4_scaling_beta), softmax routing limited to the topk_group best of n_group groups (no correction bias),
// shared experts; experts stored stacked (save_pretrained has no per-expert conversion for it); pad_token_id 11.
void parse_mistral4(const JsonReader& rd, DecoderConfig& c) {
  parse_mla(rd, c, {.q_lora_rank = 1024, .kv_lora_rank = 256, .qk_nope_head_dim = 64, .first_k_dense_replace = 0,
                    .n_routed_experts = 128, .num_experts_per_tok = 4, .n_group = 1, .topk_group = 1,
                    .routed_scaling_factor = 1.0});
  require_shared_experts(rd, c);
  c.moe_scoring = "softmax";
  c.moe_score_correction_bias = false;
  c.moe_stacked_checkpoint = true;
  if (!rd.json().contains("pad_token_id")) c.pad_token_id = 11;
}

// Kimi Linear (transformers' KimiLinearConfig defaults): latent attention without rotary embeddings in the
// full-attention layers (q_lora_rank null by default), Kimi Delta Attention in the others (shapes from
// linear_attn_config when present, else linear_head_dim / linear_num_heads / linear_conv_kernel_dim); layer kinds from
// layer_types, else linear_attn_config's 1-based full_attn_layers / kda_layers, else every 4th layer (from the 5th)
// full; DeepSeek-style routing under its attribute-map names, MLPs dense before first_k_dense_replace (1) unless
// mlp_layer_types says otherwise.
void parse_kimi_linear(const JsonReader& rd, DecoderConfig& c) {
  const std::string& file = rd.file();
  const auto str = [](int64_t v) { return std::to_string(v); };
  const int64_t layers = c.num_hidden_layers;
  parse_mla(rd, c, {.q_lora_rank = 0, .first_k_dense_replace = 1, .moe_intermediate_size = 1024, .n_group = 1, .topk_group = 1,
                    .routed_scaling_factor = 2.446, .kimi_names = true});
  c.mla_rope = false;
  c.moe_checkpoint_name = "block_sparse_moe";
  c.moe_checkpoint_all_mlps = true;
  const bool block = rd.has("linear_attn_config");
  const JsonReader la = block ? rd.object("linear_attn_config") : rd;
  const auto shape = [&](const char* key, const char* top, int64_t dflt) -> std::pair<int64_t, std::string> {
    if (block && la.has(key)) return {la.integer(key), la.field(key)};
    return {rd.integer(top, dflt), top};
  };
  const auto [head_dim, head_field] = shape("head_dim", "linear_head_dim", 128);
  const auto [heads, heads_field] = shape("num_heads", "linear_num_heads", 32);
  const auto [kernel, kernel_field] = shape("short_conv_kernel_size", "linear_conv_kernel_dim", 4);
  for (const auto& [v, f] : {std::pair{head_dim, head_field}, {heads, heads_field}, {kernel, kernel_field}})
    if (v <= 0) throw file_error(file, f, "must be positive, got " + str(v));
  c.linear_key_head_dim = c.linear_value_head_dim = head_dim;
  c.linear_num_key_heads = c.linear_num_value_heads = heads;
  c.linear_conv_kernel_dim = kernel;
  if (parse_linear_layer_types(rd, c)) return;
  if (block && la.has("full_attn_layers") && la.has("kda_layers")) {
    std::vector<int> seen(static_cast<size_t>(layers), 0);
    for (const char* key : {"full_attn_layers", "kda_layers"})
      for (int64_t l : la.int_list(key)) {
        if (l < 1 || l > layers) throw file_error(file, la.field(key), "layer " + str(l) + " out of [1, num_hidden_layers = " + str(layers) + "]");
        seen[static_cast<size_t>(l - 1)] = 1;
        c.layer_linear[static_cast<size_t>(l - 1)] = std::string(key) == "kda_layers";  // the later list wins, as transformers
      }
    for (int64_t i = 0; i < layers; ++i)
      if (!seen[static_cast<size_t>(i)])
        throw file_error(file, la.field("kda_layers"), "layer " + str(i + 1) + " is in neither full_attn_layers nor kda_layers");
  } else {
    for (int64_t i = 0; i < layers; ++i) c.layer_linear[i] = i && i % 4 == 0 ? 0 : 1;
  }
}

// Mistral4Config's rope block when the file has none (yarn, factor 128 over 8192 positions).
nlohmann::json with_mistral4_rope(const json& j, const DecoderConfig& c) {
  json out = j;
  const auto present = [&](const char* k) { return j.contains(k) && !j.at(k).is_null(); };
  if (present("rope_parameters") || present("rope_scaling")) return out;
  out["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 128.0},
                            {"original_max_position_embeddings", 8192}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                            {"mscale_all_dim", 1.0}, {"mscale", 1.0}, {"llama_4_scaling_beta", 0.1},
                            {"partial_rotary_factor", static_cast<double>(c.qk_rope_head_dim) /
                                                          static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim)}};
  return out;
}

// Mistral 4's rotary width as transformers computes it (default rope: head_dim = qk_nope + qk_rope; the scaled
// types: int(head_dim x partial_rotary_factor), which defaults to qk_rope / head_dim) must be qk_rope_head_dim; the
// query scaling by position reads llama_4_scaling_beta and original_max_position_embeddings from the rope block.
void check_mistral4_rope(const json& j, const std::string& file, DecoderConfig& c) {
  const int64_t head = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const double partial = c.rope.partial_rotary_factor.value_or(static_cast<double>(c.qk_rope_head_dim) / static_cast<double>(head));
  const int64_t width = c.rope.type == "default" ? head : static_cast<int64_t>(static_cast<double>(head) * partial);
  const std::string block = j.contains("rope_scaling") && !j.at("rope_scaling").is_null() ? "rope_scaling" : "rope_parameters";
  if (width != c.qk_rope_head_dim)
    throw file_error(file, c.rope.type == "default" || c.rope.partial_rotary_field.empty() ? block + ".rope_type" : c.rope.partial_rotary_field,
                     "transformers' Mistral 4 rotates " + std::to_string(width) + " features, qk_rope_head_dim is " +
                         std::to_string(c.qk_rope_head_dim));
  c.rope.partial_rotary_factor.reset();  // the latent attention's rope part is the rotary width already
  JsonReader rd(j, file);
  JsonReader rb = rd.object(block);
  if (!rb.has("llama_4_scaling_beta"))
    throw file_error(file, block + ".llama_4_scaling_beta", "missing (transformers' Mistral 4 attention needs it)");
  if (!rb.has("original_max_position_embeddings"))
    throw file_error(file, block + ".original_max_position_embeddings", "missing (Mistral 4's query scaling needs it)");
  c.llama4_scaling_beta = rb.number("llama_4_scaling_beta");
  c.llama4_scaling_original = rb.integer("original_max_position_embeddings");
  if (c.llama4_scaling_original <= 0)
    throw file_error(file, block + ".original_max_position_embeddings", "must be positive");
}

// The rotary defaults of these families when the file has none: GLM-4-MoE rotates half of each head; MiniMax-M2's
// legacy rotary_dim gives the factor (rotary_dim / head_dim) and its rope_theta defaults to 5e6.
void new_family_rope_defaults(const json& j, const std::string& file, DecoderConfig& c) {
  JsonReader rd(j, file);
  if (c.model_type == "glm4_moe" && !c.rope.partial_rotary_factor) {
    c.rope.partial_rotary_factor = 0.5;
    c.rope.partial_rotary_field = "partial_rotary_factor";
  }
  if (c.model_type != "minimax_m2") return;
  if (!c.rope.partial_rotary_factor && rd.has("rotary_dim")) {
    c.rope.partial_rotary_factor = static_cast<double>(rd.integer("rotary_dim")) / static_cast<double>(c.head_dim);
    c.rope.partial_rotary_field = "rotary_dim";
  }
  const auto in_block = [&](const char* b) { return j.contains(b) && j.at(b).is_object() && j.at(b).contains("rope_theta"); };
  if (!rd.has("rope_theta") && !in_block("rope_parameters") && !in_block("rope_scaling")) c.rope.theta = 5000000.0;
}

}  // namespace

DecoderConfig DecoderConfig::from_json(const json& j, const std::string& file) {
  if (!j.is_object()) throw file_error(file, "", "expected a JSON object");
  JsonReader rd(j, file);
  DecoderConfig c;
  c.raw = j;
  c.model_type = rd.string("model_type");
  if (c.model_type == "deepseek_v4") {  // deepseek_v4.cpp reads every field
    parse_deepseek_v4(rd, c);
    return c;
  }
  const bool gdn = gated_deltanet_family(c.model_type), kda = kda_family(c.model_type);
  const bool new_moe_family = c.model_type == "glm4_moe" || c.model_type == "minimax_m2" || c.model_type == "mistral4";
  if (!gdn && !kda && !new_moe_family && !is_dsa_family(c.model_type) && c.model_type != "llama" && c.model_type != "mistral" &&
      c.model_type != "qwen2" && c.model_type != "qwen3" && c.model_type != "deepseek_v3" && c.model_type != "qwen3_moe" &&
      c.model_type != "mixtral")
    throw file_error(file, "model_type", "unsupported model type '" + c.model_type +
                                             "' (decoders: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3, "
                                             "glm4_moe, minimax_m2, mistral4, qwen3_next, qwen3_5_text, qwen3_5_moe_text, "
                                             "deepseek_v32, glm_moe_dsa, kimi_linear, deepseek_v4)");
  c.vocab_size = rd.integer("vocab_size");
  c.hidden_size = rd.integer("hidden_size");
  // Qwen3.5-MoE: every layer's MLP is a MoE, transformers' Qwen3_5MoeTextConfig has no intermediate_size (unused)
  c.intermediate_size = c.model_type == "qwen3_5_moe_text" ? rd.integer("intermediate_size", 1)
                                                            : rd.integer("intermediate_size");
  c.num_hidden_layers = rd.integer("num_hidden_layers");
  c.num_attention_heads = rd.integer("num_attention_heads");
  c.num_key_value_heads = rd.integer("num_key_value_heads", c.num_attention_heads);
  for (auto [k, v] : {std::pair{"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size}, {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads}, {"num_key_value_heads", c.num_key_value_heads}})
    if (v <= 0) throw file_error(file, k, "must be positive, got " + std::to_string(v));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw file_error(file, "num_key_value_heads", "must divide num_attention_heads");
  int64_t def_head = c.hidden_size / c.num_attention_heads;
  if (c.model_type == "deepseek_v3") parse_mla(rd, c);  // head_dim = qk_rope_head_dim (transformers ignores the field)
  else if (c.model_type == "mistral4") parse_mistral4(rd, c);  // the same
  else if (is_dsa_family(c.model_type)) parse_mla(rd, c, c.model_type == "glm_moe_dsa" ? kGlmMoeDsaDefaults : MlaMoeDefaults{});
  else if (kda) parse_kimi_linear(rd, c);                      // the same
  else c.head_dim = rd.integer("head_dim", def_head);
  if (c.head_dim <= 0 || c.head_dim % 2) throw file_error(file, "head_dim", "must be positive and even");
  c.max_position_embeddings = kda ? rd.integer("model_max_length", 1048576)  // its alias (no rotary to size)
                                  : rd.integer("max_position_embeddings", c.model_type == "deepseek_v3" ? 4096 : 2048);
  c.rms_norm_eps = rd.number("rms_norm_eps", kda ? 1e-5 : 1e-6);
  c.hidden_act = rd.string("hidden_act", std::string("silu"));
  if (kda && c.hidden_act != "silu")  // KDA's short convolution's activation is hidden_act; only SiLU is implemented
    throw file_error(file, "hidden_act", "must be silu for kimi_linear, got '" + c.hidden_act + "'");
  if (c.hidden_act != "silu" && c.hidden_act != "gelu" && c.hidden_act != "gelu_pytorch_tanh" && c.hidden_act != "relu")
    throw file_error(file, "hidden_act", "unsupported activation '" + c.hidden_act + "' (silu, gelu, gelu_pytorch_tanh, relu)");
  // (transformers' KimiLinearForCausalLM never ties its head, whatever the field says)
  c.tie_word_embeddings = !kda && rd.boolean("tie_word_embeddings", false);
  if (rd.has("pad_token_id")) c.pad_token_id = rd.integer("pad_token_id");
  if (c.pad_token_id && (*c.pad_token_id < 0 || *c.pad_token_id >= c.vocab_size)) c.pad_token_id.reset();
  c.bos_token_ids = rd.int_list("bos_token_id");
  c.eos_token_ids = rd.int_list("eos_token_id");

  if (rd.has("attention_dropout") && rd.number("attention_dropout") != 0.0)
    throw file_error(file, "attention_dropout", "attention dropout is not supported (must be 0)");
  if (rd.has("logits_soft_cap") || rd.has("final_logit_softcapping"))
    throw file_error(file, rd.has("logits_soft_cap") ? "logits_soft_cap" : "final_logit_softcapping", "logit soft-capping is not supported");

  // Biases and norms per family, as in transformers' modeling files.
  if (c.model_type == "llama") {
    c.q_bias = c.k_bias = c.v_bias = c.o_bias = rd.boolean("attention_bias", false);
    c.mlp_bias = rd.boolean("mlp_bias", false);
  } else if (c.model_type == "qwen2") {
    c.q_bias = c.k_bias = c.v_bias = true;
  } else if (c.model_type == "qwen3" || c.model_type == "qwen3_moe") {
    c.q_bias = c.k_bias = c.v_bias = c.o_bias = rd.boolean("attention_bias", false);
    c.qk_norm = true;
  }

  // Sliding windows. Mistral: every layer when sliding_window is set. Qwen2/3: per layer_types (or, when absent,
  // layers >= max_window_layers when use_sliding_window). Llama: none.
  c.layer_window.assign(c.num_hidden_layers, 0);
  if (c.model_type == "mistral" || c.model_type == "mixtral") {
    if (rd.has("sliding_window")) {
      int64_t w = rd.integer("sliding_window");
      if (w <= 0) throw file_error(file, "sliding_window", "must be positive");
      c.layer_window.assign(c.num_hidden_layers, w);
    }
  } else if (c.model_type == "qwen2" || c.model_type == "qwen3") {
    bool use = rd.boolean("use_sliding_window", false);
    int64_t w = use && rd.has("sliding_window") ? rd.integer("sliding_window") : 0;
    if (use && w <= 0) throw file_error(file, "sliding_window", "must be positive when use_sliding_window is true");
    if (rd.has("layer_types")) {
      const json& lt = j.at("layer_types");
      if (!lt.is_array() || static_cast<int64_t>(lt.size()) != c.num_hidden_layers)
        throw file_error(file, "layer_types", "expected a list of num_hidden_layers strings");
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        std::string t = lt[i].is_string() ? lt[i].get<std::string>() : "";
        if (t == "sliding_attention") c.layer_window[i] = w;  // w == 0 (no window configured): full attention
        else if (t != "full_attention")
          throw file_error(file, "layer_types", "unsupported layer type " + lt[i].dump());
      }
    } else if (w > 0) {
      int64_t first = rd.integer("max_window_layers", 28);
      for (int64_t i = first; i < c.num_hidden_layers; ++i) c.layer_window[i] = w;
    }
  }
  if (c.model_type == "qwen3_moe" && rd.boolean("use_sliding_window", false)) {
    int64_t w = rd.has("sliding_window") ? rd.integer("sliding_window") : 0;
    if (w <= 0) throw file_error(file, "sliding_window", "must be positive when use_sliding_window is true");
    c.layer_window.assign(c.num_hidden_layers, w);
  }
  if (c.model_type == "qwen3_moe" || c.model_type == "mixtral") parse_moe(rd, c);
  if (gdn) parse_gated_deltanet(rd, c);
  if (c.model_type == "glm4_moe") parse_glm4_moe(rd, c);
  if (c.model_type == "minimax_m2") parse_minimax_m2(rd, c);
  if (is_dsa_family(c.model_type)) parse_dsa(rd, c);  // dsa.cpp
  const json rope_json = c.model_type == "mistral4" ? with_mistral4_rope(j, c) : json();
  const json& rj = rope_json.is_null() ? j : rope_json;  // the config with the family's rope block when it has none
  if (!kda) c.rope = parse_rope(rj, file, c.max_position_embeddings);  // Kimi Linear: no rotary (its rope fields unused)
  if (new_moe_family) new_family_rope_defaults(j, file, c);
  if (c.model_type == "mistral4") check_mistral4_rope(rj, file, c);
  if (gdn && !c.rope.partial_rotary_factor) {  // transformers' default for these families
    c.rope.partial_rotary_factor = 0.25;
    c.rope.partial_rotary_field = "partial_rotary_factor";
  }
  if (gdn) c.rope.mrope_section.clear();  // Qwen3.5's text positions are 1D: its multimodal sections rotate as plain RoPE
  // Partial rotary (transformers: dim = int(head_dim * partial_rotary_factor)); families with a default of their own
  // set it when the file has none.
  // The families whose transformers modeling rotates part of each head (the others' apply_rotary_pos_emb would fail).
  const bool partial_ok = gdn || c.model_type == "glm4_moe" || c.model_type == "minimax_m2";
  const double partial = c.rope.partial_rotary_factor.value_or(1.0);
  c.rotary_dim = c.head_dim;
  if (partial != 1.0) {
    if (!partial_ok || c.mla)
      throw file_error(file, c.rope.partial_rotary_field,
                       "partial rotary embeddings are not supported for model_type " + c.model_type);
    c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * partial);
    if (!(partial > 0.0 && partial <= 1.0) || c.rotary_dim <= 0 || c.rotary_dim % 2)
      throw file_error(file, c.rope.partial_rotary_field,
                       "must be in (0, 1] and give an even number of rotated features (head_dim " +
                           std::to_string(c.head_dim) + " x " + std::to_string(partial) + ")");
  }
  if (!c.rope.mrope_section.empty()) {
    int64_t sum = 0;
    for (int64_t n : c.rope.mrope_section) sum += n > 0 ? n : -(int64_t(1) << 40);
    if (sum != c.rotary_dim / 2)
      throw file_error(file, (j.contains("rope_scaling") ? "rope_scaling" : "rope_parameters") + std::string(".mrope_section"),
                       "positive sections summing to rotary_dim / 2 = " + std::to_string(c.rotary_dim / 2) + " expected");
  }
  if (c.mla) c.attention_scale = mla_softmax_scale(rj, c);
  return c;
}

DecoderConfig DecoderConfig::from_file(const std::string& path) { return from_json(read_json_file(path), path); }

int64_t DecoderConfig::num_parameters() const {
  if (deepseek_v4) return deepseek_v4_num_parameters(*this);
  int64_t d = hidden_size, q = num_attention_heads * head_dim, kv = num_key_value_heads * head_dim;
  int64_t attn = d * q + 2 * d * kv + q * d + (q_bias ? q : 0) + (k_bias ? kv : 0) + (v_bias ? kv : 0) + (o_bias ? d : 0) +
                 (qk_norm ? 2 * head_dim : 0);
  if (qk_norm_whole) attn += q + kv;  // MiniMax-M2: norms over the whole projections
  if (mla) {  // models/llama/mla.h
    const int64_t h = num_attention_heads, qk = qk_nope_head_dim + qk_rope_head_dim;
    attn = (q_lora_rank > 0 ? d * q_lora_rank + (q_bias ? q_lora_rank : 0) + q_lora_rank + q_lora_rank * h * qk : d * h * qk) +
           d * (kv_lora_rank + qk_rope_head_dim) + (k_bias ? kv_lora_rank + qk_rope_head_dim : 0) + kv_lora_rank +
           kv_lora_rank * h * (qk_nope_head_dim + v_head_dim) + h * v_head_dim * d + (o_bias ? d : 0);
  }
  int64_t mlp = 3 * d * intermediate_size + (mlp_bias ? 2 * intermediate_size + d : 0);
  int64_t layer = attn + mlp + 2 * d;
  int64_t total = vocab_size * d * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * layer + d;
  const int64_t moe = num_experts * d + num_experts * 3 * d * moe_intermediate_size + 3 * d * moe_intermediate_size * n_shared_experts;
  for (int64_t i = 0; i < num_hidden_layers; ++i)
    if (is_moe_layer(i)) total += moe - mlp;
  total += dsa_num_parameters(*this);  // the sparse-attention indexers (dsa.h)
  if (kda_family(model_type)) {  // a KDA layer (kimi_delta.h) instead of latent attention
    const int64_t h = linear_num_value_heads, dh = linear_value_head_dim, hd = h * dh;
    const int64_t kda = 3 * d * hd + 3 * hd * linear_conv_kernel_dim + d * dh + dh * hd + hd + h + d * h + d * dh + dh * hd +
                        dh + hd * d;
    for (int64_t i = 0; i < num_hidden_layers; ++i)
      if (is_linear_layer(i)) total += kda - attn;
  }
  if (gated_deltanet_family(model_type)) {
    // attention's output gate (q_proj twice as wide); a linear-attention layer instead of attention; the shared
    // expert's gate
    const int64_t kd = linear_num_key_heads * linear_key_head_dim, vd = linear_num_value_heads * linear_value_head_dim;
    const int64_t linear = d * (2 * kd + 2 * vd) + d * 2 * linear_num_value_heads + (2 * kd + vd) * linear_conv_kernel_dim +
                           2 * linear_num_value_heads + linear_value_head_dim + vd * d;
    for (int64_t i = 0; i < num_hidden_layers; ++i) {
      total += is_linear_layer(i) ? linear - attn : d * q + (q_bias ? q : 0);
      if (is_moe_layer(i)) total += d + 3 * d * shared_expert_intermediate_size;
    }
  }
  return total;
}

int64_t DecoderConfig::num_active_parameters() const {
  if (deepseek_v4) return deepseek_v4_active_parameters(*this);
  int64_t total = num_parameters();
  const int64_t idle = (num_experts - num_experts_per_tok) * 3 * hidden_size * moe_intermediate_size;
  for (int64_t i = 0; i < num_hidden_layers; ++i)
    if (is_moe_layer(i)) total -= idle;
  return total;
}

}  // namespace lf::models::llama

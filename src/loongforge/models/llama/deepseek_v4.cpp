#include "loongforge/models/llama/deepseek_v4.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cmath>
#include <limits>

#include "loongforge/core/error.h"
#include "loongforge/models/llama/dsa.h"
#include "loongforge/models/llama/gated_deltanet.h"
#include "loongforge/models/llama/model.h"

namespace lf::models::llama {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
std::string str(int64_t v) { return std::to_string(v); }

// A per-layer list of strings mapped to codes; absent: the default codes.
std::vector<int64_t> layer_kinds(const JsonReader& rd, const std::string& field, int64_t n,
                                 const std::vector<std::pair<std::string, int64_t>>& kinds) {
  const nlohmann::json& list = rd.json().at(field);
  if (!list.is_array() || static_cast<int64_t>(list.size()) < n)
    rd.fail(field, "expected a list of num_hidden_layers (" + str(n) + ") strings");
  std::vector<int64_t> out;
  std::string known;
  for (const auto& [name, code] : kinds) known += (known.empty() ? "" : ", ") + name;
  for (int64_t i = 0; i < n; ++i) {
    const std::string t = list[i].is_string() ? list[i].get<std::string>() : "";
    int64_t code = -1;
    for (const auto& [name, k] : kinds)
      if (name == t) code = k;
    if (code < 0) rd.fail(field, "unsupported entry " + list[i].dump() + " (" + known + ")");
    out.push_back(code);
  }
  return out;
}

// One rotary block ("main" / "compress") of rope_parameters, read as parse_rope reads a config's.
RopeConfig rope_block(const nlohmann::json& block, const std::string& file, int64_t max_pos) {
  return parse_rope(nlohmann::json{{"rope_parameters", block}}, file, max_pos);
}

at::Tensor unweighted_rms(const at::Tensor& x, double eps) {
  return x * at::rsqrt(x.to(at::kFloat).square().mean(-1, true) + eps).to(x.scalar_type());
}

}  // namespace

void parse_deepseek_v4(const JsonReader& rd, DecoderConfig& c) {
  const std::string& file = rd.file();
  c.deepseek_v4 = true;
  struct IntField {
    const char* name;
    int64_t DecoderConfig::*member;
    int64_t dflt;
  };
  // transformers' DeepseekV4Config defaults; every one must be positive
  for (const IntField& f : {IntField{"vocab_size", &DecoderConfig::vocab_size, 129280}, {"hidden_size", &DecoderConfig::hidden_size, 4096},
                            {"moe_intermediate_size", &DecoderConfig::moe_intermediate_size, 2048},
                            {"num_hidden_layers", &DecoderConfig::num_hidden_layers, 43},
                            {"num_attention_heads", &DecoderConfig::num_attention_heads, 64},
                            {"num_key_value_heads", &DecoderConfig::num_key_value_heads, 1}, {"head_dim", &DecoderConfig::head_dim, 512},
                            {"q_lora_rank", &DecoderConfig::q_lora_rank, 1024}, {"num_experts_per_tok", &DecoderConfig::num_experts_per_tok, 6},
                            {"n_routed_experts", &DecoderConfig::num_experts, 256},
                            {"max_position_embeddings", &DecoderConfig::max_position_embeddings, 1048576},
                            {"hc_mult", &DecoderConfig::hc_mult, 4}, {"hc_sinkhorn_iters", &DecoderConfig::hc_sinkhorn_iters, 20},
                            {"o_groups", &DecoderConfig::o_groups, 8}, {"o_lora_rank", &DecoderConfig::o_lora_rank, 1024},
                            {"index_n_heads", &DecoderConfig::index_n_heads, 64}, {"index_head_dim", &DecoderConfig::index_head_dim, 128},
                            {"index_topk", &DecoderConfig::index_topk, 512}}) {
    c.*f.member = rd.integer(f.name, f.dflt);
    if (c.*f.member <= 0) rd.fail(f.name, "must be positive, got " + str(c.*f.member));
  }
  c.intermediate_size = c.moe_intermediate_size;  // transformers' attribute_map: the shared expert's width
  c.routed_scaling_factor = rd.number("routed_scaling_factor", 1.5);
  c.hc_eps = rd.number("hc_eps", 1e-6);
  c.swiglu_limit = rd.number("swiglu_limit", 10.0);
  if (!(c.swiglu_limit > 0)) rd.fail("swiglu_limit", "must be positive");
  c.rms_norm_eps = rd.number("rms_norm_eps", 1e-6);
  const int64_t window = rd.integer("sliding_window", 128);
  if (window <= 0) rd.fail("sliding_window", "must be positive, got " + str(window));
  if (c.num_key_value_heads != 1) rd.fail("num_key_value_heads", "must be 1 for deepseek_v4 (one shared key/value head)");
  if (c.num_experts_per_tok > c.num_experts) rd.fail("num_experts_per_tok", "exceeds n_routed_experts");
  if ((c.num_attention_heads * c.head_dim) % c.o_groups) rd.fail("o_groups", "must divide num_attention_heads x head_dim");
  if (rd.integer("n_shared_experts", 1) != 1)  // transformers builds exactly one shared expert, whatever the field
    rd.fail("n_shared_experts", "must be 1 (transformers' DeepseekV4 has one shared expert)");
  if (!rd.boolean("norm_topk_prob", true)) rd.fail("norm_topk_prob", "must be true (transformers always normalises)");
  c.moe_scoring = rd.string("scoring_func", std::string("sqrtsoftplus"));
  if (c.moe_scoring != "sqrtsoftplus" && c.moe_scoring != "sigmoid")
    rd.fail("scoring_func", "unsupported '" + c.moe_scoring + "' (sqrtsoftplus, sigmoid)");
  c.hidden_act = rd.string("hidden_act", std::string("silu"));
  if (c.hidden_act != "silu") rd.fail("hidden_act", "must be silu for deepseek_v4, got '" + c.hidden_act + "'");
  if (rd.boolean("attention_bias", false)) rd.fail("attention_bias", "deepseek_v4 attention has no biases (must be false)");
  if (rd.boolean("mlp_bias", false)) rd.fail("mlp_bias", "biases of the shared expert are not supported (must be false)");
  if (rd.has("attention_dropout") && rd.number("attention_dropout") != 0.0)
    rd.fail("attention_dropout", "attention dropout is not supported (must be 0)");
  // transformers adds router_aux_loss_coef x load_balancing_loss_func to the loss only with output_router_logits
  // (a recipe's moe.aux_loss_coef sets the coefficient of a training run either way)
  const double aux_coef = rd.number("router_aux_loss_coef", 0.001);
  if (aux_coef < 0) rd.fail("router_aux_loss_coef", "must not be negative");
  c.router_aux_loss_coef = rd.boolean("output_router_logits", false) ? aux_coef : 0.0;
  c.tie_word_embeddings = rd.boolean("tie_word_embeddings", false);
  if (rd.has("pad_token_id")) c.pad_token_id = rd.integer("pad_token_id");
  if (c.pad_token_id && (*c.pad_token_id < 0 || *c.pad_token_id >= c.vocab_size)) c.pad_token_id.reset();
  c.bos_token_ids = rd.has("bos_token_id") ? rd.int_list("bos_token_id") : std::vector<int64_t>{0};
  c.eos_token_ids = rd.has("eos_token_id") ? rd.int_list("eos_token_id") : std::vector<int64_t>{1};
  const int64_t n = c.num_hidden_layers;
  c.layer_window.assign(n, window);

  // compress_rates (legacy: compress_rate_csa / compress_rate_hca)
  if (rd.has("compress_rates")) {
    JsonReader cr = rd.object("compress_rates");
    c.v4_csa_rate = cr.integer("compressed_sparse_attention", 4);
    c.v4_hca_rate = cr.integer("heavily_compressed_attention", 128);
  }
  if (rd.has("compress_rate_csa")) c.v4_csa_rate = rd.integer("compress_rate_csa");
  if (rd.has("compress_rate_hca")) c.v4_hca_rate = rd.integer("compress_rate_hca");
  if (c.v4_csa_rate <= 0) rd.fail("compress_rates", "the compressed_sparse_attention rate must be positive");
  if (c.v4_hca_rate <= 0) rd.fail("compress_rates", "the heavily_compressed_attention rate must be positive");
  // layer_types (legacy: compress_ratios 0 / 4 / 128); default: 2 x HCA, then CSA / HCA alternating
  if (rd.has("layer_types")) {
    c.v4_attn = layer_kinds(rd, "layer_types", n, {{"sliding_attention", 0}, {"compressed_sparse_attention", 1},
                                                   {"heavily_compressed_attention", 2}});
  } else if (rd.has("compress_ratios")) {
    const nlohmann::json& r = rd.json().at("compress_ratios");
    if (!r.is_array() || static_cast<int64_t>(r.size()) < n) rd.fail("compress_ratios", "expected a list of num_hidden_layers integers");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = r[i].is_number_integer() ? r[i].get<int64_t>() : -1;
      if (v != 0 && v != 4 && v != 128) rd.fail("compress_ratios", "entries must be 0, 4 or 128, got " + r[i].dump());
      c.v4_attn.push_back(v == 0 ? 0 : v == 4 ? 1 : 2);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) c.v4_attn.push_back(i < 2 ? 2 : ((i - 2) % 2 ? 1 : 2));
  }
  // mlp_layer_types (legacy: num_hash_layers; default 3 hash layers)
  if (rd.has("mlp_layer_types")) {
    c.v4_hash = layer_kinds(rd, "mlp_layer_types", n, {{"hash_moe", 1}, {"moe", 0}});
  } else {
    const int64_t hash = rd.integer("num_hash_layers", 3);
    for (int64_t i = 0; i < n; ++i) c.v4_hash.push_back(i < hash ? 1 : 0);
  }
  c.layer_moe.assign(n, 1);

  // partial rotary: partial_rotary_factor, else qk_rope_head_dim / head_dim, else 64 / 512
  double partial = 64.0 / 512.0;
  if (rd.has("qk_rope_head_dim")) partial = static_cast<double>(rd.integer("qk_rope_head_dim")) / static_cast<double>(c.head_dim);
  if (rd.has("partial_rotary_factor")) partial = rd.number("partial_rotary_factor");
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * partial);
  if (!(partial > 0.0 && partial <= 1.0) || c.rotary_dim <= 0 || c.rotary_dim % 2)
    rd.fail(rd.has("partial_rotary_factor") ? "partial_rotary_factor" : "qk_rope_head_dim",
            "must give an even number of rotated features in (0, head_dim]");
  if (c.index_head_dim < c.rotary_dim) rd.fail("index_head_dim", "must be at least the rotary width " + str(c.rotary_dim));
  // rope_parameters: {main, compress} blocks, or one block (the compress one's scaling) with rope_theta /
  // compress_rope_theta
  const double theta = rd.number("rope_theta", 10000.0), ctheta = rd.number("compress_rope_theta", 160000.0);
  const char* block = rd.has("rope_parameters") ? "rope_parameters" : rd.has("rope_scaling") ? "rope_scaling" : nullptr;
  nlohmann::json main = {{"rope_type", "default"}, {"rope_theta", theta}}, compress;
  const nlohmann::json rp = block ? rd.json().at(block) : nlohmann::json::object();
  if (!rp.is_object()) rd.fail(block, "expected an object");
  if (rp.contains("main") && rp.contains("compress")) {
    main = rp.at("main");
    compress = rp.at("compress");
  } else {
    compress = rp;
    compress.erase("main");
    compress.erase("compress");
    compress["rope_theta"] = ctheta;
    if (!compress.contains("rope_type")) compress["rope_type"] = compress.value("type", std::string("default"));
    if (compress["rope_type"] == "yarn" && !compress.contains("attention_factor")) compress["attention_factor"] = 1.0;
  }
  c.rope = rope_block(main, file, c.max_position_embeddings);
  c.compress_rope = rope_block(compress, file, c.max_position_embeddings);
  if (c.rope.type == "dynamic" || c.compress_rope.type == "dynamic")
    rd.fail(block ? block : "rope_parameters", "rope type 'dynamic' is not supported for deepseek_v4");
  if (c.rope.mrope_section.size() || c.compress_rope.mrope_section.size()) rd.fail(block, "mrope_section is not supported");
}

int64_t deepseek_v4_num_parameters(const DecoderConfig& c) {
  const int64_t d = c.hidden_size, D = c.head_dim, H = c.num_attention_heads, ql = c.q_lora_rank;
  const int64_t g = c.o_groups, r = c.o_lora_rank, f = c.moe_intermediate_size, E = c.num_experts, N = c.hc_mult;
  const int64_t Di = c.index_head_dim, Hi = c.index_n_heads;
  const int64_t attn = d * ql + ql + ql * H * D + d * D + D + H * D * r + g * r * d + H;
  const int64_t moe = E * d + 3 * E * f * d + 3 * d * f;
  const int64_t hc = 2 * ((2 + N) * N * N * d + (2 + N) * N + 3);
  int64_t total = c.vocab_size * d * (c.tie_word_embeddings ? 1 : 2) + d + N * N * d + N + 1;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    total += attn + moe + hc + 2 * d;
    if (c.v4_attn[i] == 1) total += 4 * d * D + c.v4_csa_rate * 2 * D + D + 4 * d * Di + c.v4_csa_rate * 2 * Di + Di + ql * Hi * Di + d * Hi;
    if (c.v4_attn[i] == 2) total += 2 * d * D + c.v4_hca_rate * D + D;
  }
  return total;
}

int64_t deepseek_v4_active_parameters(const DecoderConfig& c) {
  return deepseek_v4_num_parameters(c) -
         c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size;
}

at::Tensor v4_rotate(const at::Tensor& x, const at::Tensor& cos_h, const at::Tensor& sin_h) {
  const at::Tensor cos = cos_h.repeat_interleave(2, -1).unsqueeze(1), sin = sin_h.repeat_interleave(2, -1).unsqueeze(1);
  const int64_t rd = cos.size(-1), dim = x.size(-1);
  const at::Tensor nope = x.narrow(-1, 0, dim - rd), rope = x.narrow(-1, dim - rd, rd);
  const at::Tensor x1 = rope.slice(-1, 0, rd, 2), x2 = rope.slice(-1, 1, rd, 2);
  const at::Tensor rotated = at::stack({-x2, x1}, -1).flatten(-2);
  return at::cat({nope, (rope.to(at::kFloat) * cos + rotated.to(at::kFloat) * sin).to(x.scalar_type())}, -1);
}

V4Rotary::V4Rotary(const DecoderConfig& c)
    : main_([&] {
        DecoderConfig m = c;
        return rope_spec(m);
      }()),
      compress_([&] {
        DecoderConfig m = c;
        m.rope = c.compress_rope;
        return rope_spec(m);
      }()) {}

namespace {
std::pair<at::Tensor, at::Tensor> half(const nn::Rotary& r, const at::Tensor& pos, at::ScalarType dtype) {
  auto [cos, sin] = r.cos_sin(pos);  // [B,T,rd]: the rd / 2 angles twice
  const int64_t h = cos.size(-1) / 2;
  return {cos.narrow(-1, 0, h).to(dtype), sin.narrow(-1, 0, h).to(dtype)};
}
}  // namespace

std::pair<at::Tensor, at::Tensor> V4Rotary::main(const at::Tensor& pos, at::ScalarType dtype) const { return half(main_, pos, dtype); }
std::pair<at::Tensor, at::Tensor> V4Rotary::compress(const at::Tensor& pos, at::ScalarType dtype) const {
  return half(compress_, pos, dtype);
}
void V4Rotary::to(const at::Device& d) {
  main_.to(d);
  compress_.to(d);
}

V4CompressorImpl::V4CompressorImpl(const DecoderConfig& c, int64_t kind)
    : rate(kind == 2 ? c.v4_hca_rate : c.v4_csa_rate), dim(kind == 3 ? c.index_head_dim : c.head_dim), overlap(kind != 2) {
  const int64_t w = overlap ? 2 * dim : dim;
  kv_proj = register_module("kv_proj", nn::Linear(c.hidden_size, w, false));
  gate_proj = register_module("gate_proj", nn::Linear(c.hidden_size, w, false));
  position_bias = register_parameter("position_bias", at::zeros({rate, w}));
  kv_norm = register_module("kv_norm", nn::RMSNorm(dim, c.rms_norm_eps));
  if (kind == 1) indexer = register_module("indexer", std::make_shared<V4CompressorImpl>(c, 3));
  if (kind == 3) {
    heads = c.index_n_heads;
    topk = c.index_topk;
    q_b_proj = register_module("q_b_proj", nn::Linear(c.q_lora_rank, heads * dim, false));
    auto scorer = register_module("scorer", std::make_shared<torch::nn::Module>());
    weights_proj = scorer->register_module("weights_proj", nn::Linear(c.hidden_size, heads, false));
    for (auto& p : parameters()) p.set_requires_grad(false);  // the selection gets no gradient (as transformers')
  }
}

namespace {
// The entries of n complete windows: kv / gate [B,n,rate,w] (the gate with its position bias), windows first..first+n-1
// of the sequence; prev_kv / prev_gate [B,1,rate,dim]: the first-half features of the window before the first one
// (overlapping windows; zeros / -inf before the sequence's first window).
at::Tensor pool_windows(V4CompressorImpl& c, at::Tensor kv, at::Tensor gate, const at::Tensor& prev_kv,
                        const at::Tensor& prev_gate, int64_t first, const V4Rotary& rot) {
  const int64_t b = kv.size(0), n = kv.size(1), dim = c.dim, rate = c.rate;
  if (c.overlap) {  // window w pools window w-1's first half-features (Ca) with its own second half (Cb)
    const at::Tensor pk = at::cat({prev_kv, kv.narrow(1, 0, n - 1).narrow(-1, 0, dim)}, 1);
    const at::Tensor pg = at::cat({prev_gate, gate.narrow(1, 0, n - 1).narrow(-1, 0, dim)}, 1);
    kv = at::cat({pk, kv.narrow(-1, dim, dim)}, 2);
    gate = at::cat({pg, gate.narrow(-1, dim, dim)}, 2);
  }
  at::Tensor pooled = c.kv_norm->forward((kv * gate.softmax(2, at::kFloat).to(kv.scalar_type())).sum(2));
  const at::Tensor pos = ((at::arange(n, kv.options().dtype(at::kLong)) + first) * rate).unsqueeze(0).expand({b, n});
  auto [cos, sin] = rot.compress(pos, pooled.scalar_type());
  return v4_rotate(pooled.unsqueeze(1), cos, sin).squeeze(1);
}
}  // namespace

void v4_cache_reserve(nn::KVCache& cache, int64_t layers) {
  const size_t need = static_cast<size_t>(1 + 6 * layers);
  if (cache.keys.size() < need) {
    cache.keys.resize(need);
    cache.values.resize(need);
  }
}

at::Tensor& v4_cache_keys(nn::KVCache& cache, int64_t layer) { return cache.keys.at(static_cast<size_t>(1 + 6 * layer)); }

V4CompressorState v4_cache_state(nn::KVCache& cache, int64_t layer, bool indexer) {
  const size_t s = static_cast<size_t>(1 + 6 * layer);
  auto &k = cache.keys, &v = cache.values;
  if (!indexer) return {&v.at(s), &k.at(s + 1), &v.at(s + 1), &k.at(s + 2), &v.at(s + 2)};
  return {&k.at(s + 3), &v.at(s + 3), &k.at(s + 4), &v.at(s + 4), &k.at(s + 5)};
}

at::Tensor V4CompressorImpl::compress(const at::Tensor& x, const V4Rotary& rot, const V4CompressorState* st) {
  const int64_t b = x.size(0);
  // the whole sequence from position 0 (projected first: a sequence-parallel entry gathers it)
  if (!st) return pool(kv_proj->forward(x), gate_proj->forward(x), rot);
  // generation: the pending rows of the incomplete window, then x's
  at::Tensor kv = kv_proj->forward(x), gate = gate_proj->forward(x);  // [B,t,w]
  if (st->pending_kv->defined()) {
    kv = at::cat({*st->pending_kv, kv}, 1);
    gate = at::cat({*st->pending_gate, gate}, 1);
  }
  at::Tensor out = st->entries->defined() ? *st->entries : at::zeros({b, 0, dim}, x.options());
  const int64_t n = kv.size(1) / rate, first = out.size(1);
  if (n > 0) {
    const at::Tensor wkv = kv.narrow(1, 0, n * rate).view({b, n, rate, -1});
    const at::Tensor wg = gate.narrow(1, 0, n * rate).view({b, n, rate, -1}) + position_bias;
    at::Tensor pk = *st->prev_kv, pg = *st->prev_gate;
    if (overlap && !pk.defined()) {
      pk = at::zeros({b, 1, rate, dim}, kv.options());
      pg = at::full({b, 1, rate, dim}, -kInf, gate.options());
    }
    out = at::cat({out, pool_windows(*this, wkv, wg, pk, pg, first, rot)}, 1);
    if (overlap) {
      *st->prev_kv = wkv.narrow(1, n - 1, 1).narrow(-1, 0, dim).clone();
      *st->prev_gate = wg.narrow(1, n - 1, 1).narrow(-1, 0, dim).clone();
    }
  }
  *st->entries = out;
  *st->pending_kv = kv.narrow(1, n * rate, kv.size(1) - n * rate).clone();
  *st->pending_gate = gate.narrow(1, n * rate, gate.size(1) - n * rate).clone();
  return out;
}

at::Tensor V4CompressorImpl::pool(const at::Tensor& kv_all, const at::Tensor& gate_all, const V4Rotary& rot) {
  const int64_t b = kv_all.size(0), n = kv_all.size(1) / rate;
  if (n == 0) return at::zeros({b, 0, dim}, kv_all.options());
  const at::Tensor kv = kv_all.narrow(1, 0, n * rate).view({b, n, rate, -1});
  const at::Tensor gate = gate_all.narrow(1, 0, n * rate).view({b, n, rate, -1}) + position_bias;
  const at::Tensor pk = overlap ? at::zeros({b, 1, rate, dim}, kv.options()) : at::Tensor();
  const at::Tensor pg = overlap ? at::full({b, 1, rate, dim}, -kInf, gate.options()) : at::Tensor();
  return pool_windows(*this, kv, gate, pk, pg, 0, rot);
}

at::Tensor V4CompressorImpl::select(const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& pos,
                                    const at::Tensor& cos, const at::Tensor& sin, const V4Rotary& rot,
                                    const V4CompressorState* state) {
  at::NoGradGuard no_grad;
  return select_from(compress(x, rot, state), x, q_resid, pos, cos, sin);
}

at::Tensor V4CompressorImpl::select_from(const at::Tensor& keys, const at::Tensor& x, const at::Tensor& q_resid,
                                         const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin) {
  at::NoGradGuard no_grad;
  const int64_t b = q_resid.size(0), t = q_resid.size(1);  // (the whole sequence under sequence parallelism)
  const int64_t n = keys.size(1);  // keys [B,n,Di]
  at::Tensor q = q_b_proj->forward(q_resid).view({b, t, heads, dim}).transpose(1, 2);
  q = v4_rotate(q, cos, sin).transpose(1, 2);  // [B,T,Hi,Di]
  at::Tensor scores = at::matmul(q.to(at::kFloat), keys.transpose(-1, -2).to(at::kFloat).unsqueeze(1));  // [B,T,Hi,n]
  scores = at::relu(scores) * std::pow(static_cast<double>(dim), -0.5);
  const at::Tensor w = weights_proj->forward(x).to(at::kFloat) * std::pow(static_cast<double>(heads), -0.5);
  at::Tensor index = (scores * w.unsqueeze(-1)).sum(2);  // [B,T,n]
  const int64_t k = std::min(topk, n);
  if (n == 0) return at::zeros({b, t, 0}, pos.options());
  const at::Tensor threshold = at::floor_divide(pos + 1, rate).unsqueeze(-1);  // entries a query may see: < this
  index = index.masked_fill(at::arange(n, pos.options()).view({1, 1, n}) >= threshold, -kInf);
  const at::Tensor top = std::get<1>(index.topk(k, -1));
  return at::where(top >= threshold, at::full_like(top, -1), top);
}

V4AttentionImpl::V4AttentionImpl(const DecoderConfig& c, int64_t layer_idx)
    : nn::AttentionHook(c.num_attention_heads, 1, c.layer_window.at(layer_idx)), kind(c.v4_attn.at(layer_idx)),
      head_dim(c.head_dim), groups(c.o_groups), layer_idx(layer_idx), total_heads(c.num_attention_heads),
      eps(c.rms_norm_eps) {
  const int64_t d = c.hidden_size;
  q_a_proj = register_module("q_a_proj", nn::Linear(d, c.q_lora_rank, false));
  q_a_norm = register_module("q_a_norm", nn::RMSNorm(c.q_lora_rank, c.rms_norm_eps));
  q_b_proj = register_module("q_b_proj", nn::Linear(c.q_lora_rank, heads * head_dim, false));
  kv_proj = register_module("kv_proj", nn::Linear(d, head_dim, false));
  kv_norm = register_module("kv_norm", nn::RMSNorm(head_dim, c.rms_norm_eps));
  o_a_proj = register_module("o_a_proj", nn::Linear(heads * head_dim / groups, groups * c.o_lora_rank, false));
  o_b_proj = register_module("o_b_proj", nn::Linear(groups * c.o_lora_rank, d, false));
  sinks = register_parameter("sinks", at::zeros({heads}));
  if (kind != 0) compressor = register_module("compressor", V4Compressor(c, kind));
}

at::Tensor V4AttentionImpl::forward(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& cos,
                                    const at::Tensor& sin, const at::Tensor& cos_c, const at::Tensor& sin_c,
                                    const V4Rotary& rot, nn::KVCache* cache) {
  if (attention_fn) throw Error("deepseek_v4: its attention takes no attention_fn (internal)");
  const bool in_parts = parts.has_value() && !cache;  // context parallelism
  // b, t from the query latent: under sequence parallelism x holds this rank's part of the sequence and the
  // projections' entries gather the whole of it
  const at::Tensor q_resid = q_a_norm->forward(q_a_proj->forward(x));
  const int64_t b = q_resid.size(0), t = q_resid.size(1);
  at::Tensor q = unweighted_rms(q_b_proj->forward(q_resid).view({b, t, heads, head_dim}).transpose(1, 2), eps);
  q = v4_rotate(q, cos, sin);
  at::Tensor kv = v4_rotate(kv_norm->forward(kv_proj->forward(x)).view({b, t, 1, head_dim}).transpose(1, 2), cos, sin);
  at::Tensor entries, top;  // context parallelism: the whole sequence's compressed entries, the indexer's picks
  if (in_parts) {
    // the whole sequence's key / value head and compressor projections, gathered at once
    std::vector<at::Tensor> local{kv};
    if (compressor) {
      local.push_back(compressor->kv_proj->forward(x).unsqueeze(1));
      local.push_back(compressor->gate_proj->forward(x).unsqueeze(1));
    }
    const at::Tensor all = gather_parts(at::cat(local, -1), *parts);  // [B,1,T,D (+2w)]
    kv = all.narrow(-1, 0, head_dim);
    if (compressor) {
      const int64_t w = (all.size(-1) - head_dim) / 2;
      entries = compressor->pool(all.narrow(-1, head_dim, w).squeeze(1), all.narrow(-1, head_dim + w, w).squeeze(1), rot);
      if (const auto& ix = compressor->indexer) {
        at::NoGradGuard no_grad;
        const at::Tensor il = at::cat({ix->kv_proj->forward(x), ix->gate_proj->forward(x)}, -1).unsqueeze(1);
        const at::Tensor ia = gather_parts(il, *parts).squeeze(1);
        const int64_t iw = ia.size(-1) / 2;
        top = ix->select_from(ix->pool(ia.narrow(-1, 0, iw), ia.narrow(-1, iw, iw), rot), x, q_resid, pos, cos_c, sin_c);
      }
    }
  }
  int64_t kept = 0;  // generation: the cached keys before x's (the last window - 1 positions)
  if (cache) {
    at::Tensor& held = v4_cache_keys(*cache, layer_idx);
    if (held.defined()) {
      kept = held.size(2);
      kv = at::cat({held, kv}, 2);
    }
    const int64_t keep = std::min<int64_t>(window - 1, kv.size(2));
    held = kv.narrow(2, kv.size(2) - keep, keep).clone();
  }
  const int64_t tk = kv.size(2);
  // the sliding window: key j visible to query i when i - window < j <= i (query i is key kept + i)
  // (context parallelism: this rank's queries at their places in the whole sequence)
  const at::Tensor i = (in_parts ? part_positions(*parts, t, pos.options()) : at::arange(t, pos.options()) + kept).unsqueeze(1);
  const at::Tensor j = at::arange(tk, pos.options()).unsqueeze(0);
  at::Tensor mask = at::zeros({t, tk}, q.options()).masked_fill((j > i) | (j <= i - window), -kInf).expand({b, 1, t, tk});
  if (compressor) {
    V4CompressorState cs{}, is{};
    if (cache) cs = v4_cache_state(*cache, layer_idx, false), is = v4_cache_state(*cache, layer_idx, true);
    if (!in_parts) entries = compressor->compress(x, rot, cache ? &cs : nullptr);  // [B,n,D]
    const int64_t n = entries.size(1);
    at::Tensor bias;
    if (compressor->indexer) {  // only the indexer's picks
      if (!in_parts) top = compressor->indexer->select(x, q_resid, pos, cos_c, sin_c, rot, cache ? &is : nullptr);
      const at::Tensor safe = at::where(top >= 0, top, at::full_like(top, n));
      bias = at::full({b, 1, t, n + 1}, -kInf, q.options()).scatter(-1, safe.unsqueeze(1), 0.0).narrow(-1, 0, n);
    } else {  // every complete window before the query
      const at::Tensor threshold = at::floor_divide(pos + 1, compressor->rate).view({b, 1, t, 1});
      bias = at::zeros({b, 1, t, n}, q.options()).masked_fill(at::arange(n, pos.options()).view({1, 1, 1, n}) >= threshold, -kInf);
    }
    kv = at::cat({kv, entries.unsqueeze(1)}, 2);
    mask = at::cat({mask, bias}, -1);
  }
  at::Tensor scores = at::matmul(q, kv.transpose(2, 3)) * std::pow(static_cast<double>(head_dim), -0.5) + mask;
  scores = at::cat({scores, sinks.to(scores.scalar_type()).view({1, heads, 1, 1}).expand({b, heads, t, 1})}, -1);
  scores = scores - std::get<0>(scores.max(-1, true));
  const at::Tensor probs = scores.softmax(-1).narrow(-1, 0, scores.size(-1) - 1).to(kv.scalar_type());
  at::Tensor o = v4_rotate(at::matmul(probs, kv), cos, -sin).transpose(1, 2);  // [B,T,H,D], rotated back
  const int64_t g = groups * heads / total_heads, in = heads * head_dim / g;  // this rank's groups of heads
  const at::Tensor w = o_a_proj->weight.view({g, -1, in});
  o = at::einsum("btgi,gri->btgr", {o.reshape({b, t, g, in}), w}).reshape({b, t, -1});
  return o_b_proj->forward(o);
}

nn::MoEOptions v4_moe_options(const DecoderConfig& c, bool hash) {
  nn::MoEOptions o;
  o.num_experts = c.num_experts;
  o.top_k = c.num_experts_per_tok;
  o.hidden = c.hidden_size;
  o.expert_ffn = c.moe_intermediate_size;
  o.scoring = c.moe_scoring;  // sqrtsoftplus | sigmoid
  o.norm_topk_prob = true;
  o.score_correction_bias = !hash;
  o.hash_vocab = hash ? c.vocab_size : 0;
  o.routed_scaling_factor = c.routed_scaling_factor;
  o.shared_ffn = c.moe_intermediate_size;
  o.act = "silu";
  o.swiglu_limit = c.swiglu_limit;
  o.lb_softmax_topk = true;  // load_balancing_loss_func: softmax of the logits and its own top-k
  o.aux_loss_coef = c.router_aux_loss_coef;
  return o;
}

V4HyperConnectionImpl::V4HyperConnectionImpl(const DecoderConfig& c, bool head)
    : n(c.hc_mult), iters(c.hc_sinkhorn_iters), eps(c.rms_norm_eps), hc_eps(c.hc_eps) {
  const int64_t out = head ? n : (2 + n) * n;
  fn = register_parameter(head ? "hc_fn" : "fn", at::zeros({out, n * c.hidden_size}));
  base = register_parameter(head ? "hc_base" : "base", at::zeros({out}));
  scale = register_parameter(head ? "hc_scale" : "scale", at::ones({head ? 1 : 3}));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> V4HyperConnectionImpl::forward(const at::Tensor& h) {
  // float32 also under bf16 autocast, as transformers keeps attn_hc / ffn_hc / hc_head in fp32
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const int64_t b = h.size(0), t = h.size(1);
  const at::Tensor mix = at::linear(unweighted_rms(h.reshape({b, t, -1}).to(at::kFloat), eps), fn.to(at::kFloat));
  const auto w = mix.split({n, n, n * n}, -1);
  const auto bb = base.split({n, n, n * n});
  const at::Tensor pre = at::sigmoid(w[0] * scale[0] + bb[0]) + hc_eps;
  const at::Tensor post = 2 * at::sigmoid(w[1] * scale[1] + bb[1]);
  at::Tensor comb = at::softmax(w[2].view({b, t, n, n}) * scale[2] + bb[2].view({n, n}), -1) + hc_eps;
  comb = comb / (comb.sum(-2, true) + hc_eps);
  for (int64_t i = 0; i + 1 < iters; ++i) {
    comb = comb / (comb.sum(-1, true) + hc_eps);
    comb = comb / (comb.sum(-2, true) + hc_eps);
  }
  const at::Tensor collapsed = (pre.unsqueeze(-1) * h).sum(2).to(h.scalar_type());
  return {post, comb, collapsed};
}

at::Tensor V4HyperConnectionImpl::collapse(const at::Tensor& h) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::Tensor flat = unweighted_rms(h.flatten(2).to(at::kFloat), eps);
  const at::Tensor pre = at::sigmoid(at::linear(flat, fn.to(at::kFloat)) * scale.to(at::kFloat) + base.to(at::kFloat)) + hc_eps;
  return (pre.unsqueeze(-1) * h).sum(2).to(h.scalar_type());
}

V4DecoderLayerImpl::V4DecoderLayerImpl(const DecoderConfig& c, int64_t idx) : compress_rope(c.v4_attn.at(idx) != 0) {
  self_attn = register_module("self_attn", V4Attention(c, idx));
  mlp = register_module("mlp", nn::MoE(v4_moe_options(c, c.v4_hash.at(idx) != 0)));
  input_layernorm = register_module("input_layernorm", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  attn_hc = register_module("attn_hc", V4HyperConnection(c, false));
  ffn_hc = register_module("ffn_hc", V4HyperConnection(c, false));
}

at::Tensor V4DecoderLayerImpl::forward(const at::Tensor& h_in, const Batch& in, const V4Rotary& rot, nn::KVCache* cache) {
  const auto dtype = h_in.scalar_type();
  const at::Tensor &cos_c = in.at("cos_compress"), &sin_c = in.at("sin_compress");
  const at::Tensor& cos = compress_rope ? cos_c : in.at("cos");
  const at::Tensor& sin = compress_rope ? sin_c : in.at("sin");
  auto [post, comb, collapsed] = attn_hc->forward(h_in);
  const at::Tensor x = input_layernorm->forward(collapsed), &pos = in.at("position_ids"), seg = in.get("segment_ids");
  at::Tensor a;
  if (!seg.defined()) {
    a = self_attn->forward(x, pos, cos, sin, cos_c, sin_c, rot, cache);
  } else {
    // packed documents: each document's attention on its own (its window, compressed entries and indexer start at
    // the document's first token, whose position is 0), as if it were its own sequence
    if (cache) throw Error("deepseek_v4: packed documents (segment_ids) are not supported with a cache (generation)");
    if (x.size(1) != pos.size(1))
      throw OptionError("sp", "deepseek_v4: packed documents under sequence parallelism are not supported yet");
    if (self_attn->parts)
      throw OptionError("cp", "deepseek_v4: packed documents under context parallelism are not supported yet");
    const at::ScalarType rope_dtype = in.at("cos").scalar_type();
    const auto docs = packed_documents(seg);
    auto attend = [&](const std::vector<at::Tensor>& d) {  // d: the document's x [1, len, hidden], positions [1, len]
      auto [dc, ds] = rot.main(d[1], rope_dtype);
      auto [dcc, dsc] = rot.compress(d[1], rope_dtype);
      return self_attn->forward(d[0], d[1], compress_rope ? dcc : dc, compress_rope ? dsc : ds, dcc, dsc, rot, nullptr);
    };
    a = docs.empty() ? self_attn->forward(x, pos, cos, sin, cos_c, sin_c, rot, nullptr) : per_document(docs, {x, pos}, attend);
  }
  at::Tensor h = post.to(dtype).unsqueeze(-1) * a.unsqueeze(-2) + at::matmul(comb.to(dtype).transpose(-1, -2), h_in);
  std::tie(post, comb, collapsed) = ffn_hc->forward(h);
  const at::Tensor m = mlp->forward(post_attention_layernorm->forward(collapsed), in.get("input_ids"));
  return post.to(dtype).unsqueeze(-1) * m.unsqueeze(-2) + at::matmul(comb.to(dtype).transpose(-1, -2), h);
}

Batch v4_block_inputs(const V4Rotary& rot, const at::Tensor& input_ids, const at::Tensor& pos, at::ScalarType dtype,
                      const at::Tensor& segment_ids) {
  auto [cos, sin] = rot.main(pos, dtype);
  auto [cos_c, sin_c] = rot.compress(pos, dtype);
  return Batch{{"cos", cos}, {"sin", sin}, {"cos_compress", cos_c}, {"sin_compress", sin_c}, {"position_ids", pos},
               {"input_ids", input_ids}, {"segment_ids", segment_ids}};
}

void v4_init_weights(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& item : m.named_parameters()) {
    const std::string& n = item.key();
    if (n.ends_with(".sinks") || n.ends_with("_hc.base") || n.ends_with("hc_base") || n.ends_with("position_bias")) item.value().zero_();
    if (n.ends_with("_hc.scale") || n.ends_with("hc_scale")) item.value().fill_(1.0);
  }
}

std::string v4_checkpoint_name(const std::string& memory_name) {
  if (memory_name == "lm_head.weight") return "head.weight";
  std::string s = memory_name;
  const auto rep = [&](const std::string& from, const std::string& to) {
    if (const size_t p = s.find(from); p != std::string::npos) s.replace(p, from.size(), to);
  };
  rep(".shared_experts.gate_proj.", ".shared_experts.w1.");
  rep(".shared_experts.up_proj.", ".shared_experts.w3.");
  rep(".shared_experts.down_proj.", ".shared_experts.w2.");
  rep(".compressor.indexer.q_b_proj.", ".indexer.wq_b.");
  rep(".compressor.indexer.scorer.weights_proj.", ".indexer.weights_proj.");
  rep(".compressor.indexer.", ".indexer.compressor.");
  rep(".self_attn.", ".attn.");
  rep(".mlp.", ".ffn.");
  rep(".input_layernorm.", ".attn_norm.");
  rep(".post_attention_layernorm.", ".ffn_norm.");
  rep(".attn_hc.", ".hc_attn_");
  rep(".ffn_hc.", ".hc_ffn_");
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {".q_a_proj.", ".wq_a."}, {".q_a_norm.", ".q_norm."}, {".q_b_proj.", ".wq_b."}, {".kv_proj.", ".wkv."},
           {".gate_proj.", ".wgate."}, {".kv_norm.", ".norm."}, {".o_a_proj.", ".wo_a."}, {".o_b_proj.", ".wo_b."},
           {".gate.e_score_correction_bias", ".gate.bias"}})
    rep(from, to);
  if (s.ends_with(".sinks")) s = s.substr(0, s.size() - 6) + ".attn_sink";
  if (s.ends_with(".position_bias")) s = s.substr(0, s.size() - 14) + ".ape";
  return s;
}

std::string v4_canonical_name(const std::string& stored) {
  if (stored == "embed.weight") return "model.embed_tokens.weight";
  if (stored == "norm.weight") return "model.norm.weight";
  for (const char* part : {"fn", "base", "scale"})
    if (stored == std::string("hc_head_") + part) return std::string("model.hc_head.hc_") + part;
  if (stored.starts_with("layers.")) return "model." + stored;
  return stored;
}

std::vector<CheckpointTensor> v4_checkpoint_tensors(const torch::nn::Module& m, const DecoderConfig& c) {
  std::vector<CheckpointTensor> out;
  const int64_t f = c.moe_intermediate_size;
  for (const auto& item : m.named_parameters()) {
    const std::string& name = item.key();
    const bool gu = name.ends_with(".experts.gate_up_proj"), down = name.ends_with(".experts.down_proj");
    if (!gu && !down) {
      out.push_back({v4_checkpoint_name(name), name});
      continue;
    }
    const std::string prefix = v4_checkpoint_name(name.substr(0, name.rfind('.') + 1));  // "...ffn.experts."
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string p = prefix + std::to_string(e) + ".";
      if (gu) {
        out.push_back({p + "w1.weight", name, e, 0, f});
        out.push_back({p + "w3.weight", name, e, f, 2 * f});
      } else {
        out.push_back({p + "w2.weight", name, e, 0, c.hidden_size});
      }
    }
  }
  for (const auto& item : m.named_buffers())
    if (item.key().ends_with(".tid2eid") || item.key().ends_with(".e_score_correction_bias"))
      out.push_back({v4_checkpoint_name(item.key()), item.key(), -1, 0, 0, true});
  return out;
}

}  // namespace lf::models::llama

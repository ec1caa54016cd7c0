// The T5 / UMT5 text encoder on the model contract (models/text_encoder/t5.h).
#include "loongforge/models/text_encoder/t5.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::models::text_encoder {

namespace {

// transformers' ACT2FN entries the feed-forward takes.
at::Tensor activation(const std::string& name, const at::Tensor& x) {
  if (name == "relu") return at::relu(x);
  if (name == "gelu") return at::gelu(x);
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  if (name == "silu" || name == "swish") return at::silu(x);
  throw Error("unreachable activation " + name);
}

bool known_activation(const std::string& name) {
  for (const char* a : {"relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu", "swish"})
    if (name == a) return true;
  return false;
}

// The additive mask value of padded keys (torch.finfo(dtype).min, as transformers' masks).
double lowest(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return std::numeric_limits<double>::lowest();
    case at::kBFloat16: return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf: return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    default: return static_cast<double>(std::numeric_limits<float>::lowest());
  }
}

nn::Linear linear(int64_t in, int64_t out) { return nn::Linear(in, out, false); }

// The dump batch's [B,T] tensor `name` (int64; the attention mask may be bool), shaped like `like` when given.
at::Tensor batch_tensor(const std::map<std::string, at::Tensor>& batch, const std::string& file, const std::string& name,
                        const at::Tensor& like = {}) {
  auto it = batch.find(name);
  if (it == batch.end()) throw file_error(file, name, "missing");
  const at::Tensor& t = it->second;
  const bool ok_type = t.scalar_type() == at::kLong || (like.defined() && t.scalar_type() == at::kBool);
  if (!ok_type || t.dim() != 2)
    throw file_error(file, name, "expected int64 [B,T], got " + std::string(c10::toString(t.scalar_type())) + " with " +
                                     std::to_string(t.dim()) + " dims");
  if (like.defined() && t.sizes() != like.sizes()) throw file_error(file, name, "shape differs from input_ids");
  return t;
}

}  // namespace

T5Config T5Config::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  T5Config c;
  c.raw = j;
  c.model_type = r.string("model_type");
  if (c.model_type != "t5" && c.model_type != "umt5")
    r.fail("model_type", "'" + c.model_type + "' is not a T5 encoder (known: t5, umt5)");
  const bool umt5 = c.model_type == "umt5";
  c.vocab_size = r.integer("vocab_size", umt5 ? 250112 : 32128);
  c.d_model = r.integer("d_model", 512);
  c.d_kv = r.integer("d_kv", 64);
  c.d_ff = r.integer("d_ff", umt5 ? 1024 : 2048);
  c.num_layers = r.integer("num_layers", umt5 ? 8 : 6);
  c.num_heads = r.integer("num_heads", umt5 ? 6 : 8);
  c.relative_attention_num_buckets = r.integer("relative_attention_num_buckets", 32);
  c.relative_attention_max_distance = r.integer("relative_attention_max_distance", 128);
  c.layer_norm_epsilon = r.number("layer_norm_epsilon", 1e-6);
  c.initializer_factor = r.number("initializer_factor", 1.0);
  for (const char* k : {"vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"})
    if (r.integer(k, 1) <= 0) r.fail(k, "must be positive");
  // bidirectional buckets: half per direction, half of those exact, the rest logarithmic up to max_distance
  if (c.relative_attention_num_buckets < 4)
    r.fail("relative_attention_num_buckets", "must be at least 4 (an encoder's buckets are split by direction, then "
                                             "into exact and logarithmic halves)");
  if (c.relative_attention_max_distance <= c.relative_attention_num_buckets / 4)
    r.fail("relative_attention_max_distance", "must exceed relative_attention_num_buckets / 4 (the exact buckets)");
  if (r.boolean("is_decoder", false))
    r.fail("is_decoder", "true: LoongForge builds the encoder of a T5 model only (is_decoder must be false)");
  c.feed_forward_proj = r.string("feed_forward_proj", umt5 ? "gated-gelu" : "relu");
  const std::string& f = c.feed_forward_proj;
  const size_t dash = f.find('-');
  c.gated = dash != std::string::npos;
  if (c.gated && (f.substr(0, dash) != "gated" || f.find('-', dash + 1) != std::string::npos))
    r.fail("feed_forward_proj", "'" + f + "' is not 'gated-ACT' or 'ACT' (e.g. 'gated-gelu', 'relu')");
  c.act = c.gated ? f.substr(dash + 1) : f;
  if (f == "gated-gelu") c.act = "gelu_new";  // transformers' T5Config
  if (!known_activation(c.act))
    r.fail("feed_forward_proj", "activation '" + c.act + "' is not supported (known: relu, gelu, gelu_new, "
                                "gelu_pytorch_tanh, silu, swish)");
  if (r.has("architectures")) {
    const nlohmann::json& a = r.get("architectures");
    if (!a.is_array()) r.fail("architectures", "expected a list of class names");
    const std::string p = umt5 ? "UMT5" : "T5";
    for (const auto& name : a) {
      const std::string n = name.is_string() ? name.get<std::string>() : name.dump();
      if (n != p + "EncoderModel" && n != p + "ForConditionalGeneration" && n != p + "Model")
        r.fail("architectures", "'" + n + "' is not a class whose encoder LoongForge loads (known: " + p +
                                    "EncoderModel, " + p + "ForConditionalGeneration, " + p + "Model)");
    }
  }
  return c;
}

int64_t T5Config::num_parameters() const {
  const int64_t attention = 4 * d_model * inner_dim(), ffn = (gated ? 3 : 2) * d_model * d_ff;
  const int64_t tables = (model_type == "umt5" ? num_layers : 1) * relative_attention_num_buckets * num_heads;
  return vocab_size * d_model + num_layers * (attention + ffn + 2 * d_model) + tables + d_model;
}

at::Tensor relative_position_buckets(int64_t length, int64_t num_buckets, int64_t max_distance) {
  // transformers' _relative_position_bucket(memory - context, bidirectional=True), op for op (the float32 logs
  // decide the bucket edges)
  const at::Tensor pos = at::arange(length, at::kLong);
  at::Tensor rel = pos.unsqueeze(0) - pos.unsqueeze(1);  // [query, key]: key - query
  const int64_t half = num_buckets / 2, max_exact = half / 2;
  at::Tensor buckets = (rel > 0).to(at::kLong) * half;
  rel = rel.abs();
  at::Tensor large = max_exact + (at::log(rel.to(at::kFloat) / static_cast<double>(max_exact)) /
                                  std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                                  static_cast<double>(half - max_exact))
                                     .to(at::kLong);
  large = at::minimum(large, at::full_like(large, half - 1));
  return buckets + at::where(rel < max_exact, rel, large);
}

T5AttentionImpl::T5AttentionImpl(const T5Config& c, bool relative_bias)
    : heads_(c.num_heads),
      d_kv_(c.d_kv),
      buckets_(c.relative_attention_num_buckets),
      max_distance_(c.relative_attention_max_distance) {
  q = register_module("q", linear(c.d_model, c.inner_dim()));
  k = register_module("k", linear(c.d_model, c.inner_dim()));
  v = register_module("v", linear(c.d_model, c.inner_dim()));
  o = register_module("o", linear(c.inner_dim(), c.d_model));
  if (relative_bias)
    relative_attention_bias =
        register_module("relative_attention_bias", torch::nn::Embedding(c.relative_attention_num_buckets, c.num_heads));
}

at::Tensor T5AttentionImpl::position_bias(int64_t length) {
  const at::Tensor& w = relative_attention_bias->weight;
  at::Tensor b = relative_position_buckets(length, buckets_, max_distance_).to(w.device());
  return at::embedding(w, b).permute({2, 0, 1}).unsqueeze(0);  // [1, H, T, T]
}

at::Tensor T5AttentionImpl::forward(const at::Tensor& x, const at::Tensor& bias) {
  const int64_t b = x.size(0), t = x.size(1);
  auto split = [&](const at::Tensor& y) { return y.view({b, t, heads_, d_kv_}).transpose(1, 2); };
  // no 1/sqrt(d_kv) scaling: T5 folds it into the initialisation
  at::Tensor scores = at::matmul(split(q(x)), split(k(x)).transpose(2, 3)) + bias;
  at::Tensor out = at::matmul(at::softmax(scores, -1), split(v(x)));
  return o(out.transpose(1, 2).reshape({b, t, heads_ * d_kv_}));
}

T5LayerSelfAttentionImpl::T5LayerSelfAttentionImpl(const T5Config& c, bool relative_bias) {
  SelfAttention = register_module("SelfAttention", T5Attention(c, relative_bias));
  layer_norm = register_module("layer_norm", nn::RMSNorm(c.d_model, c.layer_norm_epsilon));
}

T5DenseImpl::T5DenseImpl(const T5Config& c) : act_(c.act) {
  if (c.gated) {
    wi_0 = register_module("wi_0", linear(c.d_model, c.d_ff));
    wi_1 = register_module("wi_1", linear(c.d_model, c.d_ff));
  } else {
    wi = register_module("wi", linear(c.d_model, c.d_ff));
  }
  wo = register_module("wo", linear(c.d_ff, c.d_model));
}

at::Tensor T5DenseImpl::forward(const at::Tensor& x) {
  if (wi) return wo(activation(act_, wi(x)));
  return wo(activation(act_, wi_0(x)) * wi_1(x));
}

T5LayerFFImpl::T5LayerFFImpl(const T5Config& c) {
  DenseReluDense = register_module("DenseReluDense", T5Dense(c));
  layer_norm = register_module("layer_norm", nn::RMSNorm(c.d_model, c.layer_norm_epsilon));
}

T5BlockImpl::T5BlockImpl(const T5Config& c, bool relative_bias) {
  layer = register_module("layer", torch::nn::ModuleList());
  layer->push_back(T5LayerSelfAttention(c, relative_bias));
  layer->push_back(T5LayerFF(c));
}

T5LayerSelfAttentionImpl* T5BlockImpl::self_attention() const { return (*layer)[0]->as<T5LayerSelfAttentionImpl>(); }
T5LayerFFImpl* T5BlockImpl::feed_forward() const { return (*layer)[1]->as<T5LayerFFImpl>(); }

at::Tensor T5BlockImpl::forward(const at::Tensor& h, const at::Tensor& mask, const at::Tensor& shared_bias) {
  auto* sa = self_attention();
  at::Tensor bias = shared_bias;
  if (!bias.defined()) {
    bias = sa->SelfAttention->relative_attention_bias ? sa->SelfAttention->position_bias(h.size(1)).to(h.scalar_type())
                                                      : at::zeros({1, 1, h.size(1), h.size(1)}, h.options());
    if (mask.defined()) bias = bias + mask;
  }
  at::Tensor x = h + sa->SelfAttention(sa->layer_norm(h), bias);
  auto* ff = feed_forward();
  return x + ff->DenseReluDense(ff->layer_norm(x));
}

T5StackImpl::T5StackImpl(const T5Config& c) : c_(c) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.d_model));
  block = register_module("block", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i) block->push_back(T5Block(c, c.bias_in_block(i)));
  final_layer_norm = register_module("final_layer_norm", nn::RMSNorm(c.d_model, c.layer_norm_epsilon));
}

at::Tensor T5StackImpl::forward(const at::Tensor& ids, const at::Tensor& mask) {
  at::Tensor h = embed_tokens(ids);
  at::Tensor additive;  // [B,1,1,T]: 0 at tokens, the dtype's lowest value at padding
  if (mask.defined())
    additive = at::zeros(mask.sizes(), h.options()).masked_fill(mask == 0, lowest(h.scalar_type())).view(
        {mask.size(0), 1, 1, mask.size(1)});
  at::Tensor shared;  // T5: block 0's position bias (+ mask), reused by every block
  for (size_t i = 0; i < block->size(); ++i) {
    auto* b = (*block)[i]->as<T5BlockImpl>();
    if (c_.model_type == "t5" && i == 0) {
      shared = b->self_attention()->SelfAttention->position_bias(h.size(1)).to(h.scalar_type());
      if (additive.defined()) shared = shared + additive;
    }
    h = b->forward(h, additive, shared);
  }
  return final_layer_norm(h);
}

T5EncoderImpl::T5EncoderImpl(T5Config c) : config_(std::move(c)) {
  encoder = register_module("encoder", T5Stack(config_));
  written_ = config_.raw;
  written_["architectures"] = nlohmann::json::array({config_.encoder_class()});
  written_["is_encoder_decoder"] = false;  // as T5EncoderModel sets it on its config
  written_["use_cache"] = false;
}

void T5EncoderImpl::init_weights(double std) {
  at::NoGradGuard no_grad;
  const double f = config_.initializer_factor, d = static_cast<double>(config_.d_model);
  const double inner = static_cast<double>(config_.inner_dim()), ff = static_cast<double>(config_.d_ff);
  for (auto& item : named_parameters()) {
    const std::string& n = item.key();
    at::Tensor& p = item.value();
    if (n.find("layer_norm") != std::string::npos) {
      p.fill_(std < 0 ? f : 1.0);
    } else if (std >= 0) {
      p.normal_(0.0, std);
    } else if (n == "encoder.embed_tokens.weight") {
      p.normal_(0.0, f);
    } else if (n.ends_with("SelfAttention.q.weight")) {
      p.normal_(0.0, f / std::sqrt(d * static_cast<double>(config_.d_kv)));
    } else if (n.ends_with("SelfAttention.k.weight") || n.ends_with("SelfAttention.v.weight") ||
               n.ends_with("relative_attention_bias.weight") || n.find(".wi") != std::string::npos) {
      p.normal_(0.0, f / std::sqrt(d));
    } else if (n.ends_with("SelfAttention.o.weight")) {
      p.normal_(0.0, f / std::sqrt(inner));
    } else if (n.ends_with("DenseReluDense.wo.weight")) {
      p.normal_(0.0, f / std::sqrt(ff));
    } else {
      throw Error("T5 init_weights: no rule for parameter " + n);
    }
  }
}

BatchSchema T5EncoderImpl::batch_schema() const {
  BatchField ids;
  ids.name = "input_ids";
  ids.doc = "token ids [B,T] (a caption each row, padded at the end)";
  BatchField mask;
  mask.name = "attention_mask";
  mask.required = false;
  mask.doc = "[B,T]: 1 at tokens, 0 at padding (absent: every position a token)";
  return {ids, mask};
}

int64_t T5EncoderImpl::loss_terms(const Batch& b) const {
  const at::Tensor m = b.get("attention_mask");
  return m.defined() ? (m != 0).sum().item<int64_t>() : b.at("input_ids").numel();
}

double T5EncoderImpl::train_flops_per_sample(int64_t seq) const {
  const T5Config& c = config_;
  const double s = static_cast<double>(seq);
  const double dense = static_cast<double>(c.num_parameters() - c.vocab_size * c.d_model);
  return (6.0 * dense + 12.0 * static_cast<double>(c.num_layers * c.inner_dim()) * s) * s;
}

at::Tensor T5EncoderImpl::forward_whole(const Batch& b) { return encoder(b.at("input_ids"), b.get("attention_mask")); }

at::Tensor T5EncoderImpl::head_loss_sum(const at::Tensor& h, const Batch& b) {
  at::Tensor sq = h.to(at::kFloat).pow(2).mean(-1);  // [B,T]
  const at::Tensor m = b.get("attention_mask");
  if (m.defined()) sq = sq * (m != 0).to(at::kFloat);
  return sq.sum();
}

Model::ReferenceOutput T5EncoderImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                       const std::string& file) {
  const at::Tensor ids = batch_tensor(batch, file, "input_ids");
  at::Tensor mask;
  if (batch.count("attention_mask")) mask = batch_tensor(batch, file, "attention_mask", ids).to(at::kLong);
  const int64_t vocab = config_.vocab_size;
  if (ids.numel() && (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= vocab))
    throw file_error(file, "input_ids", "ids must lie in [0, " + std::to_string(vocab) + ")");
  if (mask.defined() && ((mask != 0) & (mask != 1)).any().item<bool>())
    throw file_error(file, "attention_mask", "values must be 0 or 1");
  Batch b{{"input_ids", ids}, {"attention_mask", mask}};
  const int64_t terms = loss_terms(b);
  if (terms == 0) throw file_error(file, "attention_mask", "no position is a token (the loss averages over tokens)");
  at::Tensor h = forward_whole(b);
  return {{{"last_hidden_state", h}}, head_loss_sum(h, b) / static_cast<double>(terms)};
}

std::vector<CheckpointTensor> T5EncoderImpl::checkpoint_tensors() const {
  std::vector<CheckpointTensor> out;
  for (const auto& item : named_parameters()) {
    const std::string& n = item.key();
    out.push_back({n == "encoder.embed_tokens.weight" ? "shared.weight" : n, n});
  }
  return out;
}

bool T5EncoderImpl::ignorable_checkpoint_tensor(const std::string& name) const {
  return name.starts_with("decoder.") || name == "lm_head.weight";
}

std::shared_ptr<Model> build_t5(const nlohmann::json& config, const std::string& file) {
  return T5Encoder(T5Config::from_json(config, file)).ptr();
}

nlohmann::json describe_t5(const nlohmann::json& config, const std::string& file) {
  const T5Config c = T5Config::from_json(config, file);
  return {{"family", "text_encoder"},
          {"model_type", c.model_type},
          {"class", c.encoder_class()},
          {"parameters", c.num_parameters()},
          {"layers", c.num_layers},
          {"d_model", c.d_model},
          {"heads", c.num_heads},
          {"d_kv", c.d_kv},
          {"d_ff", c.d_ff},
          {"vocab_size", c.vocab_size},
          {"feed_forward_proj", c.feed_forward_proj},
          {"relative_attention_bias", c.model_type == "umt5" ? "every block" : "block 0, shared"},
          {"relative_attention_num_buckets", c.relative_attention_num_buckets},
          {"relative_attention_max_distance", c.relative_attention_max_distance}};
}

}  // namespace lf::models::text_encoder

#include "loongforge/models/policy/pi0.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/kernels/attention.h"
#include "loongforge/kernels/swiglu.h"
#include "loongforge/models/policy/spec.h"

namespace lf::models::policy {

namespace {

std::string shape_str(at::IntArrayRef s) {
  std::string out;
  for (int64_t d : s) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return "[" + out + "]";
}

// LeRobot's get_gemma_config table.
bool known_variant(const std::string& name, GemmaSize* s) {
  if (name == "gemma_300m") *s = {1024, 18, 4096, 8, 1, 256};
  else if (name == "gemma_2b") *s = {2048, 18, 16384, 8, 1, 256};
  else return false;
  return true;
}

GemmaSize read_variant(const JsonReader& r, const std::string& key) {
  const std::string name = r.string(key);
  GemmaSize s;
  if (r.has("variant_sizes") && r.json()["variant_sizes"].contains(name)) {
    const JsonReader v = r.object("variant_sizes").object(name);
    s = {v.integer("width"), v.integer("depth"), v.integer("mlp_dim"), v.integer("num_heads"), v.integer("num_kv_heads"),
         v.integer("head_dim")};
    for (const char* k : {"width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"})
      if (v.integer(k) <= 0) v.fail(k, "must be positive");
    if (s.num_heads % s.num_kv_heads) v.fail("num_kv_heads", std::to_string(s.num_kv_heads) + " does not divide num_heads " + std::to_string(s.num_heads));
    if (s.head_dim % 2) v.fail("head_dim", "must be even (rotary), got " + std::to_string(s.head_dim));
    return s;
  }
  if (!known_variant(name, &s))
    r.fail(key, "'" + name + "' is not a Gemma size LoongForge knows (gemma_300m, gemma_2b) nor one of variant_sizes");
  return s;
}

// create_sinusoidal_pos_embedding (float64, then float32): [B, dim].
at::Tensor time_embedding(const at::Tensor& time, int64_t dim, double min_period, double max_period) {
  const at::Tensor fraction = at::linspace(0.0, 1.0, dim / 2, at::TensorOptions().dtype(at::kDouble).device(time.device()));
  const at::Tensor period = at::pow(max_period / min_period, fraction) * min_period;
  const at::Tensor scale = at::reciprocal(period) * 2.0 * M_PI;
  const at::Tensor x = scale.unsqueeze(0) * time.unsqueeze(1).to(at::kDouble);
  return at::cat({x.sin(), x.cos()}, 1).to(time.scalar_type());
}

// make_att_2d_masks: key j visible to query i when both are valid and block(j) <= block(i) (cumulative starts).
at::Tensor block_mask(const at::Tensor& pad, const at::Tensor& starts) {
  const at::Tensor cum = starts.cumsum(1);
  return (cum.unsqueeze(1) <= cum.unsqueeze(2)).logical_and(pad.unsqueeze(1).logical_and(pad.unsqueeze(2)));
}

// x + y, or x + y * gate.
at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gate) {
  return gate.defined() ? x + y * gate : x + y;
}

// One stream of a decoder layer: its layer, hidden states and norm condition (undefined: none).
struct Stream {
  GemmaLayerImpl* layer;
  at::Tensor h, cond;
  bool needed = true;  // false: only its keys and values matter (the prefix in the last layer of a training forward)
  // The kept rows (defined: h is [rows, W], the rows of the padded [B, T] layout that hold a valid token, in order):
  // padded tokens are dropped from every per-token product. Nothing reads them (no query sees a padded key, a padded
  // query's output reaches no loss), so LeRobot's gradients from them are exactly zero.
  at::Tensor rows;
  int64_t B = 0, T = 0;  // the padded layout
};

// The prefix [B, P, W] with its padding [B, P] left-packed: each row's valid tokens first, in order, then padding, cut
// to the longest row's count. The prefix is one bidirectional block and a valid token's position is its rank among
// the row's valid tokens, so the mask and positions built from the packed padding are the original ones; attention
// then runs over the valid keys (and a few padded ones), not over every padded slot. Unchanged when nothing is padded.
std::pair<at::Tensor, at::Tensor> pack_prefix(const at::Tensor& prefix, const at::Tensor& pad) {
  const int64_t P = prefix.size(1);
  const at::Tensor counts = pad.to(at::kLong).sum(1);
  const int64_t L = counts.max().item<int64_t>();
  const at::Tensor slot = at::arange(P, counts.options());
  if (L == P) return {prefix, pad};
  // valid slots keep their order ahead of every padded one: sort by (padded, slot)
  const at::Tensor order = std::get<1>(at::sort(at::logical_not(pad).to(at::kLong) * P + slot.unsqueeze(0), 1)).narrow(1, 0, L);
  const at::Tensor packed = prefix.gather(1, order.unsqueeze(2).expand({prefix.size(0), L, prefix.size(2)}));
  return {packed, slot.narrow(0, 0, L).unsqueeze(0) < counts.unsqueeze(1)};
}

// The stream of hidden states [B, T, W] under the condition COND (undefined: none), every row kept.
Stream dense_stream(const at::Tensor& h, const at::Tensor& cond) {
  Stream st{nullptr, h, cond};
  st.B = h.size(0);
  st.T = h.size(1);
  return st;
}

// The stream from hidden states [B, T, W] and their padding [B, T]: compacted to the valid rows when some are padded.
Stream compact_stream(const at::Tensor& h, const at::Tensor& pad) {
  Stream st = dense_stream(h, at::Tensor());
  if (pad.all().item<bool>()) return st;
  st.rows = pad.reshape({-1}).nonzero().squeeze(1);
  st.h = h.reshape({st.B * st.T, h.size(2)}).index_select(0, st.rows);
  return st;
}

// One decoder layer over the streams (their tokens one after another) sharing attention, as LeRobot's
// compute_layer_complete: each stream's q/k/v, rotary over the joint positions (cos/sin [B, T, D]), attention of
// every query over [past keys, the streams' keys] (past undefined: none) where `allowed` [B, T, S] holds, then each
// stream's o_proj and MLP with (gated) residuals. A stream that is not needed gives only its keys and values (no
// queries: its rows of `allowed` are skipped). `kv` (when given) receives the streams' keys and values after rotary.
// LeRobot's eager attention adds a large negative number for blocked keys: the same softmax for every query that
// sees a key; kernels::masked_attention runs each block of queries against only the keys it sees (the padded
// prompt rows, which see none, get zeros where eager attention averages every key: nothing reads them).
void joint_layer(std::vector<Stream>& s, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& allowed,
                 const at::Tensor& past_k, const at::Tensor& past_v, double scaling, std::pair<at::Tensor, at::Tensor>* kv) {
  std::vector<at::Tensor> qs, ks, vs, gates, qcos, qsin, qmask;
  int64_t start = 0;
  for (Stream& st : s) {
    auto [x, gate] = st.layer->input_layernorm(st.h, st.cond);
    gates.push_back(gate);
    const int64_t B = st.B, T = st.T, D = st.layer->self_attn->head_dim();
    auto heads = [&](nn::Linear& p) {
      at::Tensor y = p(x);
      if (st.rows.defined()) y = at::zeros({B * T, y.size(-1)}, y.options()).index_copy(0, st.rows, y);
      return y.view({B, T, -1, D}).transpose(1, 2);
    };
    if (st.needed) {
      qs.push_back(heads(st.layer->self_attn->q_proj));
      qcos.push_back(cos.narrow(1, start, T));
      qsin.push_back(sin.narrow(1, start, T));
      qmask.push_back(allowed.narrow(1, start, T));
    }
    ks.push_back(heads(st.layer->self_attn->k_proj));
    vs.push_back(heads(st.layer->self_attn->v_proj));
    start += T;
  }
  auto joined = [](const std::vector<at::Tensor>& v, int64_t dim) { return v.size() == 1 ? v[0] : at::cat(v, dim); };
  at::Tensor k = nn::apply_rotary(joined(ks, 2), cos, sin);
  at::Tensor v = joined(vs, 2);
  if (kv) *kv = {k, v};
  if (qs.empty()) return;
  if (past_k.defined()) {
    k = at::cat({past_k, k}, 2);
    v = at::cat({past_v, v}, 2);
  }
  const at::Tensor q = nn::apply_rotary(joined(qs, 2), joined(qcos, 1), joined(qsin, 1));
  const int64_t B = q.size(0), Tq = q.size(2);
  const at::Tensor att = kernels::masked_attention(q, k, v, scaling, joined(qmask, 1)).transpose(1, 2).reshape({B, Tq, -1});
  int64_t row = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    Stream& st = s[i];
    if (!st.needed) continue;
    const int64_t T = st.T;
    at::Tensor a = att.narrow(1, row, T);
    if (st.rows.defined()) a = a.reshape({st.B * T, -1}).index_select(0, st.rows);
    at::Tensor h = gated_residual(st.h, st.layer->self_attn->o_proj(a), gates[i]);
    auto [x, gate] = st.layer->post_attention_layernorm(h, st.cond);
    st.h = gated_residual(h, st.layer->mlp(x), gate);
    row += T;
  }
}

// Python's str.strip(): the code points str.isspace() holds at both ends of the UTF-8 text removed.
std::string python_strip(const std::string& t) {
  auto space = [](uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
  };
  // the code point starting at byte i and its length (a malformed byte: itself, not a space)
  auto at = [&](size_t i) -> std::pair<uint32_t, size_t> {
    const auto b = static_cast<unsigned char>(t[i]);
    const size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > t.size()) return {0xffffffffu, 1};
    uint32_t c = n == 1 ? b : b & (0xffu >> (n + 1));
    for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(t[i + k]) & 0x3fu);
    return {c, n};
  };
  size_t a = 0, e = t.size();
  while (a < e) {
    auto [c, n] = at(a);
    if (!space(c)) break;
    a += n;
  }
  while (e > a) {
    size_t s = e - 1;  // back to the last code point's first byte
    while (s > a && (static_cast<unsigned char>(t[s]) & 0xc0) == 0x80) --s;
    auto [c, n] = at(s);
    if (!space(c) || s + n != e) break;
    e = s;
  }
  return t.substr(a, e - a);
}

}  // namespace

// ---- config ----

PI0Config PI0Config::from_json(const nlohmann::json& j, const std::string& file) {
  PI0Config c;
  c.raw = j;
  JsonReader r(j, file);
  c.pi05 = r.string("type") == "pi05";
  c.paligemma_variant = r.string("paligemma_variant", "gemma_2b");
  c.action_expert_variant = r.string("action_expert_variant", "gemma_300m");
  c.vlm = read_variant(r, "paligemma_variant");
  c.expert = read_variant(r, "action_expert_variant");
  if (c.vlm.depth != c.expert.depth || c.vlm.num_heads != c.expert.num_heads ||
      c.vlm.num_kv_heads != c.expert.num_kv_heads || c.vlm.head_dim != c.expert.head_dim)
    r.fail("action_expert_variant", "the action expert shares attention with the language model layer by layer: its "
                                    "depth, num_heads, num_kv_heads and head_dim must equal the paligemma variant's");
  c.vocab_size = r.integer("vocab_size", 257152);
  if (c.vocab_size < 1) r.fail("vocab_size", "must be positive");
  const std::vector<int64_t> res = r.int_list("image_resolution");
  if (!res.empty()) {
    if (res.size() != 2 || res[0] != res[1] || res[0] < 1)
      r.fail("image_resolution", "PaliGemma takes square images [size, size], got " + shape_str(res));
    c.resolution = res[0];
  }
  // LeRobot's PaliGemma SigLIP (So400m/14) with its intermediate_size 4304 and projection_dim 2048, or the config's
  nlohmann::json v = {{"model_type", "siglip_vision_model"}, {"hidden_size", 1152}, {"num_hidden_layers", 27},
                      {"num_attention_heads", 16}, {"patch_size", 14}, {"intermediate_size", 4304},
                      {"hidden_act", "gelu_pytorch_tanh"}, {"layer_norm_eps", 1e-6}, {"vision_use_head", false},
                      {"image_size", c.resolution}};
  c.projection_dim = 2048;
  if (r.has("vision_config")) {
    const JsonReader vr = r.object("vision_config");
    for (const char* k : {"hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size", "intermediate_size"})
      if (vr.has(k)) v[k] = vr.integer(k);
    if (vr.has("image_size") && vr.integer("image_size") != c.resolution)
      vr.fail("image_size", std::to_string(vr.integer("image_size")) + " is not image_resolution's " + std::to_string(c.resolution));
    c.projection_dim = vr.integer("projection_dim", c.projection_dim);
  }
  c.vision = vision::VitConfig::from_json(v, file, "vision_config");
  if (c.projection_dim != c.vlm.width)
    r.fail(r.has("vision_config") ? "vision_config.projection_dim" : "paligemma_variant",
           "the projector's width " + std::to_string(c.projection_dim) + " must equal the language model's width " + std::to_string(c.vlm.width));
  c.max_state_dim = r.integer("max_state_dim", 32);
  c.max_action_dim = r.integer("max_action_dim", 32);
  c.chunk_size = r.integer("chunk_size", 50);
  c.n_action_steps = r.integer("n_action_steps", 50);
  if (c.chunk_size < 1) r.fail("chunk_size", "expected a positive number");
  if (c.n_action_steps < 1 || c.n_action_steps > c.chunk_size)
    r.fail("n_action_steps", std::to_string(c.n_action_steps) + " is not in [1, chunk_size " + std::to_string(c.chunk_size) + "]");
  if (r.integer("n_obs_steps", 1) != 1) r.fail("n_obs_steps", "π0 takes one observation step");
  c.num_inference_steps = r.integer("num_inference_steps", 10);
  if (c.num_inference_steps < 1) r.fail("num_inference_steps", "expected a positive number");
  c.min_period = r.number("min_period", 4e-3);
  c.max_period = r.number("max_period", 4.0);
  c.time_beta_alpha = r.number("time_sampling_beta_alpha", 1.5);
  c.time_beta_beta = r.number("time_sampling_beta_beta", 1.0);
  c.time_scale = r.number("time_sampling_scale", 0.999);
  c.time_offset = r.number("time_sampling_offset", 0.001);
  if (c.expert.width % 2) r.fail("action_expert_variant", "the time embedding needs an even expert width");
  c.freeze_vision_encoder = r.boolean("freeze_vision_encoder", false);
  c.train_expert_only = r.boolean("train_expert_only", false);
  if (r.has("rtc_config") && r.json()["rtc_config"].is_object() && r.object("rtc_config").boolean("enabled", false))
    r.fail("rtc_config", "real-time chunking is not supported");
  c.tokenizer_max_length = r.integer("tokenizer_max_length", c.pi05 ? 200 : 48);
  if (c.tokenizer_max_length < 1) r.fail("tokenizer_max_length", "expected a positive number");
  if (r.boolean("use_relative_actions", false)) r.fail("use_relative_actions", "relative actions are not supported");
  // validate_features: the VISUAL inputs in order, then empty_camera_i; a missing state / action at their max sizes
  const JsonReader in = r.object("input_features");
  c.state_dim = c.max_state_dim;
  for (const auto& [name, feat] : in.json().items()) {
    const JsonReader f = in.object(name);
    const std::string type = f.string("type");
    const std::vector<int64_t> shape = f.int_list("shape");
    if (type == "VISUAL") {
      if (shape.size() != 3 || shape[0] != 3) f.fail("shape", "expected [3, height, width], got " + shape_str(shape));
      c.cameras.push_back(name);
    } else if (name == "observation.state") {
      if (shape.size() != 1) f.fail("shape", "expected [state_dim]");
      c.state_dim = shape[0];
    }
  }
  const int64_t empty = r.integer("empty_cameras", 0);
  for (int64_t i = 0; i < empty; ++i) {
    const std::string name = "observation.images.empty_camera_" + std::to_string(i);
    if (std::find(c.cameras.begin(), c.cameras.end(), name) == c.cameras.end()) c.cameras.push_back(name);
  }
  if (c.cameras.empty()) r.fail("input_features", "π0 needs at least one VISUAL input (or empty_cameras)");
  c.action_dim = c.max_action_dim;
  if (r.has("output_features") && r.json()["output_features"].contains("action")) {
    const JsonReader a = r.object("output_features").object("action");
    const std::vector<int64_t> shape = a.int_list("shape");
    if (shape.size() != 1 || shape[0] < 1) a.fail("shape", "expected [action_dim]");
    c.action_dim = shape[0];
  }
  if (c.state_dim > c.max_state_dim)
    r.fail("max_state_dim", std::to_string(c.max_state_dim) + " is below the state's " + std::to_string(c.state_dim));
  if (c.action_dim > c.max_action_dim)
    r.fail("max_action_dim", std::to_string(c.max_action_dim) + " is below the action's " + std::to_string(c.action_dim));
  return c;
}

// ---- modules ----

PiRMSNormImpl::PiRMSNormImpl(int64_t dim, double eps, int64_t cond_dim) : eps_(eps) {
  if (cond_dim > 0) dense = register_module("dense", nn::Linear(cond_dim, 3 * dim, true));
  else weight = register_parameter("weight", at::zeros({dim}));
}

std::pair<at::Tensor, at::Tensor> PiRMSNormImpl::forward(const at::Tensor& x, const at::Tensor& cond) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = x * at::rsqrt(xf.square().mean(-1, true) + eps_);
  if (!cond.defined() || !dense) return {(normed * (1.0 + weight.to(at::kFloat))).to(x.scalar_type()), at::Tensor()};
  at::Tensor m = dense(cond);
  if (x.dim() == 3) m = m.unsqueeze(1);
  auto parts = m.chunk(3, -1);
  const at::Tensor out = normed * (1 + parts[0].to(at::kFloat)) + parts[1].to(at::kFloat);
  return {out.to(x.scalar_type()), parts[2].to(x.scalar_type())};
}

GemmaAttentionImpl::GemmaAttentionImpl(int64_t width, const GemmaSize& s) : head_dim_(s.head_dim) {
  q_proj = register_module("q_proj", nn::Linear(width, s.num_heads * s.head_dim, false));
  k_proj = register_module("k_proj", nn::Linear(width, s.num_kv_heads * s.head_dim, false));
  v_proj = register_module("v_proj", nn::Linear(width, s.num_kv_heads * s.head_dim, false));
  o_proj = register_module("o_proj", nn::Linear(s.num_heads * s.head_dim, width, false));
}

GemmaMLPImpl::GemmaMLPImpl(int64_t width, int64_t inner) {
  gate_proj = register_module("gate_proj", nn::Linear(width, inner, false));
  up_proj = register_module("up_proj", nn::Linear(width, inner, false));
  down_proj = register_module("down_proj", nn::Linear(inner, width, false));
}

// gelu_pytorch_tanh(gate) * up, fused on the CPU (kernels/swiglu.h)
at::Tensor GemmaMLPImpl::forward(const at::Tensor& x) { return down_proj(kernels::geglu_tanh(gate_proj(x), up_proj(x))); }

GemmaLayerImpl::GemmaLayerImpl(const GemmaSize& s, int64_t cond_dim) {
  self_attn = register_module("self_attn", GemmaAttention(s.width, s));
  mlp = register_module("mlp", GemmaMLP(s.width, s.mlp_dim));
  input_layernorm = register_module("input_layernorm", PiRMSNorm(s.width, 1e-6, cond_dim));
  post_attention_layernorm = register_module("post_attention_layernorm", PiRMSNorm(s.width, 1e-6, cond_dim));
}

GemmaStackImpl::GemmaStackImpl(const GemmaSize& s, int64_t vocab, bool embeddings, int64_t cond_dim) {
  if (embeddings) embed_tokens = register_module("embed_tokens", torch::nn::Embedding(vocab, s.width));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < s.depth; ++i) layers->push_back(GemmaLayer(s, cond_dim));
  norm = register_module("norm", PiRMSNorm(s.width, 1e-6, cond_dim));
}

PI0ModelImpl::PI0ModelImpl(const PI0Config& c) : c_(c), rotary_([&] {
  nn::RopeSpec r;
  r.theta = 10000.0;
  r.head_dim = c.vlm.head_dim;
  r.max_position_embeddings = 8192;
  return r;
}()) {
  paligemma_with_expert = register_module("paligemma_with_expert", std::make_shared<torch::nn::Module>());
  auto paligemma = paligemma_with_expert->register_module("paligemma", std::make_shared<torch::nn::Module>());
  auto pg_model = paligemma->register_module("model", std::make_shared<torch::nn::Module>());
  vision_tower = pg_model->register_module("vision_tower", vision::VisionTower(c.vision));
  auto projector_parent = pg_model->register_module("multi_modal_projector", std::make_shared<torch::nn::Module>());
  projector = projector_parent->register_module("linear", nn::Linear(c.vision.hidden_size, c.projection_dim, true));
  language_model = pg_model->register_module("language_model", GemmaStack(c.vlm, c.vocab_size, true, 0));
  paligemma_lm_head = paligemma->register_module("lm_head", nn::Linear(c.vlm.width, c.vocab_size, false));
  auto gemma_expert = paligemma_with_expert->register_module("gemma_expert", std::make_shared<torch::nn::Module>());
  expert = gemma_expert->register_module("model", GemmaStack(c.expert, c.vocab_size, false, c.pi05 ? c.expert.width : 0));
  expert_lm_head = gemma_expert->register_module("lm_head", nn::Linear(c.expert.width, c.vocab_size, false));
  const int64_t w = c.expert.width;
  action_in_proj = register_module("action_in_proj", nn::Linear(c.max_action_dim, w, true));
  action_out_proj = register_module("action_out_proj", nn::Linear(w, c.max_action_dim, true));
  if (c.pi05) {
    time_mlp_in = register_module("time_mlp_in", nn::Linear(w, w, true));
    time_mlp_out = register_module("time_mlp_out", nn::Linear(w, w, true));
  } else {
    state_proj = register_module("state_proj", nn::Linear(c.max_state_dim, w, true));
    time_mlp_in = register_module("action_time_mlp_in", nn::Linear(2 * w, w, true));
    time_mlp_out = register_module("action_time_mlp_out", nn::Linear(w, w, true));
  }
  if (c.freeze_vision_encoder)
    for (auto& p : vision_tower->parameters()) p.set_requires_grad(false);
  if (c.train_expert_only)
    for (auto& p : paligemma->parameters()) p.set_requires_grad(false);
}

std::pair<at::Tensor, at::Tensor> PI0ModelImpl::embed_prefix(const std::vector<at::Tensor>& images,
                                                             const std::vector<at::Tensor>& image_masks,
                                                             const at::Tensor& tokens, const at::Tensor& token_mask) {
  std::vector<at::Tensor> embs, pads;
  for (size_t i = 0; i < images.size(); ++i) {
    // [B, patches, W]; a camera masked out in every row (an empty camera) reaches nothing: its rows are dropped
    // before the language model (compact_stream), so the vision tower does not run on it
    const at::Tensor f = image_masks[i].any().item<bool>()
                             ? projector(vision_tower->last_hidden_state(images[i]))
                             : at::zeros({images[i].size(0), c_.vision.num_patches(), c_.vlm.width}, projector->weight.options());
    embs.push_back(f);
    pads.push_back(image_masks[i].unsqueeze(1).expand({f.size(0), f.size(1)}));
  }
  const at::Tensor& table = language_model->embed_tokens->weight;
  // GemmaTextScaledWordEmbedding: the rows x sqrt(width) (a float32 scalar); padding_idx = Gemma's pad_token_id 0
  // (its row gets no gradient)
  const double scale = static_cast<float>(std::sqrt(static_cast<double>(c_.vlm.width)));
  embs.push_back(at::embedding(table, tokens, 0) * scale);
  pads.push_back(token_mask);
  return {at::cat(embs, 1), at::cat(pads, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> PI0ModelImpl::embed_suffix(const at::Tensor& state, const at::Tensor& x_t,
                                                                          const at::Tensor& time) {
  const int64_t C = x_t.size(1);
  const at::Tensor action = action_in_proj(x_t);
  const at::Tensor temb = time_embedding(time, c_.expert.width, c_.min_period, c_.max_period).to(action.scalar_type());
  at::Tensor starts = at::zeros({C + (c_.pi05 ? 0 : 1)}, at::kLong);
  starts[0] = 1;
  if (c_.pi05) {
    const at::Tensor cond = at::silu(time_mlp_out(at::silu(time_mlp_in(temb))));
    return {action, starts, cond};
  }
  starts[1] = 1;
  const at::Tensor fused = time_mlp_out(at::silu(time_mlp_in(at::cat({action, temb.unsqueeze(1).expand_as(action)}, 2))));
  return {at::cat({state_proj(state).unsqueeze(1), fused}, 1), starts, at::Tensor()};
}

at::Tensor PI0ModelImpl::velocity(const std::vector<at::Tensor>& images, const std::vector<at::Tensor>& image_masks,
                                  const at::Tensor& tokens, const at::Tensor& token_mask, const at::Tensor& state,
                                  const at::Tensor& x_t, const at::Tensor& time) {
  auto [embedded, embedded_pad] = embed_prefix(images, image_masks, tokens, token_mask);
  auto [prefix, prefix_pad] = pack_prefix(embedded, embedded_pad);
  auto [suffix, suffix_starts, cond] = embed_suffix(state, x_t, time);
  const int64_t B = prefix.size(0), P = prefix.size(1), S = suffix.size(1);
  const at::Tensor pad = at::cat({prefix_pad, at::ones({B, S}, prefix_pad.options())}, 1);
  const at::Tensor starts = at::cat({at::zeros({P}, at::kLong), suffix_starts}).to(pad.device()).unsqueeze(0).expand({B, P + S});
  const at::Tensor mask = block_mask(pad, starts);
  auto [cos, sin] = rotary_.cos_sin(pad.to(at::kLong).cumsum(1) - 1);
  const double scaling = 1.0 / std::sqrt(static_cast<double>(c_.vlm.head_dim));
  std::vector<Stream> s{compact_stream(prefix, prefix_pad), dense_stream(suffix, cond)};
  for (int64_t i = 0; i < c_.vlm.depth; ++i) {
    s[0].layer = &language_model->layer(i);
    s[1].layer = &expert->layer(i);
    s[0].needed = i + 1 < c_.vlm.depth;  // the prefix's last outputs reach nothing
    joint_layer(s, cos, sin, mask, {}, {}, scaling, nullptr);
  }
  const at::Tensor out = expert->norm(s[1].h, cond).first;
  return action_out_proj(out.narrow(1, S - c_.chunk_size, c_.chunk_size).to(at::kFloat));
}

PrefixCache PI0ModelImpl::encode_prefix(const std::vector<at::Tensor>& images, const std::vector<at::Tensor>& image_masks,
                                        const at::Tensor& tokens, const at::Tensor& token_mask) {
  auto [embedded, embedded_pad] = embed_prefix(images, image_masks, tokens, token_mask);
  auto [prefix, pad] = pack_prefix(embedded, embedded_pad);
  const int64_t B = prefix.size(0), P = prefix.size(1);
  const at::Tensor mask = block_mask(pad, at::zeros({B, P}, at::kLong).to(pad.device()));
  auto [cos, sin] = rotary_.cos_sin(pad.to(at::kLong).cumsum(1) - 1);
  const double scaling = 1.0 / std::sqrt(static_cast<double>(c_.vlm.head_dim));
  PrefixCache cache;
  cache.pad = pad;
  std::vector<Stream> s{compact_stream(prefix, pad)};
  for (int64_t i = 0; i < c_.vlm.depth; ++i) {
    s[0].layer = &language_model->layer(i);
    s[0].needed = i + 1 < c_.vlm.depth;
    std::pair<at::Tensor, at::Tensor> kv;
    joint_layer(s, cos, sin, mask, {}, {}, scaling, &kv);
    cache.keys.push_back(kv.first);
    cache.values.push_back(kv.second);
  }
  return cache;
}

at::Tensor PI0ModelImpl::denoise_step(const PrefixCache& cache, const at::Tensor& state, const at::Tensor& x_t,
                                      const at::Tensor& time) {
  auto [suffix, starts, cond] = embed_suffix(state, x_t, time);
  const int64_t B = suffix.size(0), S = suffix.size(1), P = cache.pad.size(1);
  const at::Tensor suffix_pad = at::ones({B, S}, cache.pad.options());
  const at::Tensor allowed = at::cat({cache.pad.unsqueeze(1).expand({B, S, P}),
                                      block_mask(suffix_pad, starts.to(suffix_pad.device()).unsqueeze(0).expand({B, S}))}, 2);
  const at::Tensor positions = cache.pad.to(at::kLong).sum(-1, true) + suffix_pad.to(at::kLong).cumsum(1) - 1;
  auto [cos, sin] = rotary_.cos_sin(positions);
  const double scaling = 1.0 / std::sqrt(static_cast<double>(c_.expert.head_dim));
  std::vector<Stream> s{dense_stream(suffix, cond)};
  for (int64_t i = 0; i < c_.expert.depth; ++i) {
    s[0].layer = &expert->layer(i);
    joint_layer(s, cos, sin, allowed, cache.keys[i], cache.values[i], scaling, nullptr);
  }
  const at::Tensor out = expert->norm(s[0].h, cond).first;
  return action_out_proj(out.narrow(1, S - c_.chunk_size, c_.chunk_size).to(at::kFloat));
}

// ---- the policy ----

PI0PolicyImpl::PI0PolicyImpl(PI0Config c) : config_(std::move(c)) { model = register_module("model", PI0Model(config_)); }

void PI0PolicyImpl::init_weights(double std) {
  torch::NoGradGuard g;
  // transformers' initialisation for the PaliGemma and the expert (normal(0, 0.02) matrices and embeddings, zero
  // biases, RMSNorms at 0, adaptive norms' dense layers at 0), PyTorch's defaults for the policy's own projections
  const double s = std < 0 ? 0.02 : std;
  model->vision_tower->init_weights(-1);
  for (auto* stack : {model->language_model.get(), model->expert.get()})
    for (auto& item : stack->named_parameters()) {
      at::Tensor p = item.value();
      const std::string& n = item.key();
      if (n.find("dense") != std::string::npos || n.find("norm") != std::string::npos || p.dim() == 1) p.zero_();
      else p.normal_(0, s);
    }
  for (nn::Linear* l : {&model->projector, &model->paligemma_lm_head, &model->expert_lm_head}) {
    (*l)->weight.normal_(0, s);
    if ((*l)->bias.defined()) (*l)->bias.zero_();
  }
  for (nn::Linear* l : {&model->action_in_proj, &model->action_out_proj, &model->state_proj, &model->time_mlp_in, &model->time_mlp_out}) {
    if (!*l) continue;
    torch::nn::init::kaiming_uniform_((*l)->weight, std::sqrt(5.0));
    const double bound = 1.0 / std::sqrt(static_cast<double>((*l)->in_features));
    (*l)->bias.uniform_(-bound, bound);
  }
}

BatchSchema PI0PolicyImpl::batch_schema() const {
  const auto& c = config_;
  BatchSchema s;
  const std::string state_doc = "normalised robot state [B, " + std::to_string(c.state_dim) + "]";
  // π0.5 reads the state only through the prompt (its processor writes it into the tokens as 256 bins)
  s.push_back(c.pi05 ? optional_field("observation.state", at::kFloat, 2, state_doc + " (unused by π0.5's model)")
                     : required_field("observation.state", at::kFloat, 2, state_doc));
  for (const std::string& cam : c.cameras) s.push_back(optional_field(cam, at::kFloat, 4, "images in [0, 1] [B, 3, H, W] (absent: an empty camera)"));
  s.push_back(required_field("observation.language.tokens", at::kLong, 2, "the prompt's token ids [B, L]"));
  s.push_back(required_field("observation.language.attention_mask", at::kBool, 2, "the prompt's valid tokens [B, L]"));
  s.push_back(required_field("action", at::kFloat, 3, "normalised action chunk [B, " + std::to_string(c.chunk_size) + ", " + std::to_string(c.action_dim) + "]"));
  s.push_back(optional_field("action_is_pad", at::kBool, 2, "padded steps of the chunk [B, chunk] (LeRobot's π0 does not mask them)"));
  s.push_back(optional_field("noise", at::kFloat, 3, "flow matching's noise [B, chunk, max_action_dim] (drawn when absent)"));
  s.push_back(optional_field("time", at::kFloat, 1, "flow matching's time [B] (Beta-drawn when absent)"));
  return s;
}

double PI0PolicyImpl::train_flops_per_sample(int64_t) const {
  const auto& c = config_;
  auto layer = [](const GemmaSize& s) {
    return 2.0 * s.width * s.num_heads * s.head_dim + 2.0 * s.width * s.num_kv_heads * s.head_dim + 3.0 * s.width * s.mlp_dim;
  };
  const auto& v = c.vision;
  const double vit_layer = 4.0 * v.hidden_size * v.hidden_size + 2.0 * v.hidden_size * v.intermediate_size;
  const double patches = static_cast<double>(v.num_patches()) * static_cast<double>(c.cameras.size());
  const double prefix = patches + static_cast<double>(c.tokenizer_max_length), suffix = c.chunk_size + 1;
  return 6.0 * (patches * vit_layer * v.num_hidden_layers + prefix * layer(c.vlm) * c.vlm.depth +
                suffix * layer(c.expert) * c.expert.depth);
}

at::Tensor PI0PolicyImpl::padded(const at::Tensor& x, int64_t dim) const {
  return x.size(-1) >= dim ? x : at::constant_pad_nd(x, {0, dim - x.size(-1)}, 0.0);
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> PI0PolicyImpl::images(const Batch& b) const {
  const int64_t R = config_.resolution;
  std::vector<at::Tensor> imgs, masks;
  int64_t missing = 0;
  for (const std::string& cam : config_.cameras) {
    if (!b.has(cam)) {
      ++missing;
      continue;
    }
    at::Tensor img = b.at(cam);
    const int64_t H = img.size(2), W = img.size(3);
    if (H != R || W != R) {  // resize_with_pad_torch: bilinear to fit, clamped to [0, 1], centred zero padding
      const double ratio = std::max(static_cast<double>(W) / R, static_cast<double>(H) / R);
      const int64_t h = static_cast<int64_t>(H / ratio), w = static_cast<int64_t>(W / ratio);
      img = at::upsample_bilinear2d(img, {h, w}, false).clamp(0.0, 1.0);
      const int64_t ph = (R - h) / 2, pw = (R - w) / 2;
      img = at::constant_pad_nd(img, {pw, pw + (R - w) % 2, ph, ph + (R - h) % 2}, 0.0);
    }
    imgs.push_back(img * 2.0 - 1.0);
    masks.push_back(at::ones({img.size(0)}, img.options().dtype(at::kBool)));
  }
  for (int64_t i = 0; i < missing; ++i) {  // padded with -1 for SigLIP, masked out
    imgs.push_back(at::ones_like(imgs.back()) * -1);
    masks.push_back(at::zeros_like(masks.back()));
  }
  return {imgs, masks};
}

at::Tensor PI0PolicyImpl::forward_whole(const Batch& b) {
  const auto& c = config_;
  const at::Tensor actions = padded(b.at("action"), c.max_action_dim);
  const int64_t B = actions.size(0);
  at::Tensor noise = b.get("noise"), time = b.get("time");
  if (!noise.defined()) noise = at::randn(actions.sizes(), actions.options());
  if (!time.defined()) {  // Beta(alpha, beta) * scale + offset, a Beta draw as X / (X + Y) of two Gamma draws
    const at::Tensor x = at::_standard_gamma(at::full({B}, c.time_beta_alpha, at::kFloat));
    const at::Tensor y = at::_standard_gamma(at::full({B}, c.time_beta_beta, at::kFloat));
    time = (x / (x + y) * c.time_scale + c.time_offset).to(actions.options());
  }
  const at::Tensor t = time.view({B, 1, 1});
  const at::Tensor x_t = t * noise + (1 - t) * actions;
  const at::Tensor u_t = noise - actions;
  auto [imgs, masks] = images(b);
  const at::Tensor state = c.pi05 ? at::Tensor() : padded(b.at("observation.state"), c.max_state_dim);
  const at::Tensor v_t = model->velocity(imgs, masks, b.at("observation.language.tokens"),
                                         b.at("observation.language.attention_mask"), state, x_t, time);
  const at::Tensor losses = (u_t - v_t).square().narrow(2, 0, c.action_dim);
  return losses.reshape({B, -1});
}

PolicySpec PI0PolicyImpl::policy_spec() const {
  PolicySpec s = lerobot_policy_spec(config_.raw, "config.json");
  for (int64_t i = 0; i < config_.chunk_size; ++i) s.action_offsets.push_back(i);
  s.n_action_steps = config_.n_action_steps;
  s.language = true;
  s.tokenizer_max_length = config_.tokenizer_max_length;
  s.padding_side = "right";
  // make_pi0_pre_post_processors / make_pi05_pre_post_processors as LeRobot saves them (relative actions off)
  const nlohmann::json tokenizer = {
      {"registry_name", "tokenizer_processor"},
      {"config", {{"max_length", config_.tokenizer_max_length}, {"task_key", "task"}, {"padding_side", "right"},
                  {"padding", "max_length"}, {"truncation", true}, {"tokenizer_name", "google/paligemma-3b-pt-224"}}}};
  const nlohmann::json rename = {{"registry_name", "rename_observations_processor"}, {"config", {{"rename_map", nlohmann::json::object()}}}};
  const nlohmann::json batch = {{"registry_name", "to_batch_processor"}, {"config", nlohmann::json::object()}};
  const nlohmann::json device = {{"registry_name", "device_processor"}, {"config", {{"device", "cpu"}, {"float_dtype", nullptr}}}};
  const nlohmann::json relative = {{"registry_name", "relative_actions_processor"},
                                   {"config", {{"enabled", false}, {"exclude_joints", config_.raw.value("relative_exclude_joints", nlohmann::json::array({"gripper"}))},
                                               {"action_names", config_.raw.value("action_feature_names", nlohmann::json())}}}};
  const nlohmann::json normalizer = {{"registry_name", "normalizer_processor"}};
  if (config_.pi05)
    s.preprocessor_steps = {rename, batch, relative, normalizer,
                            {{"registry_name", "pi05_prepare_state_tokenizer_processor_step"}, {"config", nlohmann::json::object()}},
                            tokenizer, device};
  else
    s.preprocessor_steps = {rename, batch, {{"registry_name", "pi0_new_line_processor"}, {"config", nlohmann::json::object()}},
                            tokenizer, device, relative, normalizer};
  s.postprocessor_steps = {{{"registry_name", "unnormalizer_processor"}},
                           {{"registry_name", "absolute_actions_processor"}, {"config", {{"enabled", false}}}}, device};
  return s;
}

std::vector<std::string> PI0PolicyImpl::prompts(const std::vector<std::string>& tasks, const Batch& normalised) const {
  std::vector<std::string> out;
  if (!config_.pi05) {
    for (const std::string& t : tasks) out.push_back(!t.empty() && t.back() == '\n' ? t : t + "\n");
    return out;
  }
  // np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1: the number of edges -1 + k / 128 (k < 256, exact in
  // binary) at or below the value, less one (-1 below -1, 255 from 1 - 1/128 on and for NaN)
  const at::Tensor state = normalised.at("observation.state").to(at::kDouble).contiguous();
  if (state.dim() != 2 || state.size(0) != static_cast<int64_t>(tasks.size()))
    throw Error("pi05: observation.state must be [B, state_dim] for the prompt's state bins");
  const double* x = state.data_ptr<double>();
  const int64_t D = state.size(1);
  for (size_t i = 0; i < tasks.size(); ++i) {
    // task.strip() (Python's whitespace), '_' and newlines as spaces
    std::string task = python_strip(tasks[i]);
    for (char& ch : task)
      if (ch == '_' || ch == '\n') ch = ' ';
    std::string bins;
    for (int64_t d = 0; d < D; ++d) {
      const double v = x[i * D + d];
      int64_t n = 0;  // edges <= v
      if (std::isnan(v)) n = 256;
      else
        for (int64_t k = 0; k < 256; ++k) n += (-1.0 + static_cast<double>(k) / 128.0 <= v);
      bins += (d ? " " : "") + std::to_string(n - 1);
    }
    out.push_back("Task: " + task + ", State: " + bins + ";\nAction: ");
  }
  return out;
}

std::map<std::string, at::Tensor> PI0PolicyImpl::training_draws(int64_t rows, at::Generator& gen) const {
  const auto& c = config_;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor noise = at::randn({rows, c.chunk_size, c.max_action_dim}, gen, f32);
  const at::Tensor x = at::_standard_gamma(at::full({rows}, c.time_beta_alpha, f32), gen);
  const at::Tensor y = at::_standard_gamma(at::full({rows}, c.time_beta_beta, f32), gen);
  return {{"noise", noise}, {"time", x / (x + y) * c.time_scale + c.time_offset}};
}

at::Tensor PI0PolicyImpl::head_loss_sum(const at::Tensor& h, const Batch&) {
  return h.to(at::kFloat).mean(1).sum();
}

at::Tensor PI0PolicyImpl::predict_action_chunk(const Batch& b, const at::Tensor& start) {
  torch::NoGradGuard g;
  const bool was = is_training();
  eval();
  const auto& c = config_;
  auto [imgs, masks] = images(b);
  const at::Tensor tokens = b.at("observation.language.tokens");
  const int64_t B = tokens.size(0);
  at::Tensor x = start.defined() ? start : at::randn({B, c.chunk_size, c.max_action_dim}, imgs[0].options());
  const at::Tensor state = c.pi05 ? at::Tensor() : padded(b.at("observation.state"), c.max_state_dim);
  const PrefixCache cache = model->encode_prefix(imgs, masks, tokens, b.at("observation.language.attention_mask"));
  const double dt = -1.0 / static_cast<double>(c.num_inference_steps);
  for (int64_t step = 0; step < c.num_inference_steps; ++step) {
    const at::Tensor time = at::full({B}, 1.0 + static_cast<double>(step) * dt, x.options().dtype(at::kFloat));
    x = x + dt * model->denoise_step(cache, state, x, time);
  }
  train(was);
  return x.narrow(2, 0, c.action_dim);
}

Batch PI0PolicyImpl::check_batch(const std::map<std::string, at::Tensor>& batch, const std::string& file, bool need_action) const {
  const auto& c = config_;
  const auto dtype = model->action_in_proj->bias.scalar_type();
  Batch out;
  int64_t B = -1;
  enum Kind { kFloating, kBool, kIndex };
  auto take = [&](const std::string& name, std::vector<int64_t> want, bool required, Kind kind) {
    auto it = batch.find(name);
    if (it == batch.end()) {
      if (required) throw file_error(file, name, "missing (expected " + shape_str(want) + " with B the batch)");
      return;
    }
    at::Tensor t = it->second;
    if (kind == kBool && t.scalar_type() != at::kBool && at::isIntegralType(t.scalar_type(), false)) t = t.ne(0);
    const bool ok_type = kind == kFloating ? at::isFloatingType(t.scalar_type())
                         : kind == kBool   ? t.scalar_type() == at::kBool
                                           : at::isIntegralType(t.scalar_type(), false);
    if (!ok_type)
      throw file_error(file, name, std::string("expected a ") + (kind == kFloating ? "floating-point" : kind == kBool ? "bool" : "integer") +
                                       " tensor, got " + c10::toString(t.scalar_type()));
    if (B < 0 && t.dim() > 0) B = t.size(0);
    want[0] = B;
    bool ok = t.dim() == static_cast<int64_t>(want.size());
    for (size_t i = 0; ok && i < want.size(); ++i) ok = want[i] < 0 || t.size(i) == want[i];
    if (!ok || B == 0) throw file_error(file, name, "expected " + shape_str(want) + " (-1: any), got " + shape_str(t.sizes()));
    out.set(name, kind == kFloating ? t.to(dtype) : kind == kIndex ? t.to(at::kLong) : t);
  };
  take("observation.language.tokens", {-1, -1}, true, kIndex);
  const int64_t L = out.at("observation.language.tokens").size(1);
  take("observation.language.attention_mask", {-1, L}, true, kBool);
  take("observation.state", {-1, c.state_dim}, !c.pi05, kFloating);
  bool any_camera = false;
  for (const std::string& cam : c.cameras) {
    take(cam, {-1, 3, -1, -1}, false, kFloating);
    any_camera = any_camera || out.has(cam);
  }
  if (!any_camera) throw file_error(file, c.cameras[0], "missing: at least one camera is needed (" + std::to_string(c.cameras.size()) + " in the config)");
  take("action", {-1, c.chunk_size, c.action_dim}, need_action, kFloating);
  take("action_is_pad", {-1, c.chunk_size}, false, kBool);
  take("noise", {-1, c.chunk_size, c.max_action_dim}, false, kFloating);
  take("time", {-1}, false, kFloating);
  take("sample_noise", {-1, c.chunk_size, c.max_action_dim}, false, kFloating);
  const at::Tensor& tokens = out.at("observation.language.tokens");
  if (tokens.numel() && (tokens.min().item<int64_t>() < 0 || tokens.max().item<int64_t>() >= c.vocab_size))
    throw file_error(file, "observation.language.tokens", "ids must be in [0, " + std::to_string(c.vocab_size) + ")");
  return out;
}

Model::ReferenceOutput PI0PolicyImpl::reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) {
  const Batch b = check_batch(batch, file, true);
  for (const char* k : {"noise", "time"})
    if (!b.has(k)) throw file_error(file, k, "missing (flow matching's draw: dump is deterministic)");
  if (!b.has("sample_noise"))
    throw file_error(file, "sample_noise", "missing (the sampler's start [B, chunk, max_action_dim]: dump is deterministic)");
  ReferenceOutput r;
  const at::Tensor h = forward_whole(b);
  r.loss = h.mean();
  r.outputs.emplace_back("action_chunk", predict_action_chunk(b, b.at("sample_noise")));
  return r;
}

std::string PI0PolicyImpl::canonical_checkpoint_name(const std::string& stored) const {
  static const std::string old = "vision_tower.vision_model.";
  const size_t at = stored.find(old);
  return at == std::string::npos ? stored : stored.substr(0, at) + "vision_tower." + stored.substr(at + old.size());
}

std::shared_ptr<Model> build_pi0(const nlohmann::json& j, const std::string& file) {
  return PI0Policy(PI0Config::from_json(j, file)).ptr();
}

nlohmann::json describe_pi0(const nlohmann::json& j, const std::string& file) {
  const PI0Config c = PI0Config::from_json(j, file);
  // the numbers without allocating the model (a full π0 holds 3.5B parameters)
  auto gemma = [&](const GemmaSize& s, bool adaptive) {
    const int64_t norm = adaptive ? s.width * 3 * s.width + 3 * s.width : s.width;
    return s.depth * (2 * s.width * s.num_heads * s.head_dim + 2 * s.width * s.num_kv_heads * s.head_dim +
                      3 * s.width * s.mlp_dim + 2 * norm) + norm;
  };
  const int64_t vision = c.vision.num_parameters() + c.vision.hidden_size * c.projection_dim + c.projection_dim;
  const int64_t language = gemma(c.vlm, false) + c.vocab_size * c.vlm.width;
  const int64_t expert = gemma(c.expert, c.pi05);
  const int64_t heads = c.vocab_size * (c.vlm.width + c.expert.width);
  const int64_t w = c.expert.width;
  const int64_t proj = (c.max_action_dim * w + w) + (w * c.max_action_dim + c.max_action_dim) +
                       (c.pi05 ? 2 * (w * w + w) : (c.max_state_dim * w + w) + (2 * w * w + w) + (w * w + w));
  return {{"family", "policy"},
          {"model_type", c.pi05 ? "pi05" : "pi0"},
          {"parameters", vision + language + expert + heads + proj},
          {"cameras", c.cameras},
          {"state_dim", c.state_dim},
          {"action_dim", c.action_dim},
          {"chunk_size", c.chunk_size},
          {"n_action_steps", c.n_action_steps},
          {"paligemma_variant", c.paligemma_variant},
          {"action_expert_variant", c.action_expert_variant},
          {"components", {{"vision", {{"parameters", vision}}}, {"language_model", {{"parameters", language}}},
                          {"action_expert", {{"parameters", expert}}}, {"lm_heads", {{"parameters", heads}}},
                          {"projections", {{"parameters", proj}}}}}};
}

}  // namespace lf::models::policy

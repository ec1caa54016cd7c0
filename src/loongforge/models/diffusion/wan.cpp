// Wan 2.1's video diffusion transformer on the model contract (models/diffusion/wan.h).
#include "loongforge/models/diffusion/wan.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/diffusion/embeddings.h"

namespace lf::models::diffusion {

namespace {

// diffusers runs the norms, modulations and residual sums in float32 (.float()); fp64 runs stay in fp64.
at::Tensor up(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? x : x.to(at::kFloat); }

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// A plain module holding Linear children (diffusers' TimestepEmbedding / PixArtAlphaTextProjection: linear_1, linear_2).
std::shared_ptr<torch::nn::Module> two_linears(int64_t in, int64_t hidden, nn::Linear* l1, nn::Linear* l2) {
  auto m = std::make_shared<torch::nn::Module>();
  *l1 = m->register_module("linear_1", nn::Linear(in, hidden, true));
  *l2 = m->register_module("linear_2", nn::Linear(hidden, hidden, true));
  return m;
}

// x [B, S, H, Dh] rotated by the angles' cos / sin [S, Dh / 2], pairs (2i, 2i + 1) as diffusers' apply_rotary_emb.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // [S, 1, Dh / 2]
  const at::Tensor x1 = x.slice(-1, 0, c10::nullopt, 2), x2 = x.slice(-1, 1, c10::nullopt, 2);
  return at::stack({x1 * c - x2 * s, x1 * s + x2 * c}, -1).flatten(-2);
}

}  // namespace

// ---- config ----

std::array<int64_t, 3> WanConfig::rope_dims() const {
  const int64_t hw = 2 * (attention_head_dim / 6);
  return {attention_head_dim - 2 * hw, hw, hw};
}

int64_t WanConfig::patch_embedding_parameters() const { return in_channels * patch_volume() * inner_dim() + inner_dim(); }

int64_t WanConfig::condition_embedder_parameters() const {
  const int64_t d = inner_dim();
  const int64_t time = freq_dim * d + d + d * d + d, proj = d * 6 * d + 6 * d, text = text_dim * d + d + d * d + d;
  return time + proj + text;
}

int64_t WanConfig::block_parameters() const {
  const int64_t d = inner_dim(), f = ffn_dim;
  const int64_t attn = 4 * (d * d + d) + 2 * d;  // q, k, v, out + norm_q, norm_k
  return 2 * attn + (cross_attn_norm ? 2 * d : 0) + (d * f + f) + (f * d + d) + 6 * d;
}

int64_t WanConfig::output_parameters() const {
  const int64_t d = inner_dim(), o = out_channels * patch_volume();
  return d * o + o + 2 * d;
}

int64_t WanConfig::num_parameters() const {
  return patch_embedding_parameters() + condition_embedder_parameters() + num_layers * block_parameters() +
         output_parameters();
}

WanConfig WanConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  WanConfig c;
  c.raw = j;
  if (r.has("patch_size")) {
    const std::vector<int64_t> p = r.int_list("patch_size");
    if (p.size() != 3) r.fail("patch_size", "expected 3 sizes (frame, height, width), got " + std::to_string(p.size()));
    for (int64_t v : p)
      if (v <= 0) r.fail("patch_size", "sizes must be positive");
    c.patch_size = {p[0], p[1], p[2]};
  }
  auto positive = [&](const char* key, int64_t dflt) {
    const int64_t v = r.integer(key, dflt);
    if (v <= 0) r.fail(key, "must be positive, got " + std::to_string(v));
    return v;
  };
  c.num_attention_heads = positive("num_attention_heads", 40);
  c.attention_head_dim = positive("attention_head_dim", 128);
  c.in_channels = positive("in_channels", 16);
  c.out_channels = r.has("out_channels") ? positive("out_channels", 16) : c.in_channels;  // diffusers: or in_channels
  c.text_dim = positive("text_dim", 4096);
  c.freq_dim = positive("freq_dim", 256);
  c.ffn_dim = positive("ffn_dim", 13824);
  c.num_layers = positive("num_layers", 40);
  c.rope_max_seq_len = positive("rope_max_seq_len", 1024);
  c.cross_attn_norm = r.boolean("cross_attn_norm", true);
  c.eps = r.number("eps", 1e-6);
  if (!(c.eps > 0)) r.fail("eps", "must be positive");
  if (c.attention_head_dim % 2 != 0)
    r.fail("attention_head_dim", std::to_string(c.attention_head_dim) + " is odd (rotary positions take pairs)");
  if (c.freq_dim < 2) r.fail("freq_dim", "must be at least 2");
  // diffusers' WanAttention always normalises q and k across all heads (the field is not passed on); other values
  // name the per-head norm of the original code, which this model does not have.
  const std::string qk = r.string("qk_norm", "rms_norm_across_heads");
  if (qk != "rms_norm_across_heads")
    r.fail("qk_norm", "'" + qk + "' is not supported (WanTransformer3DModel normalises q and k across heads: "
                      "rms_norm_across_heads)");
  for (const char* k : {"image_dim", "added_kv_proj_dim", "pos_embed_seq_len"})
    if (r.has(k)) r.fail(k, "image conditioning (Wan 2.1 image-to-video) is not supported; expected null");
  return c;
}

// ---- modules ----

WanRMSNormImpl::WanRMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor WanRMSNormImpl::forward(const at::Tensor& x) { return at::rms_norm(x, {weight.size(0)}, weight, eps_); }

WanLayerNormImpl::WanLayerNormImpl(int64_t dim, double eps, bool affine) : dim_(dim), eps_(eps) {
  if (affine) {
    weight = register_parameter("weight", at::ones({dim}));
    bias = register_parameter("bias", at::zeros({dim}));
  }
}

at::Tensor WanLayerNormImpl::forward(const at::Tensor& x) {
  const at::Tensor xf = up(x);
  std::optional<at::Tensor> w, b;
  if (weight.defined()) {
    w = weight.to(xf.scalar_type());
    b = bias.to(xf.scalar_type());
  }
  return at::layer_norm(xf, {dim_}, w, b, eps_).to(x.scalar_type());
}

WanAttentionImpl::WanAttentionImpl(int64_t dim, int64_t heads, double eps)
    : nn::AttentionHook(heads, heads, 0), heads_(heads) {
  causal = false;
  to_q = register_module("to_q", nn::Linear(dim, dim, true));
  to_k = register_module("to_k", nn::Linear(dim, dim, true));
  to_v = register_module("to_v", nn::Linear(dim, dim, true));
  auto to_out = register_module("to_out", torch::nn::ModuleList());
  out = nn::Linear(dim, dim, true);
  to_out->push_back(out);  // to_out.0 (to_out.1 is a dropout: no parameters)
  norm_q = register_module("norm_q", WanRMSNorm(dim, eps));
  norm_k = register_module("norm_k", WanRMSNorm(dim, eps));
}

at::Tensor WanAttentionImpl::forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& cos,
                                     const at::Tensor& sin) {
  const at::Tensor& ctx = context.defined() ? context : x;
  at::Tensor q = norm_q(to_q(x)), k = norm_k(to_k(ctx)), v = to_v(ctx);
  q = q.unflatten(2, {heads_, -1});  // [B, S, H, Dh]
  k = k.unflatten(2, {heads_, -1});
  v = v.unflatten(2, {heads_, -1});
  if (cos.defined()) {
    q = rotate(q, cos, sin);
    k = rotate(k, cos, sin);
  }
  q = q.transpose(1, 2), k = k.transpose(1, 2), v = v.transpose(1, 2);  // [B, H, S, Dh]
  // self-attention through the hook when a layout installed one (context parallelism); else SDPA as diffusers
  at::Tensor o = !context.defined() && attention_fn
                     ? attention_fn(q, k, v, 0, 0, 1.0 / std::sqrt(static_cast<double>(q.size(-1))), at::Tensor())
                     : at::scaled_dot_product_attention(q, k, v);
  return out(o.transpose(1, 2).flatten(2, 3).to(q.scalar_type()));
}

WanFeedForwardImpl::WanFeedForwardImpl(int64_t dim, int64_t inner) {
  auto net = register_module("net", torch::nn::ModuleList());
  auto act = std::make_shared<torch::nn::Module>();  // net.0: diffusers' GELU (proj + activation)
  proj = act->register_module("proj", nn::Linear(dim, inner, true));
  net->push_back(act);
  net->push_back(std::make_shared<torch::nn::Module>());  // net.1: dropout
  out = nn::Linear(inner, dim, true);
  net->push_back(out);  // net.2
}

at::Tensor WanFeedForwardImpl::forward(const at::Tensor& x) { return out(at::gelu(proj(x), "tanh")); }

WanBlockImpl::WanBlockImpl(const WanConfig& c) {
  const int64_t d = c.inner_dim();
  norm1 = register_module("norm1", WanLayerNorm(d, c.eps, false));
  attn1 = register_module("attn1", WanAttention(d, c.num_attention_heads, c.eps));
  attn2 = register_module("attn2", WanAttention(d, c.num_attention_heads, c.eps));
  if (c.cross_attn_norm) norm2 = register_module("norm2", WanLayerNorm(d, c.eps, true));
  ffn = register_module("ffn", WanFeedForward(d, c.ffn_dim));
  norm3 = register_module("norm3", WanLayerNorm(d, c.eps, false));
  scale_shift_table = register_parameter("scale_shift_table", at::empty({1, 6, d}));
}

at::Tensor WanBlockImpl::forward(const at::Tensor& h, const at::Tensor& timestep_proj, const at::Tensor& text,
                                 const at::Tensor& cos, const at::Tensor& sin) {
  const auto dt = h.scalar_type();
  const std::vector<at::Tensor> m = (scale_shift_table + up(timestep_proj)).chunk(6, 1);  // each [B, 1, D]
  const at::Tensor &shift = m[0], &scale = m[1], &gate = m[2], &c_shift = m[3], &c_scale = m[4], &c_gate = m[5];
  // 1. self-attention
  at::Tensor n = (norm1(up(h)) * (1 + scale) + shift).to(dt);
  at::Tensor x = (up(h) + attn1->forward(n, at::Tensor(), cos, sin) * gate).to(dt);
  // 2. cross-attention to the text
  n = (norm2 ? norm2(up(x)) : up(x)).to(dt);
  x = x + attn2->forward(n, text, at::Tensor(), at::Tensor());
  // 3. feed-forward
  n = (norm3(up(x)) * (1 + c_scale) + c_shift).to(dt);
  return (up(x) + up(ffn(n)) * c_gate).to(dt);
}

WanConditionEmbedderImpl::WanConditionEmbedderImpl(const WanConfig& c) : freq_dim_(c.freq_dim) {
  const int64_t d = c.inner_dim();
  register_module("time_embedder", two_linears(c.freq_dim, d, &time_1, &time_2));
  time_proj = register_module("time_proj", nn::Linear(d, 6 * d, true));
  register_module("text_embedder", two_linears(c.text_dim, d, &text_1, &text_2));
}

at::Tensor WanConditionEmbedderImpl::time_embedding(const at::Tensor& timestep) {
  // diffusers' Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0): float32 sinusoids (fp64 runs: fp64)
  const auto w = time_1->weight.scalar_type();
  const at::Tensor emb = timestep_embedding(timestep, freq_dim_, true, 0.0, 1.0, 10000.0,
                                            w == at::kDouble ? at::kDouble : at::kFloat);
  return time_2(at::silu(time_1(emb.to(w))));
}

WanConditionEmbedderImpl::Out WanConditionEmbedderImpl::forward(const at::Tensor& timestep, const at::Tensor& text) {
  Out o;
  o.temb = time_embedding(timestep).to(text.scalar_type());
  o.timestep_proj = time_proj(at::silu(o.temb)).unflatten(1, {6, -1});
  o.text = text_2(at::gelu(text_1(text), "tanh"));
  return o;
}

// ---- the model ----

WanTransformer3DImpl::WanTransformer3DImpl(WanConfig c) : config_(std::move(c)) {
  const WanConfig& k = config_;
  const int64_t d = k.inner_dim();
  patch_embedding_module = register_module("patch_embedding", std::make_shared<torch::nn::Module>());
  patch_weight = patch_embedding_module->register_parameter(
      "weight", at::empty({d, k.in_channels, k.patch_size[0], k.patch_size[1], k.patch_size[2]}));
  patch_bias = patch_embedding_module->register_parameter("bias", at::empty({d}));
  condition_embedder = register_module("condition_embedder", WanConditionEmbedder(k));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < k.num_layers; ++i) blocks->push_back(WanBlock(k));
  norm_out = register_module("norm_out", WanLayerNorm(d, k.eps, false));
  proj_out = register_module("proj_out", nn::Linear(d, k.out_channels * k.patch_volume(), true));
  scale_shift_table = register_parameter("scale_shift_table", at::empty({1, 2, d}));
}

void WanTransformer3DImpl::init_weights(double std) {
  at::NoGradGuard no_grad;
  const double d = static_cast<double>(config_.inner_dim());
  auto params = named_parameters(true);
  for (auto& item : params) {
    const std::string& n = item.key();
    at::Tensor& p = item.value();
    if (n.ends_with("scale_shift_table")) {
      p.normal_(0.0, 1.0).div_(std::sqrt(d));  // torch.randn(...) / dim**0.5
    } else if (n.find("norm") != std::string::npos) {  // norm_q / norm_k / norm2
      if (n.ends_with(".weight")) p.fill_(1.0);
      else p.zero_();
    } else if (std >= 0) {
      if (n.ends_with(".bias")) p.zero_();
      else p.normal_(0.0, std);
    } else {
      // torch's Linear / Conv3d defaults: kaiming_uniform(a = sqrt(5)) weights and biases, both U(+-1/sqrt(fan_in))
      const at::Tensor& w = n.ends_with(".bias") ? params[n.substr(0, n.size() - 4) + "weight"] : p;
      const double bound = 1.0 / std::sqrt(static_cast<double>(w.numel() / w.size(0)));
      p.uniform_(-bound, bound);
    }
  }
}

BatchSchema WanTransformer3DImpl::batch_schema() const {
  const auto field = required_field;
  return {field("hidden_states", at::kFloat, 5, "noisy latents [B, C, F, H, W]"),
          field("timestep", at::kFloat, 1, "the denoising timestep of each row [B] (float or int64)"),
          field("encoder_hidden_states", at::kFloat, 3, "the text encoder's states [B, L, text_dim]"),
          field("target", at::kFloat, 5, "what the output is trained toward [B, C_out, F, H, W] (squared error)")};
}

double WanTransformer3DImpl::train_flops_per_sample(int64_t seq) const {
  const WanConfig& c = config_;
  const double s = static_cast<double>(seq), d = static_cast<double>(c.inner_dim());
  const double per_patch = 6.0 * static_cast<double>(c.patch_embedding_parameters() + c.num_layers * c.block_parameters() +
                                                     c.output_parameters());
  return per_patch * s + 12.0 * static_cast<double>(c.num_layers) * d * s * s;  // + self-attention products
}

WanTransformer3DImpl::Inputs WanTransformer3DImpl::check(const Batch& b, const std::string& where,
                                                         bool need_target) const {
  const WanConfig& c = config_;
  auto get = [&](const char* name) {
    const at::Tensor t = b.get(name);
    if (!t.defined()) throw file_error(where, name, "missing");
    return t;
  };
  Inputs in;
  in.latents = get("hidden_states");
  const auto& x = in.latents;
  if (!at::isFloatingType(x.scalar_type()) || x.dim() != 5 || x.size(1) != c.in_channels)
    throw file_error(where, "hidden_states", "expected float [B, " + std::to_string(c.in_channels) + ", F, H, W], got " +
                                                 std::string(c10::toString(x.scalar_type())) + " " + shape_str(x.sizes()));
  const char* axes[3] = {"frames", "height", "width"};
  for (int k = 0; k < 3; ++k) {
    const int64_t n = x.size(2 + k), p = c.patch_size[k];
    if (n == 0 || n % p != 0)
      throw file_error(where, "hidden_states", std::string(axes[k]) + " " + std::to_string(n) +
                                                   " is not a positive multiple of patch_size " + std::to_string(p));
    if (n / p > c.rope_max_seq_len)
      throw file_error(where, "hidden_states", std::to_string(n / p) + " patches along " + axes[k] +
                                                   " exceed rope_max_seq_len " + std::to_string(c.rope_max_seq_len));
  }
  const int64_t B = x.size(0);
  in.timestep = get("timestep");
  const auto tt = in.timestep.scalar_type();
  if ((!at::isFloatingType(tt) && !at::isIntegralType(tt, false)) || in.timestep.dim() != 1 ||
      in.timestep.size(0) != B)
    throw file_error(where, "timestep", "expected float or int64 [" + std::to_string(B) + "] (one per row), got " +
                                            std::string(c10::toString(tt)) + " " + shape_str(in.timestep.sizes()));
  in.text = get("encoder_hidden_states");
  if (!at::isFloatingType(in.text.scalar_type()) || in.text.dim() != 3 || in.text.size(0) != B ||
      in.text.size(1) == 0 || in.text.size(2) != c.text_dim)
    throw file_error(where, "encoder_hidden_states", "expected float [" + std::to_string(B) + ", L, " +
                                                         std::to_string(c.text_dim) + "] (L > 0), got " +
                                                         shape_str(in.text.sizes()));
  in.target = b.get("target");
  if (need_target && !in.target.defined()) throw file_error(where, "target", "missing");
  if (in.target.defined()) {
    std::vector<int64_t> want = x.sizes().vec();
    want[1] = c.out_channels;
    if (!at::isFloatingType(in.target.scalar_type()) || in.target.sizes() != at::IntArrayRef(want))
      throw file_error(where, "target", "expected float " + shape_str(want) + ", got " + shape_str(in.target.sizes()));
  }
  return in;
}

at::Tensor WanTransformer3DImpl::embed(const Batch& b) {
  // The strided Conv3d as one GEMM over the flattened patches (the same sums; see vision/vit.cpp on ATen's CPU
  // convolution under the row-split engine).
  const at::Tensor x = check(b, "batch", false).latents.to(patch_weight.scalar_type());
  const auto& p = config_.patch_size;
  const int64_t B = x.size(0), C = x.size(1), f = x.size(2) / p[0], h = x.size(3) / p[1], w = x.size(4) / p[2];
  const at::Tensor patches = x.reshape({B, C, f, p[0], h, p[1], w, p[2]})
                                 .permute({0, 2, 4, 6, 1, 3, 5, 7})
                                 .reshape({B, f * h * w, C * config_.patch_volume()});
  // context parallelism: this rank's tokens (models/model.h: sequence_inside)
  return cut_sequence(at::linear(patches, patch_weight.reshape({patch_weight.size(0), -1}), patch_bias), 1);
}

Batch WanTransformer3DImpl::conditions(const Inputs& in, at::ScalarType dtype) const {
  const WanConfig& c = config_;
  const auto& p = c.patch_size;
  const int64_t n[3] = {in.latents.size(2) / p[0], in.latents.size(3) / p[1], in.latents.size(4) / p[2]};
  // diffusers' WanRotaryPosEmbed: float64 angles pos * theta^(-2i / dim) per axis, cos / sin in float32
  const std::array<int64_t, 3> dims = c.rope_dims();
  const auto f64 = in.latents.options().dtype(at::kDouble);
  std::vector<at::Tensor> parts;
  for (int k = 0; k < 3; ++k) {
    const at::Tensor inv = at::reciprocal(at::pow(10000.0, at::arange(0, dims[k], 2, f64) / dims[k]));
    at::Tensor a = at::outer(at::arange(n[k], f64), inv);  // [n_k, dims[k] / 2]
    std::vector<int64_t> view = {1, 1, 1, a.size(1)};
    view[k] = n[k];
    parts.push_back(a.view(view).expand({n[0], n[1], n[2], a.size(1)}));
  }
  const at::Tensor angles = at::cat(parts, -1).reshape({n[0] * n[1] * n[2], -1});
  const auto rope_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  auto emb = condition_embedder.ptr()->forward(in.timestep, in.text.to(dtype));
  return Batch{{"cos", cut_sequence(at::cos(angles).to(rope_dtype), 0)},  // the tokens' rows, as embed() cuts them
               {"sin", cut_sequence(at::sin(angles).to(rope_dtype), 0)},
               {"temb", emb.temb},
               {"timestep_proj", emb.timestep_proj},
               {"text", emb.text}};
}

Batch WanTransformer3DImpl::block_inputs(const Batch& b, at::ScalarType dtype) const {
  return conditions(check(b, "batch", false), dtype);
}

at::Tensor WanTransformer3DImpl::block_forward(const Batch& in, const at::Tensor& h, int64_t i) {
  // (the conditions carry gradients to condition_embedder: recomputation and FSDP units pass them through as side
  // inputs, nn/recompute.h)
  const at::Tensor &tp = in.at("timestep_proj"), &text = in.at("text");
  return (*blocks)[static_cast<size_t>(i)]->as<WanBlockImpl>()->forward(h, tp, text, in.at("cos"), in.at("sin"));
}

at::Tensor WanTransformer3DImpl::post_blocks(const at::Tensor& h) { return norm_out(up(h)); }

at::Tensor WanTransformer3DImpl::output(const at::Tensor& normed, const at::Tensor& temb, at::IntArrayRef shape) {
  const auto& p = config_.patch_size;
  const auto dt = proj_out->weight.scalar_type();
  const std::vector<at::Tensor> m = (scale_shift_table + temb.unsqueeze(1)).chunk(2, 1);  // shift, scale [B, 1, D]
  at::Tensor x = proj_out((normed * (1 + m[1]) + m[0]).to(dt));
  const int64_t B = shape[0], f = shape[2] / p[0], h = shape[3] / p[1], w = shape[4] / p[2];
  // unpatchify: [B, f, h, w, pt, ph, pw, C] -> [B, C, f, pt, h, ph, w, pw]
  return x.reshape({B, f, h, w, p[0], p[1], p[2], config_.out_channels})
      .permute({0, 7, 1, 4, 2, 5, 3, 6})
      .reshape({B, config_.out_channels, f * p[0], h * p[1], w * p[2]});
}

at::Tensor WanTransformer3DImpl::head_loss_sum(const at::Tensor& h, const Batch& b) {
  const Inputs in = check(b, "batch", true);
  // The time embedding again (a [B, freq_dim] MLP): post_blocks' output carries none, and the batch has the timestep.
  const auto dt = proj_out->weight.scalar_type();
  const at::Tensor temb = condition_embedder->time_embedding(in.timestep).to(dt);
  const std::vector<at::Tensor> m = (scale_shift_table + temb.unsqueeze(1)).chunk(2, 1);  // shift, scale [B, 1, D]
  const at::Tensor x = proj_out((h * (1 + m[1]) + m[0]).to(dt));  // [B, S (this rank's), pt * ph * pw * C_out]
  // The squared error in patch space (the output's unpatchify undone on the target instead): the target's patches
  // [B, f, h, w, pt, ph, pw, C] as rows of tokens, cut like the sequence under context parallelism.
  const auto& p = config_.patch_size;
  const at::Tensor& t = in.target;
  const int64_t B = t.size(0), C = t.size(1), f = t.size(2) / p[0], hh = t.size(3) / p[1], w = t.size(4) / p[2];
  const at::Tensor tokens = t.reshape({B, C, f, p[0], hh, p[1], w, p[2]})
                                .permute({0, 2, 4, 6, 3, 5, 7, 1})
                                .reshape({B, f * hh * w, -1});
  const at::Tensor err = (up(x) - up(cut_sequence(tokens.to(x.device()), 1))).pow(2);
  if (const at::Tensor lw = b.get("loss_weight"); lw.defined())  // per-row weights (the objective's loss weighting)
    return (err.flatten(1).sum(1) * lw.to(err.scalar_type())).sum();
  return err.sum();
}

Model::ReferenceOutput WanTransformer3DImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                               const std::string& file) {
  Batch b;
  for (const auto& [k, v] : batch) b.set(k, v);
  const bool with_target = b.has("target");  // sampling passes none
  const Inputs in = check(b, file, with_target);
  // the training path: embed, block_inputs, blocks, post_blocks, head_loss_sum / loss_terms (= F.mse_loss)
  const at::Tensor h = forward_hidden(b);
  at::Tensor loss;
  if (with_target) loss = head_loss_sum(h, b) / static_cast<double>(loss_terms(b));
  at::Tensor out;
  {
    at::NoGradGuard no_grad;  // the sample, for comparison only
    out = output(h, condition_embedder->time_embedding(in.timestep).to(proj_out->weight.scalar_type()),
                 in.latents.sizes());
  }
  return {{{"output", out}}, loss};
}

Split WanTransformer3DImpl::split() const {
  Split s;
  s.pre = {"patch_embedding"};
  s.blocks = "blocks";
  s.post = {"norm_out", "proj_out"};
  // condition_embedder and scale_shift_table belong to no piece: every stage keeps them
  return s;
}

std::vector<nn::AttentionHook*> WanTransformer3DImpl::attention_modules() {
  std::vector<nn::AttentionHook*> out;
  for (const auto& m : blocks->children()) out.push_back(m->as<WanBlockImpl>()->attn1.get());
  return out;
}

std::string WanTransformer3DImpl::pipeline_blocker() const {
  return "WanTransformer3DModel: every block and the output head read condition_embedder's conditions (one module "
         "of no stage); it is not split into pipeline stages";
}

// ---- registry pieces ----

std::shared_ptr<Model> build_wan(const nlohmann::json& j, const std::string& file) {
  return WanTransformer3D(WanConfig::from_json(j, file)).ptr();
}

nlohmann::json describe_wan(const nlohmann::json& j, const std::string& file) {
  const WanConfig c = WanConfig::from_json(j, file);
  const std::array<int64_t, 3> rope = c.rope_dims();
  return {{"family", "diffusion"},
          {"model_type", "WanTransformer3DModel"},
          {"parameters", c.num_parameters()},
          {"layers", c.num_layers},
          {"hidden_size", c.inner_dim()},
          {"heads", c.num_attention_heads},
          {"head_dim", c.attention_head_dim},
          {"patch_size", c.patch_size},
          {"components",
           {{"patch_embedding",
             {{"parameters", c.patch_embedding_parameters()}, {"in_channels", c.in_channels}, {"kind", "conv3d"}}},
            {"condition_embedder",
             {{"parameters", c.condition_embedder_parameters()}, {"freq_dim", c.freq_dim}, {"text_dim", c.text_dim}}},
            {"blocks",
             {{"parameters", c.num_layers * c.block_parameters()},
              {"layers", c.num_layers},
              {"ffn_dim", c.ffn_dim},
              {"cross_attn_norm", c.cross_attn_norm},
              {"rope_dims", rope}}},
            {"output", {{"parameters", c.output_parameters()}, {"out_channels", c.out_channels}}}}}};
}

}  // namespace lf::models::diffusion

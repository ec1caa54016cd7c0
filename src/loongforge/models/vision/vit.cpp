// CLIP / SigLIP vision transformers (models/vision/vit.h).
#include "loongforge/nn/recompute.h"
#include "loongforge/models/vision/vit.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/kernels/swiglu.h"

namespace lf::models::vision {

bool VitConfig::handles(const std::string& t) { return t == "clip_vision_model" || t == "siglip_vision_model"; }

VitConfig VitConfig::from_json(const nlohmann::json& j, const std::string& file, const std::string& path) {
  JsonReader r(j, file, path);
  VitConfig c;
  c.raw = j;
  c.model_type = r.string("model_type");
  if (!handles(c.model_type))
    r.fail("model_type", "'" + c.model_type + "' is not a vision tower this family handles (known: clip_vision_model, "
                         "siglip_vision_model)");
  const bool clip = c.model_type == "clip_vision_model";
  c.class_token = clip;
  c.hidden_size = r.integer("hidden_size", 768);
  c.intermediate_size = r.integer("intermediate_size", 3072);
  c.num_hidden_layers = r.integer("num_hidden_layers", 12);
  c.num_attention_heads = r.integer("num_attention_heads", 12);
  c.num_channels = r.integer("num_channels", 3);
  c.image_size = r.integer("image_size", 224);
  c.patch_size = r.integer("patch_size", clip ? 32 : 16);
  c.hidden_act = r.string("hidden_act", clip ? "quick_gelu" : "gelu_pytorch_tanh");
  c.layer_norm_eps = r.number("layer_norm_eps", clip ? 1e-5 : 1e-6);
  c.use_head = !clip && r.boolean("vision_use_head", true);
  c.initializer_range = r.number("initializer_range", 0.02);
  c.initializer_factor = r.number("initializer_factor", 1.0);
  for (const char* k : {"hidden_size", "num_hidden_layers", "num_attention_heads", "image_size", "patch_size"})
    if (r.integer(k, 1) <= 0) r.fail(k, "must be positive");
  if (c.hidden_size % c.num_attention_heads != 0)
    r.fail("num_attention_heads", std::to_string(c.num_attention_heads) + " does not divide hidden_size " +
                                      std::to_string(c.hidden_size));
  if (c.image_size % c.patch_size != 0)
    r.fail("patch_size", std::to_string(c.patch_size) + " does not divide image_size " + std::to_string(c.image_size));
  require_activation(r, "hidden_act", c.hidden_act);
  return c;
}

int64_t VitConfig::num_parameters() const {
  const int64_t d = hidden_size, f = intermediate_size;
  const int64_t layer = 4 * (d * d + d) + 2 * 2 * d + (d * f + f) + (f * d + d);
  int64_t n = num_channels * patch_size * patch_size * d + (class_token ? 0 : d) + num_positions() * d +
              num_hidden_layers * layer + 2 * d;
  if (class_token) n += d + 2 * d;  // class embedding, pre_layrnorm
  if (use_head) n += d + 3 * d * d + 3 * d + d * d + d + 2 * d + (d * f + f) + (f * d + d);
  return n;
}

at::Tensor activation(const std::string& name, const at::Tensor& x) {
  if (name == "gelu") return at::gelu(x);
  if (name == "gelu_pytorch_tanh" || name == "gelu_new" || name == "gelu_fast") return kernels::gelu_tanh(x);  // fused on the CPU
  if (name == "quick_gelu") return x * at::sigmoid(1.702 * x);
  if (name == "relu") return at::relu(x);
  if (name == "silu" || name == "swish") return at::silu(x);
  throw Error("activation '" + name + "' is not supported (known: gelu, gelu_pytorch_tanh, gelu_new, quick_gelu, relu, "
              "silu)");
}

void require_activation(const JsonReader& r, const std::string& key, const std::string& name) {
  try {
    activation(name, at::zeros({1}));
  } catch (const Error& e) {
    r.fail(key, e.what());
  }
}

VitAttentionImpl::VitAttentionImpl(int64_t hidden, int64_t heads)
    : nn::AttentionHook(heads, heads, 0), head_dim(hidden / heads) {
  causal = false;
  q_proj = register_module("q_proj", nn::Linear(hidden, hidden, true));
  k_proj = register_module("k_proj", nn::Linear(hidden, hidden, true));
  v_proj = register_module("v_proj", nn::Linear(hidden, hidden, true));
  out_proj = register_module("out_proj", nn::Linear(hidden, hidden, true));
}

at::Tensor VitAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1);
  auto split = [&](const at::Tensor& y) { return y.view({b, t, -1, head_dim}).transpose(1, 2); };
  at::Tensor o = attend(split(q_proj(x)), split(k_proj(x)), split(v_proj(x)), 0,
                        1.0 / std::sqrt(static_cast<double>(head_dim)), {});
  return out_proj(o.transpose(1, 2).reshape({b, t, -1}));
}

VitMLPImpl::VitMLPImpl(int64_t hidden, int64_t inner, std::string act) : act_(std::move(act)) {
  fc1 = register_module("fc1", nn::Linear(hidden, inner, true));
  fc2 = register_module("fc2", nn::Linear(inner, hidden, true));
}

namespace {
torch::nn::LayerNorm layer_norm(int64_t d, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(eps));
}
}  // namespace

VitLayerImpl::VitLayerImpl(const VitConfig& c) {
  layer_norm1 = register_module("layer_norm1", layer_norm(c.hidden_size, c.layer_norm_eps));
  self_attn = register_module("self_attn", VitAttention(c.hidden_size, c.num_attention_heads));
  layer_norm2 = register_module("layer_norm2", layer_norm(c.hidden_size, c.layer_norm_eps));
  mlp = register_module("mlp", VitMLP(c.hidden_size, c.intermediate_size, c.hidden_act));
}

at::Tensor VitLayerImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + self_attn(layer_norm1(x));
  return h + mlp(layer_norm2(h));
}

VitEmbeddingsImpl::VitEmbeddingsImpl(const VitConfig& c) : c_(c) {
  patch_embedding = register_module(
      "patch_embedding", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.num_channels, c.hidden_size, c.patch_size)
                                               .stride(c.patch_size)
                                               .bias(!c.class_token)));  // CLIP's has no bias
  position_embedding = register_module("position_embedding", torch::nn::Embedding(c.num_positions(), c.hidden_size));
  if (c.class_token) class_embedding = register_parameter("class_embedding", at::empty({c.hidden_size}));
}

at::Tensor VitEmbeddingsImpl::forward(const at::Tensor& pixel_values) {
  // The strided convolution as one GEMM over the flattened patches (the same sums). ATen's CPU convolution gave wrong
  // weight gradients under the row-split engine (parts' backward on several threads at once; correct on one):
  // a GEMM has no such problem and is faster at these shapes.
  const at::Tensor& w = patch_embedding->weight;  // [D, C, P, P]
  const int64_t n = pixel_values.size(0), c = pixel_values.size(1), P = c_.patch_size;
  const int64_t gh = pixel_values.size(2) / P, gw = pixel_values.size(3) / P;
  at::Tensor patches = pixel_values.to(w.scalar_type())
                           .reshape({n, c, gh, P, gw, P})
                           .permute({0, 2, 4, 1, 3, 5})
                           .reshape({n, gh * gw, c * P * P});
  const at::Tensor& b = patch_embedding->options.bias() ? patch_embedding->bias : at::Tensor();
  at::Tensor p = at::linear(patches, w.reshape({w.size(0), -1}), b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
  if (c_.class_token) p = at::cat({class_embedding.view({1, 1, -1}).expand({p.size(0), 1, -1}), p}, 1);
  return p + position_embedding->weight.unsqueeze(0);
}

VitEncoderImpl::VitEncoderImpl(const VitConfig& c) {
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(VitLayer(c));
}

AttentionPoolingHeadImpl::AttentionPoolingHeadImpl(const VitConfig& c) : heads_(c.num_attention_heads) {
  const int64_t d = c.hidden_size;
  probe = register_parameter("probe", at::empty({1, 1, d}));
  // torch.nn.MultiheadAttention's names: attention.in_proj_weight / in_proj_bias / out_proj
  auto attention = register_module("attention", std::make_shared<torch::nn::Module>());
  in_proj_weight = attention->register_parameter("in_proj_weight", at::empty({3 * d, d}));
  in_proj_bias = attention->register_parameter("in_proj_bias", at::empty({3 * d}));
  out_proj = attention->register_module("out_proj", nn::Linear(d, d, true));
  layernorm = register_module("layernorm", layer_norm(d, c.layer_norm_eps));
  mlp = register_module("mlp", VitMLP(d, c.intermediate_size, c.hidden_act));
}

at::Tensor AttentionPoolingHeadImpl::forward(const at::Tensor& x) {
  const int64_t n = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads_;
  auto w = in_proj_weight.chunk(3, 0);
  auto b = in_proj_bias.chunk(3, 0);
  at::Tensor q = at::linear(probe.expand({n, 1, d}), w[0], b[0]).view({n, 1, heads_, hd}).transpose(1, 2);
  at::Tensor k = at::linear(x, w[1], b[1]).view({n, t, heads_, hd}).transpose(1, 2);
  at::Tensor v = at::linear(x, w[2], b[2]).view({n, t, heads_, hd}).transpose(1, 2);
  at::Tensor o = at::scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape({n, 1, d});
  at::Tensor h = out_proj(o);
  h = h + mlp(layernorm(h));
  return h.select(1, 0);
}

VisionTowerImpl::VisionTowerImpl(VitConfig c) : c_(std::move(c)) {
  embeddings = register_module("embeddings", VitEmbeddings(c_));
  if (c_.class_token) pre_layrnorm = register_module("pre_layrnorm", layer_norm(c_.hidden_size, c_.layer_norm_eps));
  encoder = register_module("encoder", VitEncoder(c_));
  post_layernorm = register_module("post_layernorm", layer_norm(c_.hidden_size, c_.layer_norm_eps));
  if (c_.use_head) head = register_module("head", AttentionPoolingHead(c_));
}

std::vector<at::Tensor> VisionTowerImpl::hidden_states(const at::Tensor& pixel_values, int64_t upto) {
  if (upto < 0 || upto > c_.num_hidden_layers) upto = c_.num_hidden_layers;
  std::vector<at::Tensor> out;
  at::Tensor h = embeddings(pixel_values);
  if (pre_layrnorm) h = pre_layrnorm(h);
  out.push_back(h);
  for (int64_t i = 0; i < upto; ++i) {
    auto* layer = (*encoder->layers)[static_cast<size_t>(i)]->as<VitLayerImpl>();
    h = nn::maybe_recompute(recompute, *layer, [layer](const at::Tensor& x) { return layer->forward(x); }, h);
    out.push_back(h);
  }
  return out;
}

at::Tensor VisionTowerImpl::last_hidden_state(const at::Tensor& pixel_values) {
  at::Tensor h = hidden_states(pixel_values).back();
  return c_.class_token ? h : post_layernorm(h);
}

std::vector<nn::AttentionHook*> VisionTowerImpl::attention_modules() {
  std::vector<nn::AttentionHook*> out;
  for (auto& m : *encoder->layers) out.push_back(m->as<VitLayerImpl>()->self_attn.get());
  return out;
}

void VisionTowerImpl::init_weights(double std) {
  // transformers' schemes: CLIP scales normal std by width and depth; SigLIP uses xavier-uniform projections,
  // lecun-normal patch embedding, normal(1/sqrt(width)) positions.
  at::NoGradGuard no_grad;
  const double f = c_.initializer_factor, d = static_cast<double>(c_.hidden_size);
  if (std < 0) std = c_.initializer_range;
  const double depth = std::pow(2.0 * static_cast<double>(c_.num_hidden_layers), -0.5);
  auto xavier = [](at::Tensor& w) {
    const double a = std::sqrt(6.0 / static_cast<double>(w.size(0) + w.size(1)));
    w.uniform_(-a, a);
  };
  for (auto& item : named_parameters()) {
    const std::string& n = item.key();
    at::Tensor& p = item.value();
    if (n.find("norm") != std::string::npos) {
      if (n.ends_with(".weight")) p.fill_(1.0);
      else p.zero_();
    } else if (n.ends_with(".bias") || n.ends_with("in_proj_bias")) {
      if (!c_.class_token && n.find("mlp.fc") != std::string::npos) p.normal_(0.0, 1e-6);
      else p.zero_();
    } else if (n == "embeddings.class_embedding") {
      p.normal_(0.0, std::pow(d, -0.5) * f);
    } else if (n == "embeddings.position_embedding.weight") {
      p.normal_(0.0, c_.class_token ? std * f : 1.0 / std::sqrt(d));
    } else if (n == "embeddings.patch_embedding.weight") {
      const double fan_in = static_cast<double>(p.numel() / p.size(0));
      p.normal_(0.0, c_.class_token ? std * f : 1.0 / std::sqrt(fan_in));
    } else if (c_.class_token) {  // CLIP
      if (n.find("out_proj") != std::string::npos) p.normal_(0.0, std::pow(d, -0.5) * f);
      else if (n.find("_proj") != std::string::npos) p.normal_(0.0, std::pow(d, -0.5) * depth * f);
      else if (n.find("fc1") != std::string::npos) p.normal_(0.0, std::pow(2.0 * d, -0.5) * f);
      else if (n.find("fc2") != std::string::npos) p.normal_(0.0, std::pow(d, -0.5) * depth * f);
      else p.normal_(0.0, std);
    } else if (p.dim() == 2) {  // SigLIP projections and MLPs
      xavier(p);
    } else if (n == "head.probe") {
      at::Tensor v = p.view({1, -1});
      xavier(v);
    } else {
      p.normal_(0.0, std);
    }
  }
}

}  // namespace lf::models::vision

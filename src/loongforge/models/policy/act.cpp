#include "loongforge/models/policy/act.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>
#include <functional>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/kernels/dropout.h"
#include "loongforge/kernels/linear.h"
#include "loongforge/models/policy/spec.h"

namespace lf::models::policy {

namespace {

// LeRobot's create_sinusoidal_pos_embedding (computed in float64, then float32): [positions, dim].
at::Tensor sinusoid_1d(int64_t positions, int64_t dim) {
  at::Tensor pos = at::arange(positions, at::kDouble).unsqueeze(1);
  at::Tensor j = at::arange(dim, at::kDouble);
  at::Tensor angle = pos / at::pow(10000.0, 2 * at::floor(j / 2) / static_cast<double>(dim));
  at::Tensor even = (at::arange(dim) % 2 == 0).unsqueeze(0);
  return at::where(even, angle.sin(), angle.cos()).to(at::kFloat);
}

// ACTSinusoidalPositionEmbedding2d for an h x w feature map (float32, as LeRobot computes it): [h * w, 2 * half].
at::Tensor sinusoid_2d(int64_t h, int64_t w, int64_t half) {
  constexpr double kTwoPi = 2 * M_PI, kEps = 1e-6;
  at::Tensor y = at::arange(1, h + 1, at::kFloat).view({h, 1}).expand({h, w});
  at::Tensor x = at::arange(1, w + 1, at::kFloat).view({1, w}).expand({h, w});
  y = y / (static_cast<float>(h) + kEps) * kTwoPi;
  x = x / (static_cast<float>(w) + kEps) * kTwoPi;
  at::Tensor inv = at::pow(10000.0, 2 * at::floor_divide(at::arange(half, at::kFloat), 2) / static_cast<double>(half)).to(at::kFloat);
  auto embed = [&](const at::Tensor& r) {
    at::Tensor a = r.unsqueeze(-1) / inv;  // [h, w, half]
    using at::indexing::Slice;
    at::Tensor s = a.index({"...", Slice(0, at::indexing::None, 2)}).sin();
    at::Tensor c = a.index({"...", Slice(1, at::indexing::None, 2)}).cos();
    return at::stack({s, c}, -1).flatten(2);  // sin, cos interleaved
  };
  return at::cat({embed(y), embed(x)}, -1).reshape({h * w, 2 * half});
}

// training-mode dropout (p 0: none) through kernels/dropout.h (a hashed mask: LeRobot's draws are not reproduced)
at::Tensor dropout(const at::Tensor& x, double p) { return p > 0 ? kernels::dropout(x, p) : x; }

// A torch::nn::Linear (LeRobot's parameter names) through kernels::linear: the row-split GEMMs of the CPU kernels, on
// the faster float32 BLAS of the host (OpenBLAS's AVX-512 kernels on AMD, where ATen's MKL takes its AVX2 path).
at::Tensor lin(torch::nn::Linear& l, const at::Tensor& x) { return kernels::linear(x, l->weight, l->bias); }

// linear2(dropout(activation(linear1(x)))).
at::Tensor feed_forward(torch::nn::Linear& l1, torch::nn::Linear& l2, const at::Tensor& x, const std::string& activation, double p) {
  const at::Tensor h = lin(l1, x);
  return lin(l2, dropout(activation == "gelu" ? at::gelu(h) : at::relu(h), p));
}

// One residual sub-layer of LeRobot's transformer layers: pre-norm x + dropout(f(norm(x))), post-norm
// norm(x + dropout(f(x))).
at::Tensor sublayer(const at::Tensor& x, torch::nn::LayerNorm& norm, bool pre_norm, double p,
                    const std::function<at::Tensor(const at::Tensor&)>& f) {
  return pre_norm ? x + dropout(f(norm(x)), p) : norm(x + dropout(f(x), p));
}

}  // namespace

ACTConfig ACTConfig::from_json(const nlohmann::json& j, const std::string& file) {
  ACTConfig c;
  c.raw = j;
  JsonReader r(j, file);
  const PolicyFeatures f = PolicyFeatures::read(r, "ACT");
  c.state_dim = f.state_dim;
  c.env_dim = f.env_dim;
  c.action_dim = f.action_dim;
  c.cameras = f.cameras;
  c.image_shape = f.image_shape;
  c.n_obs_steps = r.integer("n_obs_steps", 1);
  if (c.n_obs_steps != 1) r.fail("n_obs_steps", "ACT takes one observation step, got " + std::to_string(c.n_obs_steps));
  c.chunk_size = r.integer("chunk_size", 100);
  c.n_action_steps = r.integer("n_action_steps", 100);
  if (c.chunk_size < 1) r.fail("chunk_size", "expected a positive number");
  if (c.n_action_steps < 1 || c.n_action_steps > c.chunk_size)
    r.fail("n_action_steps", std::to_string(c.n_action_steps) + " is not in [1, chunk_size " + std::to_string(c.chunk_size) + "]");
  c.vision_backbone = r.string("vision_backbone", "resnet18");
  std::string why;
  c.backbone = ResNetLayout::named(c.vision_backbone, &why);
  if (!why.empty()) r.fail("vision_backbone", why);
  if (j.contains("replace_final_stride_with_dilation") && !j["replace_final_stride_with_dilation"].is_null()) {
    const auto& v = j["replace_final_stride_with_dilation"];
    c.dilation = v.is_boolean() ? v.get<bool>() : r.integer("replace_final_stride_with_dilation") != 0;
  }
  if (c.dilation && !c.backbone.bottleneck)
    r.fail("replace_final_stride_with_dilation", "torchvision's BasicBlock (" + c.vision_backbone + ") has no dilation");
  c.backbone.dilate_last = c.dilation;
  c.pre_norm = r.boolean("pre_norm", false);
  c.dim_model = r.integer("dim_model", 512);
  c.n_heads = r.integer("n_heads", 8);
  if (c.n_heads < 1 || c.dim_model % c.n_heads)
    r.fail("n_heads", std::to_string(c.n_heads) + " does not divide dim_model " + std::to_string(c.dim_model));
  if (c.dim_model % 4) r.fail("dim_model", "expected a multiple of 4 (2D sine positions), got " + std::to_string(c.dim_model));
  c.dim_feedforward = r.integer("dim_feedforward", 3200);
  c.activation = r.string("feedforward_activation", "relu");
  if (c.activation != "relu" && c.activation != "gelu")
    r.fail("feedforward_activation", "'" + c.activation + "' is not relu or gelu");
  c.n_encoder_layers = r.integer("n_encoder_layers", 4);
  c.n_decoder_layers = r.integer("n_decoder_layers", 1);
  c.use_vae = r.boolean("use_vae", true);
  c.latent_dim = r.integer("latent_dim", 32);
  c.n_vae_encoder_layers = r.integer("n_vae_encoder_layers", 4);
  if (auto t = r.opt_number("temporal_ensemble_coeff")) {
    c.has_ensemble = true;
    c.temporal_ensemble_coeff = *t;
    if (c.n_action_steps != 1)
      r.fail("temporal_ensemble_coeff", "temporal ensembling queries every step: it needs n_action_steps 1");
  }
  c.dropout = r.number("dropout", 0.1);
  c.kl_weight = r.number("kl_weight", 10.0);
  for (const char* k : {"n_encoder_layers", "n_decoder_layers", "latent_dim", "dim_feedforward"})
    if (r.integer(k) < 1) r.fail(k, "expected a positive number");
  return c;
}

// ---- modules ----

MultiheadAttentionImpl::MultiheadAttentionImpl(int64_t dim, int64_t heads, double dropout)
    : heads_(heads), dropout_(dropout) {
  in_proj_weight = register_parameter("in_proj_weight", at::empty({3 * dim, dim}));
  in_proj_bias = register_parameter("in_proj_bias", at::zeros({3 * dim}));
  out_proj = register_module("out_proj", torch::nn::Linear(dim, dim));
  torch::NoGradGuard g;
  torch::nn::init::xavier_uniform_(in_proj_weight);
  out_proj->bias.zero_();
}

at::Tensor MultiheadAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& key_padding_mask) {
  const int64_t B = q.size(0), D = q.size(2), hd = D / heads_;
  auto w = in_proj_weight.chunk(3, 0);
  auto b = in_proj_bias.chunk(3, 0);
  auto heads = [&](const at::Tensor& x) { return x.view({B, x.size(1), heads_, hd}).transpose(1, 2); };
  // torch.nn.functional.multi_head_attention_forward: q scaled before the product, a -inf mask added, softmax
  at::Tensor Q, K;
  if (q.is_same(k)) {  // self-attention (q = k = x + pos): the query and key projections as one product
    auto qk = kernels::linear(q, in_proj_weight.narrow(0, 0, 2 * D), in_proj_bias.narrow(0, 0, 2 * D)).chunk(2, -1);
    Q = qk[0], K = qk[1];
  } else {
    Q = kernels::linear(q, w[0], b[0]), K = kernels::linear(k, w[1], b[1]);
  }
  Q = heads(Q) * std::sqrt(1.0 / static_cast<double>(hd));
  K = heads(K);
  at::Tensor V = heads(kernels::linear(v, w[2], b[2]));
  at::Tensor s = at::matmul(Q, K.transpose(-2, -1));
  if (key_padding_mask.defined())
    s = s.masked_fill(key_padding_mask.view({B, 1, 1, -1}), -std::numeric_limits<double>::infinity());
  at::Tensor p = at::softmax(s, -1);
  if (dropout_ > 0 && is_training()) p = kernels::dropout(p, dropout_);
  at::Tensor o = at::matmul(p, V).transpose(1, 2).reshape({B, -1, D});
  return lin(out_proj, o);
}

ACTEncoderLayerImpl::ACTEncoderLayerImpl(const ACTConfig& c)
    : pre_norm_(c.pre_norm), dropout_(c.dropout), activation_(c.activation) {
  self_attn = register_module("self_attn", MultiheadAttention(c.dim_model, c.n_heads, c.dropout));
  linear1 = register_module("linear1", torch::nn::Linear(c.dim_model, c.dim_feedforward));
  linear2 = register_module("linear2", torch::nn::Linear(c.dim_feedforward, c.dim_model));
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim_model})));
  norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim_model})));
}

at::Tensor ACTEncoderLayerImpl::forward(at::Tensor x, const at::Tensor& pos, const at::Tensor& key_padding_mask,
                                       int64_t queries) {
  const double p = is_training() ? dropout_ : 0;
  // queries > 0: the first `queries` positions' outputs only (their keys and values still from every position); the
  // same values as those rows of the whole output
  auto first = [&](const at::Tensor& t) { return queries > 0 ? t.narrow(1, 0, queries) : t; };
  const at::Tensor y = pre_norm_ ? norm1(x) : x;
  const at::Tensor qk = pos.defined() ? y + pos : y;
  const at::Tensor a = dropout(self_attn(first(qk), qk, y, key_padding_mask), p);
  x = pre_norm_ ? first(x) + a : norm1(first(x) + a);
  return sublayer(x, norm2, pre_norm_, p, [&](const at::Tensor& h) { return feed_forward(linear1, linear2, h, activation_, p); });
}

ACTDecoderLayerImpl::ACTDecoderLayerImpl(const ACTConfig& c)
    : pre_norm_(c.pre_norm), dropout_(c.dropout), activation_(c.activation) {
  self_attn = register_module("self_attn", MultiheadAttention(c.dim_model, c.n_heads, c.dropout));
  multihead_attn = register_module("multihead_attn", MultiheadAttention(c.dim_model, c.n_heads, c.dropout));
  linear1 = register_module("linear1", torch::nn::Linear(c.dim_model, c.dim_feedforward));
  linear2 = register_module("linear2", torch::nn::Linear(c.dim_feedforward, c.dim_model));
  for (auto* n : {&norm1, &norm2, &norm3}) *n = torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim_model}));
  register_module("norm1", norm1);
  register_module("norm2", norm2);
  register_module("norm3", norm3);
}

at::Tensor ACTDecoderLayerImpl::forward(at::Tensor x, const at::Tensor& memory, const at::Tensor& pos,
                                        const at::Tensor& memory_pos) {
  const double p = is_training() ? dropout_ : 0;
  x = sublayer(x, norm1, pre_norm_, p, [&](const at::Tensor& y) {
    const at::Tensor qk = y + pos;
    return self_attn(qk, qk, y);
  });
  x = sublayer(x, norm2, pre_norm_, p, [&](const at::Tensor& y) { return multihead_attn(y + pos, memory + memory_pos, memory); });
  return sublayer(x, norm3, pre_norm_, p, [&](const at::Tensor& y) { return feed_forward(linear1, linear2, y, activation_, p); });
}

ACTStackImpl::ACTStackImpl(const ACTConfig& c, int64_t n, bool decoder) {
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < n; ++i) {
    if (decoder) layers->push_back(ACTDecoderLayer(c));
    else layers->push_back(ACTEncoderLayer(c));
  }
  if (decoder || c.pre_norm) norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim_model})));
}

ACTImpl::ACTImpl(const ACTConfig& c) : c_(c) {
  const int64_t D = c.dim_model;
  if (c.use_vae) {
    vae_encoder = register_module("vae_encoder", ACTStack(c, c.n_vae_encoder_layers, false));
    vae_encoder_cls_embed = register_module("vae_encoder_cls_embed", torch::nn::Embedding(1, D));
    if (c.state_dim) vae_encoder_robot_state_input_proj = register_module("vae_encoder_robot_state_input_proj", torch::nn::Linear(c.state_dim, D));
    vae_encoder_action_input_proj = register_module("vae_encoder_action_input_proj", torch::nn::Linear(c.action_dim, D));
    vae_encoder_latent_output_proj = register_module("vae_encoder_latent_output_proj", torch::nn::Linear(D, 2 * c.latent_dim));
    vae_encoder_pos_enc = register_buffer("vae_encoder_pos_enc", sinusoid_1d(1 + c.chunk_size + (c.state_dim ? 1 : 0), D).unsqueeze(0));
  }
  if (!c.cameras.empty()) backbone = register_module("backbone", ResNet(c.backbone));
  encoder = register_module("encoder", ACTStack(c, c.n_encoder_layers, false));
  decoder = register_module("decoder", ACTStack(c, c.n_decoder_layers, true));
  if (c.state_dim) encoder_robot_state_input_proj = register_module("encoder_robot_state_input_proj", torch::nn::Linear(c.state_dim, D));
  if (c.env_dim) encoder_env_state_input_proj = register_module("encoder_env_state_input_proj", torch::nn::Linear(c.env_dim, D));
  encoder_latent_input_proj = register_module("encoder_latent_input_proj", torch::nn::Linear(c.latent_dim, D));
  if (!c.cameras.empty())
    encoder_img_feat_input_proj = register_module("encoder_img_feat_input_proj",
                                                  torch::nn::Conv2d(torch::nn::Conv2dOptions(c.backbone.out_channels(), D, 1)));
  encoder_1d_feature_pos_embed = register_module("encoder_1d_feature_pos_embed", torch::nn::Embedding(1 + (c.state_dim ? 1 : 0) + (c.env_dim ? 1 : 0), D));
  decoder_pos_embed = register_module("decoder_pos_embed", torch::nn::Embedding(c.chunk_size, D));
  action_head = register_module("action_head", torch::nn::Linear(D, c.action_dim));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ACTImpl::forward(const Batch& b, bool vae, const at::Tensor& eps) {
  const int64_t B = b.num_rows(), D = c_.dim_model;
  const at::Tensor state = c_.state_dim ? b.at("observation.state") : at::Tensor();
  const auto dtype = action_head->bias.scalar_type();  // (a bias: FSDP's bf16 compute copies only matmul weights)
  // queries > 0: only the first `queries` positions of the last layer's output (the CVAE encoder reads its cls token)
  auto run = [](ACTStack& s, at::Tensor x, const at::Tensor& pos, const at::Tensor& pad, int64_t queries) {
    const size_t n = s->layers->size();
    for (size_t i = 0; i < n; ++i) x = (*s->layers)[i]->as<ACTEncoderLayerImpl>()->forward(x, pos, pad, i + 1 == n ? queries : 0);
    return s->norm ? s->norm(x) : x;
  };
  at::Tensor mu, logvar, latent;
  if (vae) {
    std::vector<at::Tensor> in{vae_encoder_cls_embed->weight.unsqueeze(0).expand({B, 1, D})};
    if (c_.state_dim) in.push_back(lin(vae_encoder_robot_state_input_proj, state).unsqueeze(1));
    in.push_back(lin(vae_encoder_action_input_proj, b.at("action")));
    const at::Tensor pad = at::cat({at::zeros({B, c_.state_dim ? 2 : 1}, b.at("action_is_pad").options()), b.at("action_is_pad")}, 1);
    const at::Tensor cls = run(vae_encoder, at::cat(in, 1), vae_encoder_pos_enc.to(dtype), pad, 1).select(1, 0);
    const at::Tensor params = lin(vae_encoder_latent_output_proj, cls);
    mu = params.narrow(1, 0, c_.latent_dim);
    logvar = params.narrow(1, c_.latent_dim, c_.latent_dim);
    latent = mu + (logvar / 2).exp() * (eps.defined() ? eps.to(dtype) : at::randn_like(mu));
  } else {
    latent = at::zeros({B, c_.latent_dim}, action_head->bias.options());
  }
  std::vector<at::Tensor> tokens{lin(encoder_latent_input_proj, latent).unsqueeze(1)};
  std::vector<at::Tensor> pos{encoder_1d_feature_pos_embed->weight.unsqueeze(0)};
  if (c_.state_dim) tokens.push_back(lin(encoder_robot_state_input_proj, state).unsqueeze(1));
  if (c_.env_dim) tokens.push_back(lin(encoder_env_state_input_proj, b.at("observation.environment_state")).unsqueeze(1));
  for (const std::string& cam : c_.cameras) {
    const at::Tensor f = backbone(b.at(cam));  // [B, C, h, w]
    const int64_t h = f.size(2), w = f.size(3);
    pos.push_back(sinusoid_2d(h, w, D / 2).to(f.options()).unsqueeze(0));
    tokens.push_back(encoder_img_feat_input_proj(f).permute({0, 2, 3, 1}).reshape({B, h * w, D}));  // [B, h * w, D]
  }
  const at::Tensor x = at::cat(tokens, 1), p = at::cat(pos, 1);
  const at::Tensor memory = run(encoder, x, p, {}, 0);
  at::Tensor y = at::zeros({B, c_.chunk_size, D}, x.options());
  const at::Tensor qpos = decoder_pos_embed->weight.unsqueeze(0);
  for (auto& l : *decoder->layers) y = l->as<ACTDecoderLayerImpl>()->forward(y, memory, qpos, p);
  return {lin(action_head, decoder->norm(y)), mu, logvar};
}

// ---- the policy ----

ACTPolicyImpl::ACTPolicyImpl(ACTConfig c) : PolicyModel(c.raw), config_(std::move(c)) { model = register_module("model", ACT(config_)); }

void ACTPolicyImpl::init_weights(double) {
  torch::NoGradGuard g;
  // PyTorch's defaults (LeRobot builds the modules so), Xavier-uniform for the transformer's matrices, torchvision's
  // initialisation for the backbone
  for (auto& m : modules(false)) {
    if (auto* l = m->as<torch::nn::LinearImpl>()) l->reset_parameters();
    if (auto* e = m->as<torch::nn::EmbeddingImpl>()) e->reset_parameters();
    if (auto* n = m->as<torch::nn::LayerNormImpl>()) n->reset_parameters();
    if (auto* c = m->as<torch::nn::Conv2dImpl>()) c->reset_parameters();
    if (auto* a = m->as<MultiheadAttentionImpl>()) {
      torch::nn::init::xavier_uniform_(a->in_proj_weight);
      a->in_proj_bias.zero_();
      a->out_proj->bias.zero_();
    }
  }
  for (ACTStack* s : {&model->encoder, &model->decoder})
    for (auto& p : (*s)->parameters())
      if (p.dim() > 1) torch::nn::init::xavier_uniform_(p);
  if (model->backbone) model->backbone->init_weights();
}

BatchSchema ACTPolicyImpl::batch_schema() const {
  const auto& c = config_;
  BatchSchema s;
  if (c.state_dim) s.push_back(required_field("observation.state", at::kFloat, 2, "normalised robot state [B, " + std::to_string(c.state_dim) + "]"));
  if (c.env_dim) s.push_back(required_field("observation.environment_state", at::kFloat, 2, "normalised environment state [B, " + std::to_string(c.env_dim) + "]"));
  for (const std::string& cam : c.cameras) s.push_back(required_field(cam, at::kFloat, 4, "normalised images [B, 3, H, W]"));
  s.push_back(required_field("action", at::kFloat, 3, "normalised action chunk [B, " + std::to_string(c.chunk_size) + ", " + std::to_string(c.action_dim) + "]"));
  s.push_back(required_field("action_is_pad", at::kBool, 2, "padded steps of the chunk (past the episode's end) [B, chunk]"));
  s.push_back(optional_field("vae_eps", at::kFloat, 2, "the latent's standard-normal draw [B, latent_dim] (drawn when absent)"));
  return s;
}

double ACTPolicyImpl::train_flops_per_sample(int64_t) const {
  // 6 FLOPs per parameter per token through the transformer; the backbone per camera image
  const auto& c = config_;
  const double layer = 4.0 * c.dim_model * c.dim_model + 2.0 * c.dim_model * c.dim_feedforward;
  int64_t h = c.image_shape.empty() ? 0 : c.image_shape[1], w = c.image_shape.empty() ? 0 : c.image_shape[2];
  const double tokens = 2 + static_cast<double>(c.cameras.size()) * (h / 32) * (w / 32);
  return 6.0 * (layer * (tokens * (c.n_encoder_layers + (c.use_vae ? c.n_vae_encoder_layers : 0)) +
                         c.chunk_size * c.n_decoder_layers * 1.5));
}

at::Tensor ACTPolicyImpl::forward_whole(const Batch& b) {
  const bool vae = config_.use_vae && is_training();
  auto [actions, mu, logvar] = model(b, vae, b.get("vae_eps"));
  at::Tensor out = actions.flatten(1);
  return vae ? at::cat({out, mu, logvar}, 1) : out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ACTPolicyImpl::losses(const at::Tensor& head, const Batch& b) const {
  const auto& c = config_;
  const at::Tensor h = head.to(at::kFloat);  // the loss reduced in fp32 (bf16 compute)
  const int64_t B = h.size(0), n = c.chunk_size * c.action_dim;
  const at::Tensor actions = h.narrow(1, 0, n).view({B, c.chunk_size, c.action_dim});
  const at::Tensor valid = b.at("action_is_pad").logical_not().unsqueeze(-1).to(h.scalar_type());
  const at::Tensor err = (b.at("action").to(h.scalar_type()) - actions).abs();
  const at::Tensor l1 = (err * valid).sum() / (valid.sum() * c.action_dim).clamp_min(1);
  if (h.size(1) == n) return {l1, at::Tensor(), l1};
  const at::Tensor mu = h.narrow(1, n, c.latent_dim), logvar = h.narrow(1, n + c.latent_dim, c.latent_dim);
  const at::Tensor kld = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp())).sum(-1).mean();
  return {l1, kld, l1 + kld * c.kl_weight};
}

int64_t ACTPolicyImpl::loss_terms(const Batch& b) const {
  return b.at("action_is_pad").logical_not().sum().item<int64_t>();
}

at::Tensor ACTPolicyImpl::head_loss_sum(const at::Tensor& head, const Batch& b) {
  const auto& c = config_;
  const at::Tensor h = head.to(at::kFloat);  // the loss reduced in fp32 (bf16 compute)
  const int64_t B = h.size(0), n = c.chunk_size * c.action_dim;
  const at::Tensor actions = h.narrow(1, 0, n).view({B, c.chunk_size, c.action_dim});
  const at::Tensor valid = b.at("action_is_pad").logical_not().to(h.scalar_type());  // [B, chunk]
  const at::Tensor err = (b.at("action").to(h.scalar_type()) - actions).abs().sum(-1);
  at::Tensor sum = (err * valid).sum() / static_cast<double>(c.action_dim);
  if (h.size(1) != n) {
    const at::Tensor mu = h.narrow(1, n, c.latent_dim), logvar = h.narrow(1, n + c.latent_dim, c.latent_dim);
    const at::Tensor kld = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp())).sum(-1);  // [B]
    sum = sum + (kld * valid.sum(1)).sum() * c.kl_weight;
  }
  return sum;
}

PolicySpec ACTPolicyImpl::policy_spec() const {
  PolicySpec s = lerobot_policy_spec(config_.raw, "config.json");
  for (int64_t i = 0; i < config_.chunk_size; ++i) s.action_offsets.push_back(i);
  s.n_action_steps = config_.n_action_steps;
  return s;
}

std::map<std::string, at::Tensor> ACTPolicyImpl::training_draws(int64_t rows, at::Generator& gen) const {
  if (!config_.use_vae) return {};
  return {{"vae_eps", at::randn({rows, config_.latent_dim}, gen, at::TensorOptions().dtype(at::kFloat))}};
}

at::Tensor ACTPolicyImpl::predict_action_chunk(const Batch& b) {
  torch::NoGradGuard g;
  const bool was = is_training();
  eval();
  at::Tensor a = std::get<0>(model(b, false, at::Tensor()));
  train(was);
  return a;
}

Batch ACTPolicyImpl::check_batch(const std::map<std::string, at::Tensor>& batch, const std::string& file, bool need_action) const {
  const auto& c = config_;
  constexpr int64_t B = BatchChecker::kB;
  BatchChecker k(batch, file, model->action_head->bias.scalar_type());
  if (c.state_dim) k.take("observation.state", {B, c.state_dim}, true);
  if (c.env_dim) k.take("observation.environment_state", {B, c.env_dim}, true);
  for (const std::string& cam : c.cameras) k.take(cam, {B, 3, -1, -1}, true);
  k.take("action", {B, c.chunk_size, c.action_dim}, need_action);
  k.take("action_is_pad", {B, c.chunk_size}, need_action, BatchChecker::kBool);
  k.take("vae_eps", {B, c.latent_dim}, false);
  return k.out;
}

Model::ReferenceOutput ACTPolicyImpl::reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) {
  const Batch b = check_batch(batch, file, true);
  ReferenceOutput r;
  if (config_.use_vae && is_training() && !b.has("vae_eps"))
    throw file_error(file, "vae_eps", "missing (the latent's draw [B, latent_dim]: dump is deterministic)");
  const at::Tensor h = forward_whole(b);
  auto [l1, kld, loss] = losses(h, b);
  r.outputs.emplace_back("l1_loss", l1.reshape({1}));
  if (kld.defined()) r.outputs.emplace_back("kld_loss", kld.reshape({1}));
  r.outputs.emplace_back("action_chunk", predict_action_chunk(b));
  r.loss = loss;
  return r;
}

std::shared_ptr<Model> build_act(const nlohmann::json& j, const std::string& file) {
  return ACTPolicy(ACTConfig::from_json(j, file)).ptr();
}

std::shared_ptr<Model> build_act_for_weights(const nlohmann::json& j, const std::string& file, const Family::TensorShapes& shapes) {
  ACTConfig c = ACTConfig::from_json(j, file);
  c.backbone = ResNetLayout::from_shapes(shapes, "model.backbone.", c.backbone);
  return ACTPolicy(c).ptr();
}

namespace {

// Every child module of ACTImpl with its parameter count, from the config alone (what ACTImpl's constructor
// registers: Linear in x out + out, Embedding n x D, LayerNorm 2D, MultiheadAttention 3D x D + 3D + D x D + D).
std::vector<std::pair<std::string, int64_t>> act_parameter_counts(const ACTConfig& c) {
  const int64_t D = c.dim_model, F = c.dim_feedforward;
  auto linear = [](int64_t in, int64_t out) { return in * out + out; };
  const int64_t attention = 4 * D * D + 4 * D, ffn = linear(D, F) + linear(F, D);
  auto stack = [&](int64_t layers, bool decoder) {
    const int64_t layer = decoder ? 2 * attention + ffn + 3 * 2 * D : attention + ffn + 2 * 2 * D;
    return layers * layer + (decoder || c.pre_norm ? 2 * D : 0);
  };
  std::vector<std::pair<std::string, int64_t>> out;
  if (c.use_vae) {
    out.emplace_back("vae_encoder", stack(c.n_vae_encoder_layers, false));
    out.emplace_back("vae_encoder_cls_embed", D);
    if (c.state_dim) out.emplace_back("vae_encoder_robot_state_input_proj", linear(c.state_dim, D));
    out.emplace_back("vae_encoder_action_input_proj", linear(c.action_dim, D));
    out.emplace_back("vae_encoder_latent_output_proj", linear(D, 2 * c.latent_dim));
  }
  if (!c.cameras.empty()) out.emplace_back("backbone", c.backbone.parameters());
  out.emplace_back("encoder", stack(c.n_encoder_layers, false));
  out.emplace_back("decoder", stack(c.n_decoder_layers, true));
  if (c.state_dim) out.emplace_back("encoder_robot_state_input_proj", linear(c.state_dim, D));
  if (c.env_dim) out.emplace_back("encoder_env_state_input_proj", linear(c.env_dim, D));
  out.emplace_back("encoder_latent_input_proj", linear(c.latent_dim, D));
  if (!c.cameras.empty()) out.emplace_back("encoder_img_feat_input_proj", linear(c.backbone.out_channels(), D));
  out.emplace_back("encoder_1d_feature_pos_embed", (1 + (c.state_dim ? 1 : 0) + (c.env_dim ? 1 : 0)) * D);
  out.emplace_back("decoder_pos_embed", c.chunk_size * D);
  out.emplace_back("action_head", linear(D, c.action_dim));
  return out;
}

}  // namespace

nlohmann::json describe_act(const nlohmann::json& j, const std::string& file) {
  const ACTConfig c = ACTConfig::from_json(j, file);
  int64_t total = 0;
  nlohmann::json comps = nlohmann::json::object();
  for (const auto& [name, n] : act_parameter_counts(c)) {
    total += n;
    comps[name] = {{"parameters", n}};
  }
  return {{"family", "policy"},      {"model_type", "act"},         {"parameters", total},
          {"cameras", c.cameras},    {"state_dim", c.state_dim},    {"env_state_dim", c.env_dim},
          {"action_dim", c.action_dim}, {"chunk_size", c.chunk_size}, {"n_action_steps", c.n_action_steps},
          {"vision_backbone", c.vision_backbone}, {"dim_model", c.dim_model}, {"use_vae", c.use_vae},
          {"components", comps}};
}

}  // namespace lf::models::policy

// DiT on the model contract (models/diffusion/dit.h).
#include "loongforge/models/diffusion/dit.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/kernels/layer_norm_modulate.h"
#include "loongforge/kernels/swiglu.h"
#include "loongforge/models/diffusion/embeddings.h"

namespace lf::models::diffusion {

namespace {
constexpr int64_t kTimestepChannels = 256;  // CombinedTimestepLabelEmbeddings' sinusoidal projection

at::Tensor gelu(const at::Tensor& x, bool tanh) { return tanh ? kernels::gelu_tanh(x) : at::gelu(x); }  // fused on the CPU

// Adaptive LayerNorm: LayerNorm without affine parameters, then x * (1 + scale) + shift per sample (one fused kernel
// on the CPU).
at::Tensor modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale, double eps) {
  return kernels::layer_norm_modulate(x, shift, scale, eps);
}
}  // namespace

DiTConfig DiTConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  DiTConfig c;
  c.raw = j;
  c.num_attention_heads = r.integer("num_attention_heads", c.num_attention_heads);
  c.attention_head_dim = r.integer("attention_head_dim", c.attention_head_dim);
  c.in_channels = r.integer("in_channels", c.in_channels);
  c.out_channels = r.integer("out_channels", c.in_channels);
  c.num_layers = r.integer("num_layers", c.num_layers);
  c.sample_size = r.integer("sample_size", c.sample_size);
  c.patch_size = r.integer("patch_size", c.patch_size);
  c.attention_bias = r.boolean("attention_bias", c.attention_bias);
  c.norm_elementwise_affine = r.boolean("norm_elementwise_affine", c.norm_elementwise_affine);
  c.norm_eps = r.number("norm_eps", c.norm_eps);
  c.activation_fn = r.string("activation_fn", c.activation_fn);
  for (const char* k : {"num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
                        "sample_size", "patch_size"})
    if (r.integer(k, 1) <= 0) r.fail(k, "must be positive");
  if (!r.has("num_embeds_ada_norm")) r.fail("num_embeds_ada_norm", "missing (the number of classes DiT is conditioned on)");
  c.num_embeds_ada_norm = r.integer("num_embeds_ada_norm");
  if (c.num_embeds_ada_norm <= 0) r.fail("num_embeds_ada_norm", "must be positive");
  if (r.string("norm_type", "ada_norm_zero") != "ada_norm_zero")
    r.fail("norm_type", "'" + r.string("norm_type") + "' is not supported (DiT's blocks are ada_norm_zero)");
  if (c.activation_fn != "gelu-approximate" && c.activation_fn != "gelu")
    r.fail("activation_fn", "'" + c.activation_fn + "' is not supported (gelu-approximate, gelu)");
  if (r.number("dropout", 0.0) != 0.0) r.fail("dropout", "dropout inside the blocks is not supported (0 expected)");
  if (c.sample_size % c.patch_size != 0) r.fail("sample_size", "must be a multiple of patch_size");
  return c;
}

DiTConditionImpl::DiTConditionImpl(int64_t dim, int64_t num_classes) {
  auto te = register_module("timestep_embedder", std::make_shared<torch::nn::Module>());
  linear_1 = te->register_module("linear_1", nn::Linear(kTimestepChannels, dim, true));
  linear_2 = te->register_module("linear_2", nn::Linear(dim, dim, true));
  auto ce = register_module("class_embedder", std::make_shared<torch::nn::Module>());
  // diffusers' LabelEmbedding with class_dropout_prob 0.1: one extra row for the dropped label
  embedding_table = ce->register_module("embedding_table", torch::nn::Embedding(num_classes + 1, dim));
}

at::Tensor DiTConditionImpl::forward(const at::Tensor& timestep, const at::Tensor& class_labels) {
  at::Tensor proj = timestep_embedding(timestep, kTimestepChannels, true, 1.0).to(linear_1->weight.scalar_type());
  return linear_2(at::silu(linear_1(proj))) + embedding_table(class_labels);
}

DiTAttentionImpl::DiTAttentionImpl(int64_t heads, int64_t hd, bool bias)
    : nn::AttentionHook(heads, heads, 0), head_dim(hd) {
  causal = false;
  const int64_t d = heads * hd;
  to_q = register_module("to_q", nn::Linear(d, d, bias));
  to_k = register_module("to_k", nn::Linear(d, d, bias));
  to_v = register_module("to_v", nn::Linear(d, d, bias));
  auto out = register_module("to_out", std::make_shared<torch::nn::Module>());
  to_out = out->register_module("0", nn::Linear(d, d, true));
}

at::Tensor DiTAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1);
  auto split = [&](const at::Tensor& y) { return y.view({b, t, -1, head_dim}).transpose(1, 2); };
  at::Tensor o = attend(split(to_q(x)), split(to_k(x)), split(to_v(x)), 0,
                        1.0 / std::sqrt(static_cast<double>(head_dim)), {});
  return to_out(o.transpose(1, 2).reshape({b, t, -1}));
}

DiTBlockImpl::DiTBlockImpl(const DiTConfig& c) : eps_(c.norm_eps), tanh_gelu_(c.activation_fn == "gelu-approximate") {
  const int64_t d = c.inner_dim();
  auto norm1 = register_module("norm1", std::make_shared<torch::nn::Module>());
  emb = norm1->register_module("emb", DiTCondition(d, c.num_embeds_ada_norm));
  ada = norm1->register_module("linear", nn::Linear(d, 6 * d, true));
  attn1 = register_module("attn1", DiTAttention(c.num_attention_heads, c.attention_head_dim, c.attention_bias));
  norm3 = register_module("norm3", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(c.norm_eps)
                                                            .elementwise_affine(c.norm_elementwise_affine)));
  auto ff = register_module("ff", std::make_shared<torch::nn::Module>());
  auto net = ff->register_module("net", std::make_shared<torch::nn::Module>());
  auto gelu_mod = net->register_module("0", std::make_shared<torch::nn::Module>());
  ff_in = gelu_mod->register_module("proj", nn::Linear(d, 4 * d, true));
  ff_out = net->register_module("2", nn::Linear(4 * d, d, true));
}

at::Tensor DiTBlockImpl::forward(const at::Tensor& x, const at::Tensor& timestep, const at::Tensor& class_labels) {
  // shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
  auto m = ada(at::silu(emb(timestep, class_labels).to(x.scalar_type()))).chunk(6, 1);
  // adaLN-Zero's first norm has no affine parameters and eps 1e-6 (diffusers' AdaLayerNormZero)
  at::Tensor h = x + m[2].unsqueeze(1) * attn1(modulate(x, m[0], m[1], 1e-6));
  at::Tensor n = norm3->options.elementwise_affine() ? norm3(h) * (1 + m[4].unsqueeze(1)) + m[3].unsqueeze(1)
                                                    : modulate(h, m[3], m[4], eps_);
  return h + m[5].unsqueeze(1) * ff_out(gelu(ff_in(n), tanh_gelu_));
}

DiTImpl::DiTImpl(DiTConfig c) : c_(std::move(c)) {
  const int64_t d = c_.inner_dim(), p = c_.patch_size;
  auto pe = register_module("pos_embed", std::make_shared<torch::nn::Module>());
  auto proj = pe->register_module("proj", std::make_shared<torch::nn::Module>());
  patch_weight = proj->register_parameter("weight", at::empty({d, c_.in_channels, p, p}));
  patch_bias = proj->register_parameter("bias", at::empty({d}));
  transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.num_layers; ++i) transformer_blocks->push_back(DiTBlock(c_));
  proj_out_1 = register_module("proj_out_1", nn::Linear(d, 2 * d, true));
  proj_out_2 = register_module("proj_out_2", nn::Linear(d, p * p * c_.out_channels, true));
}

void DiTImpl::init_weights(double std) {
  if (std < 0) std = 0.02;
  at::NoGradGuard no_grad;
  auto xavier = [](at::Tensor w) {
    at::Tensor flat = w.view({w.size(0), -1});
    torch::nn::init::xavier_uniform_(flat);
  };
  for (auto& item : named_parameters()) {
    const std::string& n = item.key();
    at::Tensor& t = item.value();
    if (n.ends_with(".bias")) t.zero_();
    else if (n.find("norm3.weight") != std::string::npos) t.fill_(1.0);
    else xavier(t);
  }
  for (const auto& m : transformer_blocks->children()) {
    auto* blk = m->as<DiTBlockImpl>();
    blk->emb->linear_1->weight.normal_(0.0, std);
    blk->emb->linear_2->weight.normal_(0.0, std);
    blk->emb->embedding_table->weight.normal_(0.0, std);
    blk->ada->weight.zero_();
    blk->ada->bias.zero_();
  }
  for (auto* l : {proj_out_1.get(), proj_out_2.get()}) {
    l->weight.zero_();
    l->bias.zero_();
  }
}

BatchSchema DiTImpl::batch_schema() const {
  const auto field = required_field;
  BatchSchema s{field("hidden_states", at::kFloat, 4, "noisy latents [B, in_channels, H, W]"),
                field("timestep", at::kFloat, 1, "the scheduler's timestep of each sample [B]"),
                field("class_labels", at::kLong, 1, "class of each sample [B] (num_embeds_ada_norm: none)"),
                field("target", at::kFloat, 4, "what the prediction is compared with [B, in_channels, H, W]")};
  if (c_.learned_sigma()) {  // DDPM's variational bound on the predicted variance (learned_variance_vlb)
    s.push_back(optional_field("x_start", at::kFloat, 4, "the clean latents [B, in_channels, H, W]"));
    s.push_back(optional_field("vlb_terms", at::kFloat, 2, "per-row schedule terms of the bound [B, 8]"));
  }
  return s;
}

int64_t DiTImpl::loss_terms(const Batch& b) const { return b.at("target").numel(); }

double DiTImpl::train_flops_per_sample(int64_t tokens) const {
  const double d = static_cast<double>(c_.inner_dim()), t = static_cast<double>(tokens);
  // per block and token: q, k, v, out (4 d^2) and the 4x MLP (8 d^2) multiply-adds; attention 2 T d
  const double forward = 2.0 * static_cast<double>(c_.num_layers) * (12.0 * d * d * t + 2.0 * t * t * d);
  const double io = 2.0 * t * d * static_cast<double>(c_.patch_size * c_.patch_size * (c_.in_channels + c_.out_channels));
  return 3.0 * (forward + io);
}

at::Tensor DiTImpl::patchify(const at::Tensor& x) const {
  const int64_t gh = x.size(2) / c_.patch_size, gw = x.size(3) / c_.patch_size;
  // the p x p convolution with stride p, as one matrix product over the patches (C, p, p) -> dim (ATen's CPU
  // convolution gives wrong weight gradients when the row-split engine runs several parts' backward at once)
  const int64_t n = x.size(0), ch = x.size(1), p = c_.patch_size;
  at::Tensor patches = x.reshape({n, ch, gh, p, gw, p}).permute({0, 2, 4, 1, 3, 5}).reshape({n, gh * gw, ch * p * p});
  at::Tensor h = at::linear(patches, patch_weight.reshape({patch_weight.size(0), -1}), patch_bias);
  // diffusers' PatchEmbed: positions for the latents' grid, base size sample_size / patch_size
  at::Tensor pos = sincos_2d_pos_embed(c_.inner_dim(), gh, gw, static_cast<double>(c_.sample_size / c_.patch_size), 1.0);
  return h + pos.to(h.device(), h.scalar_type()).unsqueeze(0);
}

// context parallelism: this rank's tokens (models/model.h: sequence_inside)
at::Tensor DiTImpl::embed(const Batch& b) {
  const at::Tensor& x = b.at("hidden_states");
  if (x.dim() != 4 || x.size(1) != c_.in_channels)  // e.g. latents of another VAE
    throw Error("batch: hidden_states: " + std::to_string(x.dim() > 1 ? x.size(1) : 0) + " channels in " +
                std::to_string(x.dim()) + " dimensions, the model takes [B, " + std::to_string(c_.in_channels) +
                ", H, W] (in_channels)");
  return cut_sequence(patchify(x), 1);
}

Batch DiTImpl::block_inputs(const Batch& b, at::ScalarType) const {
  return Batch{{"timestep", b.at("timestep")}, {"class_labels", b.at("class_labels")}};
}

at::Tensor DiTImpl::block_forward(const Batch& in, const at::Tensor& h, int64_t i) {
  return transformer_blocks[i]->as<DiTBlockImpl>()->forward(h, in.at("timestep"), in.at("class_labels"));
}

at::Tensor DiTImpl::final_layer(const at::Tensor& h, const at::Tensor& t, const at::Tensor& y, int64_t gh, int64_t gw) {
  auto* first = transformer_blocks[0]->as<DiTBlockImpl>();
  auto ss = proj_out_1(at::silu(first->emb(t, y).to(h.scalar_type()))).chunk(2, 1);  // shift, scale
  at::Tensor o = proj_out_2(modulate(h, ss[0], ss[1], 1e-6));
  const int64_t p = c_.patch_size, n = h.size(0);
  // [B, gh * gw, p * p * C] -> [B, C, gh * p, gw * p]
  return o.view({n, gh, gw, p, p, c_.out_channels}).permute({0, 5, 1, 3, 2, 4}).reshape({n, c_.out_channels, gh * p, gw * p});
}

at::Tensor DiTImpl::head_loss_sum(const at::Tensor& h, const Batch& b) {
  // final_layer's projection in patch space (its unpatchify undone on the target instead), so that under context
  // parallelism each rank sums the error of its own tokens: the prediction's first in_channels of each patch pixel
  auto* first = transformer_blocks[0]->as<DiTBlockImpl>();
  const at::Tensor &t = b.at("timestep"), &y = b.at("class_labels");
  auto ss = proj_out_1(at::silu(first->emb(t, y).to(h.scalar_type()))).chunk(2, 1);  // shift, scale
  const int64_t p = c_.patch_size, n = h.size(0), ci = c_.in_channels;
  const at::Tensor out = proj_out_2(modulate(h, ss[0], ss[1], 1e-6)).view({n, h.size(1), p, p, c_.out_channels});
  at::Tensor pred = out.narrow(4, 0, ci);
  const at::Tensor& target = b.at("target");  // [B, C, H, W] -> [B, gh * gw, p, p, C]
  const int64_t gh = target.size(2) / p, gw = target.size(3) / p;
  auto tokens = [&](const at::Tensor& z) {
    return cut_sequence(z.reshape({n, ci, gh, p, gw, p}).permute({0, 2, 4, 3, 5, 1}).reshape({n, gh * gw, p, p, ci}), 1);
  };
  at::Tensor err = (pred.to(at::kFloat) - tokens(target).to(at::kFloat)).pow(2);
  at::Tensor sum;
  if (const at::Tensor w = b.get("loss_weight"); w.defined())  // per-row weights (the objective's loss weighting)
    sum = (err.flatten(1).sum(1) * w.to(at::kFloat)).sum();
  else
    sum = err.sum();
  if (const at::Tensor vt = b.get("vlb_terms"); vt.defined()) {
    if (!c_.learned_sigma())
      throw Error("batch: vlb_terms: the model does not predict its variance (out_channels != 2 * in_channels)");
    // Each row's bound (the mean of its elements' bits) counts once per element of its mean squared error: the sum
    // of its elements' bits (this rank's tokens' under context parallelism).
    const at::Tensor o = out.to(at::kFloat);
    sum = sum + learned_variance_vlb(o.narrow(4, 0, ci), o.narrow(4, ci, ci), tokens(b.at("hidden_states")).to(at::kFloat),
                                     tokens(b.at("x_start")).to(at::kFloat), vt.to(at::kFloat))
                    .sum();
  }
  return sum;
}

namespace {
// 0.5 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))): the standard normal CDF as guided diffusion approximates it.
at::Tensor approx_normal_cdf(const at::Tensor& x) {
  return 0.5 * (1.0 + at::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
}
}  // namespace

at::Tensor learned_variance_vlb(const at::Tensor& eps_in, const at::Tensor& v, const at::Tensor& x_t,
                                const at::Tensor& x0, const at::Tensor& terms) {
  std::vector<int64_t> shape(static_cast<size_t>(x_t.dim()), 1);
  shape[0] = x_t.size(0);
  auto col = [&](int64_t j) { return terms.select(1, j).reshape(shape); };
  const at::Tensor coef1 = col(0), coef2 = col(1), post_logvar = col(2), log_beta = col(3), recip = col(4),
                   recipm1 = col(5), first = col(6) > 0.5, weight = col(7);
  const at::Tensor eps = eps_in.detach();
  const at::Tensor frac = (v + 1) / 2;
  const at::Tensor model_logvar = frac * log_beta + (1 - frac) * post_logvar;
  const at::Tensor model_mean = coef1 * (recip * x_t - recipm1 * eps) + coef2 * x_t;
  const at::Tensor true_mean = coef1 * x0 + coef2 * x_t;
  const at::Tensor kl = 0.5 * (-1.0 + model_logvar - post_logvar + at::exp(post_logvar - model_logvar) +
                               (true_mean - model_mean).pow(2) * at::exp(-model_logvar));
  // The decoder's discretized Gaussian log-likelihood of x0 in 256 bins over [-1, 1] (t = 0).
  const at::Tensor centered = x0 - model_mean, inv_std = at::exp(-0.5 * model_logvar);
  const at::Tensor cdf_plus = approx_normal_cdf(inv_std * (centered + 1.0 / 255)),
                   cdf_min = approx_normal_cdf(inv_std * (centered - 1.0 / 255));
  const at::Tensor log_cdf_plus = at::log(cdf_plus.clamp_min(1e-12)),
                   log_one_minus_cdf_min = at::log((1 - cdf_min).clamp_min(1e-12)),
                   log_delta = at::log((cdf_plus - cdf_min).clamp_min(1e-12));
  const at::Tensor log_probs =
      at::where(x0 < -0.999, log_cdf_plus, at::where(x0 > 0.999, log_one_minus_cdf_min, log_delta));
  // per element, in bits (the row's bound is their mean over all its elements)
  return at::where(first, -log_probs, kl) * weight / std::log(2.0);
}

at::Tensor DiTImpl::forward(const at::Tensor& x, const at::Tensor& t, const at::Tensor& y) {
  at::Tensor h = patchify(x);
  for (int64_t i = 0; i < c_.num_layers; ++i) h = transformer_blocks[i]->as<DiTBlockImpl>()->forward(h, t, y);
  return final_layer(h, t, y, x.size(2) / c_.patch_size, x.size(3) / c_.patch_size);
}

Model::ReferenceOutput DiTImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                  const std::string& file) {
  auto get = [&](const std::string& name) -> at::Tensor {
    auto it = batch.find(name);
    if (it == batch.end()) throw file_error(file, name, "missing");
    return it->second;
  };
  at::Tensor x = get("hidden_states");
  if (x.dim() != 4 || x.size(1) != c_.in_channels)
    throw file_error(file, "hidden_states", "expected [B, " + std::to_string(c_.in_channels) + ", H, W]");
  if (x.size(2) % c_.patch_size != 0 || x.size(3) % c_.patch_size != 0)
    throw file_error(file, "hidden_states", "H and W must be multiples of patch_size " + std::to_string(c_.patch_size));
  if (!at::isFloatingType(x.scalar_type())) throw file_error(file, "hidden_states", "expected floating point");
  const int64_t n = x.size(0);
  at::Tensor t = get("timestep");
  if (t.dim() == 0) t = t.expand({n});
  if (t.dim() != 1 || t.size(0) != n) throw file_error(file, "timestep", "expected [B] (B = " + std::to_string(n) + ")");
  at::Tensor y = get("class_labels");
  if (y.dim() != 1 || y.size(0) != n || at::isFloatingType(y.scalar_type()))
    throw file_error(file, "class_labels", "expected integer [B] (B = " + std::to_string(n) + ")");
  y = y.to(at::kLong);
  if (n && (y.min().item<int64_t>() < 0 || y.max().item<int64_t>() > c_.num_embeds_ada_norm))
    throw file_error(file, "class_labels", "labels must lie in [0, " + std::to_string(c_.num_embeds_ada_norm) + "]");
  x = x.to(patch_weight.scalar_type());
  at::Tensor out = forward(x, t, y);
  ReferenceOutput r;
  r.outputs = {{"output", out}};
  if (batch.count("target")) {
    at::Tensor target = get("target");
    if (target.sizes() != x.sizes())
      throw file_error(file, "target", "expected the shape of hidden_states [B, in_channels, H, W]");
    r.loss = (out.narrow(1, 0, c_.in_channels).to(at::kFloat) - target.to(at::kFloat)).pow(2).mean();
  } else {
    r.loss = out.to(at::kFloat).pow(2).mean();
  }
  return r;
}

std::map<std::string, at::Tensor> DiTImpl::unconditional(const std::map<std::string, at::Tensor>& conditions,
                                                         const std::string& file) const {
  auto out = conditions;
  auto it = out.find("class_labels");
  if (it == out.end()) throw file_error(file, "class_labels", "missing");
  it->second = at::full_like(it->second, c_.num_embeds_ada_norm);
  return out;
}

Split DiTImpl::split() const {
  Split s;
  s.pre = {"pos_embed"};
  s.blocks = "transformer_blocks";
  s.post = {"proj_out_1", "proj_out_2"};
  s.shared = {"transformer_blocks.0.norm1.emb"};  // the output layer's conditioning (head_loss_sum)
  return s;
}

std::vector<nn::AttentionHook*> DiTImpl::attention_modules() {
  std::vector<nn::AttentionHook*> out;
  for (const auto& m : transformer_blocks->children()) out.push_back(m->as<DiTBlockImpl>()->attn1.get());
  return out;
}

std::string DiTImpl::pipeline_blocker() const {
  return "DiTTransformer2DModel: the output layer is conditioned through block 0's embedder "
         "(transformer_blocks.0.norm1.emb); it is not split into pipeline stages";
}

std::shared_ptr<Model> build_dit(const nlohmann::json& j, const std::string& file) {
  return DiT(DiTConfig::from_json(j, file)).ptr();
}

nlohmann::json describe_dit(const nlohmann::json& j, const std::string& file) {
  const DiTConfig c = DiTConfig::from_json(j, file);
  const int64_t d = c.inner_dim(), p = c.patch_size;
  const int64_t cond = (kTimestepChannels * d + d) + (d * d + d) + (c.num_embeds_ada_norm + 1) * d;
  const int64_t attn = 3 * (d * d + (c.attention_bias ? d : 0)) + d * d + d;
  const int64_t block = cond + (d * 6 * d + 6 * d) + attn + (d * 4 * d + 4 * d) + (4 * d * d + d) +
                        (c.norm_elementwise_affine ? 2 * d : 0);
  const int64_t patch = d * c.in_channels * p * p + d;
  const int64_t head = (d * 2 * d + 2 * d) + (d * p * p * c.out_channels + p * p * c.out_channels);
  const int64_t total = patch + c.num_layers * block + head;
  const int64_t tokens = (c.sample_size / p) * (c.sample_size / p);
  return {{"model_type", "DiTTransformer2DModel"},
          {"parameters", total},
          {"components",
           {{"patch_embed", {{"patch_size", p}, {"in_channels", c.in_channels}, {"tokens", tokens},
                             {"parameters", patch}}},
            {"blocks", {{"layers", c.num_layers}, {"hidden_size", d}, {"heads", c.num_attention_heads},
                        {"classes", c.num_embeds_ada_norm}, {"parameters", c.num_layers * block}}},
            {"output", {{"out_channels", c.out_channels}, {"learned_sigma", c.learned_sigma()},
                        {"parameters", head}}}}}};
}

}  // namespace lf::models::diffusion

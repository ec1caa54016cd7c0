// diffusers' AutoencoderKL on the model contract (models/diffusion/vae.h).
#include "loongforge/models/diffusion/vae.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <tuple>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::models::diffusion {

namespace {

std::vector<std::string> string_list(const JsonReader& r, const std::string& key, std::vector<std::string> dflt) {
  if (!r.has(key)) return dflt;
  const nlohmann::json& v = r.get(key);
  if (!v.is_array()) r.expected(key, "a list of block type names");
  std::vector<std::string> out;
  for (const auto& e : v) {
    if (!e.is_string()) r.expected(key, "a list of block type names");
    out.push_back(e.get<std::string>());
  }
  return out;
}

std::vector<double> number_list(const JsonReader& r, const std::string& key, int64_t size) {
  if (!r.has(key)) return {};
  const nlohmann::json& v = r.get(key);
  if (!v.is_array()) r.expected(key, "a list of numbers");
  std::vector<double> out;
  for (const auto& e : v) {
    if (!e.is_number()) r.expected(key, "a list of numbers");
    out.push_back(e.get<double>());
  }
  if (static_cast<int64_t>(out.size()) != size)
    r.fail(key, std::to_string(out.size()) + " values for " + std::to_string(size) + " latent_channels");
  return out;
}

}  // namespace

AutoencoderKLConfig AutoencoderKLConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  AutoencoderKLConfig c;
  c.raw = j;
  auto positive = [&](const char* key, int64_t dflt) {
    const int64_t v = r.integer(key, dflt);
    if (v <= 0) r.fail(key, std::to_string(v) + " is not positive");
    return v;
  };
  c.in_channels = positive("in_channels", 3);
  c.out_channels = positive("out_channels", 3);
  c.latent_channels = positive("latent_channels", 4);
  c.norm_num_groups = positive("norm_num_groups", 32);
  c.layers_per_block = positive("layers_per_block", 1);
  if (r.has("block_out_channels")) c.block_out_channels = r.int_list("block_out_channels");
  if (c.block_out_channels.empty()) r.fail("block_out_channels", "no channels given");
  for (int64_t ch : c.block_out_channels)
    if (ch <= 0 || ch % c.norm_num_groups != 0)
      r.fail("block_out_channels", std::to_string(ch) + " is not a positive multiple of norm_num_groups " +
                                       std::to_string(c.norm_num_groups));
  const size_t blocks = c.block_out_channels.size();
  c.down_block_types = string_list(r, "down_block_types", {"DownEncoderBlock2D"});
  c.up_block_types = string_list(r, "up_block_types", {"UpDecoderBlock2D"});
  for (const auto& [key, types, known] : {std::tuple{"down_block_types", &c.down_block_types, "DownEncoderBlock2D"},
                                          std::tuple{"up_block_types", &c.up_block_types, "UpDecoderBlock2D"}}) {
    for (const std::string& t : *types)
      if (t != known) r.fail(key, "'" + t + "' is not a block type AutoencoderKL builds (known: " + known + ")");
    if (types->size() != blocks)
      r.fail(key, std::to_string(types->size()) + " blocks for " + std::to_string(blocks) + " block_out_channels");
  }
  c.act_fn = r.string("act_fn", "silu");
  std::transform(c.act_fn.begin(), c.act_fn.end(), c.act_fn.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (!known_activation(c.act_fn))
    r.fail("act_fn", "'" + c.act_fn + "' is not an activation diffusers knows (silu, swish, mish, gelu, relu)");
  if (r.has("sample_size") && r.get("sample_size").is_array()) {
    const std::vector<int64_t> s = r.int_list("sample_size");
    if (s.size() != 2 || s[0] <= 0 || s[1] <= 0) r.fail("sample_size", "expected an integer or [height, width]");
    c.sample_height = s[0];
    c.sample_width = s[1];
  } else {
    c.sample_height = c.sample_width = positive("sample_size", 32);
  }
  c.scaling_factor = r.number("scaling_factor", 0.18215);
  c.shift_factor = r.opt_number("shift_factor");
  c.latents_mean = number_list(r, "latents_mean", c.latent_channels);
  c.latents_std = number_list(r, "latents_std", c.latent_channels);
  c.force_upcast = r.boolean("force_upcast", true);
  c.use_quant_conv = r.boolean("use_quant_conv", true);
  c.use_post_quant_conv = r.boolean("use_post_quant_conv", true);
  c.mid_block_add_attention = r.boolean("mid_block_add_attention", true);
  return c;
}

VaeCosts vae_costs(const AutoencoderKLConfig& c, int64_t height, int64_t width) {
  VaeCost* cur = nullptr;
  double hw = static_cast<double>(height * width);  // positions at the current resolution
  auto conv = [&](int64_t in, int64_t out, int64_t k) {
    cur->params += in * out * k * k + out;
    cur->macs += static_cast<double>(in * out * k * k) * hw;
  };
  auto norm = [&](int64_t ch) { cur->params += 2 * ch; };
  auto resnet = [&](int64_t in, int64_t out) {
    norm(in);
    conv(in, out, 3);
    norm(out);
    conv(out, out, 3);
    if (in != out) conv(in, out, 1);
  };
  auto mid = [&](int64_t ch) {
    resnet(ch, ch);
    if (c.mid_block_add_attention) {
      norm(ch);
      cur->params += 4 * (ch * ch + ch);
      cur->macs += 4.0 * static_cast<double>(ch * ch) * hw + 2.0 * hw * hw * static_cast<double>(ch);
    }
    resnet(ch, ch);
  };
  const auto& b = c.block_out_channels;
  const size_t n = b.size();
  VaeCosts out;
  cur = &out.encoder;
  conv(c.in_channels, b[0], 3);
  for (size_t i = 0; i < n; ++i) {
    for (int64_t l = 0; l < c.layers_per_block; ++l) resnet(l == 0 ? b[i == 0 ? 0 : i - 1] : b[i], b[i]);
    if (i + 1 < n) {
      hw /= 4;  // the stride-2 conv runs at the output resolution
      conv(b[i], b[i], 3);
    }
  }
  mid(b[n - 1]);
  norm(b[n - 1]);
  conv(b[n - 1], 2 * c.latent_channels, 3);
  if (c.use_quant_conv) {
    cur = &out.quant_conv;
    conv(2 * c.latent_channels, 2 * c.latent_channels, 1);
  }
  if (c.use_post_quant_conv) {
    cur = &out.post_quant_conv;
    conv(c.latent_channels, c.latent_channels, 1);
  }
  cur = &out.decoder;
  conv(c.latent_channels, b[n - 1], 3);
  mid(b[n - 1]);
  for (size_t i = 0; i < n; ++i) {
    const int64_t prev = b[n - 1 - (i == 0 ? 0 : i - 1)], ch = b[n - 1 - i];
    for (int64_t l = 0; l <= c.layers_per_block; ++l) resnet(l == 0 ? prev : ch, ch);
    if (i + 1 < n) {
      hw *= 4;
      conv(ch, ch, 3);
    }
  }
  norm(b[0]);
  conv(b[0], c.out_channels, 3);
  return out;
}

VaeEncoderImpl::VaeEncoderImpl(const AutoencoderKLConfig& c) {
  const auto& b = c.block_out_channels;
  const BlockOptions o = c.block_options();
  conv_in = register_module("conv_in", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.in_channels, b[0], 3).padding(1)));
  down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  for (size_t i = 0; i < b.size(); ++i)
    down_blocks->push_back(DownEncoderBlock2D(b[i == 0 ? 0 : i - 1], b[i], c.layers_per_block, i + 1 < b.size(),
                                              /*downsample_padding=*/0, o));
  mid_block = register_module("mid_block", UNetMidBlock2D(b.back(), 1, c.mid_block_add_attention, o));
  conv_norm_out = register_module(
      "conv_norm_out", torch::nn::GroupNorm(torch::nn::GroupNormOptions(c.norm_num_groups, b.back()).eps(1e-6)));
  conv_out = register_module(
      "conv_out", torch::nn::Conv2d(torch::nn::Conv2dOptions(b.back(), 2 * c.latent_channels, 3).padding(1)));
}

at::Tensor VaeEncoderImpl::forward(at::Tensor x) {
  x = conv_in(x);
  for (size_t i = 0; i < down_blocks->size(); ++i) x = down_blocks->ptr<DownEncoderBlock2DImpl>(i)->forward(x);
  x = mid_block(x);
  return conv_out(at::silu(conv_norm_out(x)));  // diffusers' conv_act is SiLU whatever act_fn says
}

VaeDecoderImpl::VaeDecoderImpl(const AutoencoderKLConfig& c) {
  const auto& b = c.block_out_channels;
  const size_t n = b.size();
  const BlockOptions o = c.block_options();
  conv_in = register_module("conv_in",
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(c.latent_channels, b.back(), 3).padding(1)));
  mid_block = register_module("mid_block", UNetMidBlock2D(b.back(), 1, c.mid_block_add_attention, o));
  up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  for (size_t i = 0; i < n; ++i)
    up_blocks->push_back(
        UpDecoderBlock2D(b[n - 1 - (i == 0 ? 0 : i - 1)], b[n - 1 - i], c.layers_per_block + 1, i + 1 < n, o));
  conv_norm_out = register_module(
      "conv_norm_out", torch::nn::GroupNorm(torch::nn::GroupNormOptions(c.norm_num_groups, b[0]).eps(1e-6)));
  conv_out =
      register_module("conv_out", torch::nn::Conv2d(torch::nn::Conv2dOptions(b[0], c.out_channels, 3).padding(1)));
}

at::Tensor VaeDecoderImpl::forward(at::Tensor z) {
  at::Tensor x = mid_block(conv_in(z));
  for (size_t i = 0; i < up_blocks->size(); ++i) x = up_blocks->ptr<UpDecoderBlock2DImpl>(i)->forward(x);
  return conv_out(at::silu(conv_norm_out(x)));
}

AutoencoderKLImpl::AutoencoderKLImpl(AutoencoderKLConfig c) : config_(std::move(c)) {
  encoder = register_module("encoder", VaeEncoder(config_));
  decoder = register_module("decoder", VaeDecoder(config_));
  const int64_t l = config_.latent_channels;
  if (config_.use_quant_conv)
    quant_conv = register_module("quant_conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2 * l, 2 * l, 1)));
  if (config_.use_post_quant_conv)
    post_quant_conv = register_module("post_quant_conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(l, l, 1)));
}

std::pair<at::Tensor, at::Tensor> AutoencoderKLImpl::encode(const at::Tensor& x) {
  at::Tensor h = encoder(x);
  if (quant_conv) h = quant_conv(h);
  auto halves = h.chunk(2, 1);
  return {halves[0], at::clamp(halves[1], -30.0, 20.0)};
}

at::Tensor AutoencoderKLImpl::decode(const at::Tensor& z) { return decoder(post_quant_conv ? post_quant_conv(z) : z); }

namespace {
// Per-channel statistics shaped to broadcast over z [B, C, ...].
at::Tensor channel_stat(const std::vector<double>& v, const at::Tensor& z) {
  std::vector<int64_t> shape(z.dim(), 1);
  shape[1] = static_cast<int64_t>(v.size());
  return at::tensor(v, z.options().dtype(at::kDouble)).to(z.scalar_type()).view(shape);
}
}  // namespace

at::Tensor AutoencoderKLImpl::normalize_latents(const at::Tensor& z) const {
  const auto& c = config_;
  if (!c.latents_mean.empty() && !c.latents_std.empty())
    return (z - channel_stat(c.latents_mean, z)) * c.scaling_factor / channel_stat(c.latents_std, z);
  return (z - c.shift_factor.value_or(0.0)) * c.scaling_factor;
}

at::Tensor AutoencoderKLImpl::denormalize_latents(const at::Tensor& z) const {
  const auto& c = config_;
  if (!c.latents_mean.empty() && !c.latents_std.empty())
    return z * channel_stat(c.latents_std, z) / c.scaling_factor + channel_stat(c.latents_mean, z);
  return z / c.scaling_factor + c.shift_factor.value_or(0.0);
}

void AutoencoderKLImpl::init_weights(double std) { init_vae_weights(*this, std); }

BatchSchema AutoencoderKLImpl::batch_schema() const {
  return {required_field("sample", at::kFloat, 4,
                         "images [B, " + std::to_string(config_.in_channels) + ", H, W] (H, W multiples of " +
                             std::to_string(config_.downsample_factor()) +
                             "), the VAE's input and reconstruction target")};
}

double AutoencoderKLImpl::train_flops_per_sample(int64_t) const {
  // 2 FLOPs per multiply-accumulate, forward + backward = 3 forwards, at the config's sample_size
  return 6.0 * vae_costs(config_, config_.sample_height, config_.sample_width).macs();
}

void AutoencoderKLImpl::check_sample(const at::Tensor& x, const std::string& file) const {
  const int64_t f = config_.downsample_factor();
  if (!at::isFloatingType(x.scalar_type()))
    throw file_error(file, "sample", "expected a floating-point tensor, got " + std::string(c10::toString(x.scalar_type())));
  if (x.dim() != 4 || x.size(1) != config_.in_channels || x.size(0) == 0 || x.size(2) == 0 || x.size(3) == 0 ||
      x.size(2) % f != 0 || x.size(3) % f != 0) {
    std::string shape;
    for (int64_t d : x.sizes()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    throw file_error(file, "sample",
                     "expected [batch, " + std::to_string(config_.in_channels) + " (in_channels), H, W] with H and W "
                     "multiples of " + std::to_string(f) + ", got [" + shape + "]");
  }
}

at::Tensor AutoencoderKLImpl::forward_whole(const Batch& b) {
  const at::Tensor& x = b.at("sample");
  check_sample(x, "batch");
  return decode(encode(x.to(encoder->conv_in->weight.scalar_type())).first);
}

at::Tensor AutoencoderKLImpl::head_loss_sum(const at::Tensor& decoded, const Batch& b) {
  return (decoded.to(at::kFloat) - b.at("sample").to(at::kFloat)).square().sum();
}

Model::ReferenceOutput AutoencoderKLImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                            const std::string& file) {
  auto it = batch.find("sample");
  if (it == batch.end()) throw file_error(file, "sample", "missing (images [B, C, H, W])");
  check_sample(it->second, file);
  return autoencoder_reference(*this, it->second.to(encoder->conv_in->weight.scalar_type()));
}

std::string AutoencoderKLImpl::canonical_checkpoint_name(const std::string& n) const {
  // diffusers' _convert_deprecated_attention_blocks: the mid blocks' attention under its old names
  static const std::pair<const char*, const char*> renames[] = {
      {".query.", ".to_q."}, {".key.", ".to_k."}, {".value.", ".to_v."}, {".proj_attn.", ".to_out.0."}};
  const size_t a = n.find(".mid_block.attentions.");
  if (a == std::string::npos) return n;
  for (const auto& [from, to] : renames)
    if (size_t p = n.find(from, a + 1); p != std::string::npos) return n.substr(0, p) + to + n.substr(p + std::strlen(from));
  return n;
}

std::shared_ptr<Model> build_autoencoder_kl(const nlohmann::json& j, const std::string& file) {
  return AutoencoderKL(AutoencoderKLConfig::from_json(j, file)).ptr();
}

nlohmann::json describe_autoencoder_kl(const nlohmann::json& j, const std::string& file) {
  const AutoencoderKLConfig c = AutoencoderKLConfig::from_json(j, file);
  const VaeCosts costs = vae_costs(c, c.sample_height, c.sample_width);
  const int64_t f = c.downsample_factor();
  nlohmann::json comps = {
      {"encoder", {{"parameters", costs.encoder.params}, {"blocks", c.down_block_types}, {"in_channels", c.in_channels}}},
      {"decoder", {{"parameters", costs.decoder.params}, {"blocks", c.up_block_types}, {"out_channels", c.out_channels}}}};
  if (c.use_quant_conv) comps["quant_conv"] = {{"parameters", costs.quant_conv.params}};
  if (c.use_post_quant_conv) comps["post_quant_conv"] = {{"parameters", costs.post_quant_conv.params}};
  nlohmann::json out = {{"family", "diffusion"},
                        {"model_type", "AutoencoderKL"},
                        {"parameters", costs.params()},
                        {"block_out_channels", c.block_out_channels},
                        {"layers_per_block", c.layers_per_block},
                        {"latent_channels", c.latent_channels},
                        {"downsample_factor", f},
                        {"sample_size", {c.sample_height, c.sample_width}},
                        {"latent_size", {c.sample_height / f, c.sample_width / f}},
                        {"mid_block_attention", c.mid_block_add_attention},
                        {"scaling_factor", c.scaling_factor},
                        {"shift_factor", c.shift_factor ? nlohmann::json(*c.shift_factor) : nlohmann::json(nullptr)},
                        {"train_flops_per_sample", 6.0 * costs.macs()},
                        {"components", comps}};
  return out;
}

}  // namespace lf::models::diffusion

#include "loongforge/models/policy/diffusion.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/policy/spec.h"

namespace lf::models::policy {

namespace {

// A [h, w] pair from a config field (null or absent: empty).
std::vector<int64_t> pair_field(const JsonReader& r, const std::string& key) {
  std::vector<int64_t> v = r.int_list(key);
  if (!v.empty() && (v.size() != 2 || v[0] < 1 || v[1] < 1)) r.fail(key, "expected a pair of positive integers [height, width]");
  return v;
}

// diffusers' betas_for_alpha_bar with the cosine transform (squaredcos_cap_v2), in double, stored as float32.
at::Tensor cosine_betas(int64_t n) {
  auto alpha_bar = [](double t) { return std::pow(std::cos((t + 0.008) / 1.008 * M_PI / 2), 2.0); };
  std::vector<float> betas;
  for (int64_t i = 0; i < n; ++i) {
    const double t1 = static_cast<double>(i) / static_cast<double>(n), t2 = static_cast<double>(i + 1) / static_cast<double>(n);
    betas.push_back(static_cast<float>(std::min(1 - alpha_bar(t2) / alpha_bar(t1), 0.999)));
  }
  return at::tensor(betas, at::kFloat);
}

// torchvision's center_crop offset: round((size - crop) / 2), Python's round (halves to even).
int64_t centre_offset(int64_t size, int64_t crop) { return static_cast<int64_t>(std::nearbyint((size - crop) / 2.0)); }

int64_t numel_of(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace

DiffusionConfig DiffusionConfig::from_json(const nlohmann::json& j, const std::string& file) {
  DiffusionConfig c;
  c.raw = j;
  JsonReader r(j, file);
  c.features = PolicyFeatures::read(r, "Diffusion Policy");
  if (c.features.state_dim == 0) r.fail("input_features", "Diffusion Policy needs observation.state (a STATE feature)");
  c.n_obs_steps = r.integer("n_obs_steps", 2);
  c.horizon = r.integer("horizon", 64);
  c.n_action_steps = r.integer("n_action_steps", 32);
  for (const char* k : {"n_obs_steps", "horizon", "n_action_steps"})
    if (r.integer(k) < 1) r.fail(k, "expected a positive number");
  c.drop_n_last_frames = r.integer("drop_n_last_frames", 7);  // LeRobot's default: horizon - n_action_steps - n_obs_steps + 1
  if (c.drop_n_last_frames < 0) r.fail("drop_n_last_frames", "expected a number >= 0");
  c.vision_backbone = r.string("vision_backbone", "resnet18");
  std::string why;
  c.backbone = ResNetLayout::named(c.vision_backbone, &why);
  if (!why.empty()) r.fail("vision_backbone", why);
  c.use_group_norm = r.boolean("use_group_norm", false);
  if (c.use_group_norm && r.has("pretrained_backbone_weights") && !r.string("pretrained_backbone_weights").empty())
    r.fail("use_group_norm", "LeRobot refuses to replace the batch norm of a pretrained backbone (pretrained_backbone_weights is set)");
  c.backbone.norm = c.use_group_norm ? ResNetNorm::kGroup : ResNetNorm::kBatch;
  c.backbone.indexed_names = true;
  c.resize_shape = pair_field(r, "resize_shape");
  c.crop_shape = pair_field(r, "crop_shape");
  if (!c.resize_shape.empty()) {  // LeRobot's __post_init__: the crop follows crop_ratio of the resize
    const double ratio = r.number("crop_ratio", 1.0);
    if (!(ratio > 0 && ratio <= 1)) r.fail("crop_ratio", "expected a number in (0, 1]");
    c.crop_shape.clear();
    if (ratio < 1)
      c.crop_shape = {static_cast<int64_t>(c.resize_shape[0] * ratio), static_cast<int64_t>(c.resize_shape[1] * ratio)};
    if (!c.crop_shape.empty() && (c.crop_shape[0] < 1 || c.crop_shape[1] < 1)) r.fail("crop_ratio", "makes an empty crop");
  }
  c.crop_is_random = r.boolean("crop_is_random", true);
  if (!c.features.cameras.empty() && !c.crop_shape.empty()) {
    const int64_t h = c.resize_shape.empty() ? c.features.image_shape[1] : c.resize_shape[0];
    const int64_t w = c.resize_shape.empty() ? c.features.image_shape[2] : c.resize_shape[1];
    if (c.crop_shape[0] > h || c.crop_shape[1] > w)
      r.fail("crop_shape", shape_str(c.crop_shape) + " does not fit in the images' " + shape_str({h, w}));
  }
  c.num_keypoints = r.integer("spatial_softmax_num_keypoints", 32);
  if (c.num_keypoints < 1) r.fail("spatial_softmax_num_keypoints", "expected a positive number");
  c.separate_encoders = r.boolean("use_separate_rgb_encoder_per_camera", true);
  if (r.has("down_dims")) c.down_dims = r.int_list("down_dims");
  if (c.down_dims.empty()) r.fail("down_dims", "expected at least one U-Net level");
  c.kernel_size = r.integer("kernel_size", 5);
  c.n_groups = r.integer("n_groups", 8);
  c.step_embed_dim = r.integer("diffusion_step_embed_dim", 128);
  if (c.step_embed_dim < 4 || c.step_embed_dim % 2)
    r.fail("diffusion_step_embed_dim", "expected an even number of at least 4 (sine and cosine halves)");
  if (c.n_groups < 1) r.fail("n_groups", "expected a positive number");
  for (int64_t d : c.down_dims)
    if (d < 1 || d % c.n_groups) r.fail("down_dims", std::to_string(d) + " is not a multiple of n_groups " + std::to_string(c.n_groups));
  if (c.down_dims[0] % 8) r.fail("down_dims", "the first width feeds final_conv's GroupNorm(8, width): expected a multiple of 8");
  if (c.horizon % (int64_t{1} << c.down_dims.size()))
    r.fail("horizon", "expected a multiple of 2^len(down_dims) = " + std::to_string(int64_t{1} << c.down_dims.size()));
  c.film_scale = r.boolean("use_film_scale_modulation", true);
  c.scheduler_type = r.string("noise_scheduler_type", "DDPM");
  if (c.scheduler_type != "DDPM" && c.scheduler_type != "DDIM") r.fail("noise_scheduler_type", "'" + c.scheduler_type + "' is not DDPM or DDIM");
  c.num_train_timesteps = r.integer("num_train_timesteps", 100);
  if (c.num_train_timesteps < 1) r.fail("num_train_timesteps", "expected a positive number");
  c.beta_schedule = r.string("beta_schedule", "squaredcos_cap_v2");
  const bool sigmoid_ok = c.scheduler_type == "DDPM";
  if (c.beta_schedule != "squaredcos_cap_v2" && c.beta_schedule != "linear" && c.beta_schedule != "scaled_linear" &&
      !(sigmoid_ok && c.beta_schedule == "sigmoid"))
    r.fail("beta_schedule", "'" + c.beta_schedule + "' is not squaredcos_cap_v2, linear, scaled_linear" + (sigmoid_ok ? " or sigmoid" : "") +
                                " (diffusers' " + c.scheduler_type + "Scheduler)");
  c.beta_start = r.number("beta_start", 1e-4);
  c.beta_end = r.number("beta_end", 0.02);
  c.prediction_type = r.string("prediction_type", "epsilon");
  if (c.prediction_type != "epsilon" && c.prediction_type != "sample") r.fail("prediction_type", "'" + c.prediction_type + "' is not epsilon or sample");
  c.clip_sample = r.boolean("clip_sample", true);
  c.clip_sample_range = r.number("clip_sample_range", 1.0);
  c.num_inference_steps = r.integer("num_inference_steps", c.num_train_timesteps);
  if (c.num_inference_steps < 1 || c.num_inference_steps > c.num_train_timesteps)
    r.fail("num_inference_steps", std::to_string(c.num_inference_steps) + " is not in [1, num_train_timesteps " + std::to_string(c.num_train_timesteps) + "]");
  c.mask_loss_for_padding = r.boolean("do_mask_loss_for_padding", false);
  return c;
}

std::vector<int64_t> DiffusionConfig::encoder_input_hw() const {
  if (!crop_shape.empty()) return crop_shape;
  if (!resize_shape.empty()) return resize_shape;
  return {features.image_shape.at(1), features.image_shape.at(2)};
}

int64_t DiffusionConfig::global_cond_dim() const {
  return features.state_dim + features.env_dim + static_cast<int64_t>(features.cameras.size()) * 2 * num_keypoints;
}

// ---- the noise scheduler ----

NoiseScheduler::NoiseScheduler(const DiffusionConfig& c) : c_(c) {
  const int64_t T = c.num_train_timesteps;
  at::Tensor betas;
  if (c.beta_schedule == "linear") {
    betas = at::linspace(c.beta_start, c.beta_end, T, at::kFloat);
  } else if (c.beta_schedule == "scaled_linear") {
    betas = at::linspace(std::pow(c.beta_start, 0.5), std::pow(c.beta_end, 0.5), T, at::kFloat).pow(2);
  } else if (c.beta_schedule == "sigmoid") {
    betas = at::sigmoid(at::linspace(-6, 6, T, at::kFloat)) * (c.beta_end - c.beta_start) + c.beta_start;
  } else {
    betas = cosine_betas(T);
  }
  alphas_cumprod_ = at::cumprod(1.0 - betas, 0);
  const int64_t n = c.num_inference_steps, ratio = T / n;  // "leading" spacing
  for (int64_t i = n - 1; i >= 0; --i) timesteps_.push_back(i * ratio);
}

at::Tensor NoiseScheduler::add_noise(const at::Tensor& x, const at::Tensor& noise, const at::Tensor& t) const {
  const at::Tensor ac = alphas_cumprod_.to(x.device(), x.scalar_type()).index_select(0, t.to(x.device()));
  const at::Tensor a = ac.pow(0.5).view({-1, 1, 1}), s = (1 - ac).pow(0.5).view({-1, 1, 1});
  return a * x + s * noise;
}

int64_t NoiseScheduler::step_draws() const {
  if (c_.scheduler_type != "DDPM") return 0;
  int64_t n = 0;
  for (int64_t t : timesteps_) n += t > 0;
  return n;
}

at::Tensor NoiseScheduler::step(const at::Tensor& out, size_t i, const at::Tensor& sample, const at::Tensor& noise) const {
  // 0-dim float32 tensors, as diffusers computes its coefficients
  const int64_t t = timesteps_.at(i);
  const at::Tensor a_t = alphas_cumprod_[t];
  const at::Tensor one = at::ones({}, at::kFloat);
  if (c_.scheduler_type == "DDPM") {
    const int64_t prev = i + 1 < timesteps_.size() ? timesteps_[i + 1] : -1;
    const at::Tensor a_prev = prev >= 0 ? alphas_cumprod_[prev] : one;
    const at::Tensor b_t = 1 - a_t, b_prev = 1 - a_prev, cur_a = a_t / a_prev, cur_b = 1 - cur_a;
    at::Tensor x0 = c_.prediction_type == "epsilon" ? (sample - b_t.pow(0.5) * out) / a_t.pow(0.5) : out;
    if (c_.clip_sample) x0 = x0.clamp(-c_.clip_sample_range, c_.clip_sample_range);
    const at::Tensor x0_coeff = (a_prev.pow(0.5) * cur_b) / b_t, sample_coeff = cur_a.pow(0.5) * b_prev / b_t;
    at::Tensor prev_sample = x0_coeff * x0 + sample_coeff * sample;
    if (t > 0) {
      const at::Tensor variance = ((1 - a_prev) / (1 - a_t) * cur_b).clamp_min(1e-20);
      const at::Tensor z = noise.defined() ? noise : at::randn(out.sizes(), out.options());
      prev_sample = prev_sample + variance.pow(0.5) * z;
    }
    return prev_sample;
  }
  // DDIM with eta 0 (LeRobot passes none): deterministic
  const int64_t prev = t - c_.num_train_timesteps / c_.num_inference_steps;
  const at::Tensor a_prev = prev >= 0 ? alphas_cumprod_[prev] : one;  // set_alpha_to_one
  const at::Tensor b_t = 1 - a_t;
  at::Tensor x0, eps;
  if (c_.prediction_type == "epsilon") {
    x0 = (sample - b_t.pow(0.5) * out) / a_t.pow(0.5);
    eps = out;
  } else {
    x0 = out;
    eps = (sample - a_t.pow(0.5) * x0) / b_t.pow(0.5);
  }
  if (c_.clip_sample) x0 = x0.clamp(-c_.clip_sample_range, c_.clip_sample_range);
  const at::Tensor variance = ((1 - a_prev) / b_t) * (1 - a_t / a_prev);
  const at::Tensor std_dev = 0.0 * variance.pow(0.5);
  const at::Tensor direction = (1 - a_prev - std_dev.pow(2)).pow(0.5) * eps;
  return a_prev.pow(0.5) * x0 + direction;
}

// ---- modules ----

SpatialSoftmaxImpl::SpatialSoftmaxImpl(int64_t in_channels, int64_t h, int64_t w, int64_t keypoints) : keypoints_(keypoints) {
  nets = register_module("nets", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, keypoints, 1)));
  // numpy's meshgrid of linspace(-1, 1, w) and linspace(-1, 1, h) in float64, stored as float32: (x, y) per position
  auto grid = [](int64_t n) {
    std::vector<double> v(n);
    const double step = n > 1 ? 2.0 / static_cast<double>(n - 1) : 0.0;
    for (int64_t i = 0; i < n; ++i) v[i] = -1.0 + static_cast<double>(i) * step;
    if (n > 1) v[n - 1] = 1.0;
    return at::tensor(v, at::kDouble);
  };
  const at::Tensor x = grid(w).view({1, w}).expand({h, w}), y = grid(h).view({h, 1}).expand({h, w});
  pos_grid = register_buffer("pos_grid", at::stack({x.reshape({-1}), y.reshape({-1})}, 1).to(at::kFloat));
}

at::Tensor SpatialSoftmaxImpl::forward(const at::Tensor& features) {
  const at::Tensor f = nets(features);
  const at::Tensor attention = at::softmax(f.reshape({-1, f.size(2) * f.size(3)}), -1);
  return at::matmul(attention, pos_grid.to(attention.scalar_type())).view({-1, keypoints_, 2});
}

DiffusionRgbEncoderImpl::DiffusionRgbEncoderImpl(const DiffusionConfig& c)
    : resize_(c.resize_shape), crop_(c.crop_shape), crop_is_random_(c.crop_is_random) {
  backbone = register_module("backbone", ResNet(c.backbone));
  const std::vector<int64_t> hw = c.encoder_input_hw();
  pool = register_module("pool", SpatialSoftmax(c.backbone.out_channels(), c.backbone.feature_size(hw[0]),
                                                c.backbone.feature_size(hw[1]), c.num_keypoints));
  out = register_module("out", torch::nn::Linear(2 * c.num_keypoints, 2 * c.num_keypoints));
}

at::Tensor DiffusionRgbEncoderImpl::forward(at::Tensor x) {
  if (!resize_.empty() && (x.size(2) != resize_[0] || x.size(3) != resize_[1]))  // torchvision's Resize: antialiased bilinear
    x = at::_upsample_bilinear2d_aa(x, {resize_[0], resize_[1]}, false);
  if (!crop_.empty()) {
    const int64_t H = x.size(2), W = x.size(3);
    int64_t top = centre_offset(H, crop_[0]), left = centre_offset(W, crop_[1]);
    if (is_training() && crop_is_random_) {  // one offset for the whole call, as torchvision's RandomCrop
      top = at::randint(0, H - crop_[0] + 1, {1}, at::kLong).item<int64_t>();
      left = at::randint(0, W - crop_[1] + 1, {1}, at::kLong).item<int64_t>();
    }
    x = x.narrow(2, top, crop_[0]).narrow(3, left, crop_[1]);
  }
  return at::relu(out(pool(backbone(x)).flatten(1)));
}

DiffusionConv1dBlockImpl::DiffusionConv1dBlockImpl(int64_t in, int64_t out, int64_t kernel, int64_t groups) {
  block = register_module("block", torch::nn::Sequential(
                                       torch::nn::Conv1d(torch::nn::Conv1dOptions(in, out, kernel).padding(kernel / 2)),
                                       torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, out)), torch::nn::Mish()));
}

DiffusionResidualBlock1dImpl::DiffusionResidualBlock1dImpl(int64_t in, int64_t out, int64_t cond_dim, const DiffusionConfig& c)
    : out_(out), film_scale_(c.film_scale) {
  conv1 = register_module("conv1", DiffusionConv1dBlock(in, out, c.kernel_size, c.n_groups));
  cond_encoder = register_module("cond_encoder", torch::nn::Sequential(torch::nn::Mish(), torch::nn::Linear(cond_dim, c.film_scale ? 2 * out : out)));
  conv2 = register_module("conv2", DiffusionConv1dBlock(out, out, c.kernel_size, c.n_groups));
  if (in != out) residual_conv = register_module("residual_conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(in, out, 1)));
}

at::Tensor DiffusionResidualBlock1dImpl::forward(const at::Tensor& x, const at::Tensor& cond) {
  at::Tensor h = conv1(x);
  const at::Tensor film = cond_encoder->forward(cond).unsqueeze(-1);
  if (film_scale_) h = film.narrow(1, 0, out_) * h + film.narrow(1, out_, out_);
  else h = h + film;
  return conv2(h) + (residual_conv ? residual_conv(x) : x);
}

DiffusionUnetLevelImpl::DiffusionUnetLevelImpl(int64_t in, int64_t out, int64_t cond_dim, const DiffusionConfig& c, int resample) {
  block0 = register_module("0", DiffusionResidualBlock1d(in, out, cond_dim, c));
  block1 = register_module("1", DiffusionResidualBlock1d(out, out, cond_dim, c));
  if (resample < 0) down = register_module("2", torch::nn::Conv1d(torch::nn::Conv1dOptions(out, out, 3).stride(2).padding(1)));
  if (resample > 0) up = register_module("2", torch::nn::ConvTranspose1d(torch::nn::ConvTranspose1dOptions(out, out, 4).stride(2).padding(1)));
}

at::Tensor DiffusionUnetLevelImpl::forward(at::Tensor x, const at::Tensor& cond, std::vector<at::Tensor>* skips) {
  if (up) {  // the decoder takes the encoder's skip features beside its input
    x = at::cat({x, skips->back()}, 1);
    skips->pop_back();
  }
  x = block1(block0(x, cond), cond);
  if (!up) skips->push_back(x);
  if (down) x = down(x);
  if (up) x = up->forward(x);
  return x;
}

namespace {
// DiffusionSinusoidalPosEmb: timesteps [B] -> [B, dim] (sines then cosines; the frequencies in float32).
class SinusoidalPosEmbImpl : public torch::nn::Module {
 public:
  explicit SinusoidalPosEmbImpl(int64_t dim) : dim_(dim) {}
  at::Tensor forward(const at::Tensor& t) {
    const int64_t half = dim_ / 2;
    const double scale = std::log(10000.0) / static_cast<double>(half - 1);
    const at::Tensor freq = (at::arange(half, t.options().dtype(at::kLong)) * -scale).exp();
    const at::Tensor e = t.unsqueeze(-1) * freq.unsqueeze(0);
    return at::cat({e.sin(), e.cos()}, -1);
  }

 private:
  int64_t dim_;
};
TORCH_MODULE(SinusoidalPosEmb);
}  // namespace

DiffusionConditionalUnet1dImpl::DiffusionConditionalUnet1dImpl(const DiffusionConfig& c, int64_t global_cond_dim)
    : embed_dim_(c.step_embed_dim) {
  const int64_t E = c.step_embed_dim, cond = E + global_cond_dim, A = c.features.action_dim;
  diffusion_step_encoder = register_module("diffusion_step_encoder",
                                           torch::nn::Sequential(SinusoidalPosEmb(E), torch::nn::Linear(E, 4 * E), torch::nn::Mish(),
                                                                 torch::nn::Linear(4 * E, E)));
  std::vector<std::pair<int64_t, int64_t>> in_out{{A, c.down_dims[0]}};
  for (size_t i = 1; i < c.down_dims.size(); ++i) in_out.emplace_back(c.down_dims[i - 1], c.down_dims[i]);
  down_modules = register_module("down_modules", torch::nn::ModuleList());
  for (size_t i = 0; i < in_out.size(); ++i)
    down_modules->push_back(DiffusionUnetLevel(in_out[i].first, in_out[i].second, cond, c, i + 1 < in_out.size() ? -1 : 0));
  mid_modules = register_module("mid_modules", torch::nn::ModuleList());
  for (int i = 0; i < 2; ++i) mid_modules->push_back(DiffusionResidualBlock1d(c.down_dims.back(), c.down_dims.back(), cond, c));
  up_modules = register_module("up_modules", torch::nn::ModuleList());
  for (size_t i = in_out.size() - 1; i >= 1; --i)  // reversed(in_out[1:]): every level upsamples
    up_modules->push_back(DiffusionUnetLevel(2 * in_out[i].second, in_out[i].first, cond, c, 1));
  final_conv = register_module("final_conv", torch::nn::Sequential(DiffusionConv1dBlock(c.down_dims[0], c.down_dims[0], c.kernel_size, 8),
                                                                   torch::nn::Conv1d(torch::nn::Conv1dOptions(c.down_dims[0], A, 1))));
}

at::Tensor DiffusionConditionalUnet1dImpl::forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& global_cond) {
  at::Tensor temb = diffusion_step_encoder->forward(timesteps);
  const at::Tensor cond = at::cat({temb.to(global_cond.scalar_type()), global_cond}, -1);
  at::Tensor h = x.transpose(1, 2);
  std::vector<at::Tensor> skips;
  for (auto& m : *down_modules) h = m->as<DiffusionUnetLevelImpl>()->forward(h, cond, &skips);
  for (auto& m : *mid_modules) h = m->as<DiffusionResidualBlock1dImpl>()->forward(h, cond);
  for (auto& m : *up_modules) h = m->as<DiffusionUnetLevelImpl>()->forward(h, cond, &skips);
  return final_conv->forward(h).transpose(1, 2);
}

DiffusionModelImpl::DiffusionModelImpl(const DiffusionConfig& c) : c_(c) {
  const size_t cams = c.features.cameras.size();
  if (cams && c.separate_encoders) {
    rgb_encoders = register_module("rgb_encoder", torch::nn::ModuleList());
    for (size_t i = 0; i < cams; ++i) rgb_encoders->push_back(DiffusionRgbEncoder(c));
  } else if (cams) {
    rgb_encoder = register_module("rgb_encoder", DiffusionRgbEncoder(c));
  }
  unet = register_module("unet", DiffusionConditionalUnet1d(c, c.global_cond_dim() * c.n_obs_steps));
}

at::Tensor DiffusionModelImpl::global_conditioning(const Batch& b) {
  const at::Tensor& state = b.at("observation.state");
  const int64_t B = state.size(0), S = state.size(1);
  std::vector<at::Tensor> feats{state};
  const auto& cams = c_.features.cameras;
  if (!cams.empty()) {
    auto flat = [&](const at::Tensor& x) { return x.reshape({-1, x.size(-3), x.size(-2), x.size(-1)}); };
    if (rgb_encoders) {  // each camera's encoder over its (b, s) images
      for (size_t i = 0; i < cams.size(); ++i)
        feats.push_back(rgb_encoders->ptr(i)->as<DiffusionRgbEncoderImpl>()->forward(flat(b.at(cams[i]))).view({B, S, -1}));
    } else {  // one call over every (b, s, camera) image, as LeRobot's "(b s n)" batch
      std::vector<at::Tensor> images;
      for (const auto& cam : cams) images.push_back(b.at(cam));
      feats.push_back(rgb_encoder(flat(at::stack(images, 2))).view({B, S, -1}));
    }
  }
  if (c_.features.env_dim) feats.push_back(b.at("observation.environment_state"));
  return at::cat(feats, -1).flatten(1);
}

// ---- the policy ----

DiffusionPolicyImpl::DiffusionPolicyImpl(DiffusionConfig c) : PolicyModel(c.raw), config_(std::move(c)), scheduler_(config_) {
  diffusion = register_module("diffusion", DiffusionModel(config_));
}

void DiffusionPolicyImpl::init_weights(double) {
  torch::NoGradGuard g;
  // PyTorch's defaults (LeRobot builds the modules so), torchvision's initialisation for the trunks
  for (auto& m : modules(false)) {
    if (auto* l = m->as<torch::nn::LinearImpl>()) l->reset_parameters();
    if (auto* n = m->as<torch::nn::GroupNormImpl>()) n->reset_parameters();
    if (auto* c = m->as<torch::nn::Conv1dImpl>()) c->reset_parameters();
    if (auto* c = m->as<torch::nn::ConvTranspose1dImpl>()) c->reset_parameters();
    if (auto* s = m->as<SpatialSoftmaxImpl>()) s->nets->reset_parameters();
    if (auto* e = m->as<DiffusionRgbEncoderImpl>()) e->backbone->init_weights();
  }
}

BatchSchema DiffusionPolicyImpl::batch_schema() const {
  const auto& c = config_;
  const std::string S = std::to_string(c.n_obs_steps), H = std::to_string(c.horizon), A = std::to_string(c.features.action_dim);
  BatchSchema s;
  s.push_back(required_field("observation.state", at::kFloat, 3, "normalised robot state [B, " + S + ", " + std::to_string(c.features.state_dim) + "]"));
  if (c.features.env_dim)
    s.push_back(required_field("observation.environment_state", at::kFloat, 3, "normalised environment state [B, " + S + ", " + std::to_string(c.features.env_dim) + "]"));
  for (const std::string& cam : c.features.cameras) s.push_back(required_field(cam, at::kFloat, 5, "normalised images [B, " + S + ", 3, H, W]"));
  s.push_back(required_field("action", at::kFloat, 3, "normalised action trajectory [B, " + H + ", " + A + "] (from n_obs_steps - 1 steps back)"));
  s.push_back(required_field("action_is_pad", at::kBool, 2, "padded steps of the trajectory (past the episode's ends) [B, " + H + "]"));
  s.push_back(optional_field("noise", at::kFloat, 3, "the forward diffusion's standard-normal draw [B, " + H + ", " + A + "] (drawn when absent)"));
  s.push_back(optional_field("timesteps", at::kLong, 1, "the noising timesteps [B] in [0, num_train_timesteps) (drawn when absent)"));
  return s;
}

double DiffusionPolicyImpl::train_flops_per_sample(int64_t) const {
  // An estimate: 6 FLOPs per weight per position it is applied at (the trunks' stages at their feature-map sizes,
  // the U-Net's levels at their lengths), per observation step and camera
  const auto& c = config_;
  double flops = 0;
  if (!c.features.cameras.empty()) {
    const auto hw = c.encoder_input_hw();
    const DiffusionRgbEncoderImpl& enc = rgb_encoders_or_shared();
    double trunk = 0, positions = static_cast<double>(hw[0]) * hw[1] / 4;  // after the stem's stride
    trunk += numel_of(*enc.backbone->conv1) * positions;
    positions /= 4;  // max pooling
    for (size_t s = 0; s < enc.backbone->layers.size(); ++s) {
      if (s > 0 && !(s + 1 == enc.backbone->layers.size() && c.backbone.dilate_last)) positions /= 4;
      trunk += numel_of(*enc.backbone->layers[s]) * positions;
    }
    flops += (trunk + numel_of(*enc.pool) * positions + numel_of(*enc.out)) * c.n_obs_steps * c.features.cameras.size();
  }
  const auto& u = diffusion->unet;
  double len = c.horizon;
  for (const auto& m : *u->down_modules) {
    flops += numel_of(*m) * len;
    len /= 2;
  }
  len *= 2;
  for (const auto& m : *u->mid_modules) flops += numel_of(*m) * len;
  for (const auto& m : *u->up_modules) {
    flops += numel_of(*m) * len;
    len *= 2;
  }
  flops += numel_of(*u->final_conv) * c.horizon + numel_of(*u->diffusion_step_encoder);
  return 6.0 * flops;
}

const DiffusionRgbEncoderImpl& DiffusionPolicyImpl::rgb_encoders_or_shared() const {
  if (diffusion->rgb_encoders) return *diffusion->rgb_encoders->ptr(0)->as<DiffusionRgbEncoderImpl>();
  return *diffusion->rgb_encoder;
}

at::Tensor DiffusionPolicyImpl::forward_whole(const Batch& b) {
  const auto& c = config_;
  const at::Tensor cond = diffusion->global_conditioning(b);
  const at::Tensor& trajectory = b.at("action");
  const int64_t B = trajectory.size(0);
  const at::Tensor eps = b.has("noise") ? b.at("noise") : at::randn(trajectory.sizes(), trajectory.options().dtype(at::kFloat));
  const at::Tensor t = b.has("timesteps") ? b.at("timesteps") : at::randint(0, c.num_train_timesteps, {B}, trajectory.options().dtype(at::kLong));
  const at::Tensor noisy = scheduler_.add_noise(trajectory, eps.to(trajectory.scalar_type()), t);
  const at::Tensor pred = diffusion->unet(noisy, t, cond);
  const at::Tensor target = c.prediction_type == "epsilon" ? eps : trajectory;
  return at::cat({pred.flatten(1), target.to(pred.scalar_type()).flatten(1)}, 1);
}

at::Tensor DiffusionPolicyImpl::loss(const at::Tensor& head, const Batch& b) const {
  const auto& c = config_;
  const at::Tensor h = head.to(at::kFloat);  // the loss reduced in fp32 (bf16 compute)
  const int64_t B = h.size(0), n = c.horizon * c.features.action_dim;
  const at::Tensor pred = h.narrow(1, 0, n).view({B, c.horizon, c.features.action_dim});
  const at::Tensor target = h.narrow(1, n, n).view({B, c.horizon, c.features.action_dim});
  const at::Tensor err = at::mse_loss(pred, target, at::Reduction::None);
  if (!c.mask_loss_for_padding) return err.mean();
  const at::Tensor mask = b.at("action_is_pad").logical_not().unsqueeze(-1);
  return (err * mask).sum() / (mask.sum() * c.features.action_dim).clamp_min(1);
}

at::Tensor DiffusionPolicyImpl::head_loss_sum(const at::Tensor& h, const Batch& b) {
  return loss(h, b) * static_cast<double>(b.num_rows());
}

PolicySpec DiffusionPolicyImpl::policy_spec() const {
  const auto& c = config_;
  PolicySpec s = lerobot_policy_spec(config_json(), "config.json");
  for (int64_t i = 1 - c.n_obs_steps; i <= 0; ++i) s.observation_offsets.push_back(i);
  for (int64_t i = 0; i < c.horizon; ++i) s.action_offsets.push_back(1 - c.n_obs_steps + i);
  s.n_action_steps = c.n_action_steps;
  s.drop_n_last_frames = c.drop_n_last_frames;
  return s;
}

std::map<std::string, at::Tensor> DiffusionPolicyImpl::training_draws(int64_t rows, at::Generator& gen) const {
  const auto& c = config_;
  return {{"noise", at::randn({rows, c.horizon, c.features.action_dim}, gen, at::TensorOptions().dtype(at::kFloat))},
          {"timesteps", at::randint(0, c.num_train_timesteps, {rows}, gen, at::TensorOptions().dtype(at::kLong))}};
}

at::Tensor DiffusionPolicyImpl::predict_action_chunk(const Batch& b, const at::Tensor& sample_noise, const at::Tensor& step_noise) {
  torch::NoGradGuard g;
  const bool was = is_training();
  eval();
  const auto& c = config_;
  const at::Tensor cond = diffusion->global_conditioning(b);
  const int64_t B = cond.size(0);
  at::Tensor sample = sample_noise.defined() ? sample_noise.to(cond.scalar_type())
                                             : at::randn({B, c.horizon, c.features.action_dim}, cond.options());
  int64_t draw = 0;
  const auto& ts = scheduler_.timesteps();
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor out = diffusion->unet(sample, at::full({B}, ts[i], cond.options().dtype(at::kLong)), cond);
    at::Tensor z;
    if (c.scheduler_type == "DDPM" && ts[i] > 0 && step_noise.defined()) z = step_noise[draw++].to(sample.scalar_type());
    sample = scheduler_.step(out, i, sample, z);
  }
  train(was);
  const int64_t start = c.n_obs_steps - 1;
  return sample.narrow(1, start, std::min(c.n_action_steps, c.horizon - start));
}

at::ScalarType DiffusionPolicyImpl::dtype() const {
  return diffusion->unet->final_conv->ptr(1)->as<torch::nn::Conv1dImpl>()->weight.scalar_type();
}

Batch DiffusionPolicyImpl::check_batch(const std::map<std::string, at::Tensor>& batch, const std::string& file, bool need_action,
                                       at::Tensor* step_noise) const {
  const auto& c = config_;
  constexpr int64_t B = BatchChecker::kB;
  const int64_t S = c.n_obs_steps, H = c.horizon, A = c.features.action_dim;
  std::map<std::string, at::Tensor> in = batch;
  for (const std::string& cam : c.features.cameras)  // LeRobot adds the step dim itself when n_obs_steps is 1
    if (auto it = in.find(cam); S == 1 && it != in.end() && it->second.dim() == 4) it->second = it->second.unsqueeze(1);
  BatchChecker k(in, file, dtype());
  k.take("observation.state", {B, S, c.features.state_dim}, true);
  if (c.features.env_dim) k.take("observation.environment_state", {B, S, c.features.env_dim}, true);
  for (const std::string& cam : c.features.cameras) {
    if (c.resize_shape.empty()) k.take(cam, {B, S, 3, c.features.image_shape[1], c.features.image_shape[2]}, true);
    else k.take(cam, {B, S, 3, -1, -1}, true);  // resized to resize_shape first
  }
  k.take("action", {B, H, A}, need_action);
  k.take("action_is_pad", {B, H}, need_action, BatchChecker::kBool);
  k.take("noise", {B, H, A}, false);
  if (k.take("timesteps", {B}, false, BatchChecker::kInteger)) {
    const at::Tensor& t = k.out.at("timesteps");
    if (t.min().item<int64_t>() < 0 || t.max().item<int64_t>() >= c.num_train_timesteps)
      throw file_error(file, "timesteps", "expected values in [0, num_train_timesteps " + std::to_string(c.num_train_timesteps) + ")");
  }
  k.take("sample_noise", {B, H, A}, false);
  // the DDPM sampler's draws (dim 0 runs over steps, not rows: kept out of the batch); DDIM (eta 0) takes none
  if (const int64_t draws = scheduler_.step_draws(); draws > 0 && k.take("sample_step_noise", {draws, -1, H, A}, false)) {
    *step_noise = k.out.at("sample_step_noise");
    if (step_noise->size(1) != k.batch_size())
      throw file_error(file, "sample_step_noise", "expected " + shape_str({draws, k.batch_size(), H, A}) + ", got " + shape_str(step_noise->sizes()));
    k.out.set("sample_step_noise", at::Tensor());
  }
  return k.out;
}

Model::ReferenceOutput DiffusionPolicyImpl::reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) {
  at::Tensor step_noise;
  const Batch b = check_batch(batch, file, true, &step_noise);
  const int64_t draws = scheduler_.step_draws();
  // dump is deterministic: every random draw comes with the batch
  if (is_training())
    for (const char* k : {"noise", "timesteps"})
      if (!b.has(k)) throw file_error(file, k, "missing (training's random draw: noise [B, horizon, A], timesteps [B] int64)");
  if (!b.has("sample_noise")) throw file_error(file, "sample_noise", "missing (the sampler's start [B, horizon, A])");
  if (draws > 0 && !step_noise.defined())
    throw file_error(file, "sample_step_noise", "missing (the DDPM sampler's per-step draws [" + std::to_string(draws) + ", B, horizon, A])");
  if (is_training() && config_.crop_is_random && !config_.crop_shape.empty() && !config_.features.cameras.empty())
    throw file_error(file, "observation.images", "random crops (crop_is_random with crop_shape) are drawn, dump is deterministic: set crop_is_random false");
  ReferenceOutput r;
  r.loss = loss(forward_whole(b), b);
  r.outputs.emplace_back("action_chunk", predict_action_chunk(b, b.at("sample_noise"), step_noise));
  return r;
}

std::shared_ptr<Model> build_diffusion(const nlohmann::json& j, const std::string& file) {
  return DiffusionPolicy(DiffusionConfig::from_json(j, file)).ptr();
}

std::shared_ptr<Model> build_diffusion_for_weights(const nlohmann::json& j, const std::string& file, const Family::TensorShapes& shapes) {
  DiffusionConfig c = DiffusionConfig::from_json(j, file);
  const std::string prefix = c.separate_encoders ? "diffusion.rgb_encoder.0.backbone." : "diffusion.rgb_encoder.backbone.";
  c.backbone = ResNetLayout::from_shapes(shapes, prefix, c.backbone);
  return DiffusionPolicy(c).ptr();
}

nlohmann::json describe_diffusion(const nlohmann::json& j, const std::string& file) {
  const DiffusionConfig c = DiffusionConfig::from_json(j, file);
  DiffusionPolicy p(c);
  int64_t total = 0;
  const nlohmann::json comps = component_parameters(*p->diffusion, &total);
  return {{"family", "policy"},
          {"model_type", "diffusion"},
          {"parameters", total},
          {"cameras", c.features.cameras},
          {"state_dim", c.features.state_dim},
          {"env_state_dim", c.features.env_dim},
          {"action_dim", c.features.action_dim},
          {"n_obs_steps", c.n_obs_steps},
          {"horizon", c.horizon},
          {"n_action_steps", c.n_action_steps},
          {"drop_n_last_frames", c.drop_n_last_frames},
          {"vision_backbone", c.vision_backbone},
          {"use_group_norm", c.use_group_norm},
          {"down_dims", c.down_dims},
          {"noise_scheduler_type", c.scheduler_type},
          {"num_train_timesteps", c.num_train_timesteps},
          {"num_inference_steps", c.num_inference_steps},
          {"prediction_type", c.prediction_type},
          {"components", comps}};
}

}  // namespace lf::models::policy

#include "loongforge/models/sample.h"

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::models {

SchedulerConfig SchedulerConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  SchedulerConfig c;
  const std::string cls = r.string("_class_name", "FlowMatchEulerDiscreteScheduler");
  if (cls == "FlowMatchEulerDiscreteScheduler") {
    c.kind = "flow_match_euler";
    for (const char* k : {"use_dynamic_shifting", "invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas",
                          "use_beta_sigmas", "stochastic_sampling"})
      if (r.boolean(k, false)) r.fail(k, "not supported (the plain shifted Euler schedule is)");
    if (r.has("shift_terminal")) r.fail("shift_terminal", "not supported");
  } else if (cls == "DDIMScheduler" || cls == "DDPMScheduler") {
    c.kind = "ddim";
    if (r.string("prediction_type", "epsilon") != "epsilon") r.fail("prediction_type", "only epsilon is supported");
    if (r.boolean("thresholding", false)) r.fail("thresholding", "not supported");
    if (r.boolean("rescale_betas_zero_snr", false)) r.fail("rescale_betas_zero_snr", "not supported");
    if (r.has("trained_betas")) r.fail("trained_betas", "not supported");
  } else {
    r.fail("_class_name", "'" + cls + "' is not a scheduler LoongForge samples with (FlowMatchEulerDiscreteScheduler, "
                          "DDIMScheduler, DDPMScheduler)");
  }
  c.num_train_timesteps = r.integer("num_train_timesteps", c.num_train_timesteps);
  if (c.num_train_timesteps <= 0) r.fail("num_train_timesteps", "must be positive");
  c.shift = r.number("shift", c.shift);
  c.beta_start = r.number("beta_start", c.beta_start);
  c.beta_end = r.number("beta_end", c.beta_end);
  c.beta_schedule = r.string("beta_schedule", c.beta_schedule);
  if (c.beta_schedule != "linear" && c.beta_schedule != "scaled_linear" && c.beta_schedule != "squaredcos_cap_v2")
    r.fail("beta_schedule", "'" + c.beta_schedule + "' is not supported (linear, scaled_linear, squaredcos_cap_v2)");
  c.clip_sample = r.boolean("clip_sample", c.clip_sample);
  c.clip_sample_range = r.number("clip_sample_range", c.clip_sample_range);
  c.set_alpha_to_one = r.boolean("set_alpha_to_one", c.set_alpha_to_one);
  c.steps_offset = r.integer("steps_offset", c.steps_offset);
  c.timestep_spacing = r.string("timestep_spacing", c.timestep_spacing);
  if (c.kind == "ddim" && c.timestep_spacing != "leading" && c.timestep_spacing != "trailing")
    r.fail("timestep_spacing", "'" + c.timestep_spacing + "' is not supported (leading, trailing)");
  return c;
}

namespace {

double shifted(double s, double shift) { return shift * s / (1 + (shift - 1) * s); }

}  // namespace

at::Tensor flow_training_sigmas(const SchedulerConfig& c) {
  const int64_t n = c.num_train_timesteps;
  const at::Tensor s = at::arange(n, 0, -1, at::kFloat) / static_cast<double>(n);
  return c.shift * s / (1 + (c.shift - 1) * s);
}

// diffusers' betas (float32).
at::Tensor betas(const SchedulerConfig& c) {
  const int64_t n = c.num_train_timesteps;
  at::Tensor betas;
  if (c.beta_schedule == "linear") {
    betas = at::linspace(c.beta_start, c.beta_end, n, at::kFloat);
  } else if (c.beta_schedule == "scaled_linear") {
    betas = at::linspace(std::sqrt(c.beta_start), std::sqrt(c.beta_end), n, at::kFloat).pow(2);
  } else {  // squaredcos_cap_v2: betas_for_alpha_bar with the cosine alpha bar, in Python floats
    std::vector<float> b(static_cast<size_t>(n));
    auto bar = [](double t) { return std::pow(std::cos((t + 0.008) / 1.008 * M_PI / 2), 2); };
    for (int64_t i = 0; i < n; ++i) {
      const double t1 = static_cast<double>(i) / n, t2 = static_cast<double>(i + 1) / n;
      b[static_cast<size_t>(i)] = static_cast<float>(std::min(1 - bar(t2) / bar(t1), 0.999));
    }
    betas = at::tensor(b, at::kFloat);
  }
  return betas;
}

// alphas_cumprod (float32, cumulative product in float32).
at::Tensor alphas_cumprod(const SchedulerConfig& c) { return at::cumprod(1.0 - betas(c), 0); }

Schedule make_schedule(const SchedulerConfig& c, int64_t steps) {
  if (steps <= 0) throw Error("sample: the number of steps must be positive");
  const double T = static_cast<double>(c.num_train_timesteps);
  Schedule s;
  if (c.kind == "flow_match_euler") {
    // The scheduler's construction shifts its training sigmas (t / T, t = T..1); set_timesteps then spaces the
    // timesteps linearly from the largest to the smallest of those and shifts again (in float64, as numpy).
    const at::Tensor train = flow_training_sigmas(c);
    const double sigma_max = train[0].item<float>(), sigma_min = train[train.size(0) - 1].item<float>();
    std::vector<float> sig(static_cast<size_t>(steps) + 1, 0.0f);
    const double a = sigma_max * T, b = sigma_min * T;
    for (int64_t i = 0; i < steps; ++i) {
      // numpy.linspace(a, b, steps): a + i * step, the last exactly b
      const double t = steps == 1 ? a : (i == steps - 1 ? b : a + static_cast<double>(i) * ((b - a) / static_cast<double>(steps - 1)));
      sig[static_cast<size_t>(i)] = static_cast<float>(shifted(t / T, c.shift));
    }
    s.sigmas = at::tensor(sig, at::kFloat);
    s.timesteps = s.sigmas.narrow(0, 0, steps) * static_cast<float>(T);
    return s;
  }
  // DDIM
  std::vector<int64_t> ts(static_cast<size_t>(steps));
  if (c.timestep_spacing == "leading") {
    const int64_t ratio = c.num_train_timesteps / steps;
    for (int64_t i = 0; i < steps; ++i) ts[static_cast<size_t>(i)] = (steps - 1 - i) * ratio + c.steps_offset;
  } else {  // trailing: round(arange(T, 0, -T / steps)) - 1
    const double ratio = T / static_cast<double>(steps);
    for (int64_t i = 0; i < steps; ++i)
      ts[static_cast<size_t>(i)] = static_cast<int64_t>(std::nearbyint(T - static_cast<double>(i) * ratio)) - 1;
  }
  for (int64_t t : ts)
    if (t < 0 || t >= c.num_train_timesteps)
      throw Error("sample: " + std::to_string(steps) + " DDIM steps give timestep " + std::to_string(t) +
                  " outside [0, " + std::to_string(c.num_train_timesteps) + ")");
  s.timesteps = at::tensor(ts, at::kLong);
  const at::Tensor ac = alphas_cumprod(c);
  at::Tensor a = ac.index_select(0, s.timesteps);
  const float last = c.set_alpha_to_one ? 1.0f : ac[0].item<float>();
  a = at::cat({a, at::full({1}, last, at::kFloat)});
  s.sigmas = ((1 - a) / a).sqrt();
  return s;
}

namespace {

// The model's prediction for x at timestep t: the first x.size(1) channels of its output.
at::Tensor predict(Model& model, std::map<std::string, at::Tensor> in, const at::Tensor& x, const at::Tensor& t,
                   const std::string& file) {
  in["hidden_states"] = x;
  in["timestep"] = t.reshape({1}).expand({x.size(0)}).contiguous();
  in.erase("target");
  Model::ReferenceOutput r = model.reference_forward(in, file);
  for (const auto& [name, out] : r.outputs)
    if (name == "output") return out.narrow(1, 0, x.size(1)).to(at::kFloat);
  throw Error("sample: the " + model.model_type() + " model gives no denoising output");
}

}  // namespace

SampleResult sample(Model& model, const std::map<std::string, at::Tensor>& batch, const SampleOptions& o,
                    const std::string& file) {
  at::NoGradGuard no_grad;
  auto it = batch.find("noise");
  if (it == batch.end()) throw file_error(file, "noise", "missing (the starting noise the samples are denoised from)");
  at::Tensor x = it->second.to(at::kFloat);
  if (x.dim() < 3) throw file_error(file, "noise", "expected [B, C, ...] latents");
  std::map<std::string, at::Tensor> cond, negative, uncond;
  for (const auto& [name, t] : batch) {
    if (name == "noise") continue;
    if (name.rfind("negative_", 0) == 0) negative[name.substr(9)] = t;
    else cond[name] = t;
  }
  if (o.guidance != 1.0) {
    if (negative.empty()) {
      uncond = model.unconditional(cond, file);
    } else {  // the batch's own unconditional inputs (one row for all, or one per row)
      uncond = cond;
      for (const auto& [name, t] : negative) {
        if (!cond.count(name)) throw file_error(file, "negative_" + name, "no condition '" + name + "' to replace");
        if (t.dim() == 0 || (t.size(0) != 1 && t.size(0) != x.size(0)))
          throw file_error(file, "negative_" + name, "expected 1 or " + std::to_string(x.size(0)) + " rows");
        std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
        shape[0] = x.size(0);
        uncond[name] = t.expand(shape).contiguous();
      }
    }
  }
  const SchedulerConfig& c = o.scheduler;
  SampleResult r;
  r.schedule = make_schedule(c, o.steps);
  std::vector<at::Tensor> out = {x};
  const at::Tensor ac = c.kind == "ddim" ? alphas_cumprod(c) : at::Tensor();
  for (int64_t i = 0; i < o.steps; ++i) {
    const at::Tensor t = r.schedule.timesteps[i];
    at::Tensor pred = predict(model, cond, x, t, file);
    if (o.guidance != 1.0) {
      at::Tensor u = predict(model, uncond, x, t, file);
      pred = u + o.guidance * (pred - u);
    }
    if (c.kind == "flow_match_euler") {
      const at::Tensor dt = r.schedule.sigmas[i + 1] - r.schedule.sigmas[i];
      x = x + dt * pred;
    } else {  // DDIM, eta 0, epsilon prediction (diffusers' DDIMScheduler.step)
      const int64_t ti = t.item<int64_t>(), prev = ti - c.num_train_timesteps / o.steps;
      const at::Tensor a_t = ac[ti];
      const at::Tensor a_prev = prev >= 0 ? ac[prev] : at::full({}, c.set_alpha_to_one ? 1.0f : ac[0].item<float>());
      const at::Tensor b_t = 1 - a_t;
      at::Tensor x0 = (x - b_t.pow(0.5) * pred) / a_t.pow(0.5);
      if (c.clip_sample) x0 = x0.clamp(-c.clip_sample_range, c.clip_sample_range);
      x = a_prev.pow(0.5) * x0 + (1 - a_prev).pow(0.5) * pred;
    }
    out.push_back(x);
  }
  r.samples = at::stack(out);
  return r;
}

at::Tensor latents_to_pixels(LatentCodec* codec, const at::Tensor& samples) {
  if (!codec) return samples;
  return codec->decode_latents(codec->denormalize_latents(samples.to(at::kFloat))).clamp(-1, 1);
}

}  // namespace lf::models

#include "loongforge/train/diffusion_source.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "loongforge/core/error.h"

namespace lf::train {

uint64_t row_seed(uint64_t seed, int64_t k) {
  const uint64_t s = seed * 6364136223846793005ULL + static_cast<uint64_t>(k) * 1442695040888963407ULL + 1ULL;
  return s & 0x7fffffffffffffffULL;
}

DiffusionObjectiveSource::DiffusionObjectiveSource(std::unique_ptr<BatchSource> inner, DiffusionObjective o,
                                                   uint64_t seed, const models::Model* model)
    : inner_(std::move(inner)), o_(std::move(o)), seed_(seed), model_(model) {
  if (o_.kind == "ddpm") alphas_cumprod_ = models::alphas_cumprod(o_.schedule);
  else sigmas_ = models::flow_training_sigmas(o_.schedule);
  bool vlb = false;
  if (model_ && o_.kind == "ddpm" && o_.vlb_weight != 0)
    for (const auto& f : model_->batch_schema()) vlb = vlb || f.name == "vlb_terms";
  if (vlb) {  // guided diffusion's GaussianDiffusion tables, in float64 from the betas
    const at::Tensor beta = models::betas(o_.schedule).to(at::kDouble), alpha = 1 - beta;
    const at::Tensor abar = at::cumprod(alpha, 0);
    const at::Tensor abar_prev = at::cat({at::ones({1}, abar.options()), abar.narrow(0, 0, abar.size(0) - 1)});
    const at::Tensor post_var = beta * (1 - abar_prev) / (1 - abar);
    const at::Tensor post_logvar = at::log(at::cat({post_var.narrow(0, 1, 1), post_var.narrow(0, 1, post_var.size(0) - 1)}));
    vlb_table_ = at::stack({beta * abar_prev.sqrt() / (1 - abar), (1 - abar_prev) * alpha.sqrt() / (1 - abar),
                            post_logvar, beta.log(), (1 / abar).sqrt(), (1 / abar - 1).sqrt()},
                           1);
  }
}

Batch DiffusionObjectiveSource::make(const Batch& clean, const std::vector<int64_t>& index) const {
  const std::string where = inner_->origin().empty() ? "the training data" : inner_->origin();
  if (!clean.has("latents"))
    throw file_error(where, "latents", "missing (a diffusion objective trains on clean latents [B, C, ...])");
  const at::Tensor x = clean.at("latents").to(at::kFloat);
  const int64_t n = x.size(0);
  if (static_cast<int64_t>(index.size()) != n) throw Error("diffusion objective: row indices do not match the batch");
  const int64_t T = o_.schedule.num_train_timesteps;
  const bool flow = o_.kind == "flow_matching";
  std::vector<at::Tensor> noise(static_cast<size_t>(n)), sigma(static_cast<size_t>(n)), step(static_cast<size_t>(n));
  std::vector<int64_t> dropped;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  for (int64_t r = 0; r < n; ++r) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(row_seed(seed_, index[static_cast<size_t>(r)]));
    // u: diffusers' compute_density_for_timestep_sampling for one row
    at::Tensor u;
    if (flow && o_.timestep_sampling == "logit_normal") {
      u = at::sigmoid(at::empty({1}, f32).normal_(o_.logit_mean, o_.logit_std, g));
    } else {
      u = at::rand({1}, g, f32);
      if (flow && o_.timestep_sampling == "mode")
        u = 1 - u - o_.mode_scale * (at::cos(M_PI * u / 2).pow(2) - 1 + u);
    }
    noise[static_cast<size_t>(r)] = at::randn(x[r].sizes(), g, f32);
    if (o_.condition_dropout > 0 && at::rand({1}, g, f32).item<float>() < o_.condition_dropout) dropped.push_back(r);
    int64_t i = std::clamp<int64_t>((u * static_cast<float>(T)).to(at::kLong).item<int64_t>(), 0, T - 1);
    if (buckets_ > 0) {  // a timestep uniform in bucket k (the density's u is drawn all the same: same stream)
      const double tau = (static_cast<double>(bucket_) + at::rand({1}, g, f32).item<double>()) /
                         static_cast<double>(buckets_) * static_cast<double>(T);
      if (flow) i = (sigmas_ * static_cast<float>(T) - tau).abs().argmin().item<int64_t>();
      else i = std::clamp<int64_t>(static_cast<int64_t>(tau), 0, T - 1);
    }
    if (flow) {
      const at::Tensor sg = sigmas_.narrow(0, i, 1);
      sigma[static_cast<size_t>(r)] = sg;
      step[static_cast<size_t>(r)] = sg * static_cast<float>(T);
    } else {
      sigma[static_cast<size_t>(r)] = alphas_cumprod_[i].reshape({1});  // (abar, for add_noise)
      step[static_cast<size_t>(r)] = at::full({1}, static_cast<float>(i), f32);
    }
  }
  const at::Tensor eps = at::stack(noise);
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[0] = n;
  const at::Tensor s = at::cat(sigma).view(shape);
  Batch out;
  for (const auto& [name, t] : clean.tensors())
    if (name != "latents") out.set(name, t);
  if (flow) {
    out.set("hidden_states", (1.0 - s) * x + s * eps);
    out.set("target", eps - x);
    const at::Tensor sg = at::cat(sigma);
    if (o_.loss_weighting == "sigma_sqrt") out.set("loss_weight", sg.pow(-2.0));
    else if (o_.loss_weighting == "cosmap") out.set("loss_weight", 2 / (M_PI * (1 - 2 * sg + 2 * sg.pow(2))));
  } else {  // DDPMScheduler.add_noise
    out.set("hidden_states", s.pow(0.5) * x + (1 - s).pow(0.5) * eps);
    out.set("target", eps);
    if (vlb_table_.defined()) {
      const at::Tensor t = at::cat(step).to(at::kLong);
      out.set("x_start", x);
      out.set("vlb_terms", at::cat({vlb_table_.index_select(0, t).to(at::kFloat),
                                    (t == 0).to(at::kFloat).unsqueeze(1),
                                    at::full({n, 1}, o_.vlb_weight, f32)},
                                   1));
    }
  }
  out.set("timestep", at::cat(step));
  if (!dropped.empty()) {
    const at::Tensor rows = at::tensor(dropped, at::kLong);
    const std::map<std::string, at::Tensor> null = inner_->null_conditions();
    if (!null.empty()) {  // the data's own "no condition" (a text encoder's empty prompt)
      for (const auto& [name, u] : null) {
        if (!out.has(name)) throw file_error(where, "negative_" + name, "no condition '" + name + "' in the rows");
        at::Tensor t = out.at(name).clone();
        if (u.sizes().slice(1) != t.sizes().slice(1))
          throw file_error(where, "negative_" + name, "shape does not match the rows' " + name);
        t.index_copy_(0, rows, u.to(t.scalar_type()).expand_as(t.index_select(0, rows)).contiguous());
        out.set(name, t);
      }
    } else {
      if (!model_) throw Error("diffusion objective: condition dropout needs the model's unconditional inputs");
      std::map<std::string, at::Tensor> cond;
      for (const auto& [name, t] : clean.tensors())
        if (name != "latents" && !Batch::is_item_index(name)) cond[name] = t;
      const auto uncond = model_->unconditional(cond, where);
      for (const auto& [name, u] : uncond) {
        at::Tensor t = out.at(name).clone();
        t.index_copy_(0, rows, u.index_select(0, rows).to(t.scalar_type()));
        out.set(name, t);
      }
    }
  }
  return out;
}

namespace {
std::vector<int64_t> iota(int64_t base, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = base + i;
  return v;
}
}  // namespace

Batch DiffusionObjectiveSource::next(int64_t b) {
  Batch clean = inner_->next(b);
  Batch out = make(clean, iota(rows_, b));
  rows_ += b;
  return out;
}

Batch DiffusionObjectiveSource::next_rows(int64_t global_rows, int64_t first, int64_t n) {
  Batch clean = inner_->next_rows(global_rows, first, n);
  Batch out = make(clean, iota(rows_ + first, n));
  rows_ += global_rows;
  return out;
}

std::vector<data::RowShape> DiffusionObjectiveSource::draw(int64_t global_rows) {
  drawn_base_ = rows_;
  rows_ += global_rows;
  return inner_->draw(global_rows);
}

Batch DiffusionObjectiveSource::take(const std::vector<int64_t>& which) {
  std::vector<int64_t> index;
  for (int64_t w : which) index.push_back(drawn_base_ + w);
  return make(inner_->take(which), index);
}

void DiffusionObjectiveSource::restore(const nlohmann::json& state) {
  inner_->restore(state.at("inner"));
  rows_ = state.at("rows").get<int64_t>();
}

}  // namespace lf::train

#include "loongforge/optim/adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sstream>

#include "loongforge/core/error.h"
#include "loongforge/kernels/cuda_ops.h"

namespace lf::optim {

AdamWOptions AdamWOptions::parse(const std::string& spec) {
  AdamWOptions o;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == std::string::npos) throw Error("--adamw: expected key=value, got '" + item + "'");
    std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    double x;
    try {
      size_t used = 0;
      x = std::stod(v, &used);
      if (used != v.size()) throw std::invalid_argument(v);
    } catch (const std::exception&) {
      throw Error("--adamw: field '" + k + "': not a number: '" + v + "'");
    }
    if (k == "lr") o.lr = x;
    else if (k == "beta1") o.beta1 = x;
    else if (k == "beta2") o.beta2 = x;
    else if (k == "eps") o.eps = x;
    else if (k == "weight_decay" || k == "wd") o.weight_decay = x;
    else throw Error("--adamw: unknown field '" + k + "' (lr, beta1, beta2, eps, weight_decay)");
  }
  return o;
}

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions opts, std::vector<double> weight_decay)
    : params_(std::move(params)), wd_(std::move(weight_decay)), opts_(opts) {
  if (wd_.empty()) wd_.assign(params_.size(), opts_.weight_decay);
  TORCH_CHECK(wd_.size() == params_.size(), "AdamW: one weight decay per parameter");
  for (const auto& p : params_) {
    m_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    v_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
  }
}

namespace {
// torch's _single_tensor_adamw, element by element in the parameter's precision (float32 scalars for float32):
//   p *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = v*b2 + (1-b2)*g*g;
//   p += -(lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
// One span [0, n); gscale != 1 scales each gradient first (fused gradient clipping: g * coef as g.mul_(coef)).
template <typename T>
void adamw_span(T* p, const T* g, T* m, T* v, int64_t n, T decay, T w, T b2t, T one_minus_b2, T neg_step_size,
                T bc2_sqrt, T eps_t, T gscale) {
  for (int64_t i = 0; i < n; ++i) {
    T pi = p[i] * decay;
    T gi = gscale != T(1) ? g[i] * gscale : g[i];
    T mi = m[i];
    mi = (w < T(0.5)) ? mi + w * (gi - mi) : gi - (gi - mi) * (T(1) - w);
    T vi = v[i] * b2t + one_minus_b2 * gi * gi;
    T denom = std::sqrt(vi) / bc2_sqrt + eps_t;
    p[i] = pi + neg_step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
  }
}

#if defined(__x86_64__)
// The same arithmetic, 8 floats at a time (AVX2 without FMA, so no product is fused into an addition: the results
// are bitwise those of the scalar loop). std::sqrt in the scalar loop is not vectorised (errno).
__attribute__((target("avx2"))) void adamw_span_avx2(float* p, const float* g, float* m, float* v, int64_t n,
                                                     float decay, float w, float b2t, float one_minus_b2,
                                                     float neg_step_size, float bc2_sqrt, float eps_t, float gscale) {
  const __m256 vdecay = _mm256_set1_ps(decay), vw = _mm256_set1_ps(w), vomw = _mm256_set1_ps(1.0f - w);
  const __m256 vb2 = _mm256_set1_ps(b2t), vomb2 = _mm256_set1_ps(one_minus_b2), vstep = _mm256_set1_ps(neg_step_size);
  const __m256 vbc2 = _mm256_set1_ps(bc2_sqrt), veps = _mm256_set1_ps(eps_t), vgs = _mm256_set1_ps(gscale);
  const bool small_w = w < 0.5f, scale = gscale != 1.0f;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), vdecay);
    __m256 gi = _mm256_loadu_ps(g + i);
    if (scale) gi = _mm256_mul_ps(gi, vgs);
    __m256 mi = _mm256_loadu_ps(m + i);
    mi = small_w ? _mm256_add_ps(mi, _mm256_mul_ps(vw, _mm256_sub_ps(gi, mi)))
                 : _mm256_sub_ps(gi, _mm256_mul_ps(_mm256_sub_ps(gi, mi), vomw));
    __m256 vi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), vb2), _mm256_mul_ps(_mm256_mul_ps(vomb2, gi), gi));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), vbc2), veps);
    _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_mul_ps(vstep, _mm256_div_ps(mi, denom))));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
  }
  adamw_span<float>(p + i, g + i, m + i, v + i, n - i, decay, w, b2t, one_minus_b2, neg_step_size, bc2_sqrt, eps_t,
                    gscale);
}
bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}
#endif

template <typename T>
void adamw_kernel(T* p, const T* g, T* m, T* v, int64_t n, double lr, double b1, double b2, double eps, double wd,
                  int64_t step, double grad_scale) {
  const T decay = static_cast<T>(1 - lr * wd);
  const T w = static_cast<T>(1 - b1);
  const T b2t = static_cast<T>(b2), one_minus_b2 = static_cast<T>(1 - b2);
  const double bc1 = 1 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(b2, static_cast<double>(step));
  const T neg_step_size = static_cast<T>(-(lr / bc1));
  const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T eps_t = static_cast<T>(eps);
  const T gscale = static_cast<T>(grad_scale);
  at::parallel_for(0, n, 2048, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if constexpr (std::is_same_v<T, float>) {
      if (use_avx2())
        return adamw_span_avx2(p + begin, g + begin, m + begin, v + begin, end - begin, decay, w, b2t, one_minus_b2,
                               neg_step_size, bc2_sqrt, eps_t, gscale);
    }
#endif
    adamw_span<T>(p + begin, g + begin, m + begin, v + begin, end - begin, decay, w, b2t, one_minus_b2, neg_step_size,
                  bc2_sqrt, eps_t, gscale);
  });
}
}  // namespace

namespace {
// Every parameter with a gradient a float32 CUDA tensor on one device (and its gradient contiguous of one float
// dtype): the multi-tensor CUDA kernel (kernels/cuda/adamw.cu) does the whole step in one launch.
bool cuda_multi_tensor(const std::vector<at::Tensor>& params) {
  std::optional<at::Device> dev;
  std::optional<at::ScalarType> gt;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    const at::Tensor& g = p.grad();
    if (!kernels::cuda::supported(p) || p.scalar_type() != at::kFloat || !p.is_contiguous() ||
        !kernels::cuda::supported(g) || g.device() != p.device())
      return false;
    if (dev && *dev != p.device()) return false;
    if (gt && *gt != g.scalar_type()) return false;
    dev = p.device();
    gt = g.scalar_type();
  }
  return dev.has_value();
}
}  // namespace

void AdamW::set_lr_scale(std::vector<double> scale) {
  TORCH_CHECK(scale.empty() || scale.size() == params_.size(), "AdamW: one learning-rate scale per parameter");
  lr_scale_ = std::move(scale);
}

void AdamW::step(std::optional<double> lr, double grad_scale) {
  ++step_;
  const double rate = lr.value_or(opts_.lr);
  const bool cpu_fused = std::all_of(params_.begin(), params_.end(), [](const at::Tensor& p) {
    return !p.grad().defined() || (p.device().is_cpu() && (p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble));
  });
  if (grad_scale != 1.0 && !cpu_fused) {  // other paths: scale the gradients first (as clip_grad_norm does)
    at::NoGradGuard no_grad;
    for (auto& p : params_)
      if (p.grad().defined()) p.mutable_grad().mul_(grad_scale);
    grad_scale = 1.0;
  }
  auto scale_of = [&](size_t i) { return lr_scale_.empty() ? 1.0 : lr_scale_[i]; };
  if (cuda_multi_tensor(params_)) {  // one launch per learning-rate scale
    std::map<double, std::vector<size_t>> by_scale;
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].grad().defined()) by_scale[scale_of(i)].push_back(i);
    at::NoGradGuard no_grad;
    for (const auto& [scale, idx] : by_scale) {
      std::vector<at::Tensor> ps, gs, ms, vs;
      std::vector<double> wds;
      for (size_t i : idx) {
        ps.push_back(params_[i]);
        gs.push_back(params_[i].grad().contiguous());
        ms.push_back(m_[i]);
        vs.push_back(v_[i]);
        wds.push_back(wd_[i]);
      }
      kernels::cuda::multi_tensor_adamw(ps, gs, ms, vs, {rate * scale, opts_.beta1, opts_.beta2, opts_.eps, step_},
                                        wds);
    }
    update_ema();
    return;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    at::NoGradGuard no_grad;
    at::Tensor g = p.grad().contiguous();
    TORCH_CHECK(p.is_contiguous(), "AdamW: parameters must be contiguous");
    const double rate_i = rate * scale_of(i);
    if (p.device().is_cpu() && (p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble)) {
      AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "adamw", [&] {
        adamw_kernel<scalar_t>(p.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), m_[i].data_ptr<scalar_t>(),
                               v_[i].data_ptr<scalar_t>(), p.numel(), rate_i, opts_.beta1, opts_.beta2, opts_.eps,
                               wd_[i], step_, grad_scale);
      });
    } else {  // composite path (other devices/dtypes), same formula
      p.mul_(1 - rate_i * wd_[i]);
      m_[i].lerp_(g, 1 - opts_.beta1);
      v_[i].mul_(opts_.beta2).addcmul_(g, g, 1 - opts_.beta2);
      double bc1 = 1 - std::pow(opts_.beta1, static_cast<double>(step_));
      double bc2 = 1 - std::pow(opts_.beta2, static_cast<double>(step_));
      at::Tensor denom = (v_[i].sqrt() / std::sqrt(bc2)).add_(opts_.eps);
      p.addcdiv_(m_[i], denom, -(rate_i / bc1));
    }
  }
  update_ema();
}

double EmaOptions::decay_at(int64_t s) const {
  if (warmup == "none") return s <= update_after_step ? 0.0 : std::max(decay, min_decay);
  const int64_t k = std::max<int64_t>(0, s - update_after_step - 1);
  if (k <= 0) return 0.0;
  const double kk = static_cast<double>(k);
  double d = decay;
  if (warmup == "ramp") d = std::min(decay, (1 + kk) / (10 + kk));
  else if (warmup == "power") d = std::min(decay, 1 - std::pow(1 + kk / inv_gamma, -power));
  return std::max(d, min_decay);
}

void AdamW::enable_ema(const EmaOptions& o) {
  TORCH_CHECK(o.warmup == "ramp" || o.warmup == "power" || o.warmup == "none", "AdamW: EMA warmup ramp, power or none");
  ema_opts_ = o;
  ema_.clear();
  at::NoGradGuard no_grad;
  for (const auto& p : params_) ema_.push_back(p.detach().clone(at::MemoryFormat::Contiguous));
}

void AdamW::update_ema() {
  if (ema_.empty()) return;
  at::NoGradGuard no_grad;
  const double one_minus = 1 - ema_opts_.decay_at(step_);
  for (size_t i = 0; i < params_.size(); ++i) ema_[i].sub_(ema_[i] - params_[i], one_minus);
}

void AdamW::zero_grad(bool set_to_none) {
  std::vector<at::Tensor> grads;
  for (auto& p : params_) {
    if (!p.grad().defined()) continue;
    if (set_to_none) p.mutable_grad() = at::Tensor();
    else grads.push_back(p.mutable_grad());
  }
  if (!grads.empty()) at::_foreach_zero_(grads);
}

namespace {
// CPU (and other non-multi-tensor) gradients: the global 2-norm and, when max_norm > 0, torch's clipping coefficient
// min(1, max_norm / (norm + 1e-6)) in the gradients' precision.
std::pair<at::Tensor, at::Tensor> norm_and_coef(const std::vector<at::Tensor>& grads, double max_norm) {
  std::vector<at::Tensor> norms;
  for (const auto& g : grads) norms.push_back(at::linalg_vector_norm(g, 2));
  at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  return {total, max_norm > 0 ? at::clamp_max(max_norm / (total + 1e-6), 1.0) : at::Tensor()};
}
std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  return grads;
}
}  // namespace

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads = grads_of(params);
  if (grads.empty()) return 0.0;
  at::NoGradGuard no_grad;
  const bool cuda = std::all_of(grads.begin(), grads.end(), [&](const at::Tensor& g) {
    return kernels::cuda::supported(g) && g.is_contiguous() && g.device() == grads[0].device();
  });
  if (cuda) {  // one multi-tensor launch per dtype for the norm, one foreach multiply for clipping
    at::Tensor total = kernels::cuda::multi_tensor_l2norm(grads);
    if (max_norm > 0) at::_foreach_mul_(grads, kernels::cuda::clip_coef(total, max_norm));
    return total.item<double>();
  }
  auto [total, coef] = norm_and_coef(grads, max_norm);
  if (coef.defined())
    for (auto& g : grads) g.mul_(coef);
  return total.item<double>();
}

std::pair<double, double> grad_norm_and_clip_coef(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads = grads_of(params);
  if (grads.empty()) return {0.0, 1.0};
  if (!std::all_of(grads.begin(), grads.end(), [](const at::Tensor& g) { return g.device().is_cpu(); }))
    return {clip_grad_norm(params, max_norm), 1.0};
  at::NoGradGuard no_grad;
  auto [total, coef] = norm_and_coef(grads, max_norm);
  return {total.item<double>(), coef.defined() ? coef.item<double>() : 1.0};
}

}  // namespace lf::optim

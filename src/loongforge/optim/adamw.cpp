#include "loongforge/optim/adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
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
template <typename T>
void adamw_kernel(T* p, const T* g, T* m, T* v, int64_t n, double lr, double b1, double b2, double eps, double wd,
                  int64_t step) {
  const T decay = static_cast<T>(1 - lr * wd);
  const T w = static_cast<T>(1 - b1);
  const T b2t = static_cast<T>(b2), one_minus_b2 = static_cast<T>(1 - b2);
  const double bc1 = 1 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(b2, static_cast<double>(step));
  const T neg_step_size = static_cast<T>(-(lr / bc1));
  const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T eps_t = static_cast<T>(eps);
  at::parallel_for(0, n, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T pi = p[i] * decay;
      T gi = g[i];
      T mi = m[i];
      mi = (w < T(0.5)) ? mi + w * (gi - mi) : gi - (gi - mi) * (T(1) - w);
      T vi = v[i] * b2t + one_minus_b2 * gi * gi;
      T denom = std::sqrt(vi) / bc2_sqrt + eps_t;
      p[i] = pi + neg_step_size * (mi / denom);
      m[i] = mi;
      v[i] = vi;
    }
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

void AdamW::step(std::optional<double> lr) {
  ++step_;
  const double rate = lr.value_or(opts_.lr);
  if (cuda_multi_tensor(params_)) {
    std::vector<at::Tensor> ps, gs, ms, vs;
    std::vector<double> wds;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].grad().defined()) continue;
      ps.push_back(params_[i]);
      gs.push_back(params_[i].grad().contiguous());
      ms.push_back(m_[i]);
      vs.push_back(v_[i]);
      wds.push_back(wd_[i]);
    }
    at::NoGradGuard no_grad;
    kernels::cuda::multi_tensor_adamw(ps, gs, ms, vs, {rate, opts_.beta1, opts_.beta2, opts_.eps, step_}, wds);
    return;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    at::NoGradGuard no_grad;
    at::Tensor g = p.grad().contiguous();
    TORCH_CHECK(p.is_contiguous(), "AdamW: parameters must be contiguous");
    if (p.device().is_cpu() && (p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble)) {
      AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "adamw", [&] {
        adamw_kernel<scalar_t>(p.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), m_[i].data_ptr<scalar_t>(),
                               v_[i].data_ptr<scalar_t>(), p.numel(), rate, opts_.beta1, opts_.beta2, opts_.eps,
                               wd_[i], step_);
      });
    } else {  // composite path (other devices/dtypes), same formula
      p.mul_(1 - rate * wd_[i]);
      m_[i].lerp_(g, 1 - opts_.beta1);
      v_[i].mul_(opts_.beta2).addcmul_(g, g, 1 - opts_.beta2);
      double bc1 = 1 - std::pow(opts_.beta1, static_cast<double>(step_));
      double bc2 = 1 - std::pow(opts_.beta2, static_cast<double>(step_));
      at::Tensor denom = (v_[i].sqrt() / std::sqrt(bc2)).add_(opts_.eps);
      p.addcdiv_(m_[i], denom, -(rate / bc1));
    }
  }
}

void AdamW::zero_grad() {
  for (auto& p : params_)
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads, norms;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
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
  for (const auto& g : grads) norms.push_back(at::linalg_vector_norm(g, 2));
  at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  if (max_norm > 0) {
    at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
    for (auto& g : grads) g.mul_(coef);
  }
  return total.item<double>();
}

}  // namespace lf::optim

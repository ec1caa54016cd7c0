// Normalisation modes (normalize.h).
#include "loongforge/data/robot/normalize.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>

#include "loongforge/core/error.h"

namespace lf::data::robot {

NormMode parse_norm_mode(const std::string& text) {
  std::string up = text;
  std::transform(up.begin(), up.end(), up.begin(), [](unsigned char c) { return std::toupper(c); });
  if (up == "IDENTITY") return NormMode::identity;
  if (up == "MEAN_STD") return NormMode::mean_std;
  if (up == "MIN_MAX") return NormMode::min_max;
  if (up == "QUANTILES") return NormMode::quantiles;
  if (up == "QUANTILE10") return NormMode::quantile10;
  throw OptionError("normalization", "unknown mode '" + text +
                                         "' (IDENTITY, MEAN_STD, MIN_MAX, QUANTILES or QUANTILE10)");
}

std::string norm_mode_name(NormMode mode) {
  switch (mode) {
    case NormMode::identity: return "IDENTITY";
    case NormMode::mean_std: return "MEAN_STD";
    case NormMode::min_max: return "MIN_MAX";
    case NormMode::quantiles: return "QUANTILES";
    case NormMode::quantile10: return "QUANTILE10";
  }
  return "?";
}

namespace {

at::Tensor stat(const std::map<std::string, at::Tensor>& stats, const char* key, NormMode mode,
                const std::string& name, const at::Tensor& x) {
  auto it = stats.find(key);
  if (it == stats.end())
    throw Error(name + ": " + norm_mode_name(mode) + " normalisation needs the statistic '" + key +
                "', which the stats lack");
  // LeRobot holds the stats as float32, then moves them to the input's dtype and device.
  return it->second.to(at::kFloat).to(x.device(), x.scalar_type());
}

at::Tensor apply(const at::Tensor& x, const std::map<std::string, at::Tensor>& stats, NormMode mode,
                 const std::string& name, double eps, bool inverse) {
  if (mode == NormMode::identity) return x;
  if (!x.is_floating_point()) throw Error(name + ": normalisation needs floating-point values");
  if (mode == NormMode::mean_std) {
    auto mean = stat(stats, "mean", mode, name, x), std = stat(stats, "std", mode, name, x);
    if (inverse) return x * std + mean;
    return (x - mean) / (std + eps);
  }
  const char* lo_key = mode == NormMode::min_max ? "min" : mode == NormMode::quantiles ? "q01" : "q10";
  const char* hi_key = mode == NormMode::min_max ? "max" : mode == NormMode::quantiles ? "q99" : "q90";
  auto lo = stat(stats, lo_key, mode, name, x), hi = stat(stats, hi_key, mode, name, x);
  auto denom = hi - lo;
  denom = at::where(denom == 0, at::scalar_tensor(eps, x.options()), denom);
  if (mode == NormMode::min_max) {
    if (inverse) return (x + 1) / 2 * denom + lo;
    return 2 * (x - lo) / denom - 1;
  }
  if (inverse) return (x + 1.0) * denom / 2.0 + lo;
  return 2.0 * (x - lo) / denom - 1.0;
}

}  // namespace

at::Tensor normalize(const at::Tensor& x, const std::map<std::string, at::Tensor>& stats, NormMode mode,
                     const std::string& name, double eps) {
  return apply(x, stats, mode, name, eps, false);
}

at::Tensor unnormalize(const at::Tensor& x, const std::map<std::string, at::Tensor>& stats, NormMode mode,
                       const std::string& name, double eps) {
  return apply(x, stats, mode, name, eps, true);
}

Normalizer::Normalizer(Stats stats, std::map<std::string, NormMode> modes, double eps)
    : stats_(std::move(stats)), modes_(std::move(modes)), eps_(eps) {
  for (const auto& [name, mode] : modes_)
    if (mode != NormMode::identity && !stats_.count(name))
      throw Error(name + ": " + norm_mode_name(mode) + " normalisation, but the stats have no entry for it");
}

at::Tensor Normalizer::normalize(const std::string& feature, const at::Tensor& x) const {
  auto it = modes_.find(feature);
  if (it == modes_.end() || it->second == NormMode::identity) return x;
  return apply(x, stats_.at(feature), it->second, feature, eps_, false);
}

at::Tensor Normalizer::unnormalize(const std::string& feature, const at::Tensor& x) const {
  auto it = modes_.find(feature);
  if (it == modes_.end() || it->second == NormMode::identity) return x;
  return apply(x, stats_.at(feature), it->second, feature, eps_, true);
}

void Normalizer::normalize(std::map<std::string, at::Tensor>& batch) const {
  for (auto& [name, t] : batch) t = normalize(name, t);
}

void Normalizer::unnormalize(std::map<std::string, at::Tensor>& batch) const {
  for (auto& [name, t] : batch) t = unnormalize(name, t);
}

}  // namespace lf::data::robot

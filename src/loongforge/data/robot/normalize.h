// Normalisation of robot features from their statistics, as LeRobot's NormalizerProcessorStep /
// UnnormalizerProcessorStep (lerobot/processor/normalize_processor.py) compute it, operation for operation:
//   MEAN_STD:   (x - mean) / (std + eps);                inverse x * std + mean
//   MIN_MAX:    2 * (x - min) / d - 1, d = max - min;     inverse (x + 1) / 2 * d + min
//   QUANTILES:  2 * (x - q01) / d - 1, d = q99 - q01;     inverse (x + 1) * d / 2 + q01   (pi0.5's choice)
//   QUANTILE10: the same with q10 / q90
// where a zero d becomes eps. The statistics are cast to float32 (LeRobot's processor dtype) and then to x's dtype
// before use, and broadcast against x ([..., D] for vectors; [..., C, H, W] for cameras with [C, 1, 1] stats).
// Unlike LeRobot, a feature given a mode other than IDENTITY but no statistics is an error, not left unchanged.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "loongforge/data/robot/dataset.h"

namespace lf::data::robot {

enum class NormMode { identity, mean_std, min_max, quantiles, quantile10 };

// "IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10" (LeRobot's NormalizationMode values; any case).
NormMode parse_norm_mode(const std::string& text);
std::string norm_mode_name(NormMode mode);

// One feature: STATS is that feature's {stat: tensor}; NAME only names it in errors.
at::Tensor normalize(const at::Tensor& x, const std::map<std::string, at::Tensor>& stats, NormMode mode,
                     const std::string& name, double eps = 1e-8);
at::Tensor unnormalize(const at::Tensor& x, const std::map<std::string, at::Tensor>& stats, NormMode mode,
                       const std::string& name, double eps = 1e-8);

// Per feature: a mode for each feature named in MODES (others pass through unchanged).
class Normalizer {
 public:
  Normalizer(Stats stats, std::map<std::string, NormMode> modes, double eps = 1e-8);
  at::Tensor normalize(const std::string& feature, const at::Tensor& x) const;
  at::Tensor unnormalize(const std::string& feature, const at::Tensor& x) const;
  // Every tensor of BATCH whose name has a mode.
  void normalize(std::map<std::string, at::Tensor>& batch) const;
  void unnormalize(std::map<std::string, at::Tensor>& batch) const;

 private:
  Stats stats_;
  std::map<std::string, NormMode> modes_;
  double eps_;
};

}  // namespace lf::data::robot

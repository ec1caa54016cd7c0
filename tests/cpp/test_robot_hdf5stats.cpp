// HDF5 episodes, statistics, normalisation and image transforms (data/robot/{hdf5_episodes,stats,normalize,
// transforms}). The values are checked against h5py, LeRobot and torchvision by the Python tests, which run the
// hooks below (gtests that skip unless their environment variables are set).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include "loongforge/core/error.h"
#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/robot/normalize.h"
#include "loongforge/data/robot/stats.h"
#include "loongforge/data/robot/transforms.h"
#include "loongforge/io/safetensors.h"

using namespace lf::data::robot;

namespace {

const char* env(const char* name) { return std::getenv(name); }

}  // namespace

// Every numeric column and every camera frame of every episode, as the reader gives them, for
// tests/python/test_robot_hdf5.py to compare with h5py: ep{P}.{feature} (the whole episode), ep{P}.{feature}.part
// (frames [1, length - 1)), ep{P}.{camera}.picked (frames length-1, 0, 0, length/2: any order, repeats); "episodes"
// [E, 3] (episode_index, length, from); "fps". Read from 4 threads at once (the reader serialises libhdf5).
TEST(RobotHdf5, ReadToSafetensors) {
  const char* path = env("LF_ROBOT_HDF5");
  const char* out = env("LF_ROBOT_OUT");
  if (!path || !out) GTEST_SKIP() << "run by tests/python/test_robot_hdf5.py";
  const char* fps = env("LF_ROBOT_FPS");
  auto ds = fps ? open_hdf5_dataset(path, std::stod(fps)) : open_robot_dataset(path);
  const auto& eps = ds->episodes();
  std::vector<lf::io::NamedTensors> per(eps.size());
  std::vector<std::thread> threads;
  std::vector<std::string> errors(eps.size());
  for (size_t t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (size_t p = t; p < eps.size(); p += 4) {
        try {
          const std::string pre = "ep" + std::to_string(p) + ".";
          const int64_t len = eps[p].length;
          for (const auto& f : ds->features()) {
            if (f.kind == FeatureKind::numeric) {
              per[p].emplace_back(pre + f.name, ds->read_numeric({f.name}, p, 0, len)[0]);
              if (len >= 2) per[p].emplace_back(pre + f.name + ".part", ds->read_numeric({f.name}, p, 1, len - 1)[0]);
            } else {
              std::vector<int64_t> all(len);
              for (int64_t i = 0; i < len; ++i) all[i] = i;
              per[p].emplace_back(pre + f.name, ds->read_camera(f.name, p, all));
              per[p].emplace_back(pre + f.name + ".picked", ds->read_camera(f.name, p, {len - 1, 0, 0, len / 2}));
            }
          }
        } catch (const std::exception& e) {
          errors[p] = e.what();
        }
      }
    });
  for (auto& th : threads) th.join();
  for (const auto& e : errors) ASSERT_EQ(e, "");
  lf::io::NamedTensors all;
  auto meta = at::empty({static_cast<int64_t>(eps.size()), 3}, at::kLong);
  for (size_t p = 0; p < eps.size(); ++p) {
    meta[p][0] = eps[p].index;
    meta[p][1] = eps[p].length;
    meta[p][2] = eps[p].from;
    for (auto& nt : per[p]) all.push_back(std::move(nt));
  }
  all.emplace_back("episodes", meta);
  all.emplace_back("fps", at::full({1}, ds->fps(), at::kDouble));
  std::string names;
  for (const auto& f : ds->features()) {
    std::string shape;
    for (auto s : f.shape) shape += (shape.empty() ? "" : ",") + std::to_string(s);
    names += (names.empty() ? "" : ";") + f.name + ":" + f.dtype + ":" + shape;
  }
  lf::io::save_file(out, all, {{"features", names}, {"format", ds->format()}});
}

// Normalisation oracle for tests/python/test_robot_transforms.py: LF_NORM_IN holds x.{feature} and
// stats.{feature}.{stat}; writes norm.{MODE}.{feature} and unnorm.{MODE}.{feature} for every mode.
TEST(RobotNormalize, Oracle) {
  const char* in = env("LF_NORM_IN");
  const char* out = env("LF_NORM_OUT");
  if (!in || !out) GTEST_SKIP() << "run by tests/python/test_robot_transforms.py";
  auto file = lf::io::SafetensorsFile::open(in);
  Stats stats;
  std::map<std::string, at::Tensor> xs;
  for (const auto& e : file->entries()) {
    if (e.name.rfind("x.", 0) == 0) xs[e.name.substr(2)] = file->tensor(e.name);
    if (e.name.rfind("stats.", 0) == 0) {
      auto rest = e.name.substr(6);
      auto dot = rest.rfind('.');
      stats[rest.substr(0, dot)][rest.substr(dot + 1)] = file->tensor(e.name);
    }
  }
  lf::io::NamedTensors res;
  for (const char* m : {"IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"}) {
    std::map<std::string, NormMode> modes;
    for (const auto& [name, x] : xs) modes[name] = parse_norm_mode(m);
    Normalizer norm(stats, modes);
    for (const auto& [name, x] : xs) {
      res.emplace_back(std::string("norm.") + m + "." + name, norm.normalize(name, x).contiguous());
      res.emplace_back(std::string("unnorm.") + m + "." + name, norm.unnormalize(name, x).contiguous());
    }
  }
  lf::io::save_file(out, res);
}

// Image transform oracle for tests/python/test_robot_transforms.py: LF_TF_IN holds u8 (uint8 [B, 3, H, W]) and f32
// (float [B, 3, H, W] in [0, 1]); writes each operation's output for both, and seeded plans with their outputs.
TEST(RobotTransforms, Oracle) {
  const char* in = env("LF_TF_IN");
  const char* out = env("LF_TF_OUT");
  if (!in || !out) GTEST_SKIP() << "run by tests/python/test_robot_transforms.py";
  auto file = lf::io::SafetensorsFile::open(in);
  lf::io::NamedTensors res;
  for (const char* kind : {"u8", "f32"}) {
    auto x = file->tensor(kind);
    const std::string k = kind;
    for (double f : {0.0, 0.5, 0.8, 1.2, 1.7}) {
      auto fs = std::to_string(f).substr(0, 3);
      res.emplace_back(k + ".brightness." + fs, adjust_brightness(x, f));
      res.emplace_back(k + ".contrast." + fs, adjust_contrast(x, f));
      res.emplace_back(k + ".saturation." + fs, adjust_saturation(x, f));
    }
    for (double f : {-0.5, -0.25, -0.05, 0.0, 0.05, 0.3, 0.5}) {
      res.emplace_back(k + ".hue." + std::to_string(f).substr(0, f < 0 ? 5 : 4), adjust_hue(x, f));
    }
    for (double f : {0.0, 0.5, 1.0, 1.5, 2.7})
      res.emplace_back(k + ".sharpness." + std::to_string(f).substr(0, 3), adjust_sharpness(x, f));
    // H <= 2: unchanged
    res.emplace_back(k + ".sharpness.tiny", adjust_sharpness(x.narrow(-2, 0, 2), 0.3).contiguous());
    res.emplace_back(k + ".sharpness.5d", adjust_sharpness(x.unsqueeze(0), 0.3).contiguous());
    // affine: (angle, tx, ty, scale, shear x, shear y, bilinear, fill or NaN for none)
    const std::vector<std::array<double, 8>> affines{{3.7, 1, -2, 1, 0, 0, 0, 0},       {-5, 0, 0, 1, 0, 0, 0, NAN},
                                                     {90, 0, 0, 1, 0, 0, 0, 0},         {30, 2, 1, 0.8, 0, 0, 1, NAN},
                                                     {-12.5, -1, 3, 1.3, 10, -5, 1, 0.4}, {7, 0, 0, 1, 0, 0, 0, 1}};
    for (size_t i = 0; i < affines.size(); ++i) {
      const auto& a = affines[i];
      std::optional<double> fill;
      if (!std::isnan(a[7])) fill = k == "u8" ? a[7] * 255 : a[7];
      res.emplace_back(k + ".affine." + std::to_string(i),
                       affine(x, a[0], {a[1], a[2]}, a[3], {a[4], a[5]},
                              a[6] > 0 ? Interpolation::bilinear : Interpolation::nearest, fill)
                           .contiguous());
    }
    res.emplace_back(k + ".center_crop.5x7", center_crop(x, 5, 7).contiguous());
    res.emplace_back(k + ".center_crop.20x9", center_crop(x, 20, 9).contiguous());
    res.emplace_back(k + ".crop.2.3.6x5", crop(x, 2, 3, 6, 5).contiguous());
    res.emplace_back(k + ".crop.-2.9.8x6", crop(x, -2, 9, 8, 6).contiguous());
    res.emplace_back(k + ".pad_center.24x24", resize_with_pad(x, 24, 24, PadAlign::center).contiguous());
    res.emplace_back(k + ".pad_center.10x31", resize_with_pad(x, 10, 31, PadAlign::center).contiguous());
    res.emplace_back(k + ".pad_left.24x24", resize_with_pad(x.to(at::kFloat), 24, 24, PadAlign::top_left, -1).contiguous());
    res.emplace_back(k + ".pad_left.7x20", resize_with_pad(x.to(at::kFloat), 7, 20, PadAlign::top_left, -1).contiguous());
    // Seeded plans: the factors and offsets they drew, and what applying them gave.
    ImageTransformsConfig cfg;
    cfg.enable = true;
    cfg.max_num_transforms = 5;
    cfg.random_order = true;
    cfg.degrees = {-20.0, 25.0};
    cfg.translate = {0.3, 0.2};  // shifts of up to 3 x 2 pixels on the 9x10 crops
    cfg.crop_height = 9;
    cfg.crop_width = 10;
    cfg.random_crop = true;
    for (uint64_t seed : {1u, 2u, 3u}) {
      auto plan = plan_transforms(cfg, seed, x.size(-2), x.size(-1));
      auto y = apply_transforms(x, cfg, plan);
      const std::string pre = k + ".plan" + std::to_string(seed);
      res.emplace_back(pre + ".out", y.contiguous());
      res.emplace_back(pre + ".crop", at::tensor({plan.crop_top, plan.crop_left}, at::kLong));
      std::vector<double> codes;
      for (const auto& [name, f] : plan.jitters) {
        const char* names[] = {"brightness", "contrast", "saturation", "hue", "sharpness", "affine"};
        codes.push_back(std::find(std::begin(names), std::end(names), name) - std::begin(names));
        codes.push_back(f);
      }
      res.emplace_back(pre + ".jitters", at::tensor(codes, at::kDouble));
      res.emplace_back(pre + ".shift", at::tensor({plan.affine_tx, plan.affine_ty}, at::kLong));
    }
  }
  // The defaults, to compare with lerobot's ImageTransformsConfig().
  ImageTransformsConfig d;
  std::vector<double> defaults{static_cast<double>(d.max_num_transforms), d.random_order ? 1.0 : 0.0};
  for (const auto* r : {&d.brightness, &d.contrast, &d.saturation, &d.hue, &d.sharpness, &d.degrees, &d.translate})
    defaults.insert(defaults.end(), r->begin(), r->end());
  defaults.insert(defaults.end(), d.weights.begin(), d.weights.end());
  res.emplace_back("defaults", at::tensor(defaults, at::kDouble));
  lf::io::save_file(out, res);
}

// The plan is a function of the seed alone, and its factors lie in the configured ranges.
TEST(RobotTransforms, PlanIsSeeded) {
  ImageTransformsConfig cfg;
  cfg.enable = true;
  cfg.crop_height = 4;
  cfg.crop_width = 4;
  cfg.random_crop = true;
  bool differs = false;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto a = plan_transforms(cfg, seed, 10, 12), b = plan_transforms(cfg, seed, 10, 12);
    auto c = plan_transforms(cfg, seed + 100, 10, 12);
    EXPECT_EQ(a.jitters, b.jitters);
    EXPECT_EQ(a.crop_top, b.crop_top);
    differs = differs || a.jitters != c.jitters;
    EXPECT_EQ(a.jitters.size(), 3u);
    EXPECT_TRUE(a.crop_top >= 0 && a.crop_top <= 6 && a.crop_left >= 0 && a.crop_left <= 8);
    // affine's shift: round(uniform(-0.05 * 4, 0.05 * 4)) pixels on the 4x4 crop -> 0
    EXPECT_TRUE(a.affine_tx == 0 && a.affine_ty == 0);
    for (const auto& [name, f] : a.jitters) {
      const auto& r = name == "brightness"   ? cfg.brightness
                      : name == "contrast"   ? cfg.contrast
                      : name == "saturation" ? cfg.saturation
                      : name == "sharpness"  ? cfg.sharpness
                      : name == "affine"     ? cfg.degrees
                                             : cfg.hue;
      EXPECT_TRUE(f >= r[0] && f <= r[1]) << name << " " << f;
    }
  }
  EXPECT_TRUE(differs);
  cfg.hue = {-0.7, 0.1};
  EXPECT_THROW(plan_transforms(cfg, 0, 10, 12), lf::OptionError);
}

// normalize then unnormalize gives the input back (to float32 rounding), for every mode.
TEST(RobotNormalize, RoundTrip) {
  auto x = at::randn({5, 4}, at::kFloat);
  auto data = at::randn({50, 4}, at::kDouble) * 3 + 1;
  Stats stats;
  stats["a"] = to_stats({{"a", numeric_stats(data)}}).at("a");
  for (const char* m : {"MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"}) {
    Normalizer n(stats, {{"a", parse_norm_mode(m)}});
    EXPECT_TRUE(at::allclose(n.unnormalize("a", n.normalize("a", x)), x, 1e-5, 1e-5)) << m;
  }
  EXPECT_THROW(parse_norm_mode("MEANSTD"), lf::Error);
  EXPECT_THROW(Normalizer(stats, {{"b", NormMode::mean_std}}), lf::Error);
}

// stats.json round trip.
TEST(RobotStats, JsonRoundTrip) {
  auto data = at::randn({30, 3}, at::kFloat);
  Stats s = to_stats({{"observation.state", numeric_stats(data)}});
  Stats back = stats_from_json(stats_to_json(s), "stats.json");
  ASSERT_EQ(back.size(), 1u);
  for (const auto& [k, v] : s.at("observation.state")) EXPECT_TRUE(at::equal(back.at("observation.state").at(k), v)) << k;
}

// Image transforms for robot-policy training, on camera frames laid out [..., C, H, W] (torchvision's layout; C = 1
// or 3), uint8 or float in [0, 1]. The colour, sharpness and affine operations compute what
// torchvision.transforms.v2.functional's adjust_brightness / adjust_contrast / adjust_saturation / adjust_hue /
// adjust_sharpness / affine compute for the same arguments, operation for operation; resize_with_pad is openpi's
// resize_with_pad_torch (pi0 / pi0.5: bilinear, centred black padding) or LeRobot's resize_with_pad (smolvla:
// padding on the left and top with a given value).
// Random choices (which jitters, their factors, crop offsets) come from a seed alone: the same seed gives the
// same plan on every machine (a plan is made first, then applied, so a loader can record or replay it).
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lf::data::robot {

at::Tensor adjust_brightness(const at::Tensor& images, double factor);
at::Tensor adjust_contrast(const at::Tensor& images, double factor);
at::Tensor adjust_saturation(const at::Tensor& images, double factor);
at::Tensor adjust_hue(const at::Tensor& images, double factor);  // factor in [-0.5, 0.5]
// 0: blurred (a 3x3 smoothing kernel, borders kept), 1: the image, 2: sharpened.
at::Tensor adjust_sharpness(const at::Tensor& images, double factor);

// torchvision's affine: rotation by ANGLE degrees (counter-clockwise) about the centre, then a shift by TRANSLATE
// pixels (x, y), with SCALE and SHEAR (degrees, x and y); pixels from outside the image are FILL (none: zero, as
// grid_sample's zero padding).
enum class Interpolation { nearest, bilinear };
at::Tensor affine(const at::Tensor& images, double angle, std::array<double, 2> translate, double scale = 1.0,
                  std::array<double, 2> shear = {0.0, 0.0}, Interpolation interpolation = Interpolation::nearest,
                  std::optional<double> fill = std::nullopt);

// torchvision's center_crop (zero padding first when the crop is larger than the image) and crop.
at::Tensor center_crop(const at::Tensor& images, int64_t height, int64_t width);
at::Tensor crop(const at::Tensor& images, int64_t top, int64_t left, int64_t height, int64_t width);

enum class PadAlign {
  center,    // openpi's resize_with_pad_torch: uint8 rounded and clamped, float clamped to [0, 1], zero padding
  top_left,  // LeRobot's resize_with_pad (smolvla): padding on the left and top with PAD_VALUE
};
at::Tensor resize_with_pad(const at::Tensor& images, int64_t height, int64_t width, PadAlign align = PadAlign::center,
                           double pad_value = 0.0);

// The knobs, named as the recipe keys will be (data.image_transforms.*). The jitters are LeRobot's
// ImageTransformsConfig's (lerobot 0.6.1's defaults): each training frame gets up to max_num_transforms of the enabled
// jitters (picked by weight without replacement), in this order unless random_order, each with a factor drawn
// uniformly from its range; affine is torchvision's RandomAffine(degrees, translate): an angle drawn from DEGREES and
// a shift of round(uniform(-t * size, t * size)) pixels per axis (nearest neighbour, fill 0).
struct ImageTransformsConfig {
  bool enable = false;
  int max_num_transforms = 3;
  bool random_order = false;
  std::array<double, 2> brightness{0.8, 1.2}, contrast{0.8, 1.2}, saturation{0.5, 1.5}, hue{-0.05, 0.05},
      sharpness{0.5, 1.5};
  std::array<double, 2> degrees{-5.0, 5.0}, translate{0.05, 0.05};  // affine: angle range; max shift (x, y) / size
  // brightness, contrast, saturation, hue, sharpness, affine (0: never)
  std::array<double, 6> weights{1.0, 1.0, 1.0, 1.0, 1.0, 1.0};
  // Geometry, applied before the jitters on every frame: a crop (0: none), then resize with padding (0: none).
  int64_t crop_height = 0, crop_width = 0;
  bool random_crop = false;  // random offsets (training) instead of the centre
  int64_t resize_height = 0, resize_width = 0;
  PadAlign resize_align = PadAlign::center;
  double pad_value = 0.0;
};

// One frame's transforms, drawn from a seed.
struct TransformPlan {
  int64_t crop_top = -1, crop_left = -1;  // -1: centre crop (or no crop)
  // ("brightness" | "contrast" | "saturation" | "hue" | "sharpness" | "affine", factor; affine: the angle)
  std::vector<std::pair<std::string, double>> jitters;
  int64_t affine_tx = 0, affine_ty = 0;  // affine's shift in pixels (x, y)
};

// The plan for images of HEIGHT x WIDTH (affine's shift is drawn for the size after the crop and resize). Throws
// lf::OptionError naming the knob when the config is invalid.
TransformPlan plan_transforms(const ImageTransformsConfig& config, uint64_t seed, int64_t height, int64_t width);
at::Tensor apply_transforms(const at::Tensor& images, const ImageTransformsConfig& config, const TransformPlan& plan);
// plan_transforms then apply_transforms (no-op unless config.enable).
at::Tensor transform_images(const at::Tensor& images, const ImageTransformsConfig& config, uint64_t seed);

}  // namespace lf::data::robot

// Hugging Face image processors, as transformers 5.24 computes them: what
// `AutoImageProcessor.from_pretrained(dir)(images, return_tensors="pt")` returns, read from the model folder's
// preprocessor_config.json with transformers' class defaults for the fields it leaves out.
//   CLIPImageProcessor, SiglipImageProcessor: resize (shortest edge / fixed size), optional center crop, rescale,
//     normalise -> pixel_values float32 [N, 3, H, W].
//   Qwen2VLImageProcessor (Qwen2-VL, Qwen2.5-VL, and Qwen3-VL, whose folders name this class with patch 16 and mean /
//     std 0.5): smart_resize to multiples of patch_size * merge_size within min/max pixels, rescale, normalise, then
//     patches -> pixel_values float32 [sum of grid_h * grid_w, C * temporal_patch_size * patch_size^2] (rows in
//     transformers' order: merge windows row-major, the merge_size^2 patches of a window row-major; each row C, T, P,
//     P with the image repeated along T) and image_grid_thw int64 [N, 3] = (1, grid_h, grid_w).
// transformers has two backends per class: torchvision-backed ("CLIPImageProcessor") when torchvision is installed,
// Pillow-backed ("CLIPImageProcessorPil") otherwise. They differ in the resize (Pillow's fixed-point passes vs ATen's
// antialiased interpolation, within one grey level of each other) and in float rounding: Backend picks which one
// to reproduce.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/data/image/resize.h"

namespace lf::data::image {

enum class Backend { pil, torchvision };
Backend backend_from_name(const std::string& name);  // "pil" | "torchvision"; lf::Error otherwise

// transformers' SizeDict: one of {height, width}, {shortest_edge}, {shortest_edge, longest_edge}; 0 = absent.
struct ImageSize {
  int64_t height = 0, width = 0, shortest_edge = 0, longest_edge = 0;
};

struct ImageProcessorConfig {
  std::string class_name;  // CLIPImageProcessor | SiglipImageProcessor | Qwen2VLImageProcessor
  bool do_resize = true, do_center_crop = false, do_rescale = true, do_normalize = true, do_pad = false;
  ImageSize size, crop_size, pad_size;  // pad_size all 0: pad to the largest image of the call
  Filter resample = Filter::bicubic;
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean{}, image_std{};
  int64_t patch_size = 14, temporal_patch_size = 2, merge_size = 2;  // Qwen2VLImageProcessor

  bool patches() const { return class_name == "Qwen2VLImageProcessor"; }
  // The class's defaults (transformers' class attributes); lf::Error for classes not listed above.
  static ImageProcessorConfig defaults(const std::string& class_name);
  // CLASS_NAME's defaults overridden by the fields of a preprocessor_config.json object (FILE names it in errors).
  static ImageProcessorConfig from_json(const nlohmann::json& j, const std::string& class_name,
                                        const std::string& file);
};

// The image processor class of a model folder (DIR, or the preprocessor_config.json file itself): the
// image_processor_type (a "Fast" / "Pil" suffix dropped) of processor_config.json's "image_processor" object or of
// preprocessor_config.json, else its feature_extractor_type, else config.json's model_type, as
// AutoImageProcessor resolves it. A folder without preprocessor_config.json is one lf::Error naming the folder.
ImageProcessorConfig load_image_processor_config(const std::string& dir);

struct ProcessedImages {
  at::Tensor pixel_values;    // float32 (uint8 when neither do_rescale nor do_normalize, as transformers)
  at::Tensor image_grid_thw;  // int64 [N, 3] for the patch processors, undefined otherwise
};

class ImageProcessor {
 public:
  explicit ImageProcessor(ImageProcessorConfig config, Backend backend = Backend::pil);
  static ImageProcessor from_pretrained(const std::string& dir, Backend backend = Backend::pil) {
    return ImageProcessor(load_image_processor_config(dir), backend);
  }

  const ImageProcessorConfig& config() const { return cfg_; }
  Backend backend() const { return backend_; }

  // IMAGES: uint8 [H, W, 3] RGB (decode.h with Alpha::white gives what transformers' convert_to_rgb gives).
  ProcessedImages preprocess(const std::vector<at::Tensor>& images) const;
  // Reads and decodes PATHS (transparency composited onto white) and preprocesses them.
  ProcessedImages preprocess_files(const std::vector<std::string>& paths) const;

  // The size (height, width) an HxW image is resized to (before any crop).
  std::pair<int64_t, int64_t> resized_size(int64_t height, int64_t width) const;
  // Patch processors: the grid (grid_h, grid_w) of an HxW image; it becomes grid_h * grid_w / merge_size^2 tokens.
  std::pair<int64_t, int64_t> patch_grid(int64_t height, int64_t width) const;

 private:
  at::Tensor resize(const at::Tensor& image) const;
  at::Tensor center_crop(const at::Tensor& chw) const;
  at::Tensor rescale_normalize(const at::Tensor& chw) const;
  at::Tensor patchify(const at::Tensor& chw) const;

  ImageProcessorConfig cfg_;
  Backend backend_;
};

// transformers' smart_resize (Qwen2-VL): HxW -> multiples of FACTOR, pixels within [MIN_PIXELS, MAX_PIXELS], the
// aspect ratio kept as closely as possible (Python's round half to even included). lf::Error for an aspect ratio
// over 200, as transformers raises.
std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                         int64_t max_pixels);

}  // namespace lf::data::image

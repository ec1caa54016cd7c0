// Image resizing as the two backends of transformers' image processors do it, on uint8 images [H, W, C]:
// - resize_pil: Pillow 13's Image.resize, bit for bit (separable convolution with 22-bit fixed-point weights and a
//   uint8 intermediate; the vertical pass first when the height shrinks more than twice as much as the width; nearest
//   by Pillow's affine scaling). What the "Pil" processors (transformers without torchvision) compute.
// - resize_torchvision: torchvision.transforms.v2.functional.resize on the CPU, i.e. ATen's antialiased
//   interpolation on uint8 (bicubic, bilinear) or nearest-exact. What the torchvision-backed processors compute.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace lf::data::image {

// Resampling filters, numbered as PIL.Image.Resampling (the "resample" field of preprocessor_config.json).
enum class Filter : int { nearest = 0, lanczos = 1, bilinear = 2, bicubic = 3, box = 4, hamming = 5 };

// The filter numbered V; lf::Error "WHERE: ..." for numbers without one here (Pillow's MKS filters 6 and 7).
Filter filter_from_pil(int64_t v, const std::string& where);
const char* filter_name(Filter f);

at::Tensor resize_pil(const at::Tensor& image, int64_t height, int64_t width, Filter filter);
// Supports nearest (as torchvision's NEAREST_EXACT, which transformers maps PIL's NEAREST to), bilinear and bicubic.
at::Tensor resize_torchvision(const at::Tensor& image, int64_t height, int64_t width, Filter filter);
// OpenCV's cv2.resize with INTER_AREA (resize_area.cpp): area averaging when shrinking, OpenCV's linear resize with
// INTER_AREA's coefficients when enlarging. What GR00T N1.7's albumentations image path computes.
at::Tensor resize_opencv_area(const at::Tensor& image, int64_t height, int64_t width);

}  // namespace lf::data::image

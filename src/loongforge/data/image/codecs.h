// The decoders behind decode.h (internal to data/image). Each returns the image's own channels as uint8 [H, W, C]:
// C = 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA); decode.h turns them into RGB. Errors: lf::Error "NAME: WHAT".
#pragma once
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "loongforge/data/image/decode.h"

namespace lf::data::image::detail {

bool is_jpeg(const uint8_t* data, size_t size);
bool is_png(const uint8_t* data, size_t size);

at::Tensor decode_jpeg(const uint8_t* data, size_t size, const std::string& name);  // C = 3
at::Tensor decode_png(const uint8_t* data, size_t size, const std::string& name);   // C = 1..4
// Decode without keeping the pixels (decode.h's check_image): the same errors, the image's size.
ImageDims check_jpeg(const uint8_t* data, size_t size, const std::string& name);
ImageDims check_png(const uint8_t* data, size_t size, const std::string& name);

// Throws unless a W x H image is within kMaxImagePixels (and non-empty).
void check_pixels(int64_t width, int64_t height, const std::string& name);

}  // namespace lf::data::image::detail

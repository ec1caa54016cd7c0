// Image decoding for vision-language models: JPEG (libjpeg-turbo) and PNG (libpng), from a file or from bytes in
// memory, to a uint8 tensor [H, W, 3] (RGB), pixel for pixel what Pillow gives (`Image.open(f).convert("RGB")`):
// grey, palette and 1/2/4-bit PNGs expanded, 16-bit RGB(A) reduced to the high byte, 16-bit grey clipped at 255
// (Pillow's I;16 -> RGB), CMYK JPEGs with Pillow's Adobe polarity and formula; EXIF orientation is not applied and
// ICC profiles / gAMA are ignored, as Pillow's plain open does. A file that cannot be decoded (not JPEG or PNG,
// truncated, corrupt, too many pixels) is an lf::Error naming the file and what is wrong; never a crash.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lf::data::image {

// What to do with transparency (an alpha channel, or a PNG tRNS colour / palette entry).
enum class Alpha {
  drop,   // [H, W, 3]: Pillow's convert("RGB") (the alpha is ignored)
  white,  // [H, W, 3]: composited onto white with Pillow's integer alpha_composite, as transformers'
          // convert_to_rgb does before every image processor
  keep,   // [H, W, 4] (RGBA) when the image has transparency, else [H, W, 3]
};

// Decodes NAME's bytes (NAME only names the image in errors). Throws lf::Error "NAME: WHAT".
at::Tensor decode_image(const uint8_t* data, size_t size, const std::string& name, Alpha alpha = Alpha::drop);
at::Tensor decode_image(std::string_view bytes, const std::string& name, Alpha alpha = Alpha::drop);
// Reads and decodes the file PATH.
at::Tensor read_image(const std::string& path, Alpha alpha = Alpha::drop);

// A one-channel depth image (LeRobot's depth frames: TIFF of uint16 or float32 samples, Pillow's I;16 / F) as
// float32 [H, W, 1] holding the stored values (tiff.cpp, libtiff). Throws lf::Error "NAME: WHAT".
at::Tensor decode_depth_image(const uint8_t* data, size_t size, const std::string& name);

// Whether an image decodes, and its size, without keeping its pixels: the whole file is read through the decoder
// as decode_image reads it (so a truncated or corrupt file fails the same way, with the same lf::Error "NAME: WHAT"),
// but into little memory (JPEG scaled down 8x by the decoder, PNG one row at a time). For checking a data set's
// images before training.
struct ImageDims {
  int64_t height = 0, width = 0;
};
ImageDims check_image(const uint8_t* data, size_t size, const std::string& name);
ImageDims check_image_file(const std::string& path);

// The most pixels an image may have: Pillow's limit (2 x Image.MAX_IMAGE_PIXELS), against decompression bombs.
// Writes uint8 [H, W, 3] RGB (or [H, W] grey) as PNG, atomically (a temporary file renamed into place); one-line
// lf::Error naming `path` when it cannot.
void write_png(const std::string& path, const at::Tensor& image);

inline constexpr int64_t kMaxImagePixels = 2 * int64_t{89478485};

}  // namespace lf::data::image

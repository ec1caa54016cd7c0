// decode.h: picks the codec by the file's signature and turns its channels into RGB as Pillow does.
#include "loongforge/data/image/decode.h"

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/codecs.h"

namespace lf::data::image {

namespace detail {

void check_pixels(int64_t width, int64_t height, const std::string& name) {
  if (width <= 0 || height <= 0) throw Error(name + ": the image is empty (" + std::to_string(width) + "x" +
                                             std::to_string(height) + ")");
  if (width * height > kMaxImagePixels)
    throw Error(name + ": " + std::to_string(width) + "x" + std::to_string(height) + " = " +
                std::to_string(width * height) + " pixels, more than the limit of " +
                std::to_string(kMaxImagePixels) + " (a decompression bomb?)");
}

}  // namespace detail

namespace {

// Pillow's alpha_composite of a pixel onto opaque white, then RGB: its 7-bit fixed-point arithmetic equals
// (c * a + 255 * (255 - a)) / 255 rounded half up, for every (c, a).
uint8_t over_white(int c, int a) { return static_cast<uint8_t>((2 * (c * a + 255 * (255 - a)) + 255) / 510); }

// SRC: [H, W, C] with C = 1 (L), 2 (LA), 3 (RGB), 4 (RGBA).
at::Tensor to_rgb(const at::Tensor& src, Alpha alpha) {
  const int64_t h = src.size(0), w = src.size(1), c = src.size(2);
  const bool has_alpha = c == 2 || c == 4;
  if (c == 3) return src;
  const int64_t oc = has_alpha && alpha == Alpha::keep ? 4 : 3;
  at::Tensor out = at::empty({h, w, oc}, at::kByte);
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* d = out.data_ptr<uint8_t>();
  const bool composite = has_alpha && alpha == Alpha::white;
  for (int64_t i = 0; i < h * w; ++i, s += c, d += oc) {
    const int a = has_alpha ? s[c - 1] : 255;
    for (int k = 0; k < 3; ++k) {
      const uint8_t v = c <= 2 ? s[0] : s[k];
      d[k] = composite ? over_white(v, a) : v;
    }
    if (oc == 4) d[3] = static_cast<uint8_t>(a);
  }
  return out;
}

}  // namespace

namespace {

[[noreturn]] void unknown_format(size_t size, const std::string& name) {
  if (size == 0) throw Error(name + ": the file is empty");
  throw Error(name + ": not a JPEG or PNG image (unknown file signature)");
}

}  // namespace

at::Tensor decode_image(const uint8_t* data, size_t size, const std::string& name, Alpha alpha) {
  at::Tensor raw;
  if (detail::is_jpeg(data, size)) raw = detail::decode_jpeg(data, size, name);
  else if (detail::is_png(data, size)) raw = detail::decode_png(data, size, name);
  else unknown_format(size, name);
  return to_rgb(raw, alpha);
}

ImageDims check_image(const uint8_t* data, size_t size, const std::string& name) {
  if (detail::is_jpeg(data, size)) return detail::check_jpeg(data, size, name);
  if (detail::is_png(data, size)) return detail::check_png(data, size, name);
  unknown_format(size, name);
}

ImageDims check_image_file(const std::string& path) {
  const std::string bytes = read_text_file(path);
  return check_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
}

at::Tensor decode_image(std::string_view bytes, const std::string& name, Alpha alpha) {
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), name, alpha);
}

at::Tensor read_image(const std::string& path, Alpha alpha) {
  return decode_image(read_text_file(path), path, alpha);  // read_text_file reads bytes (binary mode)
}

}  // namespace lf::data::image

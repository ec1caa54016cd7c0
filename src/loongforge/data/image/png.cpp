// PNG through libpng, with the samples Pillow gives: palettes and 1/2/4-bit grey expanded, tRNS turned into an alpha
// channel, 16-bit colour reduced to its high byte (Pillow's "RGB;16B" / "RGBA;16B" / "LA;16B" raw modes), 16-bit grey
// clipped at 255 (Pillow's I;16 -> L; its tRNS is ignored, as Pillow's I;16 -> RGBA does). No gamma or colour
// management. A file that ends early or fails a check is an error: Pillow raises on it too.
#include <png.h>

#include <unistd.h>

#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/data/image/codecs.h"
#include "loongforge/data/image/decode.h"

namespace lf::data::image::detail {

namespace {

struct PngSource {
  const uint8_t* data;
  size_t size, pos;
  char error[256];
};

void read_from_memory(png_structp png, png_bytep out, size_t n) {
  auto* src = static_cast<PngSource*>(png_get_io_ptr(png));
  if (src->size - src->pos < n) png_error(png, "the file ends early (truncated)");
  std::memcpy(out, src->data + src->pos, n);
  src->pos += n;
}

[[noreturn]] void on_error(png_structp png, png_const_charp msg) {
  auto* src = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(src->error, sizeof src->error, "%s", msg);
  png_longjmp(png, 1);
}

void on_warning(png_structp, png_const_charp) {}

struct PngLayout {
  png_uint_32 width = 0, height = 0;
  int channels = 0;
  bool grey16 = false;  // samples stay 16-bit (big-endian) and are clipped afterwards
};

// The two functions below call setjmp: libpng reports errors by longjmp back here, so their frames hold no object
// with a destructor (everything they fill is owned by the caller).
bool read_header(png_structp png, png_infop info, PngLayout* layout) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_info(png, info);
  const int color = png_get_color_type(png, info), depth = png_get_bit_depth(png, info);
  layout->grey16 = color == PNG_COLOR_TYPE_GRAY && depth == 16;
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (png_get_valid(png, info, PNG_INFO_tRNS) && !layout->grey16) png_set_tRNS_to_alpha(png);
  if (depth == 16 && !layout->grey16) png_set_strip_16(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  layout->width = png_get_image_width(png, info);
  layout->height = png_get_image_height(png, info);
  layout->channels = png_get_channels(png, info);
  return true;
}

bool read_rows(png_structp png, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_image(png, rows);  // chunks after the image data (up to IEND) are not needed, as for Pillow
  return true;
}

// check_png: every row of every pass into one scratch row (ROW holds png_get_rowbytes bytes).
bool read_rows_into_one(png_structp png, png_bytep row, int passes, png_uint_32 height) {
  if (setjmp(png_jmpbuf(png))) return false;
  for (int pass = 0; pass < passes; ++pass)
    for (png_uint_32 y = 0; y < height; ++y) png_read_row(png, row, nullptr);
  return true;
}

// A libpng reader over DATA whose errors land in SRC.error; the destructor frees it.
struct PngReader {
  png_structp png = nullptr;
  png_infop info = nullptr;
  PngReader(PngSource& src, const std::string& name) {
    png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, on_error, on_warning);
    if (!png) throw Error(name + ": cannot start the PNG decoder");
    info = png_create_info_struct(png);
    if (!info) {
      png_destroy_read_struct(&png, nullptr, nullptr);
      throw Error(name + ": cannot start the PNG decoder");
    }
    png_set_read_fn(png, &src, read_from_memory);
    // Pillow checks the CRC of every chunk; libpng's default skips bad ancillary chunks with a warning.
    png_set_crc_action(png, PNG_CRC_ERROR_QUIT, PNG_CRC_ERROR_QUIT);
  }
  ~PngReader() { png_destroy_read_struct(&png, &info, nullptr); }
  PngReader(const PngReader&) = delete;
  PngReader& operator=(const PngReader&) = delete;
};

}  // namespace

ImageDims check_png(const uint8_t* data, size_t size, const std::string& name) {
  PngSource src{data, size, 0, {}};
  PngReader r(src, name);
  PngLayout layout;
  if (!read_header(r.png, r.info, &layout)) throw Error(name + ": corrupt PNG file: " + src.error);
  check_pixels(layout.width, layout.height, name);
  const int passes = png_get_interlace_type(r.png, r.info) == PNG_INTERLACE_ADAM7 ? 7 : 1;
  std::vector<png_byte> row(png_get_rowbytes(r.png, r.info));
  if (!read_rows_into_one(r.png, row.data(), passes, layout.height))
    throw Error(name + ": corrupt PNG file: " + src.error);
  return {static_cast<int64_t>(layout.height), static_cast<int64_t>(layout.width)};
}

bool is_png(const uint8_t* data, size_t size) { return size >= 8 && png_sig_cmp(data, 0, 8) == 0; }

at::Tensor decode_png(const uint8_t* data, size_t size, const std::string& name) {
  PngSource src{data, size, 0, {}};
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, on_error, on_warning);
  if (!png) throw Error(name + ": cannot start the PNG decoder");
  png_infop info = png_create_info_struct(png);
  struct Guard {
    png_structp* png;
    png_infop* info;
    ~Guard() { png_destroy_read_struct(png, info, nullptr); }
  } guard{&png, &info};
  if (!info) throw Error(name + ": cannot start the PNG decoder");
  png_set_read_fn(png, &src, read_from_memory);
  // Pillow checks the CRC of every chunk; libpng's default skips bad ancillary chunks with a warning.
  png_set_crc_action(png, PNG_CRC_ERROR_QUIT, PNG_CRC_ERROR_QUIT);

  PngLayout layout;
  if (!read_header(png, info, &layout)) throw Error(name + ": corrupt PNG file: " + src.error);
  check_pixels(layout.width, layout.height, name);
  const int64_t h = layout.height, w = layout.width;
  const int bytes = layout.grey16 ? 2 : 1;
  if (static_cast<int64_t>(png_get_rowbytes(png, info)) != w * layout.channels * bytes)
    throw Error(name + ": unsupported PNG layout");
  at::Tensor raw = at::empty({h, w, layout.channels * bytes}, at::kByte);
  std::vector<png_bytep> rows(h);
  for (int64_t y = 0; y < h; ++y) rows[y] = raw.data_ptr<uint8_t>() + y * w * layout.channels * bytes;
  if (!read_rows(png, rows.data())) throw Error(name + ": corrupt PNG file: " + src.error);
  if (!layout.grey16) return raw;
  at::Tensor grey = at::empty({h, w, 1}, at::kByte);
  const uint8_t* s = raw.data_ptr<uint8_t>();
  uint8_t* d = grey.data_ptr<uint8_t>();
  for (int64_t i = 0; i < h * w; ++i) d[i] = s[2 * i] == 0 ? s[2 * i + 1] : 255;  // big-endian sample, clipped
  return grey;
}

}  // namespace lf::data::image::detail

namespace lf::data::image {

void write_png(const std::string& path, const at::Tensor& image) {
  const bool grey = image.dim() == 2;
  if (image.scalar_type() != at::kByte || !(grey || (image.dim() == 3 && image.size(2) == 3)))
    throw file_error(path, "", "write_png takes uint8 [H, W, 3] or [H, W]");
  const at::Tensor px = image.cpu().contiguous();
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (ec) throw file_error(path, "", "cannot create directory: " + ec.message());
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = png_uint_32(px.size(1));
  img.height = png_uint_32(px.size(0));
  img.format = grey ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  // <cstdio> remove/rename rather than std::filesystem's: libtorch.so exports its own (crashing) copies of some of
  // those libstdc++ symbols, which win at link time in binaries that link LibTorch.
  if (!png_image_write_to_file(&img, tmp.c_str(), 0, px.const_data_ptr<uint8_t>(), 0, nullptr)) {
    const std::string why = img.message;
    png_image_free(&img);
    std::remove(tmp.c_str());
    throw file_error(path, "", "cannot write PNG: " + why);
  }
  png_image_free(&img);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw file_error(path, "", "cannot write PNG: " + why);
  }
}

}  // namespace lf::data::image

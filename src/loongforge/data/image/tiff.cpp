// One-channel depth images in TIFF (decode.h's decode_depth_image) through libtiff, reading from memory: the
// samples as stored (uint16, Pillow's I;16, or IEEE float32, Pillow's F; libtiff swaps big-endian files), strips
// only. LF_HAVE_TIFF comes from CMake (libtiff-4 found); without it the function throws one line saying so.
#include <ATen/ATen.h>

#include <cstring>
#include <mutex>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/data/image/decode.h"

#ifdef LF_HAVE_TIFF
#include <tiffio.h>
#endif

namespace lf::data::image {

#ifndef LF_HAVE_TIFF

at::Tensor decode_depth_image(const uint8_t*, size_t, const std::string& name) {
  throw Error(name + ": this build has no TIFF support (install libtiff-dev and rebuild) for depth images");
}

#else

namespace {

struct Source {
  const uint8_t* data;
  size_t size, pos;
};

tmsize_t read_proc(thandle_t h, void* buf, tmsize_t n) {
  auto* s = static_cast<Source*>(h);
  if (n < 0) return -1;
  const size_t k = std::min(static_cast<size_t>(n), s->size - std::min(s->pos, s->size));
  std::memcpy(buf, s->data + s->pos, k);
  s->pos += k;
  return static_cast<tmsize_t>(k);
}
tmsize_t write_proc(thandle_t, void*, tmsize_t) { return -1; }
toff_t seek_proc(thandle_t h, toff_t off, int whence) {
  auto* s = static_cast<Source*>(h);
  const uint64_t base = whence == SEEK_SET ? 0 : whence == SEEK_CUR ? s->pos : s->size;
  if (off > UINT64_MAX - base) return static_cast<toff_t>(-1);
  s->pos = static_cast<size_t>(base + off);
  return s->pos;
}
int close_proc(thandle_t) { return 0; }
toff_t size_proc(thandle_t h) { return static_cast<Source*>(h)->size; }

struct Tiff {
  TIFF* p = nullptr;
  ~Tiff() {
    if (p) TIFFClose(p);
  }
};

}  // namespace

at::Tensor decode_depth_image(const uint8_t* data, size_t size, const std::string& name) {
  static std::once_flag quiet;
  std::call_once(quiet, [] {  // libtiff's messages go to stderr otherwise; a failure is our one-line error
    TIFFSetErrorHandler(nullptr);
    TIFFSetWarningHandler(nullptr);
  });
  if (size < 8 || !((data[0] == 'I' && data[1] == 'I') || (data[0] == 'M' && data[1] == 'M')))
    throw Error(name + ": not a TIFF image (LeRobot stores depth images as TIFF)");
  Source src{data, size, 0};
  Tiff t;
  t.p = TIFFClientOpen(name.c_str(), "rm", &src, read_proc, write_proc, seek_proc, close_proc, size_proc, nullptr,
                       nullptr);
  if (!t.p) throw Error(name + ": unreadable TIFF (truncated or corrupt)");
  uint32_t w = 0, h = 0;
  uint16_t spp = 1, bps = 1, format = SAMPLEFORMAT_UINT, planar = PLANARCONFIG_CONTIG;
  if (!TIFFGetField(t.p, TIFFTAG_IMAGEWIDTH, &w) || !TIFFGetField(t.p, TIFFTAG_IMAGELENGTH, &h))
    throw Error(name + ": TIFF without a width and height");
  TIFFGetFieldDefaulted(t.p, TIFFTAG_SAMPLESPERPIXEL, &spp);
  TIFFGetFieldDefaulted(t.p, TIFFTAG_BITSPERSAMPLE, &bps);
  TIFFGetFieldDefaulted(t.p, TIFFTAG_SAMPLEFORMAT, &format);
  TIFFGetFieldDefaulted(t.p, TIFFTAG_PLANARCONFIG, &planar);
  const bool u16 = bps == 16 && format == SAMPLEFORMAT_UINT, f32 = bps == 32 && format == SAMPLEFORMAT_IEEEFP;
  if (spp != 1 || !(u16 || f32))
    throw Error(name + ": a depth image must have one channel of uint16 or float32 samples (this TIFF has " +
                std::to_string(spp) + " of " + std::to_string(bps) + " bits, sample format " + std::to_string(format) +
                ")");
  if (TIFFIsTiled(t.p)) throw Error(name + ": tiled TIFF (depth images are read by strips)");
  if (w == 0 || h == 0 || static_cast<uint64_t>(w) * h > (uint64_t{1} << 28))
    throw Error(name + ": " + std::to_string(w) + "x" + std::to_string(h) + " pixels (out of range)");
  const tmsize_t row = TIFFScanlineSize(t.p);
  if (row != static_cast<tmsize_t>(w) * (bps / 8)) throw Error(name + ": unexpected TIFF row size");
  at::Tensor raw = at::empty({static_cast<int64_t>(h), static_cast<int64_t>(w), 1}, u16 ? at::kShort : at::kFloat);
  auto* out = static_cast<uint8_t*>(raw.data_ptr());
  for (uint32_t y = 0; y < h; ++y)
    if (TIFFReadScanline(t.p, out + static_cast<size_t>(y) * row, y, 0) < 0)
      throw Error(name + ": TIFF row " + std::to_string(y) + " unreadable (truncated or corrupt)");
  // uint16 samples were read into int16: their bits, reinterpreted
  return u16 ? raw.to(at::kInt).bitwise_and_(0xFFFF).to(at::kFloat) : raw;
}

#endif

}  // namespace lf::data::image

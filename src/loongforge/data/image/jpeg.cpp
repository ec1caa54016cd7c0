// JPEG through libjpeg-turbo's TurboJPEG API, decoded as Pillow decodes it: the accurate integer IDCT and fancy
// chroma upsampling (libjpeg's defaults, TurboJPEG's without flags), grey replicated to RGB, CMYK/YCCK with Pillow's
// Adobe polarity (inverted samples) and its CMYK -> RGB formula.
#include <turbojpeg.h>

#include <memory>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/data/image/codecs.h"

namespace lf::data::image::detail {

namespace {

struct TjCloser {
  void operator()(void* h) const { tjDestroy(h); }
};

// Pillow's cmyk2rgb on samples it reads inverted ("CMYK;I"): with c = 255 - C, k = 255 - K (raw C, K),
// out = clip(K - MULDIV255(c, K)), MULDIV255(a, b) = ((t >> 8) + t) >> 8 with t = a * b + 128.
uint8_t cmyk_channel(int raw_c, int raw_k) {
  const int t = (255 - raw_c) * raw_k + 128;
  const int v = raw_k - (((t >> 8) + t) >> 8);
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

}  // namespace

bool is_jpeg(const uint8_t* data, size_t size) {
  return size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF;
}

namespace {

struct JpegHeader {
  int width = 0, height = 0;
  bool cmyk = false;
};

JpegHeader read_header(void* tj, unsigned char* buf, size_t size, const std::string& name) {
  JpegHeader h;
  int subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(tj, buf, size, &h.width, &h.height, &subsamp, &colorspace) != 0)
    throw Error(name + ": not a valid JPEG file: " + tjGetErrorStr2(tj));
  if (h.width <= 0 || h.height <= 0) throw Error(name + ": not a valid JPEG file: no frame header (truncated?)");
  check_pixels(h.width, h.height, name);
  h.cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
  return h;
}

// After tjDecompress2 failed: warnings leave a complete image (Pillow accepts such files too), except the end of the
// data coming before the end of the image: libjpeg pads the rest with grey, Pillow raises "image file is truncated".
void check_decompress_failure(void* tj, const std::string& name) {
  const std::string why = tjGetErrorStr2(tj);
  if (tjGetErrorCode(tj) == TJERR_FATAL) throw Error(name + ": corrupt JPEG data: " + why);
  if (why.find("Premature end") != std::string::npos) throw Error(name + ": truncated JPEG file (" + why + ")");
}

std::unique_ptr<void, TjCloser> decoder(const std::string& name) {
  std::unique_ptr<void, TjCloser> tj(tjInitDecompress());
  if (!tj) throw Error(name + ": cannot start the JPEG decoder: " + tjGetErrorStr2(nullptr));
  return tj;
}

}  // namespace

at::Tensor decode_jpeg(const uint8_t* data, size_t size, const std::string& name) {
  const auto tj = decoder(name);
  // TurboJPEG's size arguments are unsigned long; the buffer is not written.
  unsigned char* buf = const_cast<unsigned char*>(data);
  const JpegHeader h = read_header(tj.get(), buf, size, name);
  const int width = h.width, height = h.height;
  at::Tensor out = at::empty({height, width, h.cmyk ? 4 : 3}, at::kByte);
  if (tjDecompress2(tj.get(), buf, size, out.data_ptr<uint8_t>(), width, 0, height, h.cmyk ? TJPF_CMYK : TJPF_RGB,
                    0) != 0)
    check_decompress_failure(tj.get(), name);
  if (!h.cmyk) return out;
  at::Tensor rgb = at::empty({height, width, 3}, at::kByte);
  const uint8_t* src = out.data_ptr<uint8_t>();
  uint8_t* dst = rgb.data_ptr<uint8_t>();
  for (int64_t i = 0, n = int64_t{width} * height; i < n; ++i, src += 4, dst += 3)
    for (int c = 0; c < 3; ++c) dst[c] = cmyk_channel(src[c], src[3]);
  return rgb;
}

ImageDims check_jpeg(const uint8_t* data, size_t size, const std::string& name) {
  const auto tj = decoder(name);
  unsigned char* buf = const_cast<unsigned char*>(data);
  const JpegHeader h = read_header(tj.get(), buf, size, name);
  // Asking for an eighth of the size makes libjpeg scale in its IDCT: every block is still entropy-decoded, so
  // corrupt or missing data fails as in decode_jpeg.
  const tjscalingfactor eighth{1, 8};
  const int w = TJSCALED(h.width, eighth), ht = TJSCALED(h.height, eighth);
  std::vector<uint8_t> px(static_cast<size_t>(w) * ht * 4);
  if (tjDecompress2(tj.get(), buf, size, px.data(), w, 0, ht, h.cmyk ? TJPF_CMYK : TJPF_RGB, 0) != 0)
    check_decompress_failure(tj.get(), name);
  return {h.height, h.width};
}

}  // namespace lf::data::image::detail

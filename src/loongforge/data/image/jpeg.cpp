// JPEG through libjpeg-turbo's TurboJPEG API, decoded as Pillow decodes it: the accurate integer IDCT and fancy
// chroma upsampling (libjpeg's defaults, TurboJPEG's without flags), grey replicated to RGB, CMYK/YCCK with Pillow's
// Adobe polarity (inverted samples) and its CMYK -> RGB formula.
#include <turbojpeg.h>

#include <memory>

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

at::Tensor decode_jpeg(const uint8_t* data, size_t size, const std::string& name) {
  std::unique_ptr<void, TjCloser> tj(tjInitDecompress());
  if (!tj) throw Error(name + ": cannot start the JPEG decoder: " + tjGetErrorStr2(nullptr));
  auto fail = [&](const char* what) { return Error(name + ": " + what + ": " + tjGetErrorStr2(tj.get())); };
  int width = 0, height = 0, subsamp = 0, colorspace = 0;
  // TurboJPEG's size arguments are unsigned long; the buffer is not written.
  unsigned char* buf = const_cast<unsigned char*>(data);
  if (tjDecompressHeader3(tj.get(), buf, size, &width, &height, &subsamp, &colorspace) != 0)
    throw fail("not a valid JPEG file");
  if (width <= 0 || height <= 0) throw Error(name + ": not a valid JPEG file: no frame header (truncated?)");
  check_pixels(width, height, name);
  const bool cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
  const int channels = cmyk ? 4 : 3;
  at::Tensor out = at::empty({height, width, channels}, at::kByte);
  if (tjDecompress2(tj.get(), buf, size, out.data_ptr<uint8_t>(), width, 0, height, cmyk ? TJPF_CMYK : TJPF_RGB,
                    0) != 0) {
    // Warnings leave a complete image (Pillow accepts such files too), except the end of the data coming before
    // the end of the image: libjpeg pads the rest with grey, Pillow raises "image file is truncated".
    const std::string why = tjGetErrorStr2(tj.get());
    if (tjGetErrorCode(tj.get()) == TJERR_FATAL) throw Error(name + ": corrupt JPEG data: " + why);
    if (why.find("Premature end") != std::string::npos) throw Error(name + ": truncated JPEG file (" + why + ")");
  }
  if (!cmyk) return out;
  at::Tensor rgb = at::empty({height, width, 3}, at::kByte);
  const uint8_t* src = out.data_ptr<uint8_t>();
  uint8_t* dst = rgb.data_ptr<uint8_t>();
  for (int64_t i = 0, n = int64_t{width} * height; i < n; ++i, src += 4, dst += 3)
    for (int c = 0; c < 3; ++c) dst[c] = cmyk_channel(src[c], src[3]);
  return rgb;
}

}  // namespace lf::data::image::detail

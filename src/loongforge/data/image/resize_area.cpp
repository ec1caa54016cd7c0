// resize.h's resize_opencv_area: OpenCV's cv2.resize(..., interpolation=INTER_AREA) on uint8 images, following its
// arithmetic (imgproc's resize: the area tables in double with float weights, float sums rounded half to even; the
// integer-factor fast path with integer sums, its 2 x 2 case as (a + b + c + d + 2) >> 2; enlarging through the
// linear resize with INTER_AREA's coefficients in 11-bit fixed point, the vertical pass as OpenCV's 8-bit one).
#include <ATen/ATen.h>

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/data/image/resize.h"

namespace lf::data::image {

namespace {

// saturate_cast<uchar>(float) / saturate_cast<short>(float): round to nearest, ties to even (lrintf), then clip.
uint8_t to_u8(float v) {
  const long r = std::lrintf(v);
  return static_cast<uint8_t>(std::clamp<long>(r, 0, 255));
}
int16_t to_s16(float v) { return static_cast<int16_t>(std::clamp<long>(std::lrintf(v), -32768, 32767)); }

struct Tap {
  int64_t src, dst;
  float alpha;
};

// computeResizeAreaTab: each output cell's source pixels and their fractions of the cell.
std::vector<Tap> area_taps(int64_t ssize, int64_t dsize, int64_t cn, double scale) {
  std::vector<Tap> tab;
  for (int64_t dx = 0; dx < dsize; ++dx) {
    const double f1 = static_cast<double>(dx) * scale, f2 = f1 + scale;
    const double cell = std::min(scale, static_cast<double>(ssize) - f1);
    int64_t s1 = static_cast<int64_t>(std::ceil(f1)), s2 = static_cast<int64_t>(std::floor(f2));
    s2 = std::min(s2, ssize - 1);
    s1 = std::min(s1, s2);
    if (static_cast<double>(s1) - f1 > 1e-3) tab.push_back({(s1 - 1) * cn, dx * cn, static_cast<float>((static_cast<double>(s1) - f1) / cell)});
    for (int64_t s = s1; s < s2; ++s) tab.push_back({s * cn, dx * cn, static_cast<float>(1.0 / cell)});
    if (f2 - static_cast<double>(s2) > 1e-3)
      tab.push_back({s2 * cn, dx * cn, static_cast<float>(std::min(std::min(f2 - static_cast<double>(s2), 1.0), cell) / cell)});
  }
  return tab;
}

// Shrinking by non-integer factors: per output row, the rows of its cell weighted (float sums, rows in order).
void shrink_area(const uint8_t* src, int64_t sh, int64_t sw, uint8_t* dst, int64_t dh, int64_t dw, int64_t cn,
                 double sx, double sy) {
  const std::vector<Tap> xt = area_taps(sw, dw, cn, sx), yt = area_taps(sh, dh, 1, sy);
  const int64_t W = dw * cn;
  std::vector<float> buf(static_cast<size_t>(W)), sum(static_cast<size_t>(W), 0.f);
  int64_t prev = yt.empty() ? 0 : yt[0].dst;
  for (const Tap& y : yt) {
    const uint8_t* S = src + y.src * sw * cn;
    std::fill(buf.begin(), buf.end(), 0.f);
    for (const Tap& x : xt)
      for (int64_t c = 0; c < cn; ++c) {
        const float p = static_cast<float>(S[x.src + c]) * x.alpha;
        buf[static_cast<size_t>(x.dst + c)] = buf[static_cast<size_t>(x.dst + c)] + p;
      }
    const float beta = y.alpha;
    if (y.dst != prev) {
      uint8_t* D = dst + prev * W;
      for (int64_t i = 0; i < W; ++i) {
        D[i] = to_u8(sum[static_cast<size_t>(i)]);
        sum[static_cast<size_t>(i)] = beta * buf[static_cast<size_t>(i)];
      }
      prev = y.dst;
    } else {
      for (int64_t i = 0; i < W; ++i) sum[static_cast<size_t>(i)] = sum[static_cast<size_t>(i)] + beta * buf[static_cast<size_t>(i)];
    }
  }
  uint8_t* D = dst + prev * W;
  for (int64_t i = 0; i < W; ++i) D[i] = to_u8(sum[static_cast<size_t>(i)]);
}

// Shrinking by integer factors fx x fy: the block's integer sum; 2 x 2 rounds half up, others by sum * (1 / area).
void shrink_fast(const uint8_t* src, int64_t sw, uint8_t* dst, int64_t dh, int64_t dw, int64_t cn, int64_t fx,
                 int64_t fy) {
  const float scale = 1.f / static_cast<float>(fx * fy);
  const bool two = fx == 2 && fy == 2 && (cn == 1 || cn == 3 || cn == 4);
  for (int64_t y = 0; y < dh; ++y)
    for (int64_t x = 0; x < dw; ++x)
      for (int64_t c = 0; c < cn; ++c) {
        int sum = 0;
        for (int64_t j = 0; j < fy; ++j)
          for (int64_t i = 0; i < fx; ++i) sum += src[((y * fy + j) * sw + x * fx + i) * cn + c];
        dst[(y * dw + x) * cn + c] = two ? static_cast<uint8_t>((sum + 2) >> 2) : to_u8(static_cast<float>(sum) * scale);
      }
}

// Enlarging (a factor below 1 on either axis): the linear resize with INTER_AREA's coefficients.
struct LinearTaps {
  std::vector<int64_t> ofs;
  std::vector<int16_t> w0, w1;
};
LinearTaps area_linear_taps(int64_t ssize, int64_t dsize, double scale, double inv_scale) {
  LinearTaps t;
  for (int64_t d = 0; d < dsize; ++d) {
    int64_t s = static_cast<int64_t>(std::floor(static_cast<double>(d) * scale));
    float f = static_cast<float>(static_cast<double>(d + 1) - static_cast<double>(s + 1) * inv_scale);
    f = f <= 0 ? 0.f : f - std::floor(f);
    if (s < 0) f = 0, s = 0;
    if (s >= ssize - 1) f = 0, s = ssize - 1;
    t.ofs.push_back(s);
    t.w0.push_back(to_s16((1.f - f) * 2048.f));
    t.w1.push_back(to_s16(f * 2048.f));
  }
  return t;
}

void enlarge_linear(const uint8_t* src, int64_t sh, int64_t sw, uint8_t* dst, int64_t dh, int64_t dw, int64_t cn,
                    double sx, double sy) {
  const LinearTaps xt = area_linear_taps(sw, dw, sx, static_cast<double>(dw) / static_cast<double>(sw)),
                   yt = area_linear_taps(sh, dh, sy, static_cast<double>(dh) / static_cast<double>(sh));
  const int64_t W = dw * cn;
  // HResizeLinear: two taps in ints (one at the right edge, where the second tap would leave the row)
  auto hrow = [&](int64_t r, std::vector<int>& out) {
    const uint8_t* S = src + r * sw * cn;
    for (int64_t x = 0; x < dw; ++x) {
      const int64_t s = xt.ofs[static_cast<size_t>(x)];
      for (int64_t c = 0; c < cn; ++c) {
        const int a = S[s * cn + c];
        out[static_cast<size_t>(x * cn + c)] =
            s + 1 < sw ? a * xt.w0[static_cast<size_t>(x)] + S[(s + 1) * cn + c] * xt.w1[static_cast<size_t>(x)] : a * 2048;
      }
    }
  };
  std::vector<int> r0(static_cast<size_t>(W)), r1(static_cast<size_t>(W));
  for (int64_t y = 0; y < dh; ++y) {
    const int64_t s = yt.ofs[static_cast<size_t>(y)];
    hrow(s, r0);
    hrow(std::min(s + 1, sh - 1), r1);
    const int b0 = yt.w0[static_cast<size_t>(y)], b1 = yt.w1[static_cast<size_t>(y)];
    uint8_t* D = dst + y * W;
    for (int64_t i = 0; i < W; ++i)  // VResizeLinear for 8 bits: (((b0 * (r0 >> 4)) >> 16) + ((b1 * (r1 >> 4)) >> 16) + 2) >> 2
      D[i] = static_cast<uint8_t>((((b0 * (r0[static_cast<size_t>(i)] >> 4)) >> 16) + ((b1 * (r1[static_cast<size_t>(i)] >> 4)) >> 16) + 2) >> 2);
  }
}

}  // namespace

at::Tensor resize_opencv_area(const at::Tensor& image, int64_t height, int64_t width) {
  if (image.dim() != 3 || image.scalar_type() != at::kByte)
    throw Error("resize_opencv_area: expected a uint8 image [H, W, C]");
  if (height < 1 || width < 1) throw Error("resize_opencv_area: the size must be positive");
  const at::Tensor src = image.contiguous();
  const int64_t sh = src.size(0), sw = src.size(1), cn = src.size(2);
  if (sh == height && sw == width) return src.clone();
  at::Tensor out = at::empty({height, width, cn}, src.options());
  // as cv::resize: the scales are the reciprocals of dsize / ssize
  const double sx = 1.0 / (static_cast<double>(width) / static_cast<double>(sw));
  const double sy = 1.0 / (static_cast<double>(height) / static_cast<double>(sh));
  const auto ix = static_cast<int64_t>(std::lrint(sx)), iy = static_cast<int64_t>(std::lrint(sy));
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* d = out.data_ptr<uint8_t>();
  if (sx >= 1 && sy >= 1) {
    const double eps = 2.220446049250313e-16;
    if (std::fabs(sx - static_cast<double>(ix)) < eps && std::fabs(sy - static_cast<double>(iy)) < eps)
      shrink_fast(s, sw, d, height, width, cn, ix, iy);
    else
      shrink_area(s, sh, sw, d, height, width, cn, sx, sy);
  } else {
    enlarge_linear(s, sh, sw, d, height, width, cn, sx, sy);
  }
  return out;
}

}  // namespace lf::data::image

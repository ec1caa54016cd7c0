// resize.h. The Pillow path follows libImaging/Resample.c and Geometry.c of Pillow 13 (its arithmetic, not its
// code): weights in double, normalised per output pixel, rounded to 22-bit fixed point; sums start at half a unit
// and are shifted and clipped to 0..255 after each pass.
#include "loongforge/data/image/resize.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "loongforge/core/error.h"

namespace lf::data::image {

namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;

double box_filter(double x) { return x > -0.5 && x <= 0.5 ? 1.0 : 0.0; }
double bilinear_filter(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}
double hamming_filter(double x) {
  x = std::fabs(x);
  if (x == 0.0) return 1.0;
  if (x >= 1.0) return 0.0;
  x = x * M_PI;
  return std::sin(x) / x * (0.54f + 0.46f * std::cos(x));  // float constants, as Pillow writes them
}
double bicubic_filter(double x) {  // a = -0.5
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}
double sinc(double x) {
  if (x == 0.0) return 1.0;
  x = x * M_PI;
  return std::sin(x) / x;
}
double lanczos_filter(double x) { return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3) : 0.0; }

struct FilterDef {
  double (*fn)(double);
  double support;
};

FilterDef filter_def(Filter f) {
  switch (f) {
    case Filter::box: return {box_filter, 0.5};
    case Filter::bilinear: return {bilinear_filter, 1.0};
    case Filter::hamming: return {hamming_filter, 1.0};
    case Filter::bicubic: return {bicubic_filter, 2.0};
    case Filter::lanczos: return {lanczos_filter, 3.0};
    case Filter::nearest: break;
  }
  throw Error("resize: no convolution filter for nearest");
}

// One axis: output pixel i reads inputs lo[i] .. lo[i] + n[i] - 1 with weights k[i * ksize + j].
struct Taps {
  int64_t ksize = 0;
  std::vector<int64_t> lo, n;
  std::vector<int32_t> k;
};

Taps make_taps(int64_t in_size, int64_t out_size, Filter filter) {
  const FilterDef f = filter_def(filter);
  const double scale = static_cast<double>(static_cast<float>(in_size)) / static_cast<double>(out_size);
  const double filterscale = std::max(scale, 1.0);
  const double support = f.support * filterscale;
  Taps t;
  t.ksize = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  t.lo.resize(out_size);
  t.n.resize(out_size);
  t.k.assign(out_size * t.ksize, 0);
  const double inv_filterscale = 1.0 / filterscale;
  std::vector<double> w(t.ksize);
  for (int64_t i = 0; i < out_size; ++i) {
    const double center = (i + 0.5) * scale;
    int64_t lo = static_cast<int>(center - support + 0.5), hi = static_cast<int>(center + support + 0.5);
    lo = std::max<int64_t>(lo, 0);
    hi = std::min(hi, in_size);
    const int64_t n = hi - lo;
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += w[j] = f.fn((j + lo - center + 0.5) * inv_filterscale);
    for (int64_t j = 0; j < n; ++j) {
      const double v = sum != 0.0 ? w[j] / sum : w[j];
      t.k[i * t.ksize + j] = static_cast<int32_t>(v < 0 ? -0.5 + v * (1 << kPrecisionBits)
                                                        : 0.5 + v * (1 << kPrecisionBits));
    }
    t.lo[i] = lo;
    t.n[i] = n;
  }
  return t;
}

inline uint8_t clip8(int64_t acc) {
  const int64_t v = acc >> kPrecisionBits;  // arithmetic shift: floor, as Pillow's table lookup
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// IN: [H, W, C] uint8 contiguous, rows ROW0 .. ROW0 + ROWS - 1 resampled along the width to T.lo.size() columns.
at::Tensor pass_horizontal(const at::Tensor& in, int64_t row0, int64_t rows, const Taps& t) {
  const int64_t w = in.size(1), c = in.size(2), ow = static_cast<int64_t>(t.lo.size());
  at::Tensor out = at::empty({rows, ow, c}, at::kByte);
  const uint8_t* src = in.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t y0, int64_t y1) {
    std::vector<int64_t> acc(c);
    for (int64_t y = y0; y < y1; ++y) {
      const uint8_t* line = src + (row0 + y) * w * c;
      for (int64_t x = 0; x < ow; ++x) {
        std::fill(acc.begin(), acc.end(), int64_t{1} << (kPrecisionBits - 1));
        const int32_t* k = &t.k[x * t.ksize];
        const uint8_t* p = line + t.lo[x] * c;
        for (int64_t j = 0; j < t.n[x]; ++j, p += c)
          for (int64_t ch = 0; ch < c; ++ch) acc[ch] += int64_t{p[ch]} * k[j];
        for (int64_t ch = 0; ch < c; ++ch) dst[(y * ow + x) * c + ch] = clip8(acc[ch]);
      }
    }
  });
  return out;
}

// IN: [H, W, C]; output row i reads input rows T.lo[i] - SHIFT ...
at::Tensor pass_vertical(const at::Tensor& in, const Taps& t, int64_t shift) {
  const int64_t w = in.size(1), c = in.size(2), oh = static_cast<int64_t>(t.lo.size());
  at::Tensor out = at::empty({oh, w, c}, at::kByte);
  const uint8_t* src = in.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row = w * c;
  at::parallel_for(0, oh, 4, [&](int64_t y0, int64_t y1) {
    std::vector<int64_t> acc(row);
    for (int64_t y = y0; y < y1; ++y) {
      std::fill(acc.begin(), acc.end(), int64_t{1} << (kPrecisionBits - 1));
      const int32_t* k = &t.k[y * t.ksize];
      for (int64_t j = 0; j < t.n[y]; ++j) {
        const uint8_t* line = src + (t.lo[y] - shift + j) * row;
        for (int64_t i = 0; i < row; ++i) acc[i] += int64_t{line[i]} * k[j];
      }
      for (int64_t i = 0; i < row; ++i) dst[y * row + i] = clip8(acc[i]);
    }
  });
  return out;
}

// Pillow's nearest resize: an affine scaling whose source coordinates are accumulated in double, from half a step.
at::Tensor nearest_pil(const at::Tensor& in, int64_t oh, int64_t ow) {
  const int64_t h = in.size(0), w = in.size(1), c = in.size(2);
  auto coords = [](int64_t in_size, int64_t out_size) {
    const double step = static_cast<double>(static_cast<float>(in_size)) / static_cast<double>(out_size);
    std::vector<int64_t> idx(out_size);
    double pos = step * 0.5;
    for (int64_t i = 0; i < out_size; ++i, pos += step) {
      const int64_t v = pos < 0.0 ? -1 : static_cast<int>(pos);
      idx[i] = v < in_size ? v : -1;  // outside: Pillow leaves the zero fill
    }
    return idx;
  };
  const std::vector<int64_t> xs = coords(w, ow), ys = coords(h, oh);
  at::Tensor out = at::zeros({oh, ow, c}, at::kByte);
  const uint8_t* src = in.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t y = 0; y < oh; ++y) {
    if (ys[y] < 0) continue;
    for (int64_t x = 0; x < ow; ++x)
      if (xs[x] >= 0) std::copy_n(src + (ys[y] * w + xs[x]) * c, c, dst + (y * ow + x) * c);
  }
  return out;
}

void check_image(const at::Tensor& image, int64_t height, int64_t width) {
  if (image.dim() != 3 || image.scalar_type() != at::kByte)
    throw Error("resize: expected a uint8 image [H, W, C], got " + std::string(image.toString()) + " of " +
                std::to_string(image.dim()) + " dims");
  if (height <= 0 || width <= 0)
    throw Error("resize: target size " + std::to_string(height) + "x" + std::to_string(width) + " is empty");
}

}  // namespace

Filter filter_from_pil(int64_t v, const std::string& where) {
  if (v < 0 || v > 5)
    throw Error(where + ": resampling filter " + std::to_string(v) +
                " is not supported (0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming)");
  return static_cast<Filter>(v);
}

const char* filter_name(Filter f) {
  static const char* names[] = {"nearest", "lanczos", "bilinear", "bicubic", "box", "hamming"};
  return names[static_cast<int>(f)];
}

at::Tensor resize_pil(const at::Tensor& image, int64_t height, int64_t width, Filter filter) {
  check_image(image, height, width);
  at::Tensor in = image.contiguous();
  const int64_t h = in.size(0), w = in.size(1);
  if (h == height && w == width) return in.clone();
  if (filter == Filter::nearest) return nearest_pil(in, height, width);
  const bool need_h = width != w, need_v = height != h;
  // Pillow 13: the vertical pass first when the height shrinks by more than twice as many pixels as the width.
  const bool horizontal_first = !(h - height > 0 && h - height > (w - width) * 2);
  const Taps tv = make_taps(h, height, filter);
  if (!need_h) return pass_vertical(in, tv, 0);
  const Taps th = make_taps(w, width, filter);
  if (!need_v) return pass_horizontal(in, 0, h, th);
  if (!horizontal_first) return pass_horizontal(pass_vertical(in, tv, 0), 0, height, th);
  // Only the rows the vertical pass reads go through the horizontal one.
  const int64_t first = tv.lo.front(), last = tv.lo.back() + tv.n.back();
  return pass_vertical(pass_horizontal(in, first, last - first, th), tv, first);
}

at::Tensor resize_torchvision(const at::Tensor& image, int64_t height, int64_t width, Filter filter) {
  check_image(image, height, width);
  if (image.size(0) == height && image.size(1) == width) return image.contiguous();
  // torchvision works on [N, C, H, W] tensors that are contiguous in that order, on uint8 directly for these modes.
  const at::Tensor x = image.permute({2, 0, 1}).contiguous().unsqueeze(0);
  at::Tensor y;
  switch (filter) {
    case Filter::bicubic: y = at::_upsample_bicubic2d_aa(x, {height, width}, false); break;
    case Filter::bilinear: y = at::_upsample_bilinear2d_aa(x, {height, width}, false); break;
    case Filter::nearest: y = at::_upsample_nearest_exact2d(x, {height, width}); break;
    default:
      throw Error(std::string("resize: the torchvision backend has no '") + filter_name(filter) +
                  "' filter (use the pil backend)");
  }
  return y.squeeze(0).permute({1, 2, 0}).contiguous();
}

}  // namespace lf::data::image

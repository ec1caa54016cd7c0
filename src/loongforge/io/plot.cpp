#include "loongforge/io/plot.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>

#include "loongforge/core/error.h"
#include "loongforge/data/image/decode.h"

namespace lf::io {
namespace {

// 5x7 bitmap font for ASCII 32..126 (+ a hollow box at index 95): 7 rows top to bottom, bit 4 = leftmost column.
// Characters without a glyph of their own, and bytes outside 32..126, draw as the box.
constexpr uint8_t kFont[96][7] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // space
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04},  // !
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // " (box)
    {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A},  // #
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // $ (box)
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03},  // %
    {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D},  // &
    {0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00},  // '
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02},  // (
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08},  // )
    {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00},  // *
    {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00},  // +
    {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08},  // ,
    {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00},  // -
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C},  // .
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00},  // /
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E},  // 0
    {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 1
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F},  // 2
    {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E},  // 3
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02},  // 4
    {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E},  // 5
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E},  // 6
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},  // 7
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E},  // 8
    {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C},  // 9
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00},  // :
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // ; (box)
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02},  // <
    {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00},  // =
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08},  // >
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04},  // ?
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // @ (box)
    {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // A
    {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E},  // B
    {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E},  // C
    {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C},  // D
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F},  // E
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10},  // F
    {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F},  // G
    {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // H
    {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // I
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C},  // J
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11},  // K
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F},  // L
    {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11},  // M
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11},  // N
    {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // O
    {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10},  // P
    {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D},  // Q
    {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11},  // R
    {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E},  // S
    {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // T
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // U
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04},  // V
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A},  // W
    {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11},  // X
    {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04},  // Y
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F},  // Z
    {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E},  // [
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // backslash (box)
    {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E},  // ]
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // ^ (box)
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F},  // _
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // ` (box)
    {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F},  // a
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E},  // b
    {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E},  // c
    {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F},  // d
    {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E},  // e
    {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08},  // f
    {0x00, 0x0D, 0x13, 0x11, 0x0F, 0x01, 0x0E},  // g
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11},  // h
    {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E},  // i
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C},  // j
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12},  // k
    {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // l
    {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11},  // m
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11},  // n
    {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E},  // o
    {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10},  // p
    {0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01},  // q
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10},  // r
    {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E},  // s
    {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06},  // t
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D},  // u
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04},  // v
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A},  // w
    {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11},  // x
    {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // y
    {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F},  // z
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // { (box)
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // | (box)
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // } (box)
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // ~ (box)
    {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F},  // 95: box
};
constexpr int kAdvance = 6;  // glyph width 5 + 1 column of spacing
constexpr uint32_t kBlack = 0x000000, kGrid = 0xE4E4E4, kLegendBorder = 0x999999;

int text_width(const std::string& s, int scale) { return s.empty() ? 0 : (int(s.size()) * kAdvance - 1) * scale; }

struct Rect {
  int x0, y0, x1, y1;  // inclusive
};

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), rgb_(size_t(w) * h * 3, 255), data_(size_t(w) * h, 0) {}
  int width() const { return w_; }
  int height() const { return h_; }
  const uint8_t* pixels() const { return rgb_.data(); }

  void set(int x, int y, uint32_t rgb, const Rect* clip = nullptr, bool data = false) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    if (clip && (x < clip->x0 || x > clip->x1 || y < clip->y0 || y > clip->y1)) return;
    uint8_t* p = &rgb_[(size_t(y) * w_ + x) * 3];
    p[0] = uint8_t(rgb >> 16), p[1] = uint8_t(rgb >> 8), p[2] = uint8_t(rgb);
    if (data) data_[size_t(y) * w_ + x] = 1;
  }
  void fill(Rect r, uint32_t rgb, const Rect* clip = nullptr, bool data = false) {
    for (int y = r.y0; y <= r.y1; ++y)
      for (int x = r.x0; x <= r.x1; ++x) set(x, y, rgb, clip, data);
  }
  void frame(Rect r, uint32_t rgb) {
    fill({r.x0, r.y0, r.x1, r.y0}, rgb), fill({r.x0, r.y1, r.x1, r.y1}, rgb);
    fill({r.x0, r.y0, r.x0, r.y1}, rgb), fill({r.x1, r.y0, r.x1, r.y1}, rgb);
  }
  // A 2-pixel-wide Bresenham line clipped to `clip`; marks the pixels as data (for the legend placement).
  void line(int x0, int y0, int x1, int y1, uint32_t rgb, const Rect& clip) {
    int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1, err = dx + dy;
    for (;;) {
      fill({x0, y0, x0 + 1, y0 + 1}, rgb, &clip, true);
      if (x0 == x1 && y0 == y1) break;
      int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }
  void text(int x, int y, const std::string& s, uint32_t rgb, int scale = 1) {
    for (unsigned char ch : s) {
      const uint8_t* g = kFont[ch >= 32 && ch <= 126 ? ch - 32 : 95];
      for (int r = 0; r < 7; ++r)
        for (int col = 0; col < 5; ++col)
          if (g[r] & (0x10 >> col))
            fill({x + col * scale, y + r * scale, x + (col + 1) * scale - 1, y + (r + 1) * scale - 1}, rgb);
      x += kAdvance * scale;
    }
  }
  int data_pixels(Rect r) const {
    int n = 0;
    for (int y = std::max(r.y0, 0); y <= std::min(r.y1, h_ - 1); ++y)
      for (int x = std::max(r.x0, 0); x <= std::min(r.x1, w_ - 1); ++x) n += data_[size_t(y) * w_ + x];
    return n;
  }

 private:
  int w_, h_;
  std::vector<uint8_t> rgb_, data_;
};

// [lo, hi] of the values, padded by `frac` of the span (or by max(10% of |v|, flat_min) around a single value);
// [0, 1] when there are none.
std::pair<double, double> data_range(const std::vector<double>& v, double frac, double flat_min) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (double d : v) lo = std::min(lo, d), hi = std::max(hi, d);
  if (lo > hi) return {0, 1};
  double pad = hi > lo ? (hi - lo) * frac : std::max(std::abs(lo) * 0.1, flat_min);
  if (!std::isfinite(hi - lo + 2 * pad)) pad = 0;  // spans near DBL_MAX: no padding rather than overflow
  return {lo - pad, hi + pad};
}

struct Tick {
  double pos;  // in axis coordinates (log10(y) on a log axis)
  std::string label;
};

std::vector<Tick> linear_ticks(double lo, double hi, int max_ticks) {
  std::vector<double> v = nice_ticks(lo, hi, max_ticks);
  double step = v.size() > 1 ? v[1] - v[0] : (hi - lo);
  std::vector<Tick> t;
  for (double d : v) t.push_back({d, tick_label(d, step)});
  return t;
}

std::vector<Tick> log_ticks(double lo, double hi, int max_ticks) {  // lo, hi: log10 of the range
  if (hi - lo < 1) {  // under a decade: nice values of the range, placed on the log axis
    std::vector<double> v = nice_ticks(std::pow(10.0, lo), std::pow(10.0, hi), max_ticks);
    double step = v.size() > 1 ? v[1] - v[0] : v[0];
    std::vector<Tick> t;
    for (double d : v)
      if (d > 0) t.push_back({std::log10(d), tick_label(d, step)});
    return t;
  }
  int e0 = int(std::ceil(lo)), e1 = int(std::floor(hi));
  int every = std::max(1, int(std::ceil((e1 - e0 + 1) / double(std::max(max_ticks, 1)))));
  std::vector<Tick> t;
  for (int e = e0; e <= e1; e += every) {
    double v = std::pow(10.0, e);
    t.push_back({double(e), e >= -4 && e <= 5 ? tick_label(v, v) : "1e" + std::to_string(e)});
  }
  return t;
}

void write_png(const std::string& path, const Canvas& c) {
  const at::Tensor rgb = at::from_blob(const_cast<uint8_t*>(c.pixels()), {c.height(), c.width(), 3}, at::kByte);
  data::image::write_png(path, rgb);
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int max_ticks) {
  if (!(hi > lo) || !std::isfinite(hi - lo)) return {lo};
  double raw = (hi - lo) / std::max(max_ticks, 1), mag = std::pow(10.0, std::floor(std::log10(raw)));
  double norm = raw / mag, step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
  std::vector<double> v;
  for (double k = std::ceil(lo / step); k * step <= hi + step * 1e-9 && v.size() < 64; ++k)
    v.push_back(k == 0 ? 0.0 : k * step);  // k * step, not accumulated: no drift, and an exact 0 (never -0)
  return v;
}

std::string tick_label(double v, double step) {
  if (v == 0) return "0";
  char buf[64];
  if (step >= 1e-4 && std::abs(v) < 1e6) {
    int decimals = std::max(0, int(std::ceil(-std::log10(step) - 1e-9)));
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
    return buf;
  }
  int digits = std::clamp(int(std::floor(std::log10(std::abs(v))) - std::floor(std::log10(step))), 0, 6);
  std::snprintf(buf, sizeof buf, "%.*e", digits, v);
  std::string s = buf;  // drop exponent zero padding: 1.5e-05 -> 1.5e-5
  size_t d = s.find('e') + 2;
  while (d + 1 < s.size() && s[d] == '0') s.erase(d, 1);
  return s;
}

void write_line_plot(const std::string& path, const std::string& title, const std::vector<Series>& series, int width,
                     int height, bool log_y) {
  if (width < 160 || height < 120 || width > 16384 || height > 16384)
    throw file_error(path, "", "plot size " + std::to_string(width) + "x" + std::to_string(height) +
                                   " outside 160x120 .. 16384x16384");
  // Points in axis coordinates; NaN marks a break in the line.
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::vector<std::pair<double, double>>> pts(series.size());
  std::vector<double> xs, ys;
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    if (s.x.size() != s.y.size())
      throw file_error(path, "", "series '" + s.name + "': " + std::to_string(s.x.size()) + " x values but " +
                                     std::to_string(s.y.size()) + " y values");
    for (size_t k = 0; k < s.x.size(); ++k) {
      double x = s.x[k], y = log_y ? (s.y[k] > 0 ? std::log10(s.y[k]) : kNaN) : s.y[k];
      bool ok = std::isfinite(x) && std::isfinite(y);
      pts[i].push_back(ok ? std::pair{x, y} : std::pair{kNaN, kNaN});
      if (ok) xs.push_back(x), ys.push_back(y);
    }
  }
  // Plain variables, not structured bindings: lambdas below capture them (clang before 16 cannot).
  const auto xr = data_range(xs, 0.01, 1.0), yr = data_range(ys, 0.05, log_y ? 0.5 : 1.0);
  double xlo = xr.first, xhi = xr.second, ylo = yr.first, yhi = yr.second;

  Canvas c(width, height);
  int tscale = text_width(title, 2) <= width - 20 ? 2 : 1;
  if (!title.empty()) c.text(std::max(0, (width - text_width(title, tscale)) / 2), 8, title, kBlack, tscale);
  Rect plot{0, title.empty() ? 12 : 8 + 7 * tscale + 12, width - 16, height - 28};
  int max_yt = std::clamp((plot.y1 - plot.y0) / 40, 2, 10);
  std::vector<Tick> yt = log_y ? log_ticks(ylo, yhi, max_yt) : linear_ticks(ylo, yhi, max_yt);
  int label_w = 0;
  for (const Tick& t : yt) label_w = std::max(label_w, text_width(t.label, 1));
  plot.x0 = 8 + label_w + 8;
  std::vector<Tick> xt;  // as many x ticks as fit with a gap between their labels
  for (int n = std::clamp((plot.x1 - plot.x0) / 70, 2, 12); n >= 1; --n) {
    xt = linear_ticks(xlo, xhi, n);
    int widest = 0;
    for (const Tick& t : xt) widest = std::max(widest, text_width(t.label, 1));
    double spacing = xt.size() > 1 ? (xt[1].pos - xt[0].pos) / (xhi - xlo) * (plot.x1 - plot.x0) : 1e9;
    if (spacing >= widest + 12) break;
  }
  auto to_px = [](double v) { return int(std::lround(v > -1e5 ? std::min(v, 1e5) : -1e5)); };  // NaN -> -1e5
  auto px = [&](double x) { return to_px(plot.x0 + (x - xlo) / (xhi - xlo) * (plot.x1 - plot.x0)); };
  auto py = [&](double y) { return to_px(plot.y1 - (y - ylo) / (yhi - ylo) * (plot.y1 - plot.y0)); };

  for (const Tick& t : yt) {  // grid line, tick mark, label
    int y = py(t.pos);
    c.fill({plot.x0 + 1, y, plot.x1 - 1, y}, kGrid);
    c.fill({plot.x0 - 5, y, plot.x0 - 1, y}, kBlack);
    c.text(plot.x0 - 8 - text_width(t.label, 1), y - 3, t.label, kBlack);
  }
  for (const Tick& t : xt) {
    int x = px(t.pos), w = text_width(t.label, 1);
    c.fill({x, plot.y0 + 1, x, plot.y1 - 1}, kGrid);
    c.fill({x, plot.y1 + 1, x, plot.y1 + 5}, kBlack);
    c.text(std::clamp(x - w / 2, 0, width - w), plot.y1 + 9, t.label, kBlack);
  }

  Rect inner{plot.x0 + 1, plot.y0 + 1, plot.x1 - 1, plot.y1 - 1};
  for (size_t i = 0; i < series.size(); ++i) {
    uint32_t rgb = series[i].rgb & 0xFFFFFF;
    const auto& p = pts[i];
    for (size_t k = 0; k < p.size(); ++k) {
      if (std::isnan(p[k].first)) continue;
      bool prev = k > 0 && !std::isnan(p[k - 1].first), next = k + 1 < p.size() && !std::isnan(p[k + 1].first);
      int x = px(p[k].first), y = py(p[k].second);
      if (prev)
        c.line(px(p[k - 1].first), py(p[k - 1].second), x, y, rgb, inner);
      else if (!next)
        c.fill({x - 2, y - 2, x + 2, y + 2}, rgb, &inner, true);  // an isolated point: a small square
    }
  }
  c.frame(plot, kBlack);

  if (!series.empty()) {  // legend: line sample + name per series, in the corner with the fewest data pixels
    int name_w = 0;
    for (const Series& s : series) name_w = std::max(name_w, text_width(s.name, 1));
    int lw = 8 + 20 + 6 + name_w + 8, lh = int(series.size()) * 12 + 6;
    Rect best{};
    int best_n = std::numeric_limits<int>::max();
    for (int corner = 0; corner < 4; ++corner) {  // top-right, top-left, bottom-right, bottom-left
      int x0 = corner % 2 == 0 ? plot.x1 - 8 - lw : plot.x0 + 8, y0 = corner < 2 ? plot.y0 + 8 : plot.y1 - 8 - lh;
      Rect r{x0, y0, x0 + lw, y0 + lh};
      if (int n = c.data_pixels(r); n < best_n) best_n = n, best = r;
    }
    c.fill(best, 0xFFFFFF);
    c.frame(best, kLegendBorder);
    for (size_t i = 0; i < series.size(); ++i) {
      int y = best.y0 + 4 + int(i) * 12;
      c.fill({best.x0 + 8, y + 2, best.x0 + 27, y + 3}, series[i].rgb & 0xFFFFFF);
      c.text(best.x0 + 34, y, series[i].name, kBlack);
    }
  }
  write_png(path, c);
}

}  // namespace lf::io

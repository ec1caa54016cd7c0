// PNG line plots of training curves (loss vs step), so a run can be inspected without Python. Plain C++ + libpng.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lf::io {

struct Series {
  std::string name;        // legend text
  std::vector<double> x, y;  // same length; points with a non-finite coordinate (or y <= 0 on a log axis) break the line
  uint32_t rgb;            // 0xRRGGBB
};

// Writes a width x height RGB PNG: title, framed axes with tick marks, numeric tick labels and light grid lines, one
// polyline per series (a lone point is drawn as a square), and a legend in the emptiest corner of the plot area.
// The ranges come from the finite data; log_y uses a base-10 y axis. The file is written to a temporary sibling and
// renamed into place; parent directories are created. Bad arguments or I/O failures raise lf::Error naming the path.
void write_line_plot(const std::string& path, const std::string& title, const std::vector<Series>& series,
                     int width = 900, int height = 500, bool log_y = false);

// Exposed for the tests: the "nice" tick values (1/2/5 x 10^k steps) covering [lo, hi], and a tick label.
std::vector<double> nice_ticks(double lo, double hi, int max_ticks);
std::string tick_label(double v, double step);

}  // namespace lf::io

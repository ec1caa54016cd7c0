#include "loongforge/io/samples.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/video.h"

namespace lf::io {
namespace fs = std::filesystem;

at::Tensor to_uint8_pixels(const at::Tensor& x) {
  if ((x.dim() != 4 && x.dim() != 5) || x.size(1) != 3)
    throw Error("samples: expected RGB pixels [B, 3, H, W] or [B, 3, F, H, W], got " + std::to_string(x.dim()) +
                " dimensions with " + std::to_string(x.dim() > 1 ? x.size(1) : 0) + " channels");
  at::Tensor u8 = ((x.detach().to(at::kCPU, at::kFloat).clamp(-1, 1) + 1) * 127.5).round().to(at::kByte);
  return (x.dim() == 4 ? u8.permute({0, 2, 3, 1}) : u8.permute({0, 2, 3, 4, 1})).contiguous();
}

at::Tensor sample_grid(const at::Tensor& px, int64_t max_frames) {
  const int64_t n = px.size(0);
  std::vector<at::Tensor> tiles;  // row-major
  int64_t rows = 0, cols = 0;
  if (px.dim() == 4) {
    cols = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n))));
    rows = (n + cols - 1) / cols;
    for (int64_t i = 0; i < n; ++i) tiles.push_back(px[i]);
  } else {
    const int64_t f = px.size(1), shown = std::min(f, std::max<int64_t>(1, max_frames));
    rows = n;
    cols = shown;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < shown; ++j) tiles.push_back(px[i][shown > 1 ? j * (f - 1) / (shown - 1) : 0]);
  }
  const int64_t h = tiles[0].size(0), w = tiles[0].size(1);
  at::Tensor grid = at::zeros({rows * (h + 2) + 2, cols * (w + 2) + 2, 3}, at::kByte);
  for (size_t k = 0; k < tiles.size(); ++k) {
    const int64_t r = static_cast<int64_t>(k) / cols, c = static_cast<int64_t>(k) % cols;
    grid.narrow(0, 2 + r * (h + 2), h).narrow(1, 2 + c * (w + 2), w).copy_(tiles[k]);
  }
  return grid;
}

std::string write_sample_images(const at::Tensor& x, const std::string& dir, double fps) {
  const at::Tensor px = to_uint8_pixels(x);
  fs::create_directories(dir);
  char name[48];
  for (int64_t i = 0; i < px.size(0); ++i) {
    if (px.dim() == 4) {
      std::snprintf(name, sizeof name, "sample_%02lld.png", static_cast<long long>(i));
      data::image::write_png((fs::path(dir) / name).string(), px[i]);
      continue;
    }
    std::snprintf(name, sizeof name, "sample_%02lld", static_cast<long long>(i));
    const fs::path sub = fs::path(dir) / name;
    fs::create_directories(sub);
    for (int64_t f = 0; f < px.size(1); ++f) {
      std::snprintf(name, sizeof name, "frame_%03lld.png", static_cast<long long>(f));
      data::image::write_png((sub / name).string(), px[i][f]);
    }
    if (data::video_available() && px.size(2) % 2 == 0 && px.size(3) % 2 == 0) {
      std::snprintf(name, sizeof name, "sample_%02lld.mp4", static_cast<long long>(i));
      data::encode_video((fs::path(dir) / name).string(), px[i], fps);
    }
  }
  const std::string grid = (fs::path(dir) / "grid.png").string();
  data::image::write_png(grid, sample_grid(px));
  return grid;
}

}  // namespace lf::io

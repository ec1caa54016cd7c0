// Generated samples as files a person looks at: RGB pixels in [-1, 1] ([B, 3, H, W] images or [B, 3, F, H, W]
// clips) as PNGs and one grid PNG (`loongforge sample --images`, the trainer's sample grids).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

namespace lf::io {

// [B, 3, H, W] or [B, 3, F, H, W] in [-1, 1] -> uint8 [B, H, W, 3] / [B, F, H, W, 3] (rounded, clamped).
at::Tensor to_uint8_pixels(const at::Tensor& x);
// A grid of uint8 HWC images with 2-pixel black gaps: images [B, H, W, 3] in ceil(sqrt(B)) columns; clips
// [B, F, H, W, 3] one row per clip, at most `max_frames` evenly spaced frames per row.
at::Tensor sample_grid(const at::Tensor& pixels_u8, int64_t max_frames = 8);
// Writes DIR/sample_NN.png for images (for clips DIR/sample_NN/frame_MMM.png and DIR/sample_NN.mp4 at `fps`, even
// sizes, when the build has FFmpeg) and DIR/grid.png; returns the grid's path.
std::string write_sample_images(const at::Tensor& x, const std::string& dir, double fps = 16.0);

}  // namespace lf::io

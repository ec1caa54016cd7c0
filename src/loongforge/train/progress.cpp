#include "loongforge/train/progress.h"

#include <ATen/Parallel.h>

namespace lf::train {

double peak_flops(double peak_tflops, const at::Device& device) {
  if (peak_tflops > 0) return peak_tflops * 1e12;
  if (device.is_cuda()) return 989e12;  // H100/H200 dense bf16 (the MFU convention; fp32 runs count against it too)
  // CPU: AVX2 FMA, 2 x 8 fp32 lanes x 2 flops per cycle at ~3 GHz per thread (the brief measures ~98 GFLOP/s a core).
  return 98e9 * at::get_num_threads();
}

}  // namespace lf::train

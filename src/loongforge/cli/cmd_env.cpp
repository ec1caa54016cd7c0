// loongforge env: what this build and this machine offer (for bug reports and before a first GPU run): LibTorch's
// version, the CPU threads and vector units our kernels use (and the BLAS behind their float32 GEMMs), whether our CUDA kernels are compiled and which GPUs
// are usable (or why none is), the collective backends, the video library (FFmpeg) behind `data frames`
// and the Parquet reader (Apache Arrow).
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <cstdio>
#include <string>

#include "loongforge/cli/commands.h"
#include "loongforge/data/parquet.h"
#include "loongforge/data/video.h"
#include "loongforge/kernels/cpu/blas.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/parallel/comm.h"

namespace lf::cli {
namespace {

void print_env() {
  namespace cu = kernels::cuda;
  std::printf("loongforge 0.1.0\n");
  std::printf("libtorch %d.%d.%d\n", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  __builtin_cpu_init();
  const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  std::printf("cpu: %d threads, AVX2+FMA %s\n", at::get_num_threads(), avx2_fma ? "yes" : "no");
  std::printf("cpu float32 gemm: %s\n", kernels::cpu::blas_backend_description().c_str());
  if (!cu::compiled()) {
    std::printf("cuda kernels: not compiled (LOONGFORGE_CUDA=OFF)\n");
  } else {
    std::printf("cuda kernels: compiled (CUDA runtime %s)\n", cu::runtime_version().c_str());
  }
  if (cu::available()) {
    for (int i = 0; i < cu::device_count(); ++i) std::printf("gpu %d: %s\n", i, cu::device_description(i).c_str());
  } else {
    std::printf("gpus: none usable (%s)\n", cu::unavailable_reason().c_str());
  }
  std::string backends;
  for (const auto& b : parallel::available_backends()) backends += (backends.empty() ? "" : ", ") + b;
  std::printf("collectives: %s\n", backends.c_str());
  std::printf("video: %s\n", data::video_backend_description().c_str());
  std::printf("parquet: %s\n", data::parquet_backend_description().c_str());
}

}  // namespace

void add_env(CLI::App& app) {
  auto* sub = app.add_subcommand("env", "What this build and machine offer: LibTorch, CPU, CUDA kernels, GPUs, collectives");
  sub->callback([] { print_env(); });
}

}  // namespace lf::cli

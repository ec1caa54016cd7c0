// Linear layer y = x W^T + b on the CPU, with our own autograd Function where it beats at::linear.
//
// Packed weight (the default path for float32 products of kernels/cpu/blas.h's kMinPackedRows rows or more): the
// forward and the input gradient multiply by W, which MKL re-packs on every call; packing it once per product with
// MKL's packed-GEMM API and computing against the packed copy was 3-10 % faster per GEMM on the bench shapes
// (kernels/cpu/blas.h). The weight gradient dW = dy^T x has no fixed operand and stays a plain GEMM.
//
// Row split (opt-in): the torch wheel's MKL was measured at ~96 GFLOP/s with two threads on x W^T (K=256) where OpenBLAS
// reached ~176, so one single-threaded sgemm per thread on its own block of rows looked like a way to run each core at
// its single-thread speed. Measured in `loongforge train` (small bench shape, 2 threads) it gave no gain (~2 %
// slower, bench/results/cpu_train.md), so it is opt-in, kept for A/B runs on other CPUs. (That measurement predates
// building the library with OpenMP, when at::parallel_for here ran serially; the trainer now splits whole micro-batch
// rows over the threads instead, parallel/thread_split.h, and inside a part this split is off.) Forward splits the N rows of
// y, the input gradient the N rows of dx, the weight gradient the out rows of dW; each block is one at::mm_out inside
// at::parallel_for (MKL runs single-threaded inside a parallel region: no nested team). Only libgomp's threads run.
#pragma once
#include <ATen/core/Tensor.h>

namespace lf::kernels {

// Autograd-aware. CPU f32/f64 tensors (x [..., in], weight [out, in], bias [out] or undefined) go to the split
// GEMMs when splitting pays (linear_split_mode()), float32 ones with enough rows to the packed weight or, when the
// float32 BLAS is OpenBLAS (cpu::blas_backend()), every float32 one to it; anything else to at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// The raw split GEMM (no autograd), for tests and benchmarks: a [M,K] b [K,N] (any strides) into a fresh contiguous
// [M,N], its M rows split in `parts` blocks of multiples of 8 rows (0: ATen's thread count).
at::Tensor mm_split_rows(const at::Tensor& a, const at::Tensor& b, int64_t parts = 0);

// When the CPU GEMMs of kernels::linear and kernels::linear_cross_entropy split: 0 never (the default: no gain
// measured, see above), 1 when it may pay (more than one ATen thread and at least 4M multiply-adds), 2 always, in
// at least 2 blocks (tests). LOONGFORGE_SPLIT_GEMM=1 in the environment selects 1 (A/B runs of bench/cpu_train.py).
int linear_split_mode();
void set_linear_split_mode(int mode);

}  // namespace lf::kernels

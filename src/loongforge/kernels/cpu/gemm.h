// Row-split GEMMs shared by the CPU kernels (kernels/cpu/linear.cpp, linear_ce.cpp): one single-threaded MKL sgemm
// per ATen thread on its own block of output rows (see kernels/linear.h for why).
#pragma once
#include <ATen/core/Tensor.h>

namespace lf::kernels::cpu {

// out[M,N] (= or +=) a[M,K] b[K,N]; out's rows contiguous (row stride N... any row-major view), a and b any strides.
// The M rows are split in `parts` blocks of whole rows (multiples of 8); parts <= 1 or a small M: one at::mm_out.
void mm_rows(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, int64_t parts, bool accumulate = false);

// The number of blocks for a product of m x k x n multiply-adds: ATen's thread count when splitting pays (split
// enabled, more than one thread, not already inside a parallel region, big enough), else 1.
int64_t split_parts(int64_t m, int64_t k, int64_t n);

}  // namespace lf::kernels::cpu

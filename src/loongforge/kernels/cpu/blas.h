// Direct calls into the BLAS that LibTorch carries (the x86 torch wheels link MKL into libtorch_cpu), for the CPU
// kernels: a row-major GEMM without ATen's per-call overhead, and GEMMs against a pre-packed B operand.
//
// Which BLAS runs the float32 products is chosen at run time (blas_backend()): MKL, except on AMD CPUs with AVX-512,
// where MKL takes its AVX2 code path (`mkl_blas_def_sgemm_kernel_0_zen` in a profile of a Zen 5 EPYC) and Debian's
// OpenBLAS, told to use its AVX-512 (SkylakeX) kernels, is about twice as fast on every training-step shape measured
// (bench/blas_backends.py; bench/results/cpu_train.md). Debian 12's OpenBLAS 0.3.21 does not know Zen 4/5 and would
// pick its Haswell kernels, so it is loaded with OPENBLAS_CORETYPE=SkylakeX (and one thread: the kernels split the
// work over ATen's threads themselves). LOONGFORGE_BLAS=mkl|openblas overrides the choice,
// LOONGFORGE_OPENBLAS_CORETYPE the kernels (OPENBLAS_CORETYPE in the environment is left to other OpenBLAS users).
//
// The symbols are declared weak: a LibTorch built without MKL leaves them null, and every call here then falls back to
// at::mm_out / at::addmm_ on views (same results up to rounding). MKL runs single-threaded inside an OpenMP parallel
// region (our per-thread parts), multi-threaded outside it, as when ATen calls it.
//
// Why packing: MKL's sgemm packs both operands on every call. With B packed once by cblas_sgemm_pack (MKL's own
// kernel-ready layout), cblas_sgemm_compute only packs A. Measured on the bench shapes, one thread per core, both busy
// (per call, pack included): x W^T for W 256x256 .. 688x256 and 1024 rows, 3-10 % faster; the cross-entropy logits
// (128 rows x W 8192x256, W packed once for all chunks) 15-19 % faster. End to end (`loongforge train`, small bench
// shape) the difference stayed inside this machine's noise (LOONGFORGE_PACKED_GEMM=0 for A/B runs). The packed buffer
// has a fixed part of ~7.5 MB (MKL's workspace) on top of the matrix and is kept per thread, so it is used only for
// products with many rows and a B of at most kMaxPackedBytes.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace lf::kernels::cpu {

// Row-major C[m,n] = alpha op(A) op(B) + beta C, op(X) = X^T when the flag is set; lda/ldb/ldc are row strides
// (of X as stored). float or double.
template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
          T beta, T* c, int64_t ldc);

enum class BlasBackend { kMkl, kOpenBlas };
// The backend of the float32 products: chosen once (see above), or as set by set_blas_backend.
BlasBackend blas_backend();
// Forces a backend (tests and benchmarks compare them); kOpenBlas throws when libopenblas cannot be loaded.
void set_blas_backend(BlasBackend backend);
// A line for `loongforge env` and the logs: the backend, and why (e.g. "OpenBLAS 0.3.21 (SkylakeX kernels): AMD CPU
// with AVX-512").
std::string blas_backend_description();

// True when LibTorch exports MKL's packed-GEMM API (cblas_sgemm_pack_get_size / _pack / _compute) and
// LOONGFORGE_PACKED_GEMM=0 is not set in the environment, and MKL is the backend.
bool has_packed_gemm();

// B of C = A op(B) packed once, for any number of products with row counts up to `max_m`. float32 only. Without the
// packed API it keeps a pointer to B and runs plain GEMMs; so B must stay alive and unchanged while this is used.
class PackedB {
 public:
  // op(B) is [k, n]: B is [n, k] (row stride ldb) when trans, else [k, n].
  PackedB(bool trans, int64_t max_m, int64_t n, int64_t k, const float* b, int64_t ldb);
  ~PackedB();
  PackedB(const PackedB&) = delete;
  PackedB& operator=(const PackedB&) = delete;
  // C[m, n] = A[m, k] op(B) + beta C (A, C row-major with row strides lda, ldc; m <= max_m).
  void compute(int64_t m, const float* a, int64_t lda, float beta, float* c, int64_t ldc) const;
  bool packed() const { return buf_.defined(); }

 private:
  bool trans_;
  int64_t max_m_, n_, k_, ldb_;
  const float* b_;
  at::Tensor buf_;      // MKL's packed layout (undefined: not packed)
  bool lent_ = false;  // buf_ is this thread's scratch buffer (blas.cpp)
};

// y[m, n] = x[m, k] W^T (W [n, k], all row-major, float32 contiguous rows): through PackedB when use_packed(), else one
// plain GEMM.
void linear_nt(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
               int64_t ldy);
// dx[m, k] = dy[m, n] W (W [n, k]), the input gradient of the above, the same way.
void linear_nn(int64_t m, int64_t n, int64_t k, const float* dy, int64_t lddy, const float* w, int64_t ldw, float* dx,
               int64_t lddx);

inline constexpr int64_t kMinPackedRows = 256;
// ... and a B of at most this many bytes (the packed copy is kept per thread: a large model's weights would double).
inline constexpr int64_t kMaxPackedBytes = int64_t(32) << 20;
// Whether a product of m rows against a B of n x k floats goes through PackedB.
inline bool use_packed(int64_t m, int64_t n, int64_t k) {
  return m >= kMinPackedRows && n * k * 4 <= kMaxPackedBytes && has_packed_gemm();
}

}  // namespace lf::kernels::cpu

// BLAS calls of the CPU kernels (kernels/cpu/blas.h).
#include "loongforge/kernels/cpu/blas.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <string>
#include <type_traits>

extern "C" {
// Fortran BLAS and MKL's packed-GEMM C API inside libtorch_cpu (LP64 interface); weak: null where the LibTorch build
// has none. The CBLAS enums are ints: row-major 101, no-trans 111, trans 112, B matrix 162, packed 151.
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src, int ld,
                      float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace lf::kernels::cpu {
namespace {
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kBMatrix = 162, kPacked = 151;

// op(X) of a row-major X as an ATen view [rows, cols].
template <typename T>
at::Tensor view(const T* p, bool t, int64_t rows, int64_t cols, int64_t ld) {
  const auto opt = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  return t ? at::from_blob(const_cast<T*>(p), {cols, rows}, {ld, 1}, opt).t()
           : at::from_blob(const_cast<T*>(p), {rows, cols}, {ld, 1}, opt);
}
// The packed-B buffers of this thread, kept between products: each is several MB (see blas.h), and a fresh
// allocation per product costs more in page faults than packing saves. A buffer is lent to one PackedB at a time; a
// second PackedB alive on the same thread allocates its own.
struct Scratch {
  at::Tensor buf;
  bool lent = false;
};
thread_local Scratch t_scratch;
}  // namespace

template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
          T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  // Column-major BLAS sees each row-major matrix transposed: C^T = op(B)^T op(A)^T.
  const char cta = ta ? 'T' : 'N', ctb = tb ? 'T' : 'N';
  const int im = static_cast<int>(n), in = static_cast<int>(m), ik = static_cast<int>(k);
  const int ilda = static_cast<int>(ldb), ildb = static_cast<int>(lda), ildc = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_) return sgemm_(&ctb, &cta, &im, &in, &ik, &alpha, b, &ilda, a, &ildb, &beta, c, &ildc);
  } else {
    if (dgemm_) return dgemm_(&ctb, &cta, &im, &in, &ik, &alpha, b, &ilda, a, &ildb, &beta, c, &ildc);
  }
  at::Tensor cv = at::from_blob(c, {m, n}, {ldc, 1}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  at::NoGradGuard ng;
  if (k == 0) {
    cv.mul_(beta);
    return;
  }
  if (beta == T(0)) at::mm_out(cv, view(a, ta, m, k, lda), view(b, tb, k, n, ldb)).mul_(alpha);
  else cv.mul_(beta).addmm_(view(a, ta, m, k, lda), view(b, tb, k, n, ldb), 1, alpha);
}

template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*,
                           int64_t, double, double*, int64_t);

bool has_packed_gemm() {
  // LOONGFORGE_PACKED_GEMM=0 turns the packed path off (A/B runs of bench/cpu_train.py and bench/kernels_bench.cpp).
  static const bool off = [] {
    const char* e = std::getenv("LOONGFORGE_PACKED_GEMM");
    return e && std::string(e) == "0";
  }();
  return !off && cblas_sgemm_pack_get_size && cblas_sgemm_pack && cblas_sgemm_compute;
}

PackedB::PackedB(bool trans, int64_t max_m, int64_t n, int64_t k, const float* b, int64_t ldb)
    : trans_(trans), max_m_(max_m), n_(n), k_(k), ldb_(ldb), b_(b) {
  if (!has_packed_gemm() || max_m <= 0 || n <= 0 || k <= 0) return;
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, static_cast<int>(max_m), static_cast<int>(n),
                                                 static_cast<int>(k));
  const int64_t floats = static_cast<int64_t>((bytes + 3) / 4);
  if (!t_scratch.lent) {
    if (!t_scratch.buf.defined() || t_scratch.buf.numel() < floats) {
      t_scratch.buf = at::Tensor();  // free the old one first
      t_scratch.buf = at::empty({floats}, at::kFloat);
    }
    buf_ = t_scratch.buf;
    t_scratch.lent = lent_ = true;
  } else {
    buf_ = at::empty({floats}, at::kFloat);
  }
  cblas_sgemm_pack(kRowMajor, kBMatrix, trans ? kTrans : kNoTrans, static_cast<int>(max_m), static_cast<int>(n),
                   static_cast<int>(k), 1.0f, b, static_cast<int>(ldb), buf_.mutable_data_ptr<float>());
}

PackedB::~PackedB() {
  if (lent_) t_scratch.lent = false;
}

void PackedB::compute(int64_t m, const float* a, int64_t lda, float beta, float* c, int64_t ldc) const {
  TORCH_CHECK(m <= max_m_, "PackedB::compute: ", m, " rows, packed for at most ", max_m_);
  if (m == 0) return;
  if (!packed()) return gemm<float>(false, trans_, m, n_, k_, 1.0f, a, lda, b_, ldb_, beta, c, ldc);
  // ldb is ignored for a packed B
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n_), static_cast<int>(k_), a,
                      static_cast<int>(lda), buf_.const_data_ptr<float>(), static_cast<int>(trans_ ? k_ : n_), beta, c,
                      static_cast<int>(ldc));
}

void linear_nt(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
               int64_t ldy) {
  if (use_packed(m, n, k)) PackedB(true, m, n, k, w, ldw).compute(m, x, ldx, 0.0f, y, ldy);
  else gemm<float>(false, true, m, n, k, 1.0f, x, ldx, w, ldw, 0.0f, y, ldy);
}

void linear_nn(int64_t m, int64_t n, int64_t k, const float* dy, int64_t lddy, const float* w, int64_t ldw, float* dx,
               int64_t lddx) {
  if (use_packed(m, n, k)) PackedB(false, m, k, n, w, ldw).compute(m, dy, lddy, 0.0f, dx, lddx);
  else gemm<float>(false, false, m, k, n, 1.0f, dy, lddy, w, ldw, 0.0f, dx, lddx);
}

}  // namespace lf::kernels::cpu

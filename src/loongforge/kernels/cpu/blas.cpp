// BLAS calls of the CPU kernels (kernels/cpu/blas.h).
#include "loongforge/kernels/cpu/blas.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
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

// ---- the OpenBLAS backend (blas.h): Debian's libopenblas, loaded on first use, not linked ----
using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                            int);
struct OpenBlas {
  CblasSgemm sgemm = nullptr;
  std::string name;   // "OpenBLAS 0.3.21 ... (SkylakeX kernels)"
  std::string error;  // why it could not be loaded
};

const OpenBlas& openblas() {
  static const OpenBlas lib = [] {
    OpenBlas o;
    // OpenBLAS reads these when it initialises (in dlopen): its AVX-512 kernels where the CPU has them, one thread
    // (we split over ATen's threads). OPENBLAS_CORETYPE is the knob for every OpenBLAS in the process (machines set
    // it for numpy & co.: this one exports Haswell), so ours is LOONGFORGE_OPENBLAS_CORETYPE; the caller's
    // environment is restored afterwards.
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    const char* ours = std::getenv("LOONGFORGE_OPENBLAS_CORETYPE");
    const std::string core = ours ? ours : avx512 ? "SkylakeX" : "";
    const char* user_core = std::getenv("OPENBLAS_CORETYPE");
    const char* user_threads = std::getenv("OPENBLAS_NUM_THREADS");
    const std::string saved_core = user_core ? user_core : "", saved_threads = user_threads ? user_threads : "";
    if (!core.empty()) setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    void* h = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
    if (user_core) setenv("OPENBLAS_CORETYPE", saved_core.c_str(), 1);
    else unsetenv("OPENBLAS_CORETYPE");
    if (user_threads) setenv("OPENBLAS_NUM_THREADS", saved_threads.c_str(), 1);
    else unsetenv("OPENBLAS_NUM_THREADS");
    if (!h) {
      o.error = std::string("cannot load libopenblas.so.0: ") + dlerror();
      return o;
    }
    o.sgemm = reinterpret_cast<CblasSgemm>(dlsym(h, "cblas_sgemm"));
    auto set_threads_fn = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"));
    auto config = reinterpret_cast<const char* (*)()>(dlsym(h, "openblas_get_config"));
    auto corename = reinterpret_cast<const char* (*)()>(dlsym(h, "openblas_get_corename"));
    if (!o.sgemm) {
      o.error = "libopenblas.so.0 has no cblas_sgemm";
      return o;
    }
    if (set_threads_fn) set_threads_fn(1);
    std::string cfg = config ? config() : "OpenBLAS";
    if (const auto sp = cfg.find(' ', cfg.find(' ') + 1); sp != std::string::npos) cfg.resize(sp);  // "OpenBLAS x.y.z"
    o.name = cfg + " (" + (corename ? corename() : "?") + " kernels)";
    return o;
  }();
  return lib;
}

bool amd_avx512() {
  return __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

std::atomic<int> g_backend{-1};  // -1: not chosen yet; else a BlasBackend
std::string g_why;
std::once_flag g_choose_once;

void choose_backend() {
  std::call_once(g_choose_once, [] {
    if (g_backend.load() >= 0) return;  // set_blas_backend came first
    const char* e = std::getenv("LOONGFORGE_BLAS");
    const std::string want = e ? e : "auto";
    BlasBackend b = BlasBackend::kMkl;
    if (want == "openblas") {
      if (!openblas().sgemm) throw std::runtime_error("LOONGFORGE_BLAS=openblas: " + openblas().error);
      b = BlasBackend::kOpenBlas;
      g_why = "LOONGFORGE_BLAS=openblas";
    } else if (want == "mkl") {
      g_why = "LOONGFORGE_BLAS=mkl";
    } else if (want != "auto") {
      throw std::runtime_error("LOONGFORGE_BLAS: '" + want + "' is not one of auto, mkl, openblas");
    } else if (amd_avx512()) {
      if (openblas().sgemm) {
        b = BlasBackend::kOpenBlas;
        g_why = "AMD CPU with AVX-512 (MKL would take its AVX2 path)";
      } else {
        g_why = "AMD CPU with AVX-512, but " + openblas().error;
      }
    } else {
      g_why = __builtin_cpu_is("amd") ? "AMD CPU without AVX-512" : "not an AMD CPU";
    }
    g_backend.store(static_cast<int>(b));
  });
}

// Row-major C = alpha op(A) op(B) + beta C through OpenBLAS on one thread, split over ATen's threads in blocks of
// rows (or of columns, when C is wide and short) outside a parallel region when the product is large enough.
void openblas_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                    const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const CblasSgemm f = openblas().sgemm;
  auto run = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    const float* ab = ta ? a + m0 : a + m0 * lda;  // op(A) rows m0..m1
    const float* bb = tb ? b + n0 * ldb : b + n0;  // op(B) columns n0..n1
    f(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m1 - m0), static_cast<int>(n1 - n0),
      static_cast<int>(k), alpha, ab, static_cast<int>(lda), bb, static_cast<int>(ldb), beta, c + m0 * ldc + n0,
      static_cast<int>(ldc));
  };
  constexpr double kMinSplitMacs = 2.0e6;  // below: the fork/join costs more than it gains
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (threads <= 1 || static_cast<double>(m) * n * k < kMinSplitMacs) return run(0, m, 0, n);
  const bool by_rows = m >= n;
  const int64_t len = by_rows ? m : n;
  const int64_t per = ((len + threads - 1) / threads + 15) / 16 * 16;  // whole 16-wide blocks
  const int64_t blocks = (len + per - 1) / per;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t lo = i * per, hi = std::min(len, lo + per);
      if (by_rows) run(lo, hi, 0, n);
      else run(0, m, lo, hi);
    }
  });
}

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
    if (k > 0 && blas_backend() == BlasBackend::kOpenBlas)
      return openblas_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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

BlasBackend blas_backend() {
  const int b = g_backend.load(std::memory_order_relaxed);
  if (b >= 0) return static_cast<BlasBackend>(b);
  choose_backend();
  return static_cast<BlasBackend>(g_backend.load());
}

void set_blas_backend(BlasBackend backend) {
  if (backend == BlasBackend::kOpenBlas && !openblas().sgemm)
    throw std::runtime_error("set_blas_backend: " + openblas().error);
  choose_backend();  // settles the one-time choice first, so it cannot overwrite this later
  g_backend.store(static_cast<int>(backend));
  g_why = "set by the caller";
}

std::string blas_backend_description() {
  const BlasBackend b = blas_backend();
  return (b == BlasBackend::kOpenBlas ? openblas().name : std::string("MKL (in LibTorch)")) + ": " + g_why;
}

bool has_packed_gemm() {
  // LOONGFORGE_PACKED_GEMM=0 turns the packed path off (A/B runs of bench/cpu_train.py and bench/kernels_bench.cpp).
  static const bool off = [] {
    const char* e = std::getenv("LOONGFORGE_PACKED_GEMM");
    return e && std::string(e) == "0";
  }();
  return !off && blas_backend() == BlasBackend::kMkl && cblas_sgemm_pack_get_size && cblas_sgemm_pack && cblas_sgemm_compute;
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

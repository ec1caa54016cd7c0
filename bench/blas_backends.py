"""The float32 GEMMs of a CPU training step under the two BLAS backends LoongForge can pick at run time
(kernels/cpu/blas.h): MKL as LibTorch carries it (what PyTorch runs) and Debian's OpenBLAS with the kernels it is
loaded with (OPENBLAS_CORETYPE; SkylakeX = its AVX-512 kernels, Haswell = AVX2). One thread each, the shapes of
bench/cpu_train.py's two models split over two threads (half the rows per product), median of N calls.

  .venv/bin/python bench/blas_backends.py [--core SkylakeX] [--reps 15]

Prints GFLOP/s per shape and OpenBLAS's speed-up over MKL. The choice LoongForge makes on this machine is what
`loongforge env` prints ("cpu float32 gemm: ...").
"""
import argparse
import ctypes
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--core", default="SkylakeX", help="OPENBLAS_CORETYPE for the OpenBLAS column")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    os.environ["OPENBLAS_CORETYPE"] = args.core  # read when libopenblas initialises (below)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
    lib = ctypes.CDLL("libopenblas.so.0")
    lib.openblas_get_corename.restype = ctypes.c_char_p
    core = lib.openblas_get_corename().decode()
    f32, ptr = ctypes.c_float, ctypes.c_void_p

    def openblas_mm(a, b, c):
        (m, k), n = a.shape, b.shape[1]
        ta, lda = (112, a.stride(1)) if a.stride(0) == 1 else (111, a.stride(0))
        tb, ldb = (112, b.stride(1)) if b.stride(0) == 1 else (111, b.stride(0))
        lib.cblas_sgemm(101, ta, tb, m, n, k, f32(1.0), ptr(a.data_ptr()), lda, ptr(b.data_ptr()), ldb, f32(0.0),
                        ptr(c.data_ptr()), n)

    def median_time(f):
        f()
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    rows = []
    for d, ffn, vocab, tokens in [(256, 688, 8192, 2048), (512, 1376, 16384, 2048)]:
        m = tokens // 2
        # (name, a [m,k] (transposed view when the product reads it transposed), b [k,n])
        shapes = [(f"x W^T (d{d})", (m, d), (d, d), "nt"), (f"up/gate (d{d})", (m, d), (d, ffn), "nt"),
                  (f"down (d{d})", (m, ffn), (ffn, d), "nt"), (f"dW attn (d{d})", (d // 2, tokens), (tokens, d), "tn"),
                  (f"dW up (d{d})", (ffn // 2, tokens), (tokens, d), "tn"),
                  (f"logits chunk (V{vocab})", (128, d), (d, vocab), "nt")]
        for name, (mm, k), (_, n), kind in shapes:
            a = torch.randn(mm, k) if kind == "nt" else torch.randn(k, mm).t()
            b = torch.randn(n, k).t() if kind == "nt" else torch.randn(k, n)
            c = torch.empty(mm, n)
            t_mkl = median_time(lambda: torch.mm(a, b, out=c))
            want = c.clone()
            t_ob = median_time(lambda: openblas_mm(a, b, c))
            err = ((c - want).abs().max() / want.abs().max()).item()
            gf = 2 * mm * k * n / 1e9
            rows.append((name, f"{mm}x{k}x{n}", gf / t_mkl, gf / t_ob, t_mkl / t_ob, err))
    cpu = "?"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"float32 GEMM, one thread, median of {args.reps} ({cpu}; torch {torch.__version__}; OpenBLAS {core} kernels)\n")
    print("| product | m x k x n | MKL GFLOP/s | OpenBLAS GFLOP/s | OpenBLAS / MKL | max rel diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f}x | {r[5]:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

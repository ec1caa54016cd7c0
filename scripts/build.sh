#!/usr/bin/env bash
# Configures (once) and builds ./build with Ninja and ccache against the LibTorch of .venv.
# CUDA kernels: on when nvcc is found; LOONGFORGE_CUDA=OFF (or ON) and CUDA_ARCHS=90 are passed to the first configure.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
# The CUDA toolkit lives in /usr/local/cuda on our machines; nvcc need not be on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1 CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
if [ ! -f "$BUILD/build.ninja" ]; then
  TORCH_PREFIX=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    -DPython3_EXECUTABLE="$PWD/.venv/bin/python" ${LOONGFORGE_CUDA:+-DLOONGFORGE_CUDA=$LOONGFORGE_CUDA} \
    ${CUDA_ARCHS:+-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS} ${CMAKE_ARGS:-}
fi
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}"

#!/usr/bin/env bash
# Configures (once) and builds ./build with Ninja and ccache against the LibTorch of .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1 CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
if [ ! -f "$BUILD/build.ninja" ]; then
  TORCH_PREFIX=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    -DPython3_EXECUTABLE="$PWD/.venv/bin/python" ${CMAKE_ARGS:-}
fi
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}"

#!/usr/bin/env bash
# Downloads, on this (Debian 12) machine, what bench/gpu_check.sh needs on the GPU machine (Ubuntu 24.04, no network):
# the Debian 12 .deb files of the build dependencies it may lack (headers, CMake/pkg-config files, and the runtime
# libraries the -dev symlinks point to), plus the cmake and ninja wheels as a fallback when the GPU machine has no
# cmake/ninja. Everything goes to third_party_debs/ (gitignored); pass it along to the GPU machine (run(carry=...)).
#   bash scripts/fetch_gpu_debs.sh            # debs + tool wheels
#   NO_WHEELS=1 bash scripts/fetch_gpu_debs.sh  # debs only
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-third_party_debs}
mkdir -p "$DEST"
# Header-only / CMake-config-only: nlohmann-json3-dev, libcli11-dev, libgloo-dev (only the headers are used: c10d's
# Gloo backend lives in libtorch_cpu). Static libraries: libgtest-dev (libgtest.a, libgtest_main.a, GTest config).
# Shared libraries (the -dev package has headers and the .so link, the runtime package the .so.N): pcre2, utf8proc,
# yaml-cpp, sentencepiece, png (+ zlib1g-dev: png.h includes zlib.h; zlib1g itself is on every Ubuntu).
# pkgconf-bin + libpkgconf3: pkg-config for find_package(PkgConfig) if the machine has none.
PKGS=(
  nlohmann-json3-dev libcli11-dev libgloo-dev libgtest-dev
  libpcre2-dev libpcre2-8-0
  libutf8proc-dev libutf8proc2
  libyaml-cpp-dev libyaml-cpp0.7
  libsentencepiece-dev libsentencepiece0
  libpng-dev libpng16-16 zlib1g-dev
  libturbojpeg0-dev libturbojpeg0
  pkgconf-bin libpkgconf3
)
(cd "$DEST" && apt-get download "${PKGS[@]}")
if [ -z "${NO_WHEELS:-}" ]; then
  PY=${PYTHON:-.venv/bin/python}
  mkdir -p "$DEST/wheels"
  "$PY" -m pip download --only-binary=:all: --no-deps --platform manylinux2014_x86_64 --python-version 3.12 \
    --implementation cp --dest "$DEST/wheels" cmake ninja
fi
du -sh "$DEST"
ls -1 "$DEST"

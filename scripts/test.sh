#!/usr/bin/env bash
# The test command (README, .ci/run): set up (idempotent), build, run the C++ tests (ctest) and the oracle tests
# that compare with transformers / tokenizers / safetensors / sentencepiece (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# Several test processes share the cores: libgomp's idle threads would otherwise spin at every barrier and take the
# core from the thread they wait for (bench/results/policy_cpu.md).
export GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-10000}
(cd build && ctest --output-on-failure -j "$(nproc)")
# One pytest worker per core (LF_TEST_WORKERS overrides), a test file's tests on one worker (module fixtures are made
# once); conftest.py hands out the longest files first. --durations: what to move to the slow set.
workers=${LF_TEST_WORKERS:-$(nproc)}
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider -n "$workers" --dist loadfile --no-loadscope-reorder --durations=30

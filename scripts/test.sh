#!/usr/bin/env bash
# The test command (README, .ci/run): set up (idempotent), build, run the C++ tests (ctest) and the oracle tests
# that compare with transformers / tokenizers / safetensors / sentencepiece (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
(cd build && ctest --output-on-failure -j "$(nproc)")
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider --durations=30  # the slowest tests: what to move to the slow set

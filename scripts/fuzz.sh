#!/usr/bin/env bash
# Fuzzes every parser and decoder we own with libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer.
#
#   bash scripts/fuzz.sh [RUNS] [TARGET...]     RUNS executions per target (default 10000000; 0: time-bounded only)
#   FUZZ_SECONDS=N bounds each target's time as well (default 0: none); FUZZ_JOBS=N runs N targets at once.
#
# Builds ./build-fuzz with clang (the whole library instrumented: -fsanitize=address,undefined and libFuzzer's
# coverage), writes the seed corpora (scripts/fuzz_seeds.py) into build-fuzz/corpus/<target>, runs each target
# (new inputs it finds join its corpus; a crash leaves build-fuzz/findings/<target>/crash-*), and writes the table
# of executions, time and findings to bench/results/fuzz.md. A finding is fixed with a regression seed: the input
# goes into tests/fuzz/regressions/<target>/ (tests/python/test_fuzz.py replays those in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-10000000}
shift || true
TARGETS=("$@")
BUILD=${FUZZ_BUILD_DIR:-build-fuzz}
CXX=${FUZZ_CXX:-clang++}
CC=${FUZZ_CC:-clang}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found (apt-get install clang libclang-rt-14-dev)"; exit 1; }

if [ ! -f "$BUILD/build.ninja" ]; then
  TORCH_PREFIX=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  SAN="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" -DPython3_EXECUTABLE="$PWD/.venv/bin/python" \
    -DCMAKE_CXX_FLAGS="$SAN -fsanitize=fuzzer-no-link" -DCMAKE_C_FLAGS="$SAN" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DLOONGFORGE_FUZZ=ON -DLOONGFORGE_TESTS=OFF -DLOONGFORGE_BENCH=OFF -DLOONGFORGE_CUDA=OFF -DLOONGFORGE_MPI=OFF
fi
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1 CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
cmake --build "$BUILD" --target loongforge_fuzz -j "${JOBS:-$(nproc)}"

.venv/bin/python scripts/fuzz_seeds.py "$BUILD/corpus" >/dev/null
if [ ${#TARGETS[@]} -eq 0 ]; then
  mapfile -t TARGETS < <(cd "$BUILD/corpus" && ls -d */ | tr -d /)
fi
# LibTorch is not instrumented: its own allocations and ODR layout are not ours to judge; leaks of a process that
# runs millions of inputs are reported by the RSS limit instead.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:detect_odr_violation=0:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export OMP_NUM_THREADS=1 TMPDIR=${TMPDIR:-/tmp}

results=$(mktemp)
run_one() {
  local t=$1 log="$BUILD/logs/$1.log"
  mkdir -p "$BUILD/findings/$t" "$BUILD/logs" "$BUILD/corpus/$t"
  local extra=()
  if [ -d "tests/fuzz/regressions/$t" ]; then extra+=("tests/fuzz/regressions/$t"); fi
  local start=$SECONDS rc=0 runs=$RUNS
  if [ "$runs" = 0 ]; then runs=-1; fi  # libFuzzer: -1 = no bound on executions
  LF_FUZZ_TARGET=$t "$BUILD/loongforge_fuzz" -runs="$runs" -max_total_time="${FUZZ_SECONDS:-0}" -timeout=30 \
    -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 -artifact_prefix="$BUILD/findings/$t/" \
    "$BUILD/corpus/$t" "${extra[@]}" >"$log" 2>&1 || rc=$?
  local execs secs findings
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  secs=$((SECONDS - start))
  findings=$(find "$BUILD/findings/$t" -type f | wc -l)
  echo "$t ${execs:-0} $secs $findings $rc" >>"$results"
  echo "fuzz: $t: ${execs:-0} executions in ${secs}s, findings $findings (exit $rc)"
}
export -f run_one
export BUILD RUNS results
printf '%s\n' "${TARGETS[@]}" | xargs -P "${FUZZ_JOBS:-1}" -I{} bash -c 'run_one {}'

# The table keeps one row per target: this run's rows replace the same targets' earlier rows, the others stay.
FUZZ_DATE=$(date -u +%Y-%m-%d) FUZZ_CLANG=$($CXX --version | head -1) FUZZ_CORES=$(getconf _NPROCESSORS_ONLN) \
  FUZZ_RUNS=$RUNS FUZZ_BOUND=${FUZZ_SECONDS:-0} .venv/bin/python - "$results" bench/results/fuzz.md <<'PY'
import os, pathlib, sys
new, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows, notes = {}, ""
if out.exists() and "\n## " in out.read_text():  # hand-written sections after the table (findings fixed) stay
    notes = out.read_text()[out.read_text().index("\n## "):]
if out.exists():
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 8 and cells[0] != "target":
            rows[cells[0]] = line
e = os.environ
for line in new.read_text().split("\n"):
    if line.strip():
        t, execs, secs, found, rc = line.split()
        bound = f"{e['FUZZ_RUNS']} runs" if e["FUZZ_RUNS"] != "0" else "none"
        rows[t] = (f"| {t} | {execs} | {secs} | {found} | {rc} | {e['FUZZ_DATE']} | {bound} | {e['FUZZ_BOUND']} s |")
out.write_text("\n".join([
    "# Fuzzing (scripts/fuzz.sh): libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer", "",
    f"{e['FUZZ_CLANG']}, {e['FUZZ_CORES']} cores (the latest run per target). Findings are inputs that crashed, tripped "
    "a sanitizer or let an exception other than lf::Error escape (libFuzzer stops at the first; exit 77 / 1); each is "
    "fixed with a regression seed in tests/fuzz/regressions/<target>/, which CI replays, and the target is run again.",
    "", "| target | executions | seconds | findings | exit | date | run bound | time bound |",
    "|---|---:|---:|---:|---:|---|---|---|", *[rows[k] for k in sorted(rows)], ""]) + notes)
PY
rm -f "$results"
cat bench/results/fuzz.md

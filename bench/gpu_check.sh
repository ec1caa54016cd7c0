#!/usr/bin/env bash
# The one call on the GPU machine (issue 4; Ubuntu 24.04, CUDA 13.0, PyTorch 2.11 in python3, H200 = sm_90; no
# network), under 8 minutes in all:
#   1. configure + build LoongForge with CMake/Ninja against python3's torch, -DLOONGFORGE_CUDA=ON, sm_90; build
#      dependencies the machine lacks come from the Debian 12 .deb files of scripts/fetch_gpu_debs.sh
#      (third_party_debs/, carried along), unpacked with dpkg -x into the build folder;
#   2. run the CUDA gtests (kernels; whole steps: CUDA graphs, packed documents, the distributed engine on NCCL) and
#      the distributed check (bench/gpu_dist_check.py: every layout with both ranks on the GPU, ZeRO-1 on NCCL, each
#      = the one-process GPU run; by default the data-parallel cases, GPU_CHECK_DIST=all for every layout);
#   3. the training benchmark (bench/gpu_train.py): LoongForge vs PyTorch eager / torch.compile, tokens/s, MFU, peak
#      memory, ratios (table in $OUT/gpu_train.md, JSON in $OUT/gpu_train.json): issue 4's dense shapes, then issue
#      6's Qwen3-MoE shape against transformers' Qwen3MoeForCausalLM (goal >= 2 x 54.9k tok/s);
#   4. the vision-language training step (bench/vlm_train.py --device cuda): a Qwen2.5-VL-shape model against
#      transformers' eager one (issue 19);
#   5. the DiT training step (bench/dit_train.py --device cuda, bf16): DiT-B/2 and DiT-XL/2 against diffusers' eager
#      model (issue 20);
#   6. the robot-policy training step (bench/policy_cpu.py --device cuda): ACT and a small π0 against LeRobot where
#      a Python with lerobot is given (issue 24; skipped otherwise);
#   7. every robot-policy family trained and evaluated on the GPU without LeRobot (bench/policy_device_check.sh, on the
#      carried demo datasets runs/reach*-demo-data);
#   8. print a short table last.
# Usage (repo root):  bash bench/gpu_check.sh
#   OUT=dir            where logs and JSON go (default build-gpu/gpu_out; the device tool's $OUT when set)
#   LF_DEBS=dir        the .deb folder (default ./third_party_debs)
#   BUILD_DIR=dir      build folder (default build-gpu)
#   CMAKE_ARGS="..."   extra configure arguments
#   PYTHON=python      the Python whose torch to build against (default python3)
#   GPU_CHECK_ONLY=configure   stop after configuring (to check the script on a machine without a GPU)
#   GPU_CHECK_ONLY=bench       skip the CUDA tests (a second call on a warm machine: the build is a no-op, the
#                              benchmark gets the time; GPU_BENCH_BUDGET=s sets it)
#   GPU_CHECK_ONLY=dist        the distributed check alone (with GPU_CHECK_DIST=all: every layout, ~2 minutes)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
T_START=$(date +%s)
BUILD=${BUILD_DIR:-build-gpu}
OUT=${OUT:-$ROOT/$BUILD/gpu_out}
mkdir -p "$OUT"
DEBS=${LF_DEBS:-$ROOT/third_party_debs}
SYSROOT=$ROOT/$BUILD/debroot
JOBS=${JOBS:-$(nproc)}
ROWS=()  # "step|status|seconds|detail"

row() { ROWS+=("$1|$2|$3|$4"); echo "== $1: $2 ($3 s) $4"; }
elapsed() { echo $(( $(date +%s) - $1 )); }
print_table() {
  echo
  echo "================ gpu_check summary ($(elapsed "$T_START") s total) ================"
  printf '%-28s %-6s %7s  %s\n' step status seconds detail
  for r in "${ROWS[@]}"; do
    IFS='|' read -r a b c d <<<"$r"
    printf '%-28s %-6s %7s  %s\n' "$a" "$b" "$c" "$d"
  done
  if [ -f "$OUT/cuda_tests.json" ] || [ -f "$OUT/cuda_tests_steps.json" ]; then
    echo
    "$PY" - "$OUT/cuda_tests.json" "$OUT/cuda_tests_steps.json" <<'PY'
import json, os, sys
suites = []
for f in sys.argv[1:]:
    if os.path.exists(f):
        suites += json.load(open(f)).get("testsuites", [])
print(f"{'test':55s} {'result':8s} {'ms':>7s}")
for s in suites:
    for t in s.get("testsuite", []):
        name = f"{s['name']}.{t['name']}"
        res = "FAIL" if t.get("failures") else ("SKIP" if t.get("result") == "SKIPPED" else "ok")
        ms = float(t.get("time", "0s").rstrip("s")) * 1000
        print(f"{name:55s} {res:8s} {ms:7.0f}")
        for f in t.get("failures", []):
            print("    " + f.get("failure", "").splitlines()[0][:150])
PY
  fi
}

# ---- 0. environment -------------------------------------------------------------------------------------------------
T=$(date +%s)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1
  (command -v nvcc || ls /usr/local/cuda/bin/nvcc) 2>&1
  g++ --version 2>&1 | head -1
} | tee "$OUT/env.txt"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
TORCH_PREFIX=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
if [ -z "$TORCH_PREFIX" ] || [ ! -x "$NVCC" ]; then
  row environment FAIL "$(elapsed "$T")" "python3 torch or nvcc missing (see $OUT/env.txt)"
  print_table
  exit 1
fi
row environment ok "$(elapsed "$T")" "$(grep -m1 "^torch" "$OUT/env.txt")"

# ---- 1a. tools and Debian packages ----------------------------------------------------------------------------------
T=$(date +%s)
mkdir -p "$BUILD" "$SYSROOT"
# cmake and ninja: the machine's, else the carried wheels.
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  if ls "$DEBS"/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links "$DEBS/wheels" --target "$ROOT/$BUILD/tools" cmake ninja \
      >"$OUT/tools.log" 2>&1
    export PATH="$ROOT/$BUILD/tools/bin:$PATH" PYTHONPATH="$ROOT/$BUILD/tools${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
ndebs=0
for f in "$DEBS"/*.deb; do
  [ -e "$f" ] || continue
  if command -v dpkg >/dev/null; then
    dpkg -x "$f" "$SYSROOT"
  else  # ar + tar (a .deb is an ar archive holding data.tar.*)
    (d=$(mktemp -d) && cd "$d" && ar x "$f" && tar -xf data.tar.* -C "$SYSROOT" && rm -rf "$d")
  fi
  ndebs=$((ndebs + 1))
done
LIBDIR=$SYSROOT/usr/lib/x86_64-linux-gnu
# zlib1g-dev's libz.so is an absolute link to Debian's /lib/x86_64-linux-gnu/libz.so.1.2.13: point it at the
# machine's libz.so.1 (zlib1g is on every Ubuntu).
if [ -L "$LIBDIR/libz.so" ] && [ ! -e "$LIBDIR/libz.so" ]; then
  for z in /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1; do
    if [ -e "$z" ]; then ln -sf "$(readlink -f "$z")" "$LIBDIR/libz.so" && break; fi
  done
fi
export PKG_CONFIG_LIBDIR="$LIBDIR/pkgconfig:$SYSROOT/usr/share/pkgconfig"
export PKG_CONFIG_SYSROOT_DIR="$SYSROOT"
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PKG_ARGS=()
if ! command -v pkg-config >/dev/null && [ -x "$SYSROOT/usr/bin/pkgconf" ]; then
  PKG_ARGS=(-DPKG_CONFIG_EXECUTABLE="$SYSROOT/usr/bin/pkgconf")
fi
if command -v cmake >/dev/null && command -v ninja >/dev/null; then
  row "tools + debs" ok "$(elapsed "$T")" "$(cmake --version | head -1), ninja $(ninja --version), $ndebs debs"
else
  row "tools + debs" FAIL "$(elapsed "$T")" "no cmake/ninja (and no wheels in $DEBS/wheels)"
  print_table
  exit 1
fi

# ---- 1b. configure --------------------------------------------------------------------------------------------------
T=$(date +%s)
unset TORCH_CUDA_ARCH_LIST
# shellcheck disable=SC2086
timeout 240 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$SYSROOT/usr" -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DLOONGFORGE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLOONGFORGE_BENCH=OFF \
  -DLOONGFORGE_GLOO_INCLUDE="$SYSROOT/usr/include" "${PKG_ARGS[@]}" ${CMAKE_ARGS:-} >"$OUT/configure.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  tail -30 "$OUT/configure.log"
  row configure FAIL "$(elapsed "$T")" "rc $rc, see $OUT/configure.log"
  print_table
  exit 1
fi
row configure ok "$(elapsed "$T")" "$(grep -o 'LoongForge CUDA kernels: .*' "$OUT/configure.log" | head -1)"
if [ "${GPU_CHECK_ONLY:-}" = configure ]; then
  print_table
  exit 0
fi

# ---- 1c. build ------------------------------------------------------------------------------------------------------
T=$(date +%s)
timeout 330 cmake --build "$BUILD" -j "$JOBS" --target loongforge_tests loongforge >"$OUT/build.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  grep -E "error|FAILED" "$OUT/build.log" | head -20
  tail -20 "$OUT/build.log"
  row build FAIL "$(elapsed "$T")" "rc $rc (124: timeout), see $OUT/build.log"
  print_table
  exit 1
fi
row build ok "$(elapsed "$T")" "loongforge_tests, loongforge ($JOBS jobs)"
"$BUILD/loongforge" env >"$OUT/loongforge_env.txt" 2>&1
row "loongforge env" "$([ "$(grep -c '^gpu [0-9]' "$OUT/loongforge_env.txt")" -gt 0 ] && echo ok || echo FAIL)" 0 \
  "$(grep -E '^(gpu 0|gpus)' "$OUT/loongforge_env.txt" | head -1)"

# ---- 2. CUDA tests --------------------------------------------------------------------------------------------------
# Two processes: the kernel tests, then the whole-step ones (CUDA graphs, packed-document flash attention, the model
# on the GPU, the distributed engine with NCCL at world size 1), so a device error in one group cannot take the other's results with it.
T=$(date +%s)
if [ -n "${GPU_CHECK_ONLY:-}" ]; then
  row "cuda tests" SKIP 0 "GPU_CHECK_ONLY=$GPU_CHECK_ONLY"
else
STEP_TESTS='CudaKernels.Graph*:CudaKernels.CausalLM*:CudaKernels.Document*:CudaKernels.DataParallel*'
for group in kernels steps; do
  if [ $group = kernels ]; then
    filter="CudaKernels.*:Fp8.*:RMSNormKernel.*:DistGpu.*:-$STEP_TESTS"
    json=cuda_tests.json
  else
    filter=$STEP_TESTS
    json=cuda_tests_steps.json
  fi
  timeout 150 "$BUILD/loongforge_tests" --gtest_filter="$filter" --gtest_output="json:$OUT/$json" \
    >"$OUT/cuda_tests_$group.log" 2>&1
  rc=$?
  summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/cuda_tests_$group.log" | head -3 | tr -s ' ' | tr '\n' ' ')
  if [ $rc -eq 0 ] && ! grep -q 'SKIPPED \] CudaKernels' "$OUT/cuda_tests_$group.log"; then
    row "cuda tests ($group)" ok "$(elapsed "$T")" "$summary"
  else
    tail -40 "$OUT/cuda_tests_$group.log"
    row "cuda tests ($group)" FAIL "$(elapsed "$T")" "rc $rc; $summary (skips mean no device was seen)"
  fi
  T=$(date +%s)
done
fi

# ---- 2b. distributed training on the GPU (bench/gpu_dist_check.py): dp2, dp2 + ZeRO-1, tp2, tp2 + sp, pp2, pp2 x vpp2,
# cp2 ring / a2a, FSDP, ep2 with both ranks on the one GPU (Gloo), ZeRO-1 at world size 1 (NCCL), each against the
# single-process GPU run.
T=$(date +%s)
if [ "${GPU_CHECK_ONLY:-}" = bench ]; then
  row "distributed on GPU" SKIP 0 "GPU_CHECK_ONLY=bench"
else
  timeout 300 "$PY" bench/gpu_dist_check.py --lf "$BUILD/loongforge" --out "$OUT" --layouts "${GPU_CHECK_DIST:-dp}" \
    >"$OUT/gpu_dist.log" 2>&1
  rc=$?
  cat "$OUT/gpu_dist.log"
  if [ $rc -eq 0 ]; then
    row "distributed on GPU" ok "$(elapsed "$T")" "layouts ${GPU_CHECK_DIST:-dp} (gloo), ZeRO-1 (nccl) = one process"
  else
    row "distributed on GPU" FAIL "$(elapsed "$T")" "rc $rc, see $OUT/gpu_dist.log"
  fi
fi

# ---- 3. training benchmark: LoongForge vs PyTorch eager / torch.compile (bench/gpu_train.py) ------------------------
# ---- BEGIN TRAINING BENCHMARK ----
# The two shapes of issue 4 and the MoE shape of issue 6, each run its own process; the torch.compile runs go after
# every shape's LoongForge and eager runs, and runs that no longer fit the budget are reported as skipped.
# GPU_BENCH_BUDGET (s, default: what is left of 460 s since the start), GPU_BENCH_STEPS (timed steps, default 8),
# GPU_BENCH_SHAPES (default small,1b,moe; GPU_BENCH_SHAPES=moe for the MoE rows alone), GPU_BENCH_RUNS (default
# loongforge,eager,compile), GPU_CHECK_GRAPHS=0 (no LoongForge rows with train.cuda_graphs: true, which run after
# the torch.compile ones by default), GPU_CHECK_FP8=1 (LoongForge fp8 rows too; GPU_CHECK_FP8=blockwise: tensorwise and blockwise rows), GPU_CHECK_CURVES=1 (fp32 vs bf16 loss
# curves, 200 steps of the small shape: ~2 more minutes, so off by default).
T=$(date +%s)
BUDGET=${GPU_BENCH_BUDGET:-$(( 460 - $(elapsed "$T_START") ))}
if [ "${GPU_CHECK_ONLY:-}" = dist ]; then
  row "training benchmark" SKIP 0 "GPU_CHECK_ONLY=dist"
elif [ "$BUDGET" -lt 60 ]; then
  row "training benchmark" SKIP 0 "only $BUDGET s left of the 8 minutes"
else
  FP8_BLOCK=""
  if [ "${GPU_CHECK_FP8:-}" = blockwise ]; then FP8_BLOCK=--fp8-blockwise; fi
  GRAPHS=--graphs
  if [ "${GPU_CHECK_GRAPHS:-1}" = 0 ]; then GRAPHS=""; fi
  timeout $(( BUDGET + 60 )) "$PY" bench/gpu_train.py --lf "$BUILD/loongforge" --out "$OUT" --budget "$BUDGET" \
    --steps "${GPU_BENCH_STEPS:-8}" --warmup 3 --shapes "${GPU_BENCH_SHAPES:-small,1b,moe}" \
    --runs "${GPU_BENCH_RUNS:-loongforge,eager,compile}" \
    ${GPU_CHECK_FP8:+--fp8} $FP8_BLOCK $GRAPHS ${GPU_CHECK_CURVES:+--curves} >"$OUT/gpu_train.log" 2>&1
  rc=$?
  tail -25 "$OUT/gpu_train.log"
  if [ -f "$OUT/gpu_train.json" ]; then
    while IFS='|' read -r name status secs detail; do
      row "$name" "$status" "$secs" "$detail"
    done < <("$PY" - "$OUT/gpu_train.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    st = r["status"]
    status = "ok" if st.startswith("ok") else ("SKIP" if st.startswith("skipped") else "FAIL")
    if "tokens_per_s" in r:
        mem = r.get("max_memory_allocated")
        detail = f"{r['tokens_per_s']:.0f} tok/s, MFU {r['mfu'] * 100:.1f} %" + (f", peak {mem / 2**30:.1f} GiB" if mem else "")
        if r["mode"].startswith("loongforge"):
            detail += "".join(f", {r[k]:.2f}x {m}" for k, m in (("vs_eager", "HF eager"), ("vs_compile", "compile"))
                              if k in r)
        if "goal_met" in r:
            detail += f", goal >= {r['goal_tokens_per_s'] / 1e3:.1f}k: {'yes' if r['goal_met'] else 'NO'}"
        if r.get("hf_experts_implementation"):
            detail += f" (HF experts {r['hf_experts_implementation']})"
    elif r["mode"] == "curves" and st == "ok":
        detail = f"bf16 vs fp32 over {r['steps']} steps: {r['max_rel_10step_mean'] * 100:.2f} % (goal 1 %)"
        status = "ok" if r["within_1pct"] else "FAIL"
    else:
        detail = st
    print(f"train {r['shape']} {r['mode']}|{status}|{r.get('wall_s', 0):.0f}|{detail[:150]}".replace("\n", " "))
PY
)
  else
    row "training benchmark" FAIL "$(elapsed "$T")" "rc $rc, no gpu_train.json (see $OUT/gpu_train.log)"
  fi
  [ -f "$OUT/gpu_train.md" ] && { echo; cat "$OUT/gpu_train.md"; }
fi
# ---- END TRAINING BENCHMARK ----

# ---- 4. vision-language training step: LoongForge vs transformers eager on the GPU (bench/vlm_train.py) ------------
# A Qwen2.5-VL-shape model (issue 19), both sides fp32 on the GPU, the baseline measured in the same call.
if [ "${GPU_CHECK_ONLY:-}" = dist ]; then
  row "vlm train (Qwen2.5-VL shape)" SKIP 0 "GPU_CHECK_ONLY=dist"
else
  T=$(date +%s)
  if timeout 300 "$PY" bench/vlm_train.py --device cuda --lf "$BUILD/loongforge" --rounds 2 --steps 6 --warmup 2 \
      --out "$OUT/vlm_train.md" >"$OUT/vlm_train.log" 2>&1; then
    row "vlm train (Qwen2.5-VL shape)" ok "$(elapsed "$T")" "$(tail -1 "$OUT/vlm_train.md" | cut -d'|' -f3-5 | tr -s ' ')"
    cat "$OUT/vlm_train.md"
  else
    row "vlm train (Qwen2.5-VL shape)" FAIL "$(elapsed "$T")" "see $OUT/vlm_train.log: $(tail -1 "$OUT/vlm_train.log" | cut -c1-100)"
  fi
fi

# ---- 5. DiT training step: LoongForge vs diffusers eager on the GPU (bench/dit_train.py) -----------------------------
# DiT-B/2 and DiT-XL/2 at 256 x 256 (256 tokens), batch 256, bf16 (issue 20: goals >= 3,200 and >= 550 img/s; diffusers
# eager measured 1,595 and 386 on an H200 with PyTorch 2.11), the baseline measured in the same call.
for SHAPE in B/2 XL/2; do
  NAME="dit train (DiT-$SHAPE, bf16)"
  if [ "${GPU_CHECK_ONLY:-}" = dist ]; then row "$NAME" SKIP 0 "GPU_CHECK_ONLY=dist"; continue; fi
  T=$(date +%s)
  F="$OUT/dit_train_${SHAPE/\//_}"
  if timeout 240 "$PY" bench/dit_train.py --device cuda --precision bf16 --shape "$SHAPE" --lf "$BUILD/loongforge" \
      --rounds 2 --steps 5 --warmup 2 --out "$F.md" >"$F.log" 2>&1; then
    row "$NAME" ok "$(elapsed "$T")" "$(tail -1 "$F.md" | cut -d'|' -f3-5 | tr -s ' ')"
    cat "$F.md"
  else
    row "$NAME" FAIL "$(elapsed "$T")" "see $F.log: $(tail -1 "$F.log" | cut -c1-100)"
  fi
done

# ---- 6. robot-policy training step: LoongForge vs LeRobot on the GPU (bench/policy_cpu.py --device cuda) ------------
# ACT at LeRobot's default d512 and the small π0 shape (issue 24), fp32. LeRobot is not on the GPU image and its imports
# (datasets, pandas, pyarrow, OpenCV, PyAV, diffusers, ...) do not fit the carry: the rows run where a Python with
# lerobot 0.6.1 is named by LOONGFORGE_LEROBOT_PYTHON, and are skipped with that reason otherwise.
LR_PY=${LOONGFORGE_LEROBOT_PYTHON:-$PY}
if [ "${GPU_CHECK_ONLY:-}" = dist ]; then
  row "policy train (ACT, pi0)" SKIP 0 "GPU_CHECK_ONLY=dist"
elif ! "$LR_PY" -c "import lerobot.policies.act.modeling_act" >/dev/null 2>&1; then
  row "policy train (ACT, pi0)" SKIP 0 "lerobot does not import in $LR_PY (set LOONGFORGE_LEROBOT_PYTHON)"
else
  T=$(date +%s)
  if LOONGFORGE_LEROBOT_PYTHON=$LR_PY LOONGFORGE_BIN="$BUILD/loongforge" timeout 300 "$PY" bench/policy_cpu.py \
      --device cuda --shapes act512,pi0small,pi0prompt --rounds 2 --steps 6 --warmup 2 --out "$OUT/policy_train.md" \
      >"$OUT/policy_train.log" 2>&1; then
    row "policy train (ACT, pi0)" ok "$(elapsed "$T")" "$(tail -1 "$OUT/policy_train.md" | cut -d'|' -f3-5 | tr -s ' ')"
    cat "$OUT/policy_train.md"
  else
    row "policy train (ACT, pi0)" FAIL "$(elapsed "$T")" "see $OUT/policy_train.log: $(tail -1 "$OUT/policy_train.log" | cut -c1-100)"
  fi
fi

# ---- 7. every robot-policy family on the GPU without LeRobot (bench/policy_device_check.sh) ---------------------------
# The quickstart demo recipes (ACT, Diffusion Policy, π0, GR00T N1.7) train on the GPU and on the CPU from the same
# seed on the demo datasets (carry runs/reach-demo-data, runs/reach-env-demo-data, runs/reach2-demo-data, which
# scripts/robot_demo_data.py writes with lerobot here; missing ones are skipped), the GPU checkpoint evaluated open loop
# on the GPU: finite losses, the GPU run's final losses within 1.5x of the CPU run's, step times on both.
if [ "${GPU_CHECK_ONLY:-}" = dist ]; then
  row "policy families on cuda" SKIP 0 "GPU_CHECK_ONLY=dist"
elif [ ! -d runs/reach2-demo-data ] && [ ! -d runs/reach-demo-data ]; then
  row "policy families on cuda" SKIP 0 "no demo datasets (carry runs/reach*-demo-data)"
else
  T=$(date +%s)
  if DEVICE=cuda STEPS=${GPU_POLICY_STEPS:-200} PYTHON=$PY timeout 420 bash bench/policy_device_check.sh "$BUILD" \
      "$OUT/policy_device" >"$OUT/policy_device.log" 2>&1; then
    row "policy families on cuda" ok "$(elapsed "$T")" "$(grep -c ': ok' "$OUT/policy_device.log") families ok"
  else
    row "policy families on cuda" FAIL "$(elapsed "$T")" "see $OUT/policy_device.log: $(grep -m1 FAIL "$OUT/policy_device.log" | cut -c1-100)"
  fi
  cat "$OUT/policy_device.log"
fi

print_table

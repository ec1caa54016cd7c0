#!/usr/bin/env bash
# Every robot-policy family's training on a device, without LeRobot (bench/gpu_check.sh step 7; issue 24): each
# quickstart demo recipe (ACT, Diffusion Policy, π0, GR00T N1.7; configs/quickstart/*-reach.yaml) trains STEPS steps
# on DEVICE and on the CPU from the same seed on the demo datasets scripts/robot_demo_data.py writes (made with
# lerobot elsewhere and carried: runs/reach-demo-data, runs/reach-env-demo-data, runs/reach2-demo-data; a missing one
# skips its rows), then the DEVICE checkpoint is evaluated open loop on DEVICE. The random draws (dropout, noise,
# time) come from each device's own generator, so the runs are compared as training runs, not step by step: a row
# passes when the DEVICE run's losses are finite and its mean loss over the last fifth of the steps is within 1.5x
# (+ 0.05) of the CPU run's. Prints one line per family: step times on both, the losses, the open-loop MSE.
#   usage: bash bench/policy_device_check.sh [BUILD_DIR] [OUT_DIR]    (DEVICE=cuda STEPS=300 PYTHON=python3)
# Exits 1 when a family that ran failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build}
OUT=${2:-$BUILD/policy_device_check}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-300}
PY=${PYTHON:-python3}
LF=$BUILD/loongforge
mkdir -p "$OUT"
fail=0
# family, recipe, dataset, extra settings
RUNS=("act|configs/quickstart/act-reach.yaml|runs/reach-demo-data|"
      "diffusion|configs/quickstart/diffusion-reach.yaml|runs/reach-env-demo-data|"
      "pi0|configs/quickstart/pi0-reach.yaml|runs/reach2-demo-data|data.robot.tokenizer=$OUT/gemma_tokenizer"
      "groot|configs/quickstart/groot-reach.yaml|runs/reach2-demo-data|data.robot.tokenizer=$OUT/qwen_processor")
mkdir -p "$OUT/gemma_tokenizer" "$OUT/qwen_processor"
"$PY" scripts/gemma_tokenizer.py "$OUT/gemma_tokenizer" 320 "reach the red dot"$'\n' "reach the green dot"$'\n' || true
"$PY" scripts/qwen_tokenizer.py "$OUT/qwen_processor" 320 "reach the red dot" "reach the green dot" || true
for spec in "${RUNS[@]}"; do
  IFS='|' read -r name recipe data extra <<<"$spec"
  if [ ! -f "$data/meta/info.json" ]; then echo "policy $name: SKIP ($data missing: carry it)"; continue; fi
  for dev in "$DEVICE" cpu; do
    sets=(--set "device=$dev" --set "output_dir=$OUT/$name-$dev" --set "data.train=[{path: $data}]"
          --set "train.steps=$STEPS" --set "eval.every=$STEPS" --set "checkpoint.every=$STEPS" --set "log.progress=off")
    [ -n "$extra" ] && sets+=(--set "$extra")
    rm -rf "$OUT/$name-$dev"
    if ! timeout 600 "$LF" train "$recipe" "${sets[@]}" >"$OUT/$name-$dev.log" 2>&1; then
      echo "policy $name: FAIL (train on $dev: $(tail -1 "$OUT/$name-$dev.log" | cut -c1-150))"; fail=1; continue 2
    fi
  done
  ckpt=$OUT/$name-$DEVICE/checkpoints/$(cat "$OUT/$name-$DEVICE/checkpoints/latest")
  "$LF" eval "$recipe" --set "device=$DEVICE" --set "data.train=[{path: $data}]" ${extra:+--set "$extra"} \
    --model "$ckpt" --open-loop "$OUT/$name-open-loop" >"$OUT/$name-eval.json" 2>"$OUT/$name-eval.log" || {
    echo "policy $name: FAIL (eval on $DEVICE: $(tail -1 "$OUT/$name-eval.log" | cut -c1-150))"; fail=1; continue; }
  "$PY" - "$name" "$DEVICE" "$OUT/$name-$DEVICE/metrics.jsonl" "$OUT/$name-cpu/metrics.jsonl" "$OUT/$name-eval.json" <<'PY' || fail=1
import json, math, statistics, sys
name, dev, mine, cpu, ev = sys.argv[1:6]
def read(f):
    m = [json.loads(l) for l in open(f) if '"loss"' in l]
    losses = [x["loss"] for x in m]
    tail = losses[-max(1, len(losses) // 5):]
    return losses, statistics.mean(tail), statistics.median(x["step_time_s"] for x in m[len(m) // 5:])
(lm, tm, sm), (lc, tc, sc) = read(mine), read(cpu)
mse = json.loads(open(ev).read().strip().splitlines()[-1])["mse"]
ok = all(math.isfinite(x) for x in lm) and math.isfinite(mse) and tm <= 1.5 * tc + 0.05
print(f"policy {name}: {'ok' if ok else 'FAIL'} ({dev} {sm * 1000:.1f} ms/step, cpu {sc * 1000:.1f} ms/step; loss "
      f"{lm[0]:.3f} -> {tm:.3f} on {dev}, {lc[0]:.3f} -> {tc:.3f} on cpu; open-loop MSE on {dev} {mse:.5f})")
sys.exit(0 if ok else 1)
PY
done
exit $fail

#!/usr/bin/env bash
# The longer Meta-World runs (scripts/metaworld_demo.sh is the quick one): record the scripted experts' demonstrations,
# train ACT from scratch, serve it and report closed-loop success next to the experts' on new placements.
#   SUITE=image  one task (TASK) from a rendered camera (IMAGE x IMAGE pixels, MuJoCo through OSMesa: rendering
#                dominates the time) and the hand's state; no object or goal positions
#   SUITE=mt10   the ten MT10 tasks with one state-based policy (the task's one-hot in the environment state, as
#                Meta-World's multi-task benchmarks give it)
# EPISODES (demonstrations per task), EVAL (closed-loop episodes per task), STEPS (training) size it. Results go to
# runs/metaworld-$SUITE/ (report.json per side, the rollout strip).
set -euo pipefail
cd "$(dirname "$0")/.."
LF=${LOONGFORGE_BIN:-build/loongforge}
SIM=${LOONGFORGE_SIM_PYTHON:-.venv-openpi/bin/python}
SUITE=${SUITE:-mt10}
IMAGE=${IMAGE:-64}
EPISODES=${EPISODES:-50}
EVAL=${EVAL:-20}
STEPS=${STEPS:-6000}
MT10=reach-v3,push-v3,pick-place-v3,door-open-v3,drawer-open-v3,drawer-close-v3,button-press-topdown-v3,peg-insert-side-v3,window-open-v3,window-close-v3
OUT=runs/metaworld-$SUITE
mkdir -p $OUT
export MUJOCO_GL=${MUJOCO_GL:-osmesa} PYOPENGL_PLATFORM=${PYOPENGL_PLATFORM:-osmesa}
case $SUITE in
  image) TASKS=${TASK:-button-press-topdown-v3}; REC=(--image "$IMAGE"); EVALARGS=(--image "$IMAGE") ;;
  mt10) TASKS=${TASK:-$MT10}; REC=(); EVALARGS=() ;;
  *) echo "SUITE must be image or mt10" >&2; exit 2 ;;
esac
$SIM -W ignore scripts/metaworld/record.py --task "$TASKS" --episodes "$EPISODES" "${REC[@]}" --out $OUT/demos.npz
rm -rf $OUT/data
.venv-lerobot/bin/python scripts/metaworld/to_lerobot.py $OUT/demos.npz $OUT/data
# the model: configs/metaworld/act-state-model.json with this suite's inputs
.venv/bin/python - "$SUITE" "$IMAGE" "$TASKS" $OUT/model.json <<'PY'
import json, sys
suite, image, tasks, out = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
cfg = json.load(open("configs/metaworld/act-state-model.json"))
if suite == "image":
    cfg["input_features"] = {"observation.state": {"type": "STATE", "shape": [4]},
                             "observation.image": {"type": "VISUAL", "shape": [3, image, image]}}
else:
    cfg["input_features"]["observation.environment_state"]["shape"] = [6 + (len(tasks) if len(tasks) > 1 else 0)]
    cfg["dim_model"], cfg["dim_feedforward"], cfg["n_encoder_layers"] = 256, 1024, 4
json.dump(cfg, open(out, "w"), indent=2)
PY
$LF train configs/metaworld/act-state.yaml --set model.config=$OUT/model.json --set output_dir=$OUT/run \
  --set "data.train=[{path: $OUT/data}]" --set train.steps="$STEPS" --set checkpoint.every="$STEPS" \
  --set eval.every="$STEPS" --set log.progress=lines
CKPT=$OUT/run/checkpoints/$(cat $OUT/run/checkpoints/latest)
PORT=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$LF serve --policy "$CKPT" --port "$PORT" 2> $OUT/serve.log &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
$SIM -W ignore scripts/metaworld/evaluate.py --task "$TASKS" --episodes "$EVAL" --port "$PORT" "${EVALARGS[@]}" \
  --strip $OUT/rollout.png --out $OUT/policy.json
$SIM -W ignore scripts/metaworld/evaluate.py --task "$TASKS" --episodes "$EVAL" --expert --out $OUT/expert.json
echo "reports: $OUT/policy.json, $OUT/expert.json; rollout: $OUT/rollout.png; checkpoint: $CKPT"

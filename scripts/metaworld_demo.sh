#!/usr/bin/env bash
# Meta-World in the loop, state-based: record demonstrations of one task with Meta-World's scripted expert as a
# LeRobot dataset (scripts/metaworld/record.py, then to_lerobot.py with lerobot itself), train a small ACT policy from
# scratch on the CPU (configs/metaworld/act-state.yaml), serve the checkpoint with `loongforge serve` (openpi's
# protocol) and run closed-loop episodes through openpi-client (scripts/metaworld/evaluate.py): the policy's success
# rate (95 % Wilson interval) next to the scripted expert's on the same placements, and a PNG strip of a rollout.
# TASK=... picks another task; EPISODES (demonstrations), EVAL (closed-loop episodes) and STEPS (training) size it.
set -euo pipefail
cd "$(dirname "$0")/.."
LF=${LOONGFORGE_BIN:-build/loongforge}
SIM=${LOONGFORGE_SIM_PYTHON:-.venv-openpi/bin/python}
TASK=${TASK:-button-press-topdown-v3}
EPISODES=${EPISODES:-50}
EVAL=${EVAL:-50}
STEPS=${STEPS:-2000}
OUT=runs/metaworld
mkdir -p $OUT
export MUJOCO_GL=${MUJOCO_GL:-osmesa} PYOPENGL_PLATFORM=${PYOPENGL_PLATFORM:-osmesa}
$SIM -W ignore scripts/metaworld/record.py --task "$TASK" --episodes "$EPISODES" --out $OUT/demos.npz
rm -rf $OUT/data
.venv-lerobot/bin/python scripts/metaworld/to_lerobot.py $OUT/demos.npz $OUT/data
$LF train configs/metaworld/act-state.yaml --set train.steps="$STEPS" --set checkpoint.every="$STEPS" --set log.progress=lines
CKPT=$OUT/act-state/checkpoints/$(cat $OUT/act-state/checkpoints/latest)
PORT=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$LF serve --policy "$CKPT" --port "$PORT" 2> $OUT/serve.log &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
$SIM -W ignore scripts/metaworld/evaluate.py --task "$TASK" --episodes "$EVAL" --port "$PORT" \
  --strip docs/images/metaworld_rollout.png --out $OUT/policy.json
$SIM -W ignore scripts/metaworld/evaluate.py --task "$TASK" --episodes "$EVAL" --expert --out $OUT/expert.json
# the check: the policy trained on the expert's demonstrations succeeds on most new placements
.venv/bin/python - $OUT/policy.json $OUT/expert.json <<'PY'
import json, sys
p, e = (json.loads(open(f).read()) for f in sys.argv[1:3])
print(f"success rate: ACT {p['success_rate']:.2f} [{p['wilson95'][0]:.2f}, {p['wilson95'][1]:.2f}], "
      f"scripted expert {e['success_rate']:.2f} [{e['wilson95'][0]:.2f}, {e['wilson95'][1]:.2f}] "
      f"over {p['episodes']} episodes")
ok = p["success_rate"] >= 0.5
print("learned: yes" if ok else "learned: NO")
sys.exit(0 if ok else 1)
PY
echo "checkpoint (a LeRobot policy folder): $CKPT; rollout strip: docs/images/metaworld_rollout.png"

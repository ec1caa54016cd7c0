#!/usr/bin/env bash
# The robot-policy demo: write a LeRobot dataset of a point robot reaching a target it sees only in its camera
# (scripts/robot_demo_data.py, with lerobot itself), train a LeRobot ACT policy from scratch on it on the CPU
# (configs/quickstart/act-reach.yaml, a few minutes on 2 cores) with 4 episodes held out, then report the open-loop
# action errors on them next to the error of always predicting the mean action,
# with plots of recorded vs predicted actions. The checkpoint is a LeRobot policy folder
# (ACTPolicy.from_pretrained + its pre / post-processors load it). Extra arguments go to `loongforge train`.
set -euo pipefail
cd "$(dirname "$0")/.."
LF=build/loongforge
DATA=runs/reach-demo-data
OUT=runs/act-reach
[ -f $DATA/meta/info.json ] || .venv-lerobot/bin/python scripts/robot_demo_data.py $DATA 200
$LF train configs/quickstart/act-reach.yaml "$@"
CKPT=$OUT/checkpoints/$(cat $OUT/checkpoints/latest)
$LF eval configs/quickstart/act-reach.yaml --model "$CKPT" --open-loop $OUT/open_loop/final > $OUT/open_loop.json
# the check: the policy's open-loop error is far below the mean action's (what a policy that ignores the
# observations can do at best) on the held-out episodes
if .venv/bin/python scripts/open_loop_check.py "$OUT/open_loop.json" "$DATA"; then echo "learned: yes"
else echo "learned: NO"; exit 1; fi
echo "checkpoint (a LeRobot policy folder): $CKPT"

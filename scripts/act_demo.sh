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
SETS=()
source scripts/robot_demo_lib.sh
robot_demo_train_and_check configs/quickstart/act-reach.yaml open-loop "$@"

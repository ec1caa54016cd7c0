#!/usr/bin/env bash
# The Diffusion Policy demo: write a LeRobot dataset of a point robot reaching a target (scripts/robot_demo_data.py
# --env, with lerobot itself: the robot's position as the state, the target's as the environment state), train
# LeRobot's Diffusion Policy from scratch on it on the CPU (configs/quickstart/diffusion-reach.yaml, a few minutes on
# 2 cores) with 4 episodes held out, then report the open-loop action errors of the DDIM sampler on them next to the
# error of always predicting the mean action, with plots of recorded vs predicted actions. The checkpoint is a LeRobot
# policy folder (DiffusionPolicy.from_pretrained + its processors load it). Extra arguments go to `loongforge train`;
# DIFFUSION_DEMO_DIR puts the dataset and the run elsewhere than runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
LF=build/loongforge
RUNS=${DIFFUSION_DEMO_DIR:-runs}
DATA=$RUNS/reach-env-demo-data
OUT=$RUNS/diffusion-reach
SETS=(--set "output_dir=$OUT" --set "data.train=[{path: $DATA}]")
[ -f $DATA/meta/info.json ] || .venv-lerobot/bin/python scripts/robot_demo_data.py $DATA 200 --env
source scripts/robot_demo_lib.sh
robot_demo_train_and_check configs/quickstart/diffusion-reach.yaml open-loop "$@"

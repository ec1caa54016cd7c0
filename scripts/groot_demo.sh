#!/usr/bin/env bash
# The GR00T demo: write the two-dot reach dataset (scripts/robot_demo_data.py --two, with lerobot itself: the task
# names the dot to reach, red or green, both in the camera image and in the state) and a small Qwen-VL-like processor
# folder (scripts/qwen_tokenizer.py), train a small GR00T N1.7 from scratch on it on the CPU
# (configs/quickstart/groot-reach.yaml: a 2-layer Qwen3-VL backbone, the AlternateVLDiT action head; a few minutes on
# 2 cores) with 4 episodes held out, then report the open-loop action errors on them next to the error of always
# predicting the mean action, with plots of recorded vs predicted actions, and ask the trained policy
# (`loongforge predict`) for both tasks on held-out frames: the first action must be closer to the scripted expert's
# for the named dot than for the other (scripts/two_dot_check.py). The
# checkpoint is a LeRobot GR00T policy folder with GR00T's processor files; its base_model_path is the repository's
# configs/quickstart/groot-model/base, which holds no weights (nothing here is pretrained), so LeRobot's
# GrootPolicy.from_pretrained, which first builds the model from the base folder's weights, does not load it as it
# is (the tests load such folders with that step patched). Extra arguments go to
# `loongforge train`; GROOT_DEMO_DIR puts the dataset, the processor folder and the run elsewhere than runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
LF=build/loongforge
RUNS=${GROOT_DEMO_DIR:-runs}  # where the dataset, the processor folder and the run go
DATA=$RUNS/reach2-demo-data
PROC=$RUNS/groot-demo-processor
OUT=$RUNS/groot-reach
SETS=(--set "output_dir=$OUT" --set "data.train=[{path: $DATA}]" --set "data.robot.tokenizer=$PROC")
[ -f $DATA/meta/info.json ] || .venv-lerobot/bin/python scripts/robot_demo_data.py $DATA 200 --two
if [ ! -f $PROC/tokenizer.json ]; then
  mkdir -p $PROC
  .venv/bin/python scripts/qwen_tokenizer.py $PROC 320 "reach the red dot" "reach the green dot"
fi
source scripts/robot_demo_lib.sh
robot_demo_train_and_check configs/quickstart/groot-reach.yaml prompt "$@"

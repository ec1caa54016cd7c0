#!/usr/bin/env bash
# The vision-language-action demo: write a LeRobot dataset of a point robot that must reach the dot its task names
# (red or green, both in the camera image; scripts/robot_demo_data.py --two, with lerobot itself) and a small
# Gemma-like tokenizer, train a small π0 from scratch on it on the CPU (configs/quickstart/pi0-reach.yaml, a few
# minutes on 2 cores) with 4 episodes held out, then report the open-loop action errors on them next to the error of
# always predicting the mean action, with plots of recorded vs predicted actions, and ask the trained policy
# (`loongforge predict`) for both tasks on held-out frames: the first action must be closer to the scripted expert's
# for the named dot than for the other (scripts/two_dot_check.py). The
# checkpoint is a LeRobot policy folder (PI0Policy.from_pretrained + its processors load it). Extra arguments go to
# `loongforge train`;
# PI0_DEMO_DIR puts the dataset, the tokenizer and the run elsewhere than runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
LF=build/loongforge
RUNS=${PI0_DEMO_DIR:-runs}  # where the dataset, the tokenizer and the run go
DATA=$RUNS/reach2-demo-data
TOK=$RUNS/pi0-demo-tokenizer
OUT=$RUNS/pi0-reach
SETS=(--set "output_dir=$OUT" --set "data.train=[{path: $DATA}]" --set "data.robot.tokenizer=$TOK")
[ -f $DATA/meta/info.json ] || .venv-lerobot/bin/python scripts/robot_demo_data.py $DATA 200 --two
if [ ! -f $TOK/tokenizer.json ]; then
  mkdir -p $TOK
  .venv/bin/python scripts/gemma_tokenizer.py $TOK 320 "reach the red dot"$'\n' "reach the green dot"$'\n'
fi
source scripts/robot_demo_lib.sh
robot_demo_train_and_check configs/quickstart/pi0-reach.yaml prompt "$@"

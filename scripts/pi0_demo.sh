#!/usr/bin/env bash
# The vision-language-action demo: write a LeRobot dataset of a point robot that must reach the dot its task names
# (red or green, both in the camera image; scripts/robot_demo_data.py --two, with lerobot itself) and a small
# Gemma-like tokenizer, train a small π0 from scratch on it on the CPU (configs/quickstart/pi0-reach.yaml, a few
# minutes on 2 cores) with 4 episodes held out, then report the open-loop action errors on them next to the error of
# always predicting the mean action, with plots of recorded vs predicted actions, and ask the trained policy
# (`loongforge predict`) for both tasks on one held-out frame: the first action must head for the named dot. The
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
$LF train configs/quickstart/pi0-reach.yaml "${SETS[@]}" "$@"
CKPT=$OUT/checkpoints/$(cat $OUT/checkpoints/latest)
$LF eval configs/quickstart/pi0-reach.yaml "${SETS[@]}" --model "$CKPT" --open-loop $OUT/open_loop/final > $OUT/open_loop.json
# the checks: the open-loop error is far below the mean action's (what a policy that ignores the observations can do
# at best) on the held-out episodes, and on a held-out frame each task's first action heads for its own dot
ok=1
.venv/bin/python scripts/open_loop_check.py "$OUT/open_loop.json" "$DATA" || ok=0
.venv/bin/python - "$OUT/open_loop.json" "$DATA" "$CKPT" "$LF" "$OUT" <<'PY' || ok=0
import glob, io, json, subprocess, sys
import numpy as np
import pyarrow.parquet as pq
from PIL import Image
from safetensors.numpy import load_file, save_file
t = pq.read_table(glob.glob(f"{sys.argv[2]}/data/*/*.parquet"))
ok = True
# the last episode's first frame (held out): the robot, a red and a green dot
ep = np.array(t.column("episode_index").to_pylist())
row = int(np.flatnonzero(ep == ep.max())[0])
img = np.array(Image.open(io.BytesIO(t.column("observation.images.top")[row].as_py()["bytes"])).convert("RGB"))
state = np.array(t.column("observation.state")[row].as_py(), np.float32)
save_file({"observation.images.top": np.ascontiguousarray(img), "observation.state": state}, f"{sys.argv[5]}/frame.safetensors")
def centre(colour):  # the dot's position in the state's [-1, 1] coordinates
    ys, xs = np.nonzero(np.all(np.abs(img.astype(int) - colour) < 40, axis=-1))
    return np.array([xs.mean(), ys.mean()]) / (img.shape[1] - 1) * 2 - 1
for task, colour in (("reach the red dot", (220, 30, 30)), ("reach the green dot", (30, 170, 40))):
    subprocess.run([sys.argv[4], "predict", "--policy", sys.argv[3], "--observation", f"{sys.argv[5]}/frame.safetensors",
                    "--prompt", task, "--seed", "0", "--out", f"{sys.argv[5]}/chunk.safetensors"],
                   capture_output=True, text=True, check=True)
    act = load_file(f"{sys.argv[5]}/chunk.safetensors")["action"][0]
    want = centre(colour) - state[:2]
    cos = float(act @ want / (np.linalg.norm(act) * np.linalg.norm(want) + 1e-9))
    print(f"'{task}': first action {np.round(act, 3).tolist()}, towards the dot {np.round(want, 3).tolist()}, cosine {cos:.2f}")
    ok = ok and cos > 0.7
sys.exit(0 if ok else 1)
PY
[ $ok = 1 ] && echo "learned: yes" || { echo "learned: NO"; exit 1; }
echo "checkpoint (a LeRobot policy folder): $CKPT"

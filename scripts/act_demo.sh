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
.venv/bin/python - "$OUT/open_loop.json" "$DATA" <<'PY'
import json, sys
import numpy as np
import pyarrow.parquet as pq
import glob
rep = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
t = pq.read_table(glob.glob(f"{sys.argv[2]}/data/*/*.parquet"))
a = np.array(t.column("action").to_pylist())
base = float(((a - a.mean(0)) ** 2).mean())
print(f"open-loop action MSE on {rep['episodes']} held-out episodes ({rep['chunks']} chunks): {rep['mse']:.5f}; "
      f"always the mean action: {base:.5f}")
print("per chunk step:", " ".join(f"{x:.4f}" for x in rep["mse_per_step"]))
print("plots:", ", ".join(rep["plots"][:2]), "...")
ok = rep["mse"] < 0.25 * base
print("learned: yes" if ok else "learned: NO")
sys.exit(0 if ok else 1)
PY
echo "checkpoint (a LeRobot policy folder): $CKPT"

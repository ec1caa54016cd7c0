"""The robot demos' check (scripts/act_demo.sh, pi0_demo.sh, diffusion_demo.sh, groot_demo.sh): prints the open-loop
action errors of `loongforge eval --open-loop` (its JSON report) next to the error of always predicting the dataset's
mean action (what a policy that ignores its observations can do at best), and exits 1 unless the policy's is under a
quarter of it.

usage: python scripts/open_loop_check.py REPORT.json DATASET_DIR"""
import glob
import json
import sys

import numpy as np
import pyarrow.parquet as pq

rep = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
t = pq.read_table(glob.glob(f"{sys.argv[2]}/data/*/*.parquet"))
a = np.array(t.column("action").to_pylist())
base = float(((a - a.mean(0)) ** 2).mean())
print(f"open-loop action MSE on {rep['episodes']} held-out episodes ({rep['chunks']} chunks): {rep['mse']:.5f}; "
      f"always the mean action: {base:.5f}")
print("per chunk step:", " ".join(f"{x:.4f}" for x in rep["mse_per_step"]))
print("plots:", ", ".join(rep["plots"][:2]), "...")
ok = rep["mse"] < 0.25 * base
print("open-loop error under a quarter of the mean action's:", "yes" if ok else "NO")
sys.exit(0 if ok else 1)

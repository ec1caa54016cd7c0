"""The language-conditioned demos' second check (scripts/pi0_demo.sh, scripts/groot_demo.sh): on the first frame of
each of the two-dot reach dataset's 4 held-out episodes (data.robot.valid_episodes: 4 holds out the episodes
floor((i + 0.5) n / 4) of n), asks the trained policy (`loongforge predict`, seeded) for both tasks and compares its
first action with what the scripted expert does for each dot (a step towards it capped at 0.15: the dots' positions
are in the state). Exits 1 unless the action is closer to the named dot's expert action than to the other dot's in at
least 7 of the 8 cases: a policy that ignores the prompt does the same for both tasks.

usage: python scripts/two_dot_check.py DATASET_DIR CHECKPOINT LOONGFORGE_BINARY WORK_DIR"""
import glob
import io
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
from PIL import Image
from safetensors.numpy import load_file, save_file

data, ckpt, lf, work = sys.argv[1:5]
t = pq.read_table(glob.glob(f"{data}/data/*/*.parquet"))
ep = np.array(t.column("episode_index").to_pylist())
episodes = sorted(set(ep.tolist()))
good = 0
for e in [episodes[(2 * i + 1) * len(episodes) // 8] for i in range(4)]:
    row = int(np.flatnonzero(ep == e)[0])
    img = np.array(Image.open(io.BytesIO(t.column("observation.images.top")[row].as_py()["bytes"])).convert("RGB"))
    state = np.array(t.column("observation.state")[row].as_py(), np.float32)  # robot, red dot, green dot (x, y)
    save_file({"observation.images.top": np.ascontiguousarray(img), "observation.state": state}, f"{work}/frame.safetensors")
    expert = {}
    for name, at in (("red", state[2:4]), ("green", state[4:6])):
        step = at - state[:2]
        expert[name] = step / max(np.linalg.norm(step), 1e-6) * min(np.linalg.norm(step), 0.15)
    for name, other in (("red", "green"), ("green", "red")):
        task = f"reach the {name} dot"
        subprocess.run([lf, "predict", "--policy", ckpt, "--observation", f"{work}/frame.safetensors", "--prompt", task,
                        "--seed", "0", "--out", f"{work}/chunk.safetensors"], capture_output=True, text=True, check=True)
        act = load_file(f"{work}/chunk.safetensors")["action"][0]
        named, unnamed = np.linalg.norm(act - expert[name]), np.linalg.norm(act - expert[other])
        good += bool(named < unnamed)
        print(f"episode {e} '{task}': first action {np.round(act, 3).tolist()}, the expert's "
              f"{np.round(expert[name], 3).tolist()} (for the {other} dot {np.round(expert[other], 3).tolist()}): "
              f"off by {named:.3f} ({unnamed:.3f} from the other){'' if named < unnamed else '  <- wrong'}")
print(f"follows the prompt in {good} / 8 cases (the check: >= 7)")
sys.exit(0 if good >= 7 else 1)

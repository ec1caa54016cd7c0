"""Writes the demonstrations scripts/metaworld/record.py recorded (an .npz) as a LeRobot v3.0 dataset with the
lerobot package itself (run in the lerobot environment, .venv-lerobot): features observation.state [4],
observation.environment_state [6] (+ the task one-hot with several tasks), action [4], and observation.image when frames were recorded; each episode's task
text is the Meta-World task's name in words. 80 fps (Meta-World's control rate).

usage: python scripts/metaworld/to_lerobot.py DEMOS.npz OUT_DIR"""
import json
import sys

import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset


def main():
    src, out = sys.argv[1], sys.argv[2]
    d = np.load(src)
    tasks = json.loads(str(d["tasks"]))
    names = ["obj_x", "obj_y", "obj_z", "goal_x", "goal_y", "goal_z"] + ([f"task_{i}" for i in range(len(tasks))] if len(tasks) > 1 else [])
    feats = {"observation.state": {"dtype": "float32", "shape": (4,), "names": ["x", "y", "z", "gripper"]},
             "observation.environment_state": {"dtype": "float32", "shape": (len(names),), "names": names},
             "action": {"dtype": "float32", "shape": (4,), "names": ["dx", "dy", "dz", "grip"]}}
    image = d["image"].ndim == 4
    if image:
        feats["observation.image"] = {"dtype": "image", "shape": tuple(d["image"].shape[1:]),
                                      "names": ["height", "width", "channels"]}
    ds = LeRobotDataset.create("loongforge/metaworld", fps=80, features=feats, root=out, use_videos=False)
    episodes = d["episode"]
    for ep in np.unique(episodes):
        rows = np.nonzero(episodes == ep)[0]
        for i in rows:
            frame = {"observation.state": d["state"][i], "observation.environment_state": d["env"][i],
                     "action": d["action"][i], "task": tasks[int(d["task"][i])]}
            if image:
                frame["observation.image"] = d["image"][i]
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()
    print(f"wrote {out}: {len(np.unique(episodes))} episodes, {len(episodes)} frames")


if __name__ == "__main__":
    main()

"""Writes the robot demo's dataset with the lerobot package (run in the lerobot environment, .venv-lerobot):
a point robot on a 48 x 48 table reaching a target it sees only in the camera image (the red dot; the robot is the
blue dot). State: the robot's (x, y) in [-1, 1]; action: the velocity command, a capped step towards the target,
which the scripted expert follows (plus a little noise). 10 fps, 30 frames per episode, a new target each episode.

usage: python scripts/robot_demo_data.py OUT_DIR [EPISODES]"""
import sys

import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset

S, FRAMES = 48, 30


def pixel(p):
    return np.clip(np.round((p + 1) / 2 * (S - 1)).astype(int), 0, S - 1)


def frame(pos, target):
    img = np.full((S, S, 3), 235, np.uint8)
    for p, colour in ((target, (220, 30, 30)), (pos, (30, 60, 220))):
        x, y = pixel(p)
        img[max(0, y - 2):y + 3, max(0, x - 2):x + 3] = colour
    return img


def main():
    out, episodes = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 60
    feats = {"observation.state": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
             "action": {"dtype": "float32", "shape": (2,), "names": ["vx", "vy"]},
             "observation.images.top": {"dtype": "image", "shape": (S, S, 3), "names": ["height", "width", "channels"]}}
    ds = LeRobotDataset.create("loongforge/reach-demo", fps=10, features=feats, root=out, use_videos=False)
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        pos = rng.uniform(-0.9, 0.9, 2).astype(np.float32)
        target = rng.uniform(-0.8, 0.8, 2).astype(np.float32)
        for _ in range(FRAMES):
            step = target - pos
            n = np.linalg.norm(step)
            act = (step / max(n, 1e-6) * min(n, 0.15) + rng.normal(0, 0.005, 2)).astype(np.float32)
            ds.add_frame({"observation.state": pos.copy(), "action": act, "observation.images.top": frame(pos, target),
                          "task": "reach the red dot"})
            pos = np.clip(pos + act, -1, 1).astype(np.float32)
        ds.save_episode()
    ds.finalize()


if __name__ == "__main__":
    main()

"""Writes the robot demo's dataset with the lerobot package (run in the lerobot environment, .venv-lerobot):
a point robot on a 48 x 48 table reaching a target it sees only in the camera image (the red dot; the robot is the
blue dot). State: the robot's (x, y) in [-1, 1]; action: the velocity command, a capped step towards the target,
which the scripted expert follows (plus a little noise). 10 fps, 30 frames per episode, a new target each episode.
With --two (the language-conditioned demo, scripts/pi0_demo.sh): a red and a green dot on the table, the state the
robot's (x, y) then the red and the green dot's, and the episode's task names the one to reach ("reach the red dot" /
"reach the green dot"), so only a policy that reads the prompt can follow the expert.

With --env (scripts/diffusion_demo.sh): the target's position also as `observation.environment_state`.

usage: python scripts/robot_demo_data.py OUT_DIR [EPISODES] [--two | --env]"""
import sys

import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset

S, FRAMES = 48, 30


def pixel(p):
    return np.clip(np.round((p + 1) / 2 * (S - 1)).astype(int), 0, S - 1)


RED, GREEN, BLUE = (220, 30, 30), (30, 170, 40), (30, 60, 220)


def frame(pos, dots):
    img = np.full((S, S, 3), 235, np.uint8)
    for p, colour in dots + [(pos, BLUE)]:
        x, y = pixel(p)
        img[max(0, y - 2):y + 3, max(0, x - 2):x + 3] = colour
    return img


def main():
    args = [a for a in sys.argv[1:] if a not in ("--two", "--env")]
    two, env = "--two" in sys.argv, "--env" in sys.argv
    out, episodes = args[0], int(args[1]) if len(args) > 1 else 60
    names = ["x", "y"] + (["red_x", "red_y", "green_x", "green_y"] if two else [])
    feats = {"observation.state": {"dtype": "float32", "shape": (len(names),), "names": names},
             "action": {"dtype": "float32", "shape": (2,), "names": ["vx", "vy"]},
             "observation.images.top": {"dtype": "image", "shape": (S, S, 3), "names": ["height", "width", "channels"]}}
    if env:
        feats["observation.environment_state"] = {"dtype": "float32", "shape": (2,), "names": ["target_x", "target_y"]}
    ds = LeRobotDataset.create("loongforge/reach-demo", fps=10, features=feats, root=out, use_videos=False)
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        pos = rng.uniform(-0.9, 0.9, 2).astype(np.float32)
        target = rng.uniform(-0.8, 0.8, 2).astype(np.float32)
        dots, task = [(target, RED)], "reach the red dot"
        if two:  # a second dot at least 0.6 away; the task names the one to reach
            other = target
            while np.linalg.norm(other - target) < 0.6:
                other = rng.uniform(-0.8, 0.8, 2).astype(np.float32)
            dots = [(target, RED), (other, GREEN)]
            known = np.concatenate([target, other])
            if rng.random() < 0.5:
                target, task = other, "reach the green dot"
        for _ in range(FRAMES):
            step = target - pos
            n = np.linalg.norm(step)
            act = (step / max(n, 1e-6) * min(n, 0.15) + rng.normal(0, 0.005, 2)).astype(np.float32)
            state = np.concatenate([pos, known]) if two else pos.copy()
            row = {"observation.state": state.astype(np.float32), "action": act, "observation.images.top": frame(pos, dots),
                   "task": task}
            if env:
                row["observation.environment_state"] = target.copy()
            ds.add_frame(row)
            pos = np.clip(pos + act, -1, 1).astype(np.float32)
        ds.save_episode()
    ds.finalize()


if __name__ == "__main__":
    main()

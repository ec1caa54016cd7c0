"""Records Meta-World demonstrations with the package's own scripted expert policies (run in the simulator
environment, .venv-sim: metaworld + mujoco). Each episode: the task's MT1 environment reset (a new object / goal
placement), the expert acting until Meta-World reports success or max_steps. Only successful episodes are kept (the
experts succeed on nearly every placement). Per step: observation.state = the hand's xyz and the gripper opening
(obs[0:4]), observation.environment_state = the first object's position and the goal's (obs[4:7], obs[36:39]; the
constant and zero-padded parts of Meta-World's 39 numbers left out: a dimension constant in the demonstrations has
no spread to normalise by; with several tasks, MT10-style, a one-hot of the task follows),
action = the expert's command clipped to [-1, 1], and with --image a camera frame (uint8 [H, W, 3]; needs
MUJOCO_GL=osmesa or egl). Written to OUT.npz; scripts/metaworld/to_lerobot.py turns it into a LeRobot dataset.

usage: python scripts/metaworld/record.py --task button-press-topdown-v3 --episodes 60 --out runs/mw/demos.npz"""
import argparse
import json
import os
import sys

# Offscreen rendering without a display or GPU (MUJOCO_GL=egl where a GPU renders)
os.environ.setdefault("MUJOCO_GL", "osmesa")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
import gymnasium as gym  # noqa: E402
import metaworld  # noqa: F401, E402  (registers the Meta-World environments)
import metaworld.policies as experts  # noqa: E402
import numpy as np  # noqa: E402


def expert_for(task):
    """The scripted expert of TASK (Meta-World's own map from task names to expert policies)."""
    if task not in experts.ENV_POLICY_MAP:
        sys.exit(f"record: Meta-World has no scripted expert for task '{task}' (metaworld.policies.ENV_POLICY_MAP)")
    return experts.ENV_POLICY_MAP[task]()


def make_env(task, seed, image=0, camera="corner"):
    kw = dict(render_mode="rgb_array", camera_name=camera, width=image, height=image) if image else {}
    return gym.make("Meta-World/MT1", env_name=task, seed=seed, **kw)


def camera(env):
    """The camera frame upright (MuJoCo's offscreen frames come bottom row first)."""
    return np.ascontiguousarray(np.flipud(env.render()))


def env_state(obs, task_index=0, n_tasks=1):
    """The object's and the goal's positions; with several tasks (MT10-style) then a one-hot of the task, as
    Meta-World's multi-task benchmarks give it."""
    parts = [obs[4:7], obs[36:39]]
    if n_tasks > 1:
        parts.append(np.eye(n_tasks, dtype=np.float32)[task_index])
    return np.concatenate(parts).astype(np.float32)


def task_text(task):
    return task[:-3].replace("-", " ")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="button-press-topdown-v3", help="one task, or several comma-separated (MT10-style)")
    ap.add_argument("--episodes", type=int, default=60, help="successful episodes per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--image", type=int, default=0, help="also record a square camera frame of this size")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cols = {k: [] for k in ("state", "env", "action", "episode", "frame", "task", "image")}
    tasks, ep = a.task.split(","), 0
    for ti, task in enumerate(tasks):
        env, pol = make_env(task, a.seed + 1000 * ti, a.image), expert_for(task)
        kept = tried = 0
        while kept < a.episodes:
            tried += 1
            if tried > 2 * a.episodes + 10:
                sys.exit(f"record: the expert of {task} succeeded in only {kept} of {tried} episodes")
            obs, _ = env.reset()
            steps = []
            for t in range(a.max_steps):
                act = np.clip(pol.get_action(obs), -1, 1).astype(np.float32)
                steps.append((obs.astype(np.float32), act, camera(env) if a.image else None))
                obs, _, _, _, info = env.step(act)
                if info["success"] > 0.5:
                    break
            if info["success"] <= 0.5:
                continue
            for f, (o, act, img) in enumerate(steps):
                cols["state"].append(o[:4]); cols["env"].append(env_state(o, ti, len(tasks))); cols["action"].append(act)
                cols["episode"].append(ep); cols["frame"].append(f); cols["task"].append(ti)
                if a.image:
                    cols["image"].append(img)
            kept += 1
            ep += 1
        print(f"{task}: {kept} episodes ({tried - kept} failed placements skipped)", flush=True)
    out = {k: np.stack(v) if k != "image" or v else np.zeros(0) for k, v in cols.items()}
    out["tasks"] = np.array(json.dumps([task_text(t) for t in tasks]))
    np.savez_compressed(a.out, **out)
    print(f"wrote {a.out}: {ep} episodes, {len(out['action'])} frames")


if __name__ == "__main__":
    main()

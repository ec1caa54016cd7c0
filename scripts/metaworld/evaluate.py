"""Closed-loop evaluation on Meta-World (run in the simulator environment, .venv-sim: metaworld + mujoco +
openpi-client): N episodes of a task (or of each of several tasks, MT10-style), each a fresh MT1 placement from --seed (not the recording's), driven by a policy
behind an openpi-protocol server (`loongforge serve --policy DIR`, through openpi_client's WebsocketClientPolicy) or
by Meta-World's scripted expert (--expert, the reference). The policy is queried with the raw observation
(observation.state, observation.environment_state as scripts/metaworld/record.py records them, observation.image
when the policy reads it, prompt = the task in words when it reads one); the first n_action_steps actions of each
chunk (the server's metadata) are executed, then it is queried again. Success is Meta-World's own signal
(info["success"]); an episode ends at success or --max-steps.

Prints and writes (--out, JSON) the success rate with its 95 % Wilson interval, the mean return and episode length,
and with --strip a PNG strip of the first episode's rollout (needs MUJOCO_GL=osmesa or egl).

usage: python scripts/metaworld/evaluate.py --task button-press-topdown-v3 --episodes 20 --port 8000 [--expert]"""
import argparse
import json
import math
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import camera, env_state, expert_for, make_env, task_text  # noqa: E402


def wilson(successes, n, z=1.959964):
    """The 95 % Wilson score interval of a success rate."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def wait_for(host, port, timeout):
    end = time.time() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.time() > end:
                sys.exit(f"evaluate: no server at {host}:{port} after {timeout} s")
            time.sleep(0.2)


class ServedPolicy:
    """A policy behind an openpi-protocol server: chunks queried every n_action_steps steps."""

    def __init__(self, host, port, tasks, timeout):
        from openpi_client import websocket_client_policy

        wait_for(host, port, timeout)
        self.client = websocket_client_policy.WebsocketClientPolicy(host=host, port=port)
        self.meta = self.client.get_server_metadata()
        self.feats = self.meta.get("input_features", {})
        self.image = next((k for k in self.feats if self.feats[k].get("type") == "VISUAL"), None)
        self.n = int(self.meta.get("n_action_steps", 1))
        self.tasks, self.task, self.queue, self.latency = tasks, 0, [], []

    def reset(self, task=0):
        self.task, self.queue = task, []

    def act(self, obs, env):
        if not self.queue:
            o = {"observation.state": obs[:4].astype(np.float32),
                 "observation.environment_state": env_state(obs, self.task, len(self.tasks))}
            o = {k: v for k, v in o.items() if k in self.feats}  # what the policy reads
            if self.image:
                o[self.image] = camera(env)
            if self.meta.get("prompt"):
                o["prompt"] = task_text(self.tasks[self.task])
            t = time.perf_counter()
            chunk = np.asarray(self.client.infer(o)["actions"])
            self.latency.append(time.perf_counter() - t)
            self.queue = list(chunk[: self.n])
        return self.queue.pop(0)


class Expert:
    def __init__(self, tasks):
        self.pols, self.meta, self.image, self.latency = [expert_for(t) for t in tasks], {"policy_type": "scripted expert"}, None, []

    def reset(self, task=0):
        self.pol = self.pols[task]

    def act(self, obs, env):
        return self.pol.get_action(obs)


def save_strip(frames, path, most=8):
    """At most MOST frames, evenly spaced, first and last kept, side by side."""
    from PIL import Image

    keep = np.unique(np.round(np.linspace(0, len(frames) - 1, min(most, len(frames)))).astype(int))
    Image.fromarray(np.concatenate([frames[i] for i in keep], axis=1)).save(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="button-press-topdown-v3", help="one task or several, comma-separated, in the "
                    "order they were recorded (MT10-style: the task's one-hot)")
    ap.add_argument("--episodes", type=int, default=20, help="episodes per task")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--wait", type=float, default=120, help="seconds to wait for the server")
    ap.add_argument("--expert", action="store_true", help="run Meta-World's scripted expert instead of a server")
    ap.add_argument("--image", type=int, default=0, help="camera frame size, for a policy that reads images")
    ap.add_argument("--strip", help="write a PNG strip of the first episode's rollout here")
    ap.add_argument("--out", help="write the report (JSON) here")
    a = ap.parse_args()
    tasks = a.task.split(",")
    pol = Expert(tasks) if a.expert else ServedPolicy(a.host, a.port, tasks, a.wait)
    size = a.image or (96 if a.strip else 0)
    per_task, returns, lengths, frames = {}, [], [], []
    for ti, task in enumerate(tasks):
        env = make_env(task, a.seed + 1000 * ti, size)
        per_task[task] = 0
        for ep in range(a.episodes):
            obs, _ = env.reset()
            pol.reset(ti)
            total, success = 0.0, False
            first = a.strip and ti == 0 and ep == 0
            for t in range(a.max_steps):
                if first and t % 10 == 0:
                    frames.append(camera(env))
                act = np.clip(np.asarray(pol.act(obs, env), dtype=np.float32), -1, 1)
                obs, reward, _, _, info = env.step(act)
                total += float(reward)
                if info["success"] > 0.5:
                    success = True
                    break
            if first:
                frames.append(camera(env))
            per_task[task] += success
            returns.append(total)
            lengths.append(t + 1)
    successes, n = sum(per_task.values()), a.episodes * len(tasks)
    lo, hi = wilson(successes, n)
    rep = {"task": a.task, "policy": pol.meta.get("policy_type", "?"), "episodes": n,
           "successes": successes, "success_rate": successes / n, "wilson95": [lo, hi],
           "per_task": {t: {"successes": k, "episodes": a.episodes, "success_rate": k / a.episodes,
                            "wilson95": list(wilson(k, a.episodes))} for t, k in per_task.items()},
           "mean_return": float(np.mean(returns)), "mean_length": float(np.mean(lengths)), "seed": a.seed}
    if pol.latency:
        ms = np.array(pol.latency) * 1000
        rep["latency_ms"] = {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                             "queries": len(ms)}
    if len(tasks) > 1:
        for t, r in rep["per_task"].items():
            print(f"  {t}: {r['successes']}/{r['episodes']} = {r['success_rate']:.2f}")
    print(f"{a.task} [{rep['policy']}]: success {successes}/{n} = {rep['success_rate']:.2f} "
          f"(95% Wilson [{lo:.2f}, {hi:.2f}]), mean return {rep['mean_return']:.1f}, mean length {rep['mean_length']:.1f}"
          + (f", latency p50 {rep['latency_ms']['p50']:.1f} ms p99 {rep['latency_ms']['p99']:.1f} ms" if pol.latency else ""))
    if a.strip and frames:
        save_strip(frames, a.strip)
        rep["strip"] = a.strip
    if a.out:
        Path(a.out).write_text(json.dumps(rep) + "\n")


if __name__ == "__main__":
    main()

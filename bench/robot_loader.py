"""Robot data loading (issue 21): frames/s delivered to the step by `loongforge data bench-loader` (the threaded
RobotLoader over the LeRobot reader: decode threads, prefetch, the GOP cache) against LeRobot's own
LeRobotDataset(delta_timestamps=..., video_backend="pyav") + torch DataLoader, on the same dataset written by
lerobot (AV1 videos, its default encoder), the same delta_timestamps windows, batch size and shuffling, in the same
run. LeRobot runs with 2 DataLoader workers, LoongForge with 2 decode threads (the machine's cores). A "frame" is
one item: a dataset frame with its windows (state, action chunk, and per camera the frames of its window). Both
sides are timed from opening the dataset (after Python's imports / the program's start: LeRobot's includes the
DataLoader's worker start) and after the first batch (steady state); rounds alternate the two sides. By default one epoch is read, so every frame is
decoded once (in a second epoch our GOP cache would hold small datasets whole). Goal: >= 3x.

  .venv/bin/python bench/robot_loader.py [--episodes 12 --length 50 --cams 2 --height 96 --width 128]
                                         [--batch 16 --steps EPOCH --rounds 2 --threads 2 --workers 2] [--out FILE.md]
"""
import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LF = ROOT / "build" / "loongforge"
LEROBOT_PY = pathlib.Path(os.environ.get("LOONGFORGE_LEROBOT_PYTHON", ROOT / ".venv-lerobot" / "bin" / "python"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

WRITE = r"""
import json, sys
import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset
root, cfg = sys.argv[1], json.loads(sys.argv[2])
H, W = cfg["height"], cfg["width"]
cams = [f"observation.images.cam{i}" for i in range(cfg["cams"])]
features = {"observation.state": {"dtype": "float32", "shape": (14,), "names": None},
            "action": {"dtype": "float32", "shape": (14,), "names": None}}
for c in cams:
    features[c] = {"dtype": "video", "shape": (H, W, 3), "names": ["height", "width", "channels"]}
ds = LeRobotDataset.create("bench/loader", fps=cfg["fps"], features=features, root=root, use_videos=True)
rng = np.random.default_rng(0)
yy, xx = np.mgrid[0:H, 0:W]
for e in range(cfg["episodes"]):
    for f in range(cfg["length"]):
        frame = {"observation.state": rng.standard_normal(14).astype(np.float32),
                 "action": rng.standard_normal(14).astype(np.float32), "task": "pick"}
        for i, c in enumerate(cams):
            img = ((xx[..., None] * (1 + i) + yy[..., None] * 2 + f * 5 + e * 31 + np.arange(3) * 60) % 256)
            img = img.astype(np.uint8)
            y0, x0 = (f * 3) % (H - 16), (f * 5 + 20 * i) % (W - 16)
            img[y0:y0 + 16, x0:x0 + 16] = 255 - img[y0:y0 + 16, x0:x0 + 16]
            noise = rng.integers(0, 24, (H, W, 3), dtype=np.uint8)
            frame[c] = img // 2 + noise
        ds.add_frame(frame)
    ds.save_episode()
ds.finalize()
"""

LEROBOT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from lerobot.datasets.lerobot_dataset import LeRobotDataset
root, cfg = sys.argv[1], json.loads(sys.argv[2])
torch.manual_seed(cfg["seed"])
t_start = time.perf_counter()
ds = LeRobotDataset("bench/loader", root=root, delta_timestamps=cfg["deltas"], video_backend="pyav")
loader = torch.utils.data.DataLoader(ds, batch_size=cfg["batch"], shuffle=True, num_workers=cfg["workers"],
                                     drop_last=True, persistent_workers=False)
it = iter(loader)
first = None
for step in range(cfg["steps"]):
    try:
        batch = next(it)
    except StopIteration:  # the next epoch (a new shuffle, as ours)
        it = iter(loader)
        batch = next(it)
    if first is None:
        first = time.perf_counter()
end = time.perf_counter()
print(json.dumps({"total": end - t_start, "steady": end - first, "first": first - t_start, "import": t_start - t0}))
"""


def lerobot_run(ds, cfg):
    out = subprocess.run([str(LEROBOT_PY), "-c", LEROBOT, str(ds), json.dumps(cfg)], capture_output=True, text=True,
                         env={**ENV, "OMP_NUM_THREADS": "1"}, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"lerobot run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def loongforge_run(ds, cfg, threads):
    args = [str(LF), "data", "bench-loader", str(ds), "--batch", str(cfg["batch"]), "--steps", str(cfg["steps"]),
            "--threads", str(threads), "--shuffle", "--seed", str(cfg["seed"])]
    for k, v in cfg["deltas"].items():
        args += ["--delta", f"{k}=" + ",".join(repr(x) for x in v)]
    t0 = time.perf_counter()
    out = subprocess.run(args, capture_output=True, text=True, env={**ENV, "OMP_NUM_THREADS": "1"}, timeout=900)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"loongforge failed:\n{out.stderr}")
    m = re.search(r"\(([\d.]+) s from opening the dataset, first batch after ([\d.]+) s\)", out.stdout)
    total, first = float(m.group(1)), float(m.group(2))
    return {"total": total, "steady": total - first, "first": first, "process": wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=12)
    ap.add_argument("--length", type=int, default=50)
    ap.add_argument("--cams", type=int, default=2)
    ap.add_argument("--height", type=int, default=96)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, help="batches (default: one epoch, so that no frame is read twice)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", help="reuse a dataset folder written by an earlier run")
    ap.add_argument("--out")
    a = ap.parse_args()

    fps = a.fps
    if a.steps is None:
        a.steps = a.episodes * a.length // a.batch
    cams = [f"observation.images.cam{i}" for i in range(a.cams)]
    deltas = {"observation.state": [-1 / fps, 0.0], "action": [k / fps for k in range(16)]}
    for c in cams:
        deltas[c] = [-1 / fps, 0.0]
    cfg = {"episodes": a.episodes, "length": a.length, "cams": a.cams, "height": a.height, "width": a.width,
           "fps": fps, "batch": a.batch, "steps": a.steps, "workers": a.workers, "seed": a.seed, "deltas": deltas}
    tmp = tempfile.TemporaryDirectory(prefix="lf_robot_loader_")
    ds = pathlib.Path(a.data) if a.data else pathlib.Path(tmp.name) / "ds"
    if not (ds / "meta" / "info.json").exists():
        t0 = time.perf_counter()
        w = subprocess.run([str(LEROBOT_PY), "-c", WRITE, str(ds), json.dumps(cfg)], capture_output=True, text=True,
                           env=ENV, timeout=900)
        if w.returncode != 0:
            raise SystemExit(f"writing the dataset failed:\n{w.stderr[-3000:]}")
        print(f"dataset written by lerobot in {time.perf_counter() - t0:.1f} s: {ds}", flush=True)
    info = json.loads((ds / "meta" / "info.json").read_text())
    codec = info["features"][cams[0]].get("info", {}).get("video.codec", "?") if cams else "-"

    frames = a.batch * a.steps
    rows = {"lerobot": [], "loongforge": []}
    for r in range(a.rounds):
        order = ["lerobot", "loongforge"] if r % 2 == 0 else ["loongforge", "lerobot"]
        for side in order:
            res = lerobot_run(ds, cfg) if side == "lerobot" else loongforge_run(ds, cfg, a.threads)
            rows[side].append(res)
            print(f"round {r} {side}: {frames / res['total']:.1f} frames/s from the start, "
                  f"{frames * (a.steps - 1) / a.steps / res['steady']:.1f} after the first batch", flush=True)

    def rate(side, key):
        if key == "total":
            return statistics.median(frames / x["total"] for x in rows[side])
        return statistics.median(frames * (a.steps - 1) / a.steps / x["steady"] for x in rows[side])

    lines = [
        f"Dataset: LeRobot v3.0 written by lerobot, {a.episodes} episodes x {a.length} frames at {fps} fps, "
        f"{a.cams} cameras {a.height}x{a.width} ({codec}); windows: state 2, action 16, each camera 2 frames; "
        f"batch {a.batch}, {a.steps} batches ({a.steps * a.batch} of {a.episodes * a.length} frames), shuffled; LeRobot DataLoader {a.workers} workers (pyav), "
        f"LoongForge {a.threads} decode threads; median of {a.rounds} rounds. Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs.",
        "",
        "| loader | frames/s from opening the dataset | frames/s after the first batch | camera images/s (steady) |",
        "|---|---|---|---|",
    ]
    imgs = 2 * a.cams
    for side, label in [("lerobot", f"LeRobotDataset + DataLoader ({a.workers} workers)"),
                        ("loongforge", f"loongforge data bench-loader ({a.threads} threads)")]:
        lines.append(f"| {label} | {rate(side, 'total'):.1f} | {rate(side, 'steady'):.1f} | "
                     f"{rate(side, 'steady') * imgs:.0f} |")
    ratio_total = rate("loongforge", "total") / rate("lerobot", "total")
    ratio_steady = rate("loongforge", "steady") / rate("lerobot", "steady")
    lines.append(f"| **ratio** | **{ratio_total:.2f}x** | **{ratio_steady:.2f}x** | goal >= 3x: "
                 f"{'met' if ratio_steady >= 3 else 'not met'} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""The robot loader (`loongforge data bench-loader`) against LeRobot 0.6.1 itself: a dataset written by lerobot
(LeRobotDataset.create, AV1 videos), then every item of `--dump --samples` (delta_timestamps windows, `*_is_pad`
masks, decoded camera frames, indices) equal to LeRobotDataset(..., delta_timestamps=..., video_backend="pyav")[i];
episode subsets, shuffled order, held-out episodes, exact resume and thread-count invariance on the real files;
bad options as one-line errors."""
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_lerobot

LF = ROOT / "build" / "loongforge"

FPS = 10
LENGTHS = [6, 3, 9, 5]
# a past state, two camera frames 0.1 s apart, an action chunk running past the episode's end
DELTAS = {
    "observation.state": [-0.2, -0.1, 0.0],
    "observation.images.cam0": [-0.1, 0.0],
    "action": [0.0, 0.1, 0.2, 0.3, 0.4, 0.5],
}
QUERIES = {"all": None, "sub": [1, 3]}  # oracle items: every episode; episodes 1 and 3

# Runs in the lerobot env: writes a LeRobot v3.0 dataset (2 cameras, AV1 via lerobot's default encoder) and saves
# LeRobotDataset(...)[i] for every i of each query as <query>.<i>.<key>.
ORACLE = r"""
import json, sys
import numpy as np
import torch
from safetensors.torch import save_file
from lerobot.datasets.lerobot_dataset import LeRobotDataset

root, out, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
H, W, fps = cfg["H"], cfg["W"], cfg["fps"]
cams = [f"observation.images.cam{i}" for i in range(cfg["cams"])]
features = {"observation.state": {"dtype": "float32", "shape": (6,), "names": None},
            "action": {"dtype": "float32", "shape": (6,), "names": None}}
for c in cams:
    features[c] = {"dtype": "video", "shape": (H, W, 3), "names": ["height", "width", "channels"]}
ds = LeRobotDataset.create("test/loader", fps=fps, features=features, root=root, use_videos=True)
rng = np.random.default_rng(0)
yy, xx = np.mgrid[0:H, 0:W]
for e, n in enumerate(cfg["lengths"]):
    for f in range(n):
        frame = {"observation.state": rng.standard_normal(6).astype(np.float32),
                 "action": rng.standard_normal(6).astype(np.float32),
                 "task": "pick the cube" if e % 2 == 0 else "place it"}
        for i, c in enumerate(cams):
            img = np.zeros((H, W, 3), np.uint8)
            img[..., 0] = (xx * 2 + f * 3 + 40 * i) % 256
            img[..., 1] = (yy * 2 + e * 50) % 256
            y0, x0 = (f * 2) % (H - 8), (f * 3 + 10 * i) % (W - 8)
            img[y0:y0 + 8, x0:x0 + 8, 2] = 255
            frame[c] = img
        ds.add_frame(frame)
    ds.save_episode()
ds.finalize()
tensors = {}
for name, episodes in cfg["queries"].items():
    rd = LeRobotDataset("test/loader", root=root, episodes=episodes, delta_timestamps=cfg["deltas"],
                        video_backend="pyav")
    for i in range(len(rd)):
        for k, v in rd[i].items():
            if isinstance(v, torch.Tensor):
                tensors[f"{name}.{i}.{k}"] = v.contiguous()
save_file(tensors, out)
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("robot_loader")
    cfg = {"H": 24, "W": 32, "fps": FPS, "cams": 2, "lengths": LENGTHS, "deltas": DELTAS, "queries": QUERIES}
    run_lerobot(ORACLE, d / "ds", d / "oracle.safetensors", json.dumps(cfg))
    return d / "ds", load_file(str(d / "oracle.safetensors"))


def lf(*args, check=True):
    proc = subprocess.run([str(LF), *map(str, args)], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"loongforge failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def delta_args(deltas=DELTAS):
    return [a for k, v in deltas.items() for a in ("--delta", f"{k}=" + ",".join(repr(x) for x in v))]


def bench(ds, out, *extra, batch=4, steps=None, frames=sum(LENGTHS)):
    steps = steps if steps is not None else -(-frames // batch)
    lf("data", "bench-loader", ds, *delta_args(), "--batch", batch, "--steps", steps, "--dump", out, *extra)
    return load_file(str(out))


def items(dump, prefix):
    """{n: {key: tensor}} from keys <prefix><n>.<key>"""
    out = {}
    for k, v in dump.items():
        n, key = k[len(prefix):].split(".", 1)
        out.setdefault(int(n), {})[key] = v
    return out


def as_lerobot(key, v):
    """Ours in LeRobot's layout: cameras uint8 [..., H, W, C] -> float32 [..., C, H, W] / 255."""
    if key.startswith("observation.images.") and not key.endswith("_is_pad"):
        return v.movedim(-1, -3).float() / 255
    return v


def expect_item(ours, oracle, where):
    want = {k for k in oracle}
    assert set(ours) == want, f"{where}: keys {sorted(set(ours) ^ want)} differ"
    for k, ref in oracle.items():
        got = as_lerobot(k, ours[k])
        assert got.dtype == ref.dtype and got.shape == ref.shape, f"{where} {k}: {got.dtype}{list(got.shape)} vs {ref.dtype}{list(ref.shape)}"
        if k.startswith("observation.images.") and not k.endswith("_is_pad"):
            # LeRobot's float frames are uint8 / 255: compare the bytes
            assert torch.equal(ours[k].movedim(-1, -3), (ref * 255).round().to(torch.uint8)), f"{where} {k}"
        else:
            assert torch.equal(got, ref), f"{where} {k}"


def oracle_items(oracle, query):
    return items({k[len(query) + 1:]: v for k, v in oracle.items() if k.startswith(query + ".")}, "")


def test_windows_pad_masks_and_frames_equal_lerobot(dataset, tmp_path):
    ds, oracle = dataset
    ref = oracle_items(oracle, "all")
    assert len(ref) == sum(LENGTHS)
    ours = items(bench(ds, tmp_path / "s.safetensors", "--samples", "--threads", 2), "sample")
    for i in range(len(ref)):
        expect_item(ours[i], ref[i], f"item {i}")
    # the windows really reach past both episode edges
    assert any(ref[i]["action_is_pad"].any() for i in ref) and any(ref[i]["observation.state_is_pad"].any() for i in ref)


def test_episode_subset_and_shuffled_order_equal_lerobot(dataset, tmp_path):
    ds, oracle = dataset
    ref = oracle_items(oracle, "sub")
    ours = items(bench(ds, tmp_path / "sub.safetensors", "--samples", "--episodes", "1,3", frames=len(ref)), "sample")
    for i in range(len(ref)):
        expect_item(ours[i], ref[i], f"episodes 1,3 item {i}")
    # shuffled: each item is LeRobot's item of the same frame (by its index), each frame once per epoch
    every = oracle_items(oracle, "all")
    by_index = {int(v["index"]): v for v in every.values()}
    shuf = items(bench(ds, tmp_path / "shuf.safetensors", "--samples", "--shuffle", "--seed", 5, "--threads", 3),
                 "sample")
    seen = [int(shuf[n]["index"]) for n in range(len(every))]
    assert sorted(seen) == sorted(by_index) and seen != sorted(seen)
    for n in range(len(every)):
        expect_item(shuf[n], by_index[seen[n]], f"shuffled item {n}")


def test_held_out_episodes_resume_and_thread_count(dataset, tmp_path):
    ds, _ = dataset
    # --val-episodes 1 holds out one episode; --take val reads only it, training never does
    val = items(bench(ds, tmp_path / "val.safetensors", "--samples", "--val-episodes", 1, "--take", "val",
                      steps=2), "sample")
    train = items(bench(ds, tmp_path / "train.safetensors", "--samples", "--val-episodes", 1, steps=6), "sample")
    val_eps = {int(v["episode_index"]) for v in val.values()}
    assert len(val_eps) == 1 and not val_eps & {int(v["episode_index"]) for v in train.values()}
    # resume: 3 batches, state saved, 4 more == the last 4 of 7 uninterrupted (shuffled, crossing an epoch)
    whole = bench(ds, tmp_path / "whole.safetensors", "--shuffle", "--seed", 9, steps=7, batch=5)
    first = tmp_path / "state.json"
    bench(ds, tmp_path / "a.safetensors", "--shuffle", "--seed", 9, "--state-out", first, steps=3, batch=5)
    state = json.loads(first.read_text())
    assert state["position"] == 15 and state["epoch"] == 0
    rest = bench(ds, tmp_path / "b.safetensors", "--shuffle", "--seed", 9, "--resume", first, steps=4, batch=5)
    for k, v in rest.items():
        n, key = k[len("batch"):].split(".", 1)
        assert torch.equal(v, whole[f"batch{int(n) + 3}.{key}"]), k
    # the same batches with the decoding in the caller's thread or in 4 threads
    t0 = bench(ds, tmp_path / "t0.safetensors", "--shuffle", "--threads", 0, steps=4, batch=6)
    t4 = bench(ds, tmp_path / "t4.safetensors", "--shuffle", "--threads", 4, steps=4, batch=6)
    assert t0.keys() == t4.keys() and all(torch.equal(t0[k], t4[k]) for k in t0)


def test_bad_options_are_one_line_errors(dataset, tmp_path):
    ds, _ = dataset

    def error(*args):
        proc = lf("data", "bench-loader", ds, "--steps", 1, *args, check=False)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        return lines[0]

    msg = error("--delta", "action=0,0.15")
    assert "delta_timestamps.action" in msg and "0.15" in msg and "1/10" in msg
    assert "observation.effort" in error("--delta", "observation.effort=0")
    assert "--episodes: expected an integer" in error("--episodes", "x")
    assert "no episode 7" in error("--episodes", "0,7")
    assert "none to train on" in error("--val-episodes", 4)
    state = tmp_path / "other.json"
    lf("data", "bench-loader", ds, "--steps", 1, "--episodes", "0,1", "--state-out", state)
    assert "other episodes" in error("--resume", state)

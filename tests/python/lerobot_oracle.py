"""The lerobot oracle of test_lerobot_dataset.py, run in the lerobot environment (.venv-lerobot) by conftest's
run_lerobot: writes small LeRobot datasets with lerobot itself, and what LeRobotDataset reads from them.

usage: python lerobot_oracle.py OUT_DIR
  OUT/v30       v3.0, AV1 (lerobot's default encoder, GOP 2): a video camera and an image camera, 3 episodes in one
                data file and one video file
  OUT/v30h264   v3.0, H.264 (libx264): one video camera, 2 episodes
  OUT/v30multi  v3.0 split over several files by lerobot's writer (tiny data_files_size_in_mb /
                video_files_size_in_mb, 2 files per chunk): 2 data files, 4 video files in 2 chunks, the data and
                video files splitting at different episodes (one video file holds 2 episodes)
  OUT/v30depth  v3.0 with depth cameras beside an RGB video camera, 2 episodes: a depth video (lerobot's: uint16
                millimetres quantised to 12-bit codes, HEVC gray12le) and depth images (TIFF in the Parquet) of
                uint16 millimetres and of float32 metres
  OUT/v21       the v30 dataset in the v2.1 layout (one parquet and one mp4 per episode, jsonl metadata, per-episode
                stats and no stats.json), written here with pyarrow and lerobot's own video encoder
  OUT/v21conv   OUT/v21 converted to v3.0 by lerobot's convert_dataset_v21_to_v30 (the v2.1 oracle)
  OUT/NAME.npz  for v30, v30h264, v30multi, v30depth, v21conv: every frame of LeRobotDataset(root,
                video_backend="pyav")[i], stacked per key (cameras as uint8 [N, H, W, C], depth cameras as lerobot's
                float32 millimetres [N, H, W, 1])
  OUT/NAME.json tasks and episodes of each
"""
import json
import pathlib
import shutil
import sys
import tempfile
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)

from lerobot.configs.video import RGBEncoderConfig  # noqa: E402
from lerobot.datasets.lerobot_dataset import LeRobotDataset  # noqa: E402
from lerobot.datasets.video_utils import encode_video_frames  # noqa: E402

H, W = 24, 32


def camera_frame(ep, i):
    yy, xx = np.mgrid[0:H, 0:W]
    return np.stack([(xx * 8 + i * 10) % 256, (yy * 10 + ep * 40) % 256, ((xx + yy) * 5 + i * 7) % 256],
                    -1).astype(np.uint8)


def depth_frame(ep, i):
    yy, xx = np.mgrid[0:H, 0:W]
    return (150 + xx * 61 + yy * 37 + i * 90 + ep * 400).astype(np.uint16)[..., None]  # millimetres


def make(root, lengths, codec, image_camera, seed, file_sizes_mb=None, depth_camera=False):
    feats = {
        "observation.state": {"dtype": "float32", "shape": (6,), "names": [f"joint{i}" for i in range(6)]},
        "action": {"dtype": "float32", "shape": (6,), "names": None},
        "observation.images.top": {"dtype": "video", "shape": (H, W, 3), "names": ["height", "width", "channels"]},
    }
    if image_camera:
        feats["observation.images.wrist"] = {"dtype": "image", "shape": (H, W, 3),
                                             "names": ["height", "width", "channels"]}
    if depth_camera:
        for key, dtype in [("depth", "video"), ("depth_mm", "image"), ("depth_m", "image")]:
            feats[f"observation.images.{key}"] = {"dtype": dtype, "shape": (H, W, 1),
                                                  "names": ["height", "width", "channels"],
                                                  "info": {"is_depth_map": True}}
    enc = RGBEncoderConfig(vcodec=codec) if codec else None
    sizes = {} if file_sizes_mb is None else {"data_files_size_in_mb": file_sizes_mb[0],
                                              "video_files_size_in_mb": file_sizes_mb[1]}
    ds = LeRobotDataset.create("test/" + root.name, fps=10, features=feats, root=root, use_videos=True,
                               rgb_encoder=enc, **sizes)
    if file_sizes_mb is not None:
        ds.meta.update_chunk_settings(chunks_size=2)
    rng = np.random.default_rng(seed)
    for ep, n in enumerate(lengths):
        for i in range(n):
            frame = {"observation.state": rng.standard_normal(6).astype(np.float32),
                     "action": rng.standard_normal(6).astype(np.float32),
                     "observation.images.top": camera_frame(ep, i),
                     "task": ["pick the cube", "place the cube"][ep % 2]}
            if image_camera:
                frame["observation.images.wrist"] = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
            if depth_camera:
                frame["observation.images.depth"] = depth_frame(ep, i)
                frame["observation.images.depth_mm"] = depth_frame(ep, i + 3)
                frame["observation.images.depth_m"] = depth_frame(ep, i + 5).astype(np.float32) / np.float32(997)
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()


def dump(root, name):
    ds = LeRobotDataset("test/" + root.name, root=root, video_backend="pyav")
    cams = set(ds.meta.camera_keys)
    depth = set(ds.meta.depth_keys)
    cols = {}
    for i in range(len(ds)):
        item = ds[i]
        for k, v in item.items():
            if not isinstance(v, torch.Tensor):
                continue
            if k in depth:  # float32 millimetres [1, H, W] -> [H, W, 1]
                v = v.permute(1, 2, 0)
            elif k in cams:  # float32 [C, H, W] in [0, 1] -> uint8 [H, W, C] (exactly: lerobot divided uint8 by 255)
                u = torch.round(v * 255)
                assert (u - v * 255).abs().max() < 1e-3, k
                v = u.to(torch.uint8).permute(1, 2, 0)
            cols.setdefault(k, []).append(v.numpy())
    np.savez(out / f"{name}.npz", **{k: np.stack(v) for k, v in cols.items()})
    eps = [{"episode_index": int(e["episode_index"]), "length": int(e["length"]),
            "from": int(e["dataset_from_index"]), "tasks": list(e["tasks"])} for e in ds.meta.episodes]
    tasks = {int(r.task_index): t for t, r in ds.meta.tasks.iterrows()}
    (out / f"{name}.json").write_text(json.dumps({"episodes": eps, "tasks": [tasks[k] for k in sorted(tasks)],
                                                  "fps": ds.meta.fps, "cameras": list(ds.meta.camera_keys)}))


def to_v21(src, dst):
    """The v3.0 dataset SRC in the v2.1 layout at DST: per-episode parquet (rows of the v3 data file, same schema),
    per-episode mp4 (encoded from the same images by lerobot's encode_video_frames), jsonl metadata."""
    info = json.loads((src / "meta/info.json").read_text())
    table = pq.read_table(src / "data/chunk-000/file-000.parquet")
    meta_eps = pq.read_table(src / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    tasks = pq.read_table(src / "meta/tasks.parquet").to_pandas()
    (dst / "meta").mkdir(parents=True)
    video_keys = [k for k, f in info["features"].items() if f["dtype"] == "video"]
    with open(dst / "meta/episodes.jsonl", "w") as fe, open(dst / "meta/episodes_stats.jsonl", "w") as fs:
        for e in meta_eps:
            ep = e["episode_index"]
            fe.write(json.dumps({"episode_index": ep, "tasks": e["tasks"], "length": e["length"]}) + "\n")
            stats = {}
            for k, v in e.items():
                if k.startswith("stats/"):
                    _, feat, stat = k.split("/")
                    stats.setdefault(feat, {})[stat] = v
            fs.write(json.dumps({"episode_index": ep, "stats": stats}) + "\n")
            rows = table.slice(e["dataset_from_index"], e["length"])
            path = dst / f"data/chunk-000/episode_{ep:06d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(rows, path)
            for key in video_keys:
                with tempfile.TemporaryDirectory() as tmp:
                    from PIL import Image
                    for i in range(e["length"]):
                        Image.fromarray(camera_frame(ep, i)).save(f"{tmp}/frame-{i:06d}.png")
                    encode_video_frames(tmp, dst / f"videos/chunk-000/{key}/episode_{ep:06d}.mp4", info["fps"])
    with open(dst / "meta/tasks.jsonl", "w") as ft:
        for task, r in tasks.iterrows():
            ft.write(json.dumps({"task_index": int(r.task_index), "task": task}) + "\n")
    info["codebase_version"] = "v2.1"
    info["data_path"] = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
    info["video_path"] = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
    info["total_chunks"] = 1
    info["total_videos"] = len(video_keys) * len(meta_eps)
    del info["data_files_size_in_mb"], info["video_files_size_in_mb"]
    for f in info["features"].values():
        f.pop("fps", None)
    (dst / "meta/info.json").write_text(json.dumps(info, indent=4))


make(out / "v30", [12, 20, 9], None, True, 0)
make(out / "v30h264", [15, 11], "h264", False, 1)
make(out / "v30multi", [7, 5, 6, 4, 8], None, False, 3, file_sizes_mb=(0.0045, 0.003))
make(out / "v30depth", [6, 5], None, False, 4, depth_camera=True)
to_v21(out / "v30", out / "v21")
shutil.copytree(out / "v21", out / "v21conv")

# lerobot's converter imports jsonlines (not in this environment): a stand-in with the one call it makes
jsonlines = types.ModuleType("jsonlines")


class _Reader:
    def __init__(self, path, mode="r"):
        self.f = open(path)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.f.close()

    def __iter__(self):
        return (json.loads(line) for line in self.f if line.strip())


jsonlines.open = _Reader
sys.modules["jsonlines"] = jsonlines
import lerobot.utils.import_utils as iu  # noqa: E402
_require = iu.require_package
iu.require_package = lambda name, *a, **k: None if name == "jsonlines" else _require(name, *a, **k)
from lerobot.scripts.convert_dataset_v21_to_v30 import convert_dataset  # noqa: E402

convert_dataset("test/v21conv", root=out / "v21conv", push_to_hub=False)
shutil.rmtree(out / "v21conv_old")

for name in ["v30", "v30h264", "v30multi", "v30depth", "v21conv"]:
    dump(out / name, name)
print("ok")

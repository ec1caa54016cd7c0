"""Statistics (data/robot/stats.h, `loongforge data stats`) against LeRobot's own compute_stats: HDF5 episodes
written here with h5py, their arrays fed to lerobot.datasets.compute_stats.compute_episode_stats (camera frames
through its own sample_images: sample_indices, auto_downsample_height_width, per-channel stats / 255; only the file
loading is replaced by the arrays h5py reads) and aggregate_stats over the episodes, all episodes or a subset, and
compared with the stats.json `data stats` writes: every feature, every statistic, within 1e-6 relative (the
issue's tolerance) and, beyond it, bit for bit. Covers float32 / float64 / int64 columns, scalar and vector features,
a constant column, a one-frame episode (numpy reduces its camera batch column by column), an episode long enough to sample frames (> 100) and frames large enough to
be subsampled (>= 300 px)."""
import json

import numpy as np
import pytest

from conftest import run_lerobot, run_lf

WRITE = r"""
import sys, h5py, numpy as np
folder = sys.argv[1]
specs = [(0, 130, 0), (1, 1, 1), (4, 40, 2), (7, 9, 3)]
for ep, T, seed in specs:
    rng = np.random.default_rng(seed)
    with h5py.File(f"{folder}/episode_{ep}.hdf5", "w") as f:
        qpos = rng.standard_normal((T, 6)) * [1, 10, 0.01, 100, 1, 1] + [0, 5, 0, -50, 0, 0]
        qpos[:, 4] = 0.25  # a constant joint
        f.create_dataset("observations/qpos", data=qpos)
        f.create_dataset("observations/qvel", data=rng.standard_normal((T, 6)).astype(np.float32))
        f.create_dataset("action", data=(rng.standard_normal((T, 3)) * 3).astype(np.float32))
        f.create_dataset("observations/effort", data=(rng.standard_normal(T) * 2).astype(np.float32))
        top = rng.integers(0, 256, (T, 8, 10, 3), dtype=np.uint8)
        top[..., 2] //= 4
        f.create_dataset("observations/images/top", data=top)
        big = np.broadcast_to(rng.integers(0, 256, (T, 1, 1, 3), dtype=np.uint8), (T, 300, 320, 3)).copy()
        big[:, ::7, ::3, 1] = 255 - big[:, ::7, ::3, 1]  # near-constant channels: std from a cancelling difference
        f.create_dataset("observations/images/big", data=big)
"""

# LeRobot's statistics of the same arrays: argv = folder, then requests "fps;episode indices (comma-separated or
# all);features (comma-separated or all)"; prints one {feature: {stat: nested list}} per request, a JSON list.
ORACLE = r"""
import glob, json, re, sys
import h5py, numpy as np
import lerobot.datasets.compute_stats as cs
def run(folder, fps, which, feats):
  frames = {}
  def load(path, dtype=np.uint8, channel_first=True):
      img = frames[path].astype(dtype)
      return np.transpose(img, (2, 0, 1)) if channel_first else img
  cs.load_image_as_numpy = load
  files = sorted(glob.glob(f"{folder}/*.hdf5"), key=lambda p: int(re.findall(r"(\d+)\.hdf5$", p)[0]))
  ep_stats, start = [], 0
  for path in files:
      ep = int(re.findall(r"(\d+)\.hdf5$", path)[0])
      with h5py.File(path, "r") as f:
          T = f["action"].shape[0]
          data = {"observation.state": f["observations/qpos"][:], "observation.velocity": f["observations/qvel"][:],
                  "observation.effort": f["observations/effort"][:], "action": f["action"][:],
                  "timestamp": (np.arange(T) / fps).astype(np.float32), "frame_index": np.arange(T),
                  "episode_index": np.full(T, ep), "index": np.arange(T) + start}
          features = {k: {"dtype": str(v.dtype)} for k, v in data.items()}
          for cam in f["observations/images"]:
              key = f"observation.images.{cam}"
              arr = f[f"observations/images/{cam}"][:]
              data[key] = []
              for t in range(T):
                  frames[f"{cam}/{ep}/{t}"] = arr[t]
                  data[key].append(f"{cam}/{ep}/{t}")
              features[key] = {"dtype": "image"}
      start += T
      if which != "all" and ep not in [int(x) for x in which.split(",")]:
          continue
      if feats != "all":
          data = {k: v for k, v in data.items() if k in feats.split(",")}
      ep_stats.append(cs.compute_episode_stats(data, features))
  agg = cs.aggregate_stats(ep_stats)
  return {k: {s: np.asarray(v).tolist() for s, v in st.items()} for k, st in agg.items()}
res = []
for req in sys.argv[2:]:
    fps, which, feats = req.split(";")
    res.append(run(sys.argv[1], float(fps), which, feats))
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stats_eps")
    run_lerobot(WRITE, folder)
    return folder


def compare(ours, ref):
    assert sorted(ours) == sorted(ref)
    exact = total = 0
    for feature, st in ref.items():
        assert sorted(ours[feature]) == sorted(st), feature
        for key, want in st.items():
            want, have = np.asarray(want, np.float64), np.asarray(ours[feature][key], np.float64)
            assert have.shape == want.shape, (feature, key, have.shape, want.shape)
            np.testing.assert_allclose(have, want, rtol=1e-6, atol=0, err_msg=f"{feature}.{key}")
            exact += int(np.array_equal(have, want))
            total += 1
    return exact, total


SUBSET = "observation.state,timestamp,index,observation.images.top"


@pytest.fixture(scope="module")
def reference(episodes):
    """LeRobot's stats: all episodes at 50 fps; episodes 1 and 7, four features, at 30 fps (one oracle run)."""
    return json.loads(run_lerobot(ORACLE, episodes, "50;all;all", f"30;1,7;{SUBSET}"))


def test_all_episodes_all_features(episodes, reference, tmp_path):
    out = tmp_path / "stats.json"
    run_lf("data", "stats", "--dataset", episodes, "--out", out)
    ours = json.loads(out.read_text())
    assert np.asarray(ours["observation.images.big"]["q50"]).shape == (3, 1, 1)
    assert ours["action"]["count"] == [130 + 1 + 40 + 9]
    exact, total = compare(ours, reference[0])
    assert exact == total, f"only {exact} of {total} statistics bit-equal"


def test_subset_of_episodes_and_features(episodes, reference):
    proc = run_lf("data", "stats", "--dataset", episodes, "--episodes", "7,1", "--features", SUBSET, "--fps", "30")
    ours = json.loads(proc.stdout)
    assert sorted(ours) == ["index", "observation.images.top", "observation.state", "timestamp"]
    exact, total = compare(ours, reference[1])
    assert exact == total, f"only {exact} of {total} statistics bit-equal"


def test_bad_requests_one_line(episodes):
    for args, needle in [(["--episodes", "3"], "no episode 3"), (["--features", "observation.nope"], "observation.nope"),
                         (["--episodes", "x"], "'x'")]:
        proc = run_lf("data", "stats", "--dataset", episodes, *args, check=False)
        err = proc.stderr.strip()
        assert proc.returncode != 0 and len(err.splitlines()) == 1 and needle in err, err

"""LeRobot datasets (data/robot/lerobot.cpp, video_frames.cpp) checked against lerobot 0.6.1 itself: datasets written
by lerobot in its environment (lerobot_oracle.py: v3.0 with AV1 video + a PNG image camera, v3.0 with H.264, v3.0
split by lerobot's writer over several data and video files and chunks, v3.0 with a depth video camera, the same
data in the v2.1 layout, cross-checked through lerobot's v2.1 -> v3.0 converter), read here through
`loongforge data export` / `loongforge info` and compared frame by frame with LeRobotDataset(root,
video_backend="pyav")[i]: states, actions, indices, timestamps equal; decoded video frames, image frames and depth
frames (millimetres) bitwise equal; the statistics equal stats.json (v2.1: the per-episode stats aggregated as lerobot's converter does).
Bad input fails in one line naming the file, the episode and the field."""
import json
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import TESTS_BIN, run_gtest_hook, run_lerobot, run_lf

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ORACLE = pathlib.Path(__file__).with_name("lerobot_oracle.py")
NUMERIC = ["observation.state", "action", "timestamp", "frame_index", "episode_index", "index", "task_index"]
VIDEO = "observation.images.top"
IMAGE = "observation.images.wrist"
# dataset folder -> the oracle that read it (v2.1: the converted copy)
DATASETS = {"v30": "v30", "v30h264": "v30h264", "v30multi": "v30multi", "v30depth": "v30depth", "v21": "v21conv"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("lerobot")
    run_lerobot(ORACLE.read_text(), d)
    return d


def export(dataset, out, *extra):
    run_lf("data", "export", "--dataset", dataset, "--out", out, *map(str, extra))
    return load_file(str(out))


def fails(*args):
    proc = run_lf(*args, check=False)
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def exported(data, tmp_path_factory):
    """Each dataset read once through `data export --cameras --stats` (every episode, cameras included)."""
    out = tmp_path_factory.mktemp("exports")
    return {name: export(data / name, out / f"{name}.safetensors", "--cameras", "--stats") for name in DATASETS}


@pytest.mark.parametrize("name", list(DATASETS))
def test_frames_equal_lerobot(data, exported, name):
    oracle = np.load(data / f"{DATASETS[name]}.npz")
    meta = json.loads((data / f"{DATASETS[name]}.json").read_text())
    x = exported[name]
    for k in NUMERIC + meta["cameras"]:
        assert x[k].dtype == oracle[k].dtype and x[k].shape == oracle[k].shape, k
        for e in meta["episodes"]:
            rows = slice(e["from"], e["from"] + e["length"])
            np.testing.assert_array_equal(x[k][rows], oracle[k][rows], err_msg=f"{name} episode {e} {k}")
    assert {k for k in x if not k.startswith("stats/")} == set(NUMERIC + meta["cameras"])


def test_multi_file_layout(data):
    """v30multi is what test_frames_equal_lerobot needs it to be: lerobot's writer split the data and the videos over
    several files (two chunks of videos), at different episodes, with a video file shared by two episodes."""
    d = data / "v30multi"
    assert len(list((d / "data").rglob("*.parquet"))) >= 2
    assert len({p.parent.name for p in (d / "videos" / VIDEO).rglob("*.mp4")}) >= 2
    eps = pq.read_table(next((d / "meta" / "episodes").rglob("*.parquet"))).to_pylist()
    data_files = [(e["data/chunk_index"], e["data/file_index"]) for e in eps]
    video_files = [(e[f"videos/{VIDEO}/chunk_index"], e[f"videos/{VIDEO}/file_index"]) for e in eps]
    assert len(set(data_files)) >= 2 and len(set(video_files)) >= 3
    assert len(set(video_files)) < len(eps)  # a video file holds two episodes

    def splits(files):
        return [i for i in range(1, len(files)) if files[i] != files[i - 1]]
    assert splits(data_files) != splits(video_files)
    assert any(e[f"videos/{VIDEO}/from_timestamp"] > 0 for e in eps)


def test_export_episodes(data, tmp_path):
    """--episode E (repeatable): those episodes' frames only, in the order given, cameras included."""
    oracle = np.load(data / "v30.npz")
    meta = json.loads((data / "v30.json").read_text())
    x = export(data / "v30", tmp_path / "x.safetensors", "--episode", 2, "--episode", 0)
    eps = {e["episode_index"]: e for e in meta["episodes"]}
    rows = np.r_[eps[2]["from"]:eps[2]["from"] + eps[2]["length"], eps[0]["from"]:eps[0]["from"] + eps[0]["length"]]
    assert set(x) == set(NUMERIC + meta["cameras"])
    for k in x:
        np.testing.assert_array_equal(x[k], oracle[k][rows], err_msg=k)
    line = fails("data", "export", "--dataset", data / "v30", "--episode", 7, "--out", tmp_path / "y.safetensors")
    assert "episode" in line and "7" in line
    assert not (tmp_path / "y.safetensors").exists()


@pytest.mark.parametrize("name", list(DATASETS))
def test_info(data, name):
    meta = json.loads((data / f"{DATASETS[name]}.json").read_text())
    info = json.loads((data / name / "meta" / "info.json").read_text())
    j = json.loads(run_lf("info", data / name).stdout)
    assert j["format"] == ("LeRobot v2.1" if name == "v21" else "LeRobot v3.0")
    assert j["episodes"] == len(meta["episodes"]) == info["total_episodes"]
    assert j["frames"] == sum(e["length"] for e in meta["episodes"]) == info["total_frames"]
    assert j["fps"] == meta["fps"]
    assert j["tasks"] == len(meta["tasks"])
    assert j["cameras"] == meta["cameras"]
    feats = {f["name"]: f for f in j["features"]}
    oracle = np.load(data / f"{DATASETS[name]}.npz")
    for k, spec in info["features"].items():
        assert feats[k]["dtype"] == spec["dtype"], k
        if k in meta["cameras"]:
            assert feats[k]["kind"] == spec["dtype"] and feats[k]["shape"] == spec["shape"], k
        else:  # as stored (lerobot's items): a scalar column is [], info.json says [1]
            assert feats[k]["kind"] == "numeric" and feats[k]["shape"] == list(oracle[k].shape[1:]), k
        if spec.get("names") and isinstance(spec["names"], list):
            assert feats[k]["names"] == spec["names"], k
    # numeric features first, in info.json's order, then cameras, then the task text
    names = [f["name"] for f in j["features"]]
    order = [k for k in info["features"] if k not in meta["cameras"]] + [k for k in info["features"]
                                                                          if k in meta["cameras"]] + ["task"]
    assert names == order


@pytest.mark.parametrize("name", ["v30", "v21"])
def test_stats(data, exported, name):
    # v3.0: meta/stats.json as read; v2.1 (no stats.json): episodes_stats.jsonl aggregated, compared with the
    # stats.json lerobot's converter wrote from the same per-episode stats
    stats = json.loads((data / DATASETS[name] / "meta" / "stats.json").read_text())
    if name == "v21":
        assert not (data / name / "meta" / "stats.json").exists()
    x = exported[name]
    got = {k[len("stats/"):] for k in x if k.startswith("stats/")}
    assert got == {f"{f}/{s}" for f, per in stats.items() for s in per}
    for f, per in stats.items():
        for s, v in per.items():
            t = x[f"stats/{f}/{s}"]
            assert t.dtype == np.float64 and t.shape == np.asarray(v).shape, (f, s)
            if name == "v30":
                np.testing.assert_array_equal(t, np.asarray(v, np.float64), err_msg=f"{f}/{s}")
            else:
                np.testing.assert_allclose(t, np.asarray(v, np.float64), rtol=1e-12, atol=1e-12,
                                           err_msg=f"{f}/{s}")


@pytest.mark.parametrize("name", ["v30", "v30h264"])
def test_gop_cache_hook(data, name):
    """The GOP cache (C++): sequential reads decode each GOP once; threads asking for the same frames agree and
    share the decodes; a small budget evicts and still gives the same frames; the dataset's read_camera from
    several threads equals the single-threaded read. AV1 and H.264 (whose keyframes' dts precede their pts): each
    seek lands on the GOP's own keyframe (no frame decoded twice)."""
    if not TESTS_BIN.exists():
        pytest.skip("no gtest binary")
    run_gtest_hook("RobotLeRobot.GopCacheHook", {
        "LF_TEST_LEROBOT_VIDEO": str(data / name / "videos" / VIDEO / "chunk-000" / "file-000.mp4"),
        "LF_TEST_LEROBOT_DATASET": str(data / name)})


# ---- bad input: one line naming the file, the episode and the field -------------------------------------------


def broken_copy(data, tmp_path, name="v30"):
    dst = tmp_path / name
    shutil.copytree(data / name, dst)
    return dst


def test_missing_data_file(data, tmp_path):
    d = broken_copy(data, tmp_path, "v21")
    f = d / "data" / "chunk-000" / "episode_000001.parquet"
    f.unlink()
    line = fails("data", "export", "--dataset", d, "--out", tmp_path / "x.safetensors")
    assert str(f) in line and "episode 1" in line
    assert not (tmp_path / "x.safetensors").exists()


def test_truncated_data_file(data, tmp_path):
    d = broken_copy(data, tmp_path)
    f = d / "data" / "chunk-000" / "file-000.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    line = fails("data", "export", "--dataset", d, "--out", tmp_path / "x.safetensors")
    assert str(f) in line and "episode 0" in line


def test_feature_absent_from_parquet(data, tmp_path):
    d = broken_copy(data, tmp_path)
    info = json.loads((d / "meta" / "info.json").read_text())
    info["features"]["observation.effort"] = {"dtype": "float32", "shape": [6], "names": None}
    (d / "meta" / "info.json").write_text(json.dumps(info))
    line = fails("info", d)
    assert str(d / "data" / "chunk-000" / "file-000.parquet") in line and "observation.effort" in line
    assert "episode 0" in line


def set_from_timestamp(d, episode, value):
    f = next((d / "meta" / "episodes").rglob("*.parquet"))
    t = pq.read_table(f)
    col = f"videos/{VIDEO}/from_timestamp"
    vals = t.column(col).to_pylist()
    vals[episode] = value
    t = t.set_column(t.schema.get_field_index(col), col, pa.array(vals, pa.float64()))
    pq.write_table(t, f)


def test_timestamp_outside_video(data, tmp_path):
    d = broken_copy(data, tmp_path)
    set_from_timestamp(d, 2, 3.9)  # episode 2 (9 frames, 0.9 s) would run past the video's end (4.0 s)
    line = fails("data", "export", "--dataset", d, "--episode", 2, "--out", tmp_path / "x.safetensors")
    video = d / "videos" / VIDEO / "chunk-000" / "file-000.mp4"
    assert str(video) in line and "episode 2" in line and VIDEO in line and "timestamp 4.1" in line
    assert not (tmp_path / "x.safetensors").exists()


def test_missing_video(data, tmp_path):
    d = broken_copy(data, tmp_path, "v21")
    f = d / "videos" / "chunk-000" / VIDEO / "episode_000002.mp4"
    f.unlink()
    line = fails("data", "export", "--dataset", d, "--episode", 2, "--out", tmp_path / "x.safetensors")
    assert str(f) in line and "episode 2" in line and VIDEO in line


def test_truncated_video(data, tmp_path):
    d = broken_copy(data, tmp_path)
    f = d / "videos" / VIDEO / "chunk-000" / "file-000.mp4"
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])
    line = fails("data", "export", "--dataset", d, "--episode", 2, "--out", tmp_path / "x.safetensors")
    assert str(f) in line and "episode 2" in line and VIDEO in line


def test_bad_info(data, tmp_path):
    d = broken_copy(data, tmp_path)
    info = json.loads((d / "meta" / "info.json").read_text())
    info["codebase_version"] = "v1.6"
    (d / "meta" / "info.json").write_text(json.dumps(info))
    line = fails("info", d)
    assert str(d / "meta" / "info.json") in line and "codebase_version" in line and "v1.6" in line


def test_codec_without_decoder(data, tmp_path):
    d = broken_copy(data, tmp_path)
    f = d / "videos" / VIDEO / "chunk-000" / "file-000.mp4"
    raw = f.read_bytes()
    at = raw.index(b"av01", raw.index(b"stsd"))  # the sample entry's codec tag: unknown, FFmpeg has no decoder
    f.write_bytes(raw[:at] + b"zz01" + raw[at + 4:])
    line = fails("data", "export", "--dataset", d, "--episode", 0, "--out", tmp_path / "x.safetensors")
    assert str(f) in line and "episode 0" in line and VIDEO in line and "no decoder" in line and "zz01" in line


def test_row_groups(data, tmp_path):
    """The v3.0 data file rewritten in row groups of 7 rows (episodes straddle them): the same frames."""
    d = broken_copy(data, tmp_path)
    f = d / "data" / "chunk-000" / "file-000.parquet"
    pq.write_table(pq.read_table(f), f, row_group_size=7)
    assert pq.ParquetFile(f).num_row_groups == 6
    oracle = np.load(data / "v30.npz")
    x = export(d, tmp_path / "x.safetensors", "--cameras")
    for k in NUMERIC + [VIDEO, IMAGE]:
        np.testing.assert_array_equal(x[k], oracle[k], err_msg=k)
    x = export(d, tmp_path / "y.safetensors", "--episode", 1)
    for k in NUMERIC + [VIDEO, IMAGE]:
        np.testing.assert_array_equal(x[k], oracle[k][12:32], err_msg=k)


def test_depth_camera_info_and_stats(data, tmp_path):
    """A depth camera: info marks it; data stats computes its statistics as lerobot did while recording (stats.json:
    the sampled frames in the recorded unit, not divided by 255): the TIFF images' bit for bit (millimetres) and within
    1e-6 (metres, read back through millimetres), the depth video's within its 12-bit quantisation (lerobot's come
    from the frames before encoding); a depth flag on a 3-channel camera is refused in one line naming info.json and
    the feature."""
    feats = {f["name"]: f for f in json.loads(run_lf("info", data / "v30depth").stdout)["features"]}
    assert feats["observation.images.depth"].get("depth") is True and "depth" not in feats[VIDEO]
    run_lf("data", "stats", "--dataset", data / "v30depth", "--out", tmp_path / "stats.json")
    got = json.loads((tmp_path / "stats.json").read_text())
    want = json.loads((data / "v30depth" / "meta" / "stats.json").read_text())
    for cam, rtol in [("depth_mm", 0), ("depth_m", 1e-6), ("depth", 2e-3)]:
        name = "observation.images." + cam
        assert set(got[name]) == set(want[name]), name
        for stat in want[name]:
            np.testing.assert_allclose(np.array(got[name][stat]), np.array(want[name][stat]), rtol=rtol, atol=0,
                                       err_msg=f"{name} {stat}")
        assert np.array(got[name]["mean"]).shape == (1, 1, 1)
    d = broken_copy(data, tmp_path)
    info = json.loads((d / "meta" / "info.json").read_text())
    info["features"][VIDEO].setdefault("info", {})["is_depth_map"] = True
    (d / "meta" / "info.json").write_text(json.dumps(info))
    line = fails("info", d)
    assert str(d / "meta" / "info.json") in line and f"features.{VIDEO}.shape" in line and "one channel" in line


def test_truncated_depth_image(data, tmp_path):
    """A depth image (TIFF in the Parquet) cut short: one line naming the data file, the episode, the camera and the
    frame."""
    d = broken_copy(data, tmp_path, "v30depth")
    f = d / "data" / "chunk-000" / "file-000.parquet"
    t = pq.read_table(f)
    col = "observation.images.depth_mm"
    rows = t.column(col).to_pylist()
    rows[8]["bytes"] = rows[8]["bytes"][:60]  # episode 1 (6 + 5 frames), frame 2
    t = t.set_column(t.schema.get_field_index(col), col, pa.array(rows, t.schema.field(col).type))
    pq.write_table(t, f)
    line = fails("data", "export", "--dataset", d, "--episode", 1, "--out", tmp_path / "x.safetensors")
    assert str(f) in line and "episode 1" in line and col in line and "frame 2" in line, line


DEPTH_WINDOWS = r"""
import sys, torch
from safetensors.torch import save_file
from lerobot.datasets.lerobot_dataset import LeRobotDataset
delta = {"observation.images.depth": [-0.1, 0.0], "observation.images.depth_m": [-0.1, 0.0]}
ds = LeRobotDataset("test/v30depth", root=sys.argv[1], video_backend="pyav", delta_timestamps=delta)
out = {}
for i in range(len(ds)):
    for k, v in ds[i].items():
        if k.startswith("observation.images.depth"):
            out[f"sample{i}.{k}"] = v.contiguous()
save_file(out, sys.argv[2])
"""


@pytest.mark.slow  # lerobot decodes ~20 s of HEVC windows item by item
def test_depth_windows_equal_lerobot(data, tmp_path):
    """The loader's delta_timestamps windows of depth cameras (video and image; padded at episode starts) and their
    pad masks equal LeRobotDataset(..., delta_timestamps=...)[i] bitwise, frames as float32 millimetres."""
    from safetensors.numpy import load_file as load
    n = sum(e["length"] for e in json.loads((data / "v30depth.json").read_text())["episodes"])
    run_lf("data", "bench-loader", data / "v30depth", "--delta", "observation.images.depth=-0.1,0.0",
           "--delta", "observation.images.depth_m=-0.1,0.0", "--batch", n, "--steps", 1, "--samples",
           "--dump", tmp_path / "ours.safetensors")
    run_lerobot(DEPTH_WINDOWS, data / "v30depth", tmp_path / "ref.safetensors")
    ours, ref = load(str(tmp_path / "ours.safetensors")), load(str(tmp_path / "ref.safetensors"))
    assert len(ref) == 5 * n  # per item: 3 depth cameras, 2 pad masks
    for k, want in ref.items():
        got = ours[k] if k.endswith("_is_pad") else np.moveaxis(ours[k], -1, -3)  # [..., H, W, 1] -> [..., 1, H, W]
        assert got.dtype == want.dtype and got.shape == want.shape, k
        np.testing.assert_array_equal(got, want, err_msg=k)

"""HDF5 episodes in ALOHA's and robomimic's layouts (data/robot/hdf5_episodes.cpp) checked against h5py: files
written here with h5py (in the lerobot oracle environment, which has it), read through the gtest hook
RobotHdf5.ReadToSafetensors (every numeric column whole and in part, every camera frame, from 4 threads at once)
and compared value for value with what h5py reads; timestamps, frame / episode indices and the global index
synthesised as LeRobot lays them out (timestamp = frame / fps in float32); ALOHA's compressed files (JPEG bytes
per frame) decoded as Pillow decodes them. robomimic's one-file layout (/data/demo_N/obs/<key>, actions, rewards,
dones, states; uint8 [T, H, W, C] image observations as cameras; the rate from env_args) is told apart from
ALOHA's without an option. Bad files fail in one line naming the file, the episode and the dataset path."""
import json
import os

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from conftest import run_gtest_hook, run_lerobot, run_lf

# Writes ALOHA episode files: argv = folder, spec (JSON: {file: {T, dtypes, cams, compress, ...}}); saves what h5py
# reads back (and Pillow's decode of compressed frames) as FOLDER/expected.npz.
WRITE = r"""
import io, json, sys
import h5py, numpy as np
from PIL import Image
folder, spec = sys.argv[1], json.loads(sys.argv[2])
exp = {}
for name, s in spec.items():
    rng = np.random.default_rng(s.get("seed", 0))
    T = s["T"]
    with h5py.File(f"{folder}/{name}", "w") as f:
        if s.get("sim") is not None:
            f.attrs["sim"] = s["sim"]
        obs = f.create_group("observations")
        def put(path, arr):
            if path.startswith("/observations/"):
                obs.create_dataset(path[len("/observations/"):], data=arr)
            else:
                f.create_dataset(path, data=arr)
        for path, (dims, dtype) in s["arrays"].items():
            shape = [T] + dims if not isinstance(dims, list) or dims != ["scalar"] else [T]
            arr = (rng.standard_normal(shape) * 2).astype(dtype)
            put(path, arr)
        imgs = obs.create_group("images")
        if s.get("compress"):
            f.attrs["compress"] = True
            for cam, (h, w) in s["cams"].items():
                rows = []
                for t in range(T):
                    yy, xx = np.mgrid[0:h, 0:w]
                    px = np.stack([(xx * 7 + t * 13) % 256, (yy * 11 + t) % 256, ((xx + yy) * 5) % 256], -1)
                    buf = io.BytesIO()
                    Image.fromarray(px.astype(np.uint8)).save(buf, format="JPEG", quality=80)
                    rows.append(np.frombuffer(buf.getvalue(), np.uint8))
                pad = max(len(r) for r in rows) + 5
                data = np.zeros((T, pad), np.uint8)
                for t, r in enumerate(rows):
                    data[t, : len(r)] = r
                imgs.create_dataset(cam, data=data, chunks=(1, pad))
                f.create_dataset("compress_len", data=np.array([[len(r) for r in rows]], np.float64))
        else:
            for cam, (h, w) in s["cams"].items():
                imgs.create_dataset(cam, data=rng.integers(0, 256, (T, h, w, 3), dtype=np.uint8))
    with h5py.File(f"{folder}/{name}", "r") as f:
        for path in s["arrays"]:
            exp[f"{name}:{path}"] = f[path][:]
        for cam in s["cams"]:
            d = f[f"/observations/images/{cam}"][:]
            if s.get("compress"):
                d = np.stack([np.asarray(Image.open(io.BytesIO(r.tobytes())).convert("RGB")) for r in d])
            exp[f"{name}:cam:{cam}"] = d
np.savez(f"{folder}/expected.npz", **exp)
"""

ALOHA = {"/observations/qpos": [[14], "float64"], "/observations/qvel": [[14], "float64"],
         "/action": [[14], "float32"]}


def write_episodes(folder, spec):
    folder.mkdir(parents=True, exist_ok=True)
    run_lerobot(WRITE, folder, json.dumps(spec))
    return dict(np.load(folder / "expected.npz"))


def read_all(tmp_path, dataset, fps=None):
    out = tmp_path / "read.safetensors"
    env = {"LF_ROBOT_HDF5": str(dataset), "LF_ROBOT_OUT": str(out)}
    if fps is not None:
        env["LF_ROBOT_FPS"] = str(fps)
    run_gtest_hook("RobotHdf5.ReadToSafetensors", env)
    with safe_open(str(out), "np") as f:
        meta = f.metadata()
    features = [tuple(x.split(":")) for x in meta["features"].split(";")]
    got = load_file(str(out))
    got["format"] = meta["format"]
    return got, features


NAMES = {"/observations/qpos": "observation.state", "/observations/qvel": "observation.velocity",
         "/observations/effort": "observation.effort", "/action": "action"}


def check_episodes(got, spec, exp, files, fps):
    """files: [(file name, episode_index)] in the reader's episode order."""
    assert got["format"] == "HDF5 (ALOHA layout)"
    eps = got["episodes"]
    assert eps[:, 0].tolist() == [i for _, i in files]
    assert eps[:, 1].tolist() == [spec[n]["T"] for n, _ in files]
    assert eps[:, 2].tolist() == np.concatenate([[0], np.cumsum(eps[:, 1])[:-1]]).tolist()
    assert got["fps"][0] == fps
    for p, (name, index) in enumerate(files):
        T, start = spec[name]["T"], eps[p, 2]
        for path in spec[name]["arrays"]:
            want = exp[f"{name}:{path}"]
            have = got[f"ep{p}.{NAMES[path]}"]
            assert have.dtype == want.dtype and np.array_equal(have, want), (name, path)
            if T >= 2:
                assert np.array_equal(got[f"ep{p}.{NAMES[path]}.part"], want[1:T - 1])
        frames = np.arange(T)
        assert np.array_equal(got[f"ep{p}.timestamp"], (frames / fps).astype(np.float32))
        assert got[f"ep{p}.timestamp"].dtype == np.float32
        assert np.array_equal(got[f"ep{p}.frame_index"], frames)
        assert np.array_equal(got[f"ep{p}.episode_index"], np.full(T, index))
        assert np.array_equal(got[f"ep{p}.index"], frames + start)
        for cam in spec[name]["cams"]:
            want = exp[f"{name}:cam:{cam}"]
            assert np.array_equal(got[f"ep{p}.observation.images.{cam}"], want), (name, cam)
            assert np.array_equal(got[f"ep{p}.observation.images.{cam}.picked"], want[[T - 1, 0, 0, T // 2]])


def test_aloha_folder_every_value(tmp_path):
    # Episodes numbered 0, 2, 10 (sorted by number, not by name); lengths 9, 1, 12; one without qvel would differ,
    # so all share the layout; an effort column, a float32 action.
    arrays = {**ALOHA, "/observations/effort": [[14], "float64"]}
    cams = {"top": [6, 8], "left_wrist": [4, 5]}
    spec = {"episode_10.hdf5": {"T": 12, "arrays": arrays, "cams": cams, "seed": 3, "sim": True},
            "episode_0.hdf5": {"T": 9, "arrays": arrays, "cams": cams, "seed": 1, "sim": True},
            "episode_2.hdf5": {"T": 1, "arrays": arrays, "cams": cams, "seed": 2, "sim": True}}
    exp = write_episodes(tmp_path / "aloha", spec)
    os.remove(tmp_path / "aloha" / "expected.npz")
    got, features = read_all(tmp_path, tmp_path / "aloha")
    assert [f[0] for f in features] == ["observation.state", "observation.velocity", "observation.effort", "action",
                                        "timestamp", "frame_index", "episode_index", "index",
                                        "observation.images.left_wrist", "observation.images.top"]
    assert dict((f[0], (f[1], f[2])) for f in features)["observation.images.top"] == ("image", "6,8,3")
    assert dict((f[0], f[1]) for f in features)["action"] == "float32"
    check_episodes(got, spec, exp, [("episode_0.hdf5", 0), ("episode_2.hdf5", 2), ("episode_10.hdf5", 10)], 50.0)


def test_single_file_fps_and_compressed_frames(tmp_path):
    # One file (one episode), ALOHA's compressed layout (JPEG bytes padded per frame), a scalar column, --fps 30.
    spec = {"episode_0.hdf5": {"T": 5, "arrays": {"/observations/qpos": [[3], "float32"],
                                                 "/action": [["scalar"], "float64"]},
                               "cams": {"high": [10, 12]}, "compress": True}}
    exp = write_episodes(tmp_path / "one", spec)
    got, features = read_all(tmp_path, tmp_path / "one" / "episode_0.hdf5", fps=30)
    assert got["ep0.action"].shape == (5,)
    check_episodes(got, spec, exp, [("episode_0.hdf5", 0)], 30.0)


# Bad files: one line naming the file, the episode and the dataset path.
BAD = r"""
import sys, h5py, numpy as np
folder, case = sys.argv[1], sys.argv[2]
with h5py.File(f"{folder}/episode_0.hdf5", "w") as f:
    f.create_dataset("observations/qpos", data=np.zeros((6, 4)))
    if case != "no_action":
        f.create_dataset("action", data=np.zeros((5 if case == "lengths" else 6, 4)))
    if case == "rank":
        f.create_dataset("observations/images/top", data=np.zeros((6, 4, 4), np.uint8))
    else:
        f.create_dataset("observations/images/top", data=np.zeros((6, 4, 4, 3), np.uint8))
    if case == "float_images":
        del f["observations/images/top"]
        f.create_dataset("observations/images/top", data=np.zeros((6, 4, 4, 3), np.float32))
"""


@pytest.mark.parametrize("case,field", [("no_action", "/action"), ("lengths", "/action"),
                                        ("rank", "/observations/images/top"),
                                        ("float_images", "/observations/images/top")])
def test_bad_layout_one_line(tmp_path, case, field):
    run_lerobot(BAD, tmp_path, case)
    proc = run_lf("data", "stats", "--dataset", tmp_path, check=False)
    err = proc.stderr.strip()
    assert proc.returncode != 0 and len(err.splitlines()) == 1, err
    assert str(tmp_path / "episode_0.hdf5") in err and "episode 0" in err and f"'{field}'" in err, err


def test_truncated_and_foreign_files_one_line(tmp_path):
    spec = {"episode_0.hdf5": {"T": 40, "arrays": ALOHA, "cams": {"top": [16, 16]}}}
    write_episodes(tmp_path / "d", spec)
    os.remove(tmp_path / "d" / "expected.npz")
    path = tmp_path / "d" / "episode_0.hdf5"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    proc = run_lf("data", "stats", "--dataset", tmp_path / "d", check=False)
    err = proc.stderr.strip()
    assert proc.returncode != 0 and len(err.splitlines()) == 1, err
    assert str(path) in err and "episode 0" in err, err
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "episode_3.h5").write_bytes(b"not hdf5 at all")
    proc = run_lf("data", "stats", "--dataset", tmp_path / "e", check=False)
    err = proc.stderr.strip()
    assert proc.returncode != 0 and len(err.splitlines()) == 1, err
    assert "episode_3.h5" in err and "episode 3" in err, err


# robomimic's layout: one file, /data/demo_N groups (written out of order: demo_2, demo_10, demo_0), low-dim and image
# observations, a 1-channel uint8 camera, a float depth observation [T, H, W, 1], next_obs (not read), masks.
ROBOMIMIC = r"""
import json, sys
import h5py, numpy as np
path, spec = sys.argv[1], json.loads(sys.argv[2])
rng = np.random.default_rng(5)
with h5py.File(path, "w") as f:
    data = f.create_group("data")
    if spec.get("env_args") is not None:
        data.attrs["env_args"] = spec["env_args"]
    total = 0
    for name, T in spec["demos"].items():
        g = data.create_group(name)
        g.attrs["num_samples"] = spec.get("num_samples", {}).get(name, T)
        total += T
        obs, nobs = g.create_group("obs"), g.create_group("next_obs")
        for key, (dims, dtype) in spec["obs"].items():
            if dtype == "uint8":
                arr = rng.integers(0, 256, [T] + dims, dtype=np.uint8)
            else:
                arr = rng.standard_normal([T] + dims).astype(dtype)
            obs.create_dataset(key, data=arr)
            nobs.create_dataset(key, data=arr[::-1].copy())
        if name not in spec.get("no_actions", []):
            g.create_dataset("actions", data=rng.uniform(-1, 1, (T, 7)))
        g.create_dataset("rewards", data=rng.random(T))
        g.create_dataset("dones", data=(np.arange(T) == T - 1).astype(np.int64))
        g.create_dataset("states", data=rng.standard_normal((T, 32)))
    data.attrs["total"] = total
    names = sorted(spec["demos"])
    f.create_dataset("mask/train", data=np.array(names[:-1], dtype="S"))
    f.create_dataset("mask/valid", data=np.array(names[-1:], dtype="S"))
exp = {}
with h5py.File(path, "r") as f:
    for name in spec["demos"]:
        g = f["data"][name]
        for key in g["obs"]:
            exp[f"{name}:obs/{key}"] = g["obs"][key][:]
        for key in ["actions", "rewards", "dones", "states"]:
            if key in g:
                exp[f"{name}:{key}"] = g[key][:]
np.savez(path + ".npz", **exp)
"""

ROBOMIMIC_OBS = {"robot0_eef_pos": [[3], "float64"], "robot0_joint_pos": [[7], "float64"],
                 "object": [[10], "float32"], "agentview_image": [[12, 16, 3], "uint8"],
                 "robot0_eye_in_hand_image": [[8, 8, 3], "uint8"], "gray_image": [[6, 5, 1], "uint8"],
                 "agentview_depth": [[6, 5, 1], "float32"]}


def write_robomimic(path, **spec):
    spec.setdefault("obs", ROBOMIMIC_OBS)
    spec.setdefault("env_args", json.dumps({"env_name": "Lift", "type": 1, "env_kwargs": {"control_freq": 15}}))
    run_lerobot(ROBOMIMIC, path, json.dumps(spec))
    exp = dict(np.load(str(path) + ".npz"))
    os.remove(str(path) + ".npz")
    return exp


def test_robomimic_every_value(tmp_path):
    demos = {"demo_2": 6, "demo_10": 9, "demo_0": 1}
    exp = write_robomimic(tmp_path / "lift.hdf5", demos=demos)
    got, features = read_all(tmp_path, tmp_path / "lift.hdf5")
    assert got["format"] == "HDF5 (robomimic layout)"
    # numeric observations (name order), the simulator state, actions, rewards, dones, the synthesised columns,
    # then the uint8 [T, H, W, C] observations as cameras
    assert [f[0] for f in features] == [
        "observation.agentview_depth", "observation.object", "observation.robot0_eef_pos",
        "observation.robot0_joint_pos", "observation.environment_state", "action", "next.reward", "next.done",
        "timestamp", "frame_index", "episode_index", "index", "observation.images.agentview_image",
        "observation.images.gray_image", "observation.images.robot0_eye_in_hand_image"]
    kinds = {f[0]: (f[1], f[2]) for f in features}
    assert kinds["observation.images.agentview_image"] == ("image", "12,16,3")
    assert kinds["observation.images.gray_image"] == ("image", "6,5,1")
    assert kinds["observation.agentview_depth"] == ("float32", "6,5,1")
    assert kinds["observation.object"] == ("float32", "10") and kinds["action"] == ("float64", "7")
    assert kinds["next.reward"] == ("float64", "") and kinds["next.done"] == ("int64", "")
    order = ["demo_0", "demo_2", "demo_10"]  # by number, not by name
    eps = got["episodes"]
    assert eps[:, 0].tolist() == [0, 2, 10]
    assert eps[:, 1].tolist() == [demos[d] for d in order]
    assert eps[:, 2].tolist() == [0, 1, 7]
    assert got["fps"][0] == 15.0  # env_args' control_freq
    names = {"actions": "action", "rewards": "next.reward", "dones": "next.done",
             "states": "observation.environment_state"}
    for p, demo in enumerate(order):
        T = demos[demo]
        checked = 0
        for key, want in exp.items():
            d, path = key.split(":")
            if d != demo:
                continue
            obs = path[len("obs/"):] if path.startswith("obs/") else None
            if obs is not None and ROBOMIMIC_OBS[obs][1] == "uint8":
                have = got[f"ep{p}.observation.images.{obs}"]
                assert np.array_equal(got[f"ep{p}.observation.images.{obs}.picked"], want[[T - 1, 0, 0, T // 2]])
            else:
                name = f"ep{p}.observation.{obs}" if obs else f"ep{p}.{names[path]}"
                have = got[name]
                if T >= 2:
                    assert np.array_equal(got[name + ".part"], want[1:T - 1]), (demo, path)
            assert have.dtype == want.dtype and np.array_equal(have, want), (demo, path)
            checked += 1
        assert checked == len(ROBOMIMIC_OBS) + 4
        frames = np.arange(T)
        assert np.array_equal(got[f"ep{p}.timestamp"], (frames / 15.0).astype(np.float32))
        assert np.array_equal(got[f"ep{p}.episode_index"], np.full(T, eps[p, 0]))
        assert np.array_equal(got[f"ep{p}.index"], frames + eps[p, 2])


def test_robomimic_rate_default_and_option(tmp_path):
    # no env_args: robosuite's default 20; an explicit rate overrides env_args'
    obs = {"robot0_eef_pos": [[3], "float64"]}
    write_robomimic(tmp_path / "a.hdf5", demos={"demo_1": 3}, env_args=None, obs=obs)
    got, _ = read_all(tmp_path, tmp_path / "a.hdf5")
    assert got["fps"][0] == 20.0 and got["episodes"][:, 0].tolist() == [1]
    write_robomimic(tmp_path / "b.hdf5", demos={"demo_1": 3}, obs=obs)
    got, _ = read_all(tmp_path, tmp_path / "b.hdf5", fps=40)
    assert got["fps"][0] == 40.0


@pytest.mark.parametrize("case,field", [("num_samples", "/data/demo_1@num_samples"),
                                        ("no_actions", "/data/demo_1/actions"),
                                        ("env_args", "/data@env_args")])
def test_robomimic_bad_one_line(tmp_path, case, field):
    spec = {"demos": {"demo_0": 4, "demo_1": 5}, "obs": {"robot0_eef_pos": [[3], "float64"]}}
    if case == "num_samples":
        spec["num_samples"] = {"demo_1": 7}
    elif case == "no_actions":
        spec["no_actions"] = ["demo_1"]
    else:
        spec["env_args"] = "{not json"
    write_robomimic(tmp_path / "bad.hdf5", **spec)
    proc = run_lf("data", "stats", "--dataset", tmp_path / "bad.hdf5", check=False)
    err = proc.stderr.strip()
    assert proc.returncode != 0 and len(err.splitlines()) == 1, err
    assert str(tmp_path / "bad.hdf5") in err and f"'{field}'" in err, err
    if case != "env_args":
        assert "episode 1" in err, err

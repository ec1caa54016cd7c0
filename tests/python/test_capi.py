"""The installed library and its C API (<loongforge/loongforge.h>, issue 25): `cmake --install build --prefix P` puts
libloongforge.so (exporting only lf_*), the header and the CMake package in P; the C example (examples/c_api) is
configured and built in a clean folder against P alone with find_package(LoongForge), and run on a small ACT policy
made with LeRobot:
  - its action chunk for a raw observation (state, camera as [H, W, C] 0..255 and as [C, H, W] in [0, 1]) is
    LeRobot's preprocessor -> predict_action_chunk -> postprocessor's on the same observation; two threads predicting
    at once get the same chunk;
  - a folder that is no policy fails with one line naming the file, an observation without the camera with one
    line naming the feature; a folder lf_policy_save wrote predicts the same chunk;
  - (slow) a few fine-tune steps on a LeRobot dataset through lf_policy_finetune with a recipe, then lf_policy_save:
    LeRobot loads the saved folder and its chunk is the C API's after the fine-tune."""
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from conftest import LF_BIN, ROOT, run_lerobot
from test_policy_train import DATASET, NARROW, POLICY, _DATASET

BUILD = pathlib.Path(os.environ.get("LOONGFORGE_BUILD_DIR", LF_BIN.parent))  # the build folder to install from

# After POLICY (the small ACT of test_policy_train.py saved to argv[1]): LeRobot's processors for it with made-up
# statistics, saved beside it (a complete LeRobot policy folder).
PROCESSORS = r'''
from lerobot.policies.factory import make_pre_post_processors
t = lambda *v: torch.tensor(v, dtype=torch.float32)
stats = {"observation.state": {"mean": t(0.1, -0.2, 0.3, 0.0), "std": t(0.9, 1.1, 1.3, 0.7)},
         "observation.images.top": {"mean": t(0.4, 0.5, 0.6).reshape(3, 1, 1), "std": t(0.2, 0.25, 0.3).reshape(3, 1, 1)},
         "action": {"mean": t(0.5, -0.5, 0.2, 0.1), "std": t(2.0, 1.5, 0.5, 1.0)}}
pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
pre.save_pretrained(sys.argv[1])
post.save_pretrained(sys.argv[1])
'''

# LeRobot's chunk for the observation in argv[A] (state [4], camera [H, W, C] 0..255; an .npz) from the policy folder
# argv[A - 1], written to argv[A + 1] (.npy).
REFERENCE = r'''
def reference(folder, obs_file, out):
    import numpy as np, torch
    from lerobot.policies.act.modeling_act import ACTPolicy
    from lerobot.policies.factory import make_pre_post_processors
    p = ACTPolicy.from_pretrained(folder); p.eval()
    pre, post = make_pre_post_processors(p.config, pretrained_path=folder)
    o = np.load(obs_file)
    obs = {"observation.state": torch.from_numpy(o["state"])[None],
           "observation.images.top": (torch.from_numpy(o["image"]).permute(2, 0, 1) / 255)[None]}
    with torch.no_grad():
        chunk = post(p.predict_action_chunk(pre(obs)))[0]
    np.save(out, chunk.numpy())
'''
MAKE_AND_PREDICT = POLICY + PROCESSORS + REFERENCE + "\nreference(sys.argv[1], sys.argv[2], sys.argv[3])\n"
LOAD_AND_PREDICT = NARROW + "import sys\n" + REFERENCE + "\nreference(sys.argv[1], sys.argv[2], sys.argv[3])\n"


def write_obs(path, state, image, chw=False):
    """The example's observation file: the state, and the camera as [H, W, C] 0..255 or [C, H, W] in [0, 1]."""
    img = (image.transpose(2, 0, 1) / np.float32(255)).astype(np.float32) if chw else image
    with open(path, "w") as f:
        f.write("# an observation for lf_example\n")
        for name, a in [("observation.state", state), ("observation.images.top", img)]:
            f.write(f"{name} {a.ndim} {' '.join(map(str, a.shape))}\n")
            f.write(" ".join(f"{v:.9g}" for v in a.reshape(-1).tolist()) + "\n")


def run_example(example, *args, check=True):
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["OMP_NUM_THREADS"] = "2"
    proc = subprocess.run([str(example), *map(str, args)], capture_output=True, text=True, env=env, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def chunk_of(stdout):
    lines = stdout.splitlines()
    head = lines[0].split()
    assert head[0] == "actions", stdout
    rows, cols = int(head[1]), int(head[2])
    a = np.array([[float(v) for v in line.split()] for line in lines[1:1 + rows]], np.float32)
    assert a.shape == (rows, cols)
    return a


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The library installed into a fresh prefix, and lf_example built against it in a clean folder."""
    if not (BUILD / "cmake_install.cmake").exists():
        pytest.fail(f"{BUILD} is not a configured build (scripts/build.sh)")
    base = tmp_path_factory.mktemp("capi")
    prefix, example_build = base / "prefix", base / "example"
    subprocess.run(["cmake", "--install", str(BUILD), "--prefix", str(prefix)], check=True, capture_output=True)
    # A clean folder and a clean environment: only the prefix tells CMake where LoongForge is.
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_PREFIX_PATH", "LD_LIBRARY_PATH")}
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (["cmake", "-S", str(ROOT / "examples" / "c_api"), "-B", str(example_build), *gen,
                 f"-DCMAKE_PREFIX_PATH={prefix}"], ["cmake", "--build", str(example_build)]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return prefix, example_build / "lf_example"


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A small ACT policy folder made by LeRobot (with processors), an observation, LeRobot's chunk for it."""
    base = tmp_path_factory.mktemp("capi_policy")
    rng = np.random.default_rng(3)
    state = rng.standard_normal(4).astype(np.float32)
    image = rng.integers(0, 256, (24, 32, 3)).astype(np.float32)
    np.savez(base / "obs.npz", state=state, image=image)
    run_lerobot(MAKE_AND_PREDICT, base / "policy", base / "obs.npz", base / "ref.npy")
    write_obs(base / "obs.txt", state, image)
    write_obs(base / "obs_chw.txt", state, image, chw=True)
    return base


def test_install_layout_exports_only_the_c_api(installed):
    prefix, _ = installed
    assert (prefix / "include" / "loongforge" / "loongforge.h").exists()
    assert (prefix / "lib" / "cmake" / "LoongForge" / "LoongForgeConfig.cmake").exists()
    lib = prefix / "lib" / "libloongforge.so"
    assert lib.exists()
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in syms.splitlines() if len(line.split()) == 3]
    assert names and all(n.startswith("lf_") for n in names), names


def test_c_api_predicts_lerobots_chunk_from_two_threads(installed, policy, tmp_path):
    _, example = installed
    ref = np.load(policy / "ref.npy")
    saved = tmp_path / "saved"
    out = run_example(example, policy / "policy", policy / "obs.txt", "--threads", 2, "--save", saved)
    got = chunk_of(out.stdout)
    assert got.shape == ref.shape == (5, 4)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert "threads 2 x 4 predictions equal the first" in out.stdout
    # the folder lf_policy_save wrote, with the camera as [C, H, W] in [0, 1] (LeRobot's frames): the same chunk
    got_chw = chunk_of(run_example(example, saved, policy / "obs_chw.txt").stdout)
    np.testing.assert_allclose(got_chw, ref, rtol=1e-5, atol=1e-5)


def test_c_api_errors_are_one_line(installed, policy, tmp_path):
    _, example = installed
    empty = tmp_path / "not_a_policy"
    empty.mkdir()
    proc = run_example(example, empty, policy / "obs.txt", check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(empty) in lines[0] and "config.json" in lines[0], lines[0]
    # an observation without the camera: predict fails with one line naming the feature (lf_last_error)
    state_only = tmp_path / "state_only.txt"
    state_only.write_text((policy / "obs.txt").read_text().split("observation.images.top")[0])
    proc = run_example(example, policy / "policy", state_only, check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "observation 'observation.images.top': missing" in lines[0], proc.stderr


@pytest.mark.slow
def test_c_api_finetune_then_save_loads_in_lerobot(installed, policy, tmp_path_factory, tmp_path):
    _, example = installed
    if not _DATASET:
        _DATASET.append(tmp_path_factory.mktemp("robot") / "dataset")
        run_lerobot(DATASET, _DATASET[0])
    recipe = tmp_path / "finetune.yaml"
    recipe.write_text("seed: 7\ndata:\n  robot:\n    threads: 1\ntrain:\n  steps: 4\n  micro_batch_size: 6\n"
                      "optim:\n  lr: 0.001\n  weight_decay: 0.0\nschedule:\n  kind: constant\n"
                      "log:\n  tensorboard: false\n  plot: false\n  progress: \"off\"\n")
    saved = tmp_path / "saved"
    out = run_example(example, policy / "policy", policy / "obs.txt", "--finetune", _DATASET[0], "--recipe", recipe,
                      "--save", saved)
    got = chunk_of(out.stdout)
    before = np.load(policy / "ref.npy")
    assert np.abs(got - before).max() > 1e-3  # the fine-tune changed the policy (weights and statistics)
    run_lerobot(LOAD_AND_PREDICT, saved, policy / "obs.npz", tmp_path / "ref_saved.npy")
    np.testing.assert_allclose(got, np.load(tmp_path / "ref_saved.npy"), rtol=1e-5, atol=1e-5)
    assert not (saved / "optimizer.safetensors").exists() and not (saved / "trainer_state.json").exists()
    # the saved folder opens through the C API too, and predicts the same chunk
    again = chunk_of(run_example(example, saved, policy / "obs.txt").stdout)
    np.testing.assert_array_equal(again, got)


@pytest.mark.slow
def test_c_api_finetune_with_the_default_recipe(installed, policy, tmp_path_factory, tmp_path):
    """lf_policy_finetune(..., NULL): the default recipe (100 steps, AdamW 1e-5) runs and changes the policy; the
    saved folder opens again and predicts the same chunk."""
    _, example = installed
    if not _DATASET:
        _DATASET.append(tmp_path_factory.mktemp("robot") / "dataset")
        run_lerobot(DATASET, _DATASET[0])
    saved = tmp_path / "saved"
    got = chunk_of(run_example(example, policy / "policy", policy / "obs.txt", "--finetune", _DATASET[0],
                               "--save", saved).stdout)
    assert np.isfinite(got).all() and np.abs(got - np.load(policy / "ref.npy")).max() > 1e-3
    np.testing.assert_array_equal(chunk_of(run_example(example, saved, policy / "obs.txt").stdout), got)


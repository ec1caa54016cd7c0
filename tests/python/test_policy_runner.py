"""A trained policy at deployment (train/policy_runner.h, `loongforge predict`): one raw observation, as a robot sends
it (uint8 [H, W, C] camera frames, float state, the task text), in; the unnormalised action chunk out — against
LeRobot's own preprocessor -> policy.predict_action_chunk -> postprocessor on the same observation:
  - ACT with its processor files written by LeRobot (make_pre_post_processors(dataset_stats=...).save_pretrained):
    the camera as uint8 [H, W, C] or as LeRobot's float [C, H, W] frames gives LeRobot's chunk;
  - π0 trained one step by `loongforge train` (the checkpoint: weights, processors, tokenizer): the prompt through
    the tokenizer, the sampler's noise from the seed (torch's generator, as LeRobot's sample_noise draws it);
  - Diffusion Policy (two observation steps): one frame = LeRobot's chunk for a window of copies of it (its queues at an
    episode's start), two frames along a leading dimension = LeRobot's chunk for that history (the DDPM sampler's
    draws from the seed);
  - keys the policy does not read are ignored; bad observations (a missing feature, a misshapen camera or state): one line naming the file and the feature."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import run_lerobot, run_lf
from test_pi0_parity import EXPERT, VISION, VLM
from test_pi0_train import POLICY as PI0_POLICY
from test_pi0_train import SETUP as PI0_SETUP
from test_pi0_train import TOKENIZER, TOKENIZER_ARGS
from test_pi0_train import recipe as pi0_recipe
from test_diffusion_policy_parity import NARROW as DP_NARROW
from test_diffusion_policy_train import POLICY as DP_POLICY
from test_policy_train import DATASET, NARROW, POLICY

# argv: dataset, policy folder: LeRobot's processors for the dataset's stats written into the policy folder.
PROCESSORS = NARROW + r'''
import sys
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.policies.factory import make_pre_post_processors
root, pol = sys.argv[1:3]
p = ACTPolicy.from_pretrained(pol)
pre, post = make_pre_post_processors(p.config, dataset_stats=LeRobotDataset("test/robot", root=root).meta.stats)
pre.save_pretrained(pol); post.save_pretrained(pol)
'''

# argv: policy folder, observation file (raw), out: LeRobot's unnormalised chunk for it.
ACT_REF = NARROW + r'''
import sys
from safetensors.torch import load_file, save_file
from lerobot.policies.factory import make_pre_post_processors
pol, obs, out = sys.argv[1:4]
p = ACTPolicy.from_pretrained(pol); p.eval()
pre, post = make_pre_post_processors(p.config, pretrained_path=pol)
o = load_file(obs)
batch = {"observation.state": o["observation.state"][None].float(),
         "observation.images.top": o["observation.images.top"].permute(2, 0, 1)[None].float() / 255}
with torch.no_grad():
    chunk = post(p.predict_action_chunk(pre(batch)))[0]
save_file({"action": chunk.contiguous()}, out)
'''

# argv (then the size json pair): kind, tokenizer, checkpoint, observation file, prompt, seed, out.
PI0_REF = PI0_SETUP + r'''
import shutil, tempfile
from safetensors.torch import load_file, save_file
from lerobot.policies.factory import make_pre_post_processors
kind, tok, ckpt, obs, prompt, seed, out = sys.argv[1:8]
M, Config, Policy = setup(kind, tok)
folder = tempfile.mkdtemp()
shutil.copytree(ckpt, folder, dirs_exist_ok=True)
cfg = json.loads(open(folder + "/config.json").read())
for k in ("variant_sizes", "vocab_size", "vision_config"): cfg.pop(k)
open(folder + "/config.json", "w").write(json.dumps(cfg))
p = Policy.from_pretrained(folder); p.eval()
pre, post = make_pre_post_processors(p.config, pretrained_path=folder)
o = load_file(obs)
batch = {"observation.state": o["observation.state"][None].float(),
         "observation.images.top": o["observation.images.top"].permute(2, 0, 1)[None].float() / 255, "task": [prompt]}
torch.manual_seed(int(seed))
with torch.no_grad():
    chunk = post(p.predict_action_chunk(pre(batch)))[0]
save_file({"action": chunk.contiguous()}, out)
'''


# argv: dataset, policy folder: LeRobot's processors for the dataset's stats, for the Diffusion Policy.
DP_PROCESSORS = DP_NARROW + r'''
import sys
narrow_resnet18()
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
from lerobot.policies.factory import make_pre_post_processors
root, pol = sys.argv[1:3]
p = DiffusionPolicy.from_pretrained(pol)
pre, post = make_pre_post_processors(p.config, dataset_stats=LeRobotDataset("test/robot", root=root).meta.stats)
pre.save_pretrained(pol); post.save_pretrained(pol)
'''

# argv: policy folder, observation file (raw: one frame or a window of frames), seed, out: LeRobot's unnormalised chunk
# for the observation window (one frame: its copies), the sampler's draws from the seeded global generator.
DP_REF = DP_NARROW + r'''
import sys, torch
narrow_resnet18()
from safetensors.torch import load_file, save_file
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
from lerobot.policies.factory import make_pre_post_processors
pol, obs, seed, out = sys.argv[1:5]
p = DiffusionPolicy.from_pretrained(pol); p.eval()
pre, post = make_pre_post_processors(p.config, pretrained_path=pol)
o = load_file(obs)
state, img = o["observation.state"].float(), o["observation.images.top"]
if state.dim() == 1:
    state, img = torch.stack([state, state]), torch.stack([img, img])
batch = {"observation.state": state[None], "observation.images.top": img.permute(0, 3, 1, 2)[None].float() / 255}
torch.manual_seed(int(seed))
with torch.no_grad():
    chunk = post(p.predict_action_chunk(pre(batch)))[0]
save_file({"action": chunk.contiguous()}, out)
'''


def observation(path, seed, **extra):
    rng = np.random.default_rng(seed)
    obs = {"observation.state": rng.standard_normal(4).astype(np.float32),
           "observation.images.top": rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)}
    obs.update(extra)
    save_file(obs, str(path))
    return obs


def predict(tmp_path, policy, obs, *args):
    out = tmp_path / "ours.safetensors"
    run_lf("predict", "--policy", policy, "--observation", obs, "--out", out, *args)
    return load_file(str(out))["action"]


@pytest.fixture(scope="module")
def act(tmp_path_factory):
    d = tmp_path_factory.mktemp("runner")
    run_lerobot("import sys\n" + "".join(f"sys.argv = {['-c', *map(str, a)]!r}\nexec({c!r}, {{}})\n" for c, a in
                                         [(DATASET, [d / "dataset"]), (POLICY, [d / "act"]),
                                          (PROCESSORS, [d / "dataset", d / "act"])]))
    return d


@pytest.mark.slow  # the fast set checks the same runner through serve (test_serve.py) and the C API (test_capi.py)
def test_act_chunk_for_a_raw_observation_equals_lerobots(tmp_path, act):
    obs = observation(tmp_path / "obs.safetensors", 0)
    ref = tmp_path / "ref.safetensors"
    run_lerobot(ACT_REF, act / "act", tmp_path / "obs.safetensors", ref)
    want = load_file(str(ref))["action"]
    got = predict(tmp_path, act / "act", tmp_path / "obs.safetensors")
    assert got.shape == want.shape == (5, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # LeRobot's float [C, H, W] frames in [0, 1] give the same chunk
    chw = dict(obs)
    chw["observation.images.top"] = np.ascontiguousarray(obs["observation.images.top"].transpose(2, 0, 1)).astype(np.float32) / 255
    save_file(chw, str(tmp_path / "chw.safetensors"))
    np.testing.assert_allclose(predict(tmp_path, act / "act", tmp_path / "chw.safetensors"), got, rtol=1e-6, atol=1e-6)
    # keys the policy does not read are ignored, as LeRobot's policies ignore them
    save_file(dict(obs, **{"observation.velocity": np.zeros(3, np.float32)}), str(tmp_path / "extra.safetensors"))
    np.testing.assert_array_equal(predict(tmp_path, act / "act", tmp_path / "extra.safetensors"), got)
    # the JSON form: metadata and the same actions
    j = json.loads(run_lf("predict", "--policy", act / "act", "--observation", tmp_path / "obs.safetensors").stdout)
    assert j["policy_type"] == "act" and j["action_shape"] == [5, 4] and j["n_action_steps"] == 5
    assert set(j["input_features"]) == {"observation.state", "observation.images.top"} and not j["prompt"]
    np.testing.assert_allclose(np.array(j["actions"]), got, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("change,words", [
    ({"drop": "observation.state"}, ["observation.state", "missing"]),
    ({"observation.images.top": np.zeros((20, 32, 3), np.uint8)}, ["observation.images.top", "[20, 32, 3]", "[3, 24, 32]"]),
    ({"observation.state": np.zeros(5, np.float32)}, ["observation.state", "[5]"]),
])
def test_bad_observations_fail_in_one_line(tmp_path, act, change, words):
    obs = observation(tmp_path / "x.safetensors", 1)
    if "drop" in change:
        obs.pop(change.pop("drop"))
    obs.update(change)
    save_file(obs, str(tmp_path / "bad.safetensors"))
    r = run_lf("predict", "--policy", act / "act", "--observation", tmp_path / "bad.safetensors", check=False)
    assert r.returncode != 0
    line = r.stderr.strip()
    assert "\n" not in line and str(tmp_path / "bad.safetensors") in line, line
    for w in words:
        assert w in line, line


def test_not_a_policy_folder_fails_in_one_line(tmp_path):
    r = run_lf("predict", "--policy", tmp_path / "nothing", "--observation", tmp_path / "x.safetensors", check=False)
    assert r.returncode != 0 and str(tmp_path / "nothing") in r.stderr and "\n" not in r.stderr.strip()


@pytest.fixture(scope="module")
def pi0(tmp_path_factory):
    """test_pi0_train's dataset, tokenizer and small π0, trained one step by `loongforge train` (its checkpoint holds
    the processors and the tokenizer)."""
    d = tmp_path_factory.mktemp("runner_pi0")
    (d / "tokenizer").mkdir()
    sizes, vision = json.dumps({"gemma_tiny": VLM, "gemma_tiny_expert": EXPERT}), json.dumps(VISION)
    tasks = json.dumps(["pick up the cube"] * 3)
    runs = [(DATASET, [d / "dataset", tasks]), (TOKENIZER, [d / "tokenizer", *TOKENIZER_ARGS]),
            (PI0_POLICY, ["pi0", d / "tokenizer", d / "pi0", sizes, vision])]
    run_lerobot("import sys\n" + "".join(f"sys.argv = {['-c', *map(str, a)]!r}\nexec({c!r}, {{}})\n" for c, a in runs))
    rec = pi0_recipe(d, d, "pi0", steps=1)
    run_lf("train", rec)
    ckpts = d / "run" / "checkpoints"
    return d, ckpts / (ckpts / "latest").read_text().strip()


@pytest.mark.slow
def test_pi0_chunk_with_its_prompt_equals_lerobots(tmp_path, pi0):
    made, ckpt = pi0
    observation(tmp_path / "obs.safetensors", 2)
    sizes, vision = json.dumps({"gemma_tiny": VLM, "gemma_tiny_expert": EXPERT}), json.dumps(VISION)
    ref = tmp_path / "ref.safetensors"
    run_lerobot(PI0_REF, "pi0", made / "tokenizer", ckpt, tmp_path / "obs.safetensors", "pick up the cube", 3, ref,
                sizes, vision)
    want = load_file(str(ref))["action"]
    got = predict(tmp_path, ckpt, tmp_path / "obs.safetensors", "--prompt", "pick up the cube", "--seed", "3")
    assert got.shape == want.shape == (5, 4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # another seed, another draw; no prompt: one line
    other = predict(tmp_path, ckpt, tmp_path / "obs.safetensors", "--prompt", "pick up the cube", "--seed", "4")
    assert np.abs(other - got).max() > 1e-3
    r = run_lf("predict", "--policy", ckpt, "--observation", tmp_path / "obs.safetensors", check=False)
    assert r.returncode != 0 and "prompt" in r.stderr


@pytest.fixture(scope="module")
def diffusion(tmp_path_factory):
    d = tmp_path_factory.mktemp("runner_dp")
    run_lerobot("import sys\n" + "".join(f"sys.argv = {['-c', *map(str, a)]!r}\nexec({c!r}, {{}})\n" for c, a in
                                         [(DATASET, [d / "dataset"]), (DP_POLICY, [d / "dp"]),
                                          (DP_PROCESSORS, [d / "dataset", d / "dp"])]))
    return d / "dp"


def test_diffusion_policy_chunk_for_a_frame_and_for_a_history_equals_lerobots(tmp_path, diffusion):
    rng = np.random.default_rng(5)
    one = observation(tmp_path / "one.safetensors", 3)
    hist = {"observation.state": rng.standard_normal((2, 4)).astype(np.float32),
            "observation.images.top": rng.integers(0, 256, (2, 24, 32, 3), dtype=np.uint8)}
    save_file(hist, str(tmp_path / "hist.safetensors"))
    for name in ("one", "hist"):
        ref = tmp_path / f"ref_{name}.safetensors"
        run_lerobot(DP_REF, diffusion, tmp_path / f"{name}.safetensors", 7, ref)
        want = load_file(str(ref))["action"]
        got = predict(tmp_path, diffusion, tmp_path / f"{name}.safetensors", "--seed", "7")
        assert got.shape == want.shape == (4, 4), name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    # the history matters: its last frame alone gives another chunk
    last = {k: v[-1] for k, v in hist.items()}
    save_file(last, str(tmp_path / "last.safetensors"))
    assert np.abs(predict(tmp_path, diffusion, tmp_path / "last.safetensors", "--seed", "7") - got).max() > 1e-3
    # three frames for a window of two: one line naming the feature and the window
    save_file(dict(one, **{"observation.state": np.zeros((3, 4), np.float32)}), str(tmp_path / "bad.safetensors"))
    r = run_lf("predict", "--policy", diffusion, "--observation", tmp_path / "bad.safetensors", check=False)
    line = r.stderr.strip()
    assert r.returncode != 0 and "\n" not in line and "observation.state" in line and "2 such frames" in line, line

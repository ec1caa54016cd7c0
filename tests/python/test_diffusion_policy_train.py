"""Diffusion Policy (LeRobot's DiffusionPolicy) trained by `loongforge train` from a LeRobot dataset (data.format:
robot), against LeRobot on the dataset of test_policy_train.py and a small Diffusion Policy written here with the
lerobot package:
  - the training frames are LeRobot's: its training sampler (EpisodeAwareSampler as lerobot_train makes it) leaves out
    each episode's last drop_n_last_frames frames, and so does the robot source;
  - a whole epoch's batch = LeRobot's for the same frames (observation history of n_obs_steps frames with the first
    frame repeated at episode starts, the action trajectory from n_obs_steps - 1 frames back with action_is_pad at
    both episode edges, normalised by make_pre_post_processors); its loss (`dump`) = DiffusionPolicy.forward's on
    LeRobot's batch with the same noise and timesteps; the processor files load in LeRobot and normalise as its own;
  - (slow) training lowers the loss, the checkpoint and processors load in LeRobot, and the open-loop numbers = LeRobot's
    for the same checkpoint: its DDPM sampler draws from the global generator seeded with the recipe's seed, the same
    draws in the same order as LoongForge's (one micro-batch of queries at a time)."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import run_gtest_hook, run_lerobot, run_lf
from test_diffusion_policy_parity import NARROW
from test_policy_train import CHECK_LOADED, PROCESSED, check_layout, made_with, recipe

# A small Diffusion Policy for that dataset (4-d state, one 24 x 32 camera, 4-d action), saved to argv[1]: two
# observation steps, a horizon of 8, 4 actions executed, LeRobot's drop_n_last_frames rule (horizon - n_action_steps
# - n_obs_steps + 1 = 3), a centre crop, DDPM with 5 inference steps.
POLICY = NARROW + r'''
import sys, torch
narrow_resnet18()
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
torch.manual_seed(0)
cfg = DiffusionConfig(input_features={"observation.state": PolicyFeature(FeatureType.STATE, (4,)),
                                      "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 24, 32))},
                      output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))},
                      pretrained_backbone_weights=None, device="cpu", n_obs_steps=2, horizon=8, n_action_steps=4,
                      drop_n_last_frames=3, use_group_norm=True, crop_shape=(20, 28), crop_is_random=False,
                      down_dims=(16, 32), kernel_size=3, n_groups=4, diffusion_step_embed_dim=16,
                      spatial_softmax_num_keypoints=4, num_train_timesteps=20, num_inference_steps=5)
DiffusionPolicy(cfg).save_pretrained(sys.argv[1])
'''

# The dataset as LeRobot's training reads it for the policy (argv[2]): delta_timestamps from the config, the training
# sampler of lerobot_train over the training episodes (argv[6], comma-separated) with the config's drop_n_last_frames
# (its frames: "sampler_index"), LeRobot's batch for the frames the source read (argv[3]'s "index"), its loss with our
# noise and timesteps, and the processors LoongForge wrote (argv[4]) applied to the same raw batch.
LEROBOT_BATCH = NARROW + PROCESSED + r'''
import sys, torch
narrow_resnet18()
from safetensors.torch import load_file, save_file
from lerobot.datasets import EpisodeAwareSampler
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
root, pol, ours, files, out, episodes = sys.argv[1:7]
policy = DiffusionPolicy.from_pretrained(pol)
cfg = policy.config
fps = 10
delta = {k: [i / fps for i in cfg.observation_delta_indices] for k in cfg.input_features}
delta["action"] = [i / fps for i in cfg.action_delta_indices]
ds = LeRobotDataset("test/robot", root=root, delta_timestamps=delta)
sampler = EpisodeAwareSampler(ds.meta.episodes["dataset_from_index"], ds.meta.episodes["dataset_to_index"],
                              episode_indices_to_use=[int(e) for e in episodes.split(",")],
                              drop_n_last_frames=getattr(cfg, "drop_n_last_frames", 0), shuffle=True, seed=0)
ours = load_file(ours)
keys = ["observation.state", "observation.images.top", "action", "action_is_pad"]
ref, res = processed(ds, cfg, ours["index"], files, keys)
res["sampler_index"] = torch.tensor(sorted(sampler))
policy.train()
real = torch.randn, torch.randint
torch.randn = lambda *a, **kw: ours["noise"].clone()
torch.randint = lambda *a, **kw: ours["timesteps"].clone()
try:
    loss, _ = policy.forward({k: ref[k] for k in keys})
finally:
    torch.randn, torch.randint = real
res["loss"] = loss.detach().reshape(1)
save_file(res, out)
'''

# The trained checkpoint (argv[1]) as LeRobot loads it: policy, processors, an action for a raw observation.
LOAD_CHECKPOINT = NARROW + r'''
import sys, torch
narrow_resnet18()
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
p = DiffusionPolicy.from_pretrained(sys.argv[1])
''' + CHECK_LOADED

# LeRobot's own open-loop numbers for the checkpoint (argv[1]) on the held-out episode (argv[3]) of the dataset
# (argv[2]): a chunk every n_action_steps frames from its preprocessed observation history, queried argv[5] frames at a
# time after torch.manual_seed(argv[4]) (the recipe's micro-batch size and seed: the sampler's draws), unnormalised by
# its postprocessor, against the recorded actions inside the episode.
OPEN_LOOP = NARROW + r'''
import sys, json, torch
narrow_resnet18()
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
from lerobot.policies.factory import make_pre_post_processors
p = DiffusionPolicy.from_pretrained(sys.argv[1]); p.eval()
cfg = p.config
delta = {k: [i / 10 for i in cfg.observation_delta_indices] for k in cfg.input_features}
ds = LeRobotDataset("test/robot", root=sys.argv[2], delta_timestamps=delta)
plain = LeRobotDataset("test/robot", root=sys.argv[2])
pre, post = make_pre_post_processors(cfg, dataset_stats=ds.meta.stats)
ep, seed, mb = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
lo, hi = int(ds.meta.episodes["dataset_from_index"][ep]), int(ds.meta.episodes["dataset_to_index"][ep])
actions = torch.stack([plain[i]["action"] for i in range(lo, hi)])
queries = list(range(0, hi - lo, cfg.n_action_steps))
torch.manual_seed(seed)
sq, n = 0.0, 0
for g in range(0, len(queries), mb):
    fs = queries[g:g + mb]
    items = [ds[lo + f] for f in fs]
    obs = pre({k: torch.stack([it[k] for it in items]) for k in cfg.input_features})
    p.reset()
    with torch.no_grad():
        chunks = post(p.predict_action_chunk(obs))
    for f, chunk in zip(fs, chunks):
        k = min(len(chunk), hi - lo - f)
        sq += ((chunk[:k] - actions[f:f + k]) ** 2).sum().item(); n += k * chunk.shape[1]
print(json.dumps({"mse": sq / n}))
'''


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return made_with(tmp_path_factory, POLICY)


def test_diffusion_trains_on_lerobots_frames_and_batches(tmp_path, made):
    """One whole epoch over the training episodes (0 and 2: episode 1 held out) in one batch: its frames = LeRobot's
    sampler's (22 + 20 frames less 3 at each end), every row = LeRobot's, the loss = LeRobot's."""
    ds, pol = made
    rec = recipe(tmp_path, ds, pol, "    valid_episodes: 1\n")
    out = tmp_path / "hook"
    out.mkdir()
    run_gtest_hook("RobotSource.BatchHook", {"LF_TEST_ROBOT_RECIPE": str(rec), "LF_TEST_ROBOT_OUT": str(out),
                                             "LF_TEST_ROBOT_ROWS": "epoch"})
    run_lerobot(LEROBOT_BATCH, ds, pol, out / "batch.safetensors", out / "model_files", tmp_path / "ref.safetensors",
                "0,2")
    ours, ref = load_file(out / "batch.safetensors"), load_file(tmp_path / "ref.safetensors")
    assert len(ours["index"]) == 36 and sorted(ours["index"]) == list(ref["sampler_index"])
    assert ours["observation.state"].shape == (36, 2, 4) and ours["observation.images.top"].shape == (36, 2, 3, 24, 32)
    assert ours["action"].shape == (36, 8, 4)
    for k in ["observation.state", "observation.images.top", "action"]:
        assert ours[k].shape == ref[k].shape, k
        assert np.abs(ours[k] - ref[k]).max() <= 1e-5, (k, np.abs(ours[k] - ref[k]).max())
        assert np.abs(ref["files." + k] - ref[k]).max() <= 1e-6, k  # our processor files = LeRobot's own
    # both edges pad: the episode starts (the step before frame 0) and ends (up to 3 steps past the last frame)
    assert (ours["action_is_pad"] == ref["action_is_pad"]).all()
    assert ours["action_is_pad"][:, 0].sum() == 2 and ours["action_is_pad"][:, -1].sum() == 6
    # the loss of our batch (dump: the model as LeRobot's forward, with the batch's noise and timesteps) = LeRobot's
    batch = {k: v for k, v in ours.items() if k != "index"}
    rng = np.random.default_rng(0)  # dump runs the sampler too: its draws (not compared here)
    batch["sample_noise"] = rng.standard_normal((36, 8, 4)).astype(np.float32)
    batch["sample_step_noise"] = rng.standard_normal((4, 36, 8, 4)).astype(np.float32)
    save_file(batch, tmp_path / "ours.safetensors")
    run_lf("dump", "--model", pol, "--batch", tmp_path / "ours.safetensors", "--out", tmp_path / "dump.safetensors")
    got = load_file(tmp_path / "dump.safetensors")
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * max(1.0, abs(ref["loss"][0])), (got["loss"], ref["loss"])


@pytest.mark.slow
def test_diffusion_training_checkpoint_and_open_loop_match_lerobot(tmp_path, made):
    ds, pol = made
    rec = recipe(tmp_path, ds, pol)
    # the noise-prediction loss is noisy (a random timestep per row): 60 steps at a high rate for a clear fall
    run_lf("train", rec, "--set", "data.robot.valid_episodes=1", "--set", "eval.every=30", "--set", "train.steps=60",
           "--set", "checkpoint.every=60", "--set", "optim.lr=0.01")
    m = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in m if "loss" in x]
    assert len(losses) == 60
    assert [x["step"] for x in m if "open_loop_mse" in x] == [30, 60]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10]), losses
    ckpts = tmp_path / "run" / "checkpoints"
    ckpt = ckpts / (ckpts / "latest").read_text().strip()
    assert json.loads((ckpt / "config.json").read_text())["drop_n_last_frames"] == 3
    assert "ok" in run_lerobot(LOAD_CHECKPOINT, ckpt)

    # Open-loop evaluation on the held-out episode 1 (18 frames: queries at 0, 4, 8, 12, 16, one micro-batch) = LeRobot's
    # numbers for the same checkpoint and the same sampler draws.
    proc = run_lf("eval", rec, "--model", ckpt, "--set", "data.robot.valid_episodes=1", "--open-loop", tmp_path / "ol")
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = json.loads(run_lerobot(OPEN_LOOP, ckpt, ds, 1, 7, 6).strip().splitlines()[-1])
    assert ours["episodes"] == 1 and ours["chunks"] == 5
    assert abs(ours["mse"] - ref["mse"]) <= 1e-4 * max(ref["mse"], 1e-3), (ours["mse"], ref["mse"])
    assert abs(m[-1]["open_loop_mse"] - ours["mse"]) <= 1e-6 * max(ours["mse"], 1e-3)  # the same during training
    assert len(ours["mse_per_dim"]) == 4 and len(ours["mse_per_step"]) == 4


@pytest.mark.parametrize("layout", ["dp2", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_diffusion_layout_matches_one_process(tmp_path, made, layout):
    """Diffusion Policy (the DDPM draws `noise` / `timesteps` of each row from its own seeded stream, the observation
    history, the first ResNet stage frozen) under DDP / FSDP = one process."""
    ds, pol = made
    check_layout(tmp_path, lambda d, steps: recipe(d, ds, pol, steps=steps), layout, pol / "model.safetensors",
                 ["model.freeze=[diffusion.rgb_encoder.0.backbone.4]"], frozen=".backbone.4.")

"""Robot policies trained by `loongforge train` from a LeRobot dataset (data.format: robot, train/robot_source.h),
against LeRobot itself on a dataset and an ACT policy written here with the lerobot package:
  - a batch of the robot source = LeRobot's for the same frames (LeRobotDataset with the policy's delta_timestamps,
    then make_pre_post_processors with the dataset's stats): normalised state, camera and action chunk, pad mask;
    its loss (`dump`) = LeRobotPolicy.forward's on LeRobot's batch with the same latent draw; the processor files
    written beside checkpoints load in LeRobot and normalise as its own; data-parallel shares and resume give the
    same rows (the C++ hook RobotSource.BatchHook);
  - training lowers the loss, and the checkpoint folder is a LeRobot policy folder: ACTPolicy.from_pretrained and
    make_pre_post_processors(pretrained_path=...) load it."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import LF_BIN, launch_ranks, run_gtest_hook, run_lerobot, run_lf

# In the lerobot environment: a v3.0 dataset (argv[1]) of 3 episodes at 10 fps whose actions follow from the state
# (action_t = state_{t+1}, a slow rotation) and whose camera (an image feature, 24 x 32) shows the state as colour;
# the episodes' tasks: argv[2] (a json list, one per episode) or "follow".
DATASET = r'''
import json, sys, numpy as np
tasks = json.loads(sys.argv[2]) if len(sys.argv) > 2 else ["follow"] * 3
from lerobot.datasets.lerobot_dataset import LeRobotDataset
H, W = 24, 32
feats = {"observation.state": {"dtype": "float32", "shape": (4,), "names": None},
         "action": {"dtype": "float32", "shape": (4,), "names": None},
         "observation.images.top": {"dtype": "image", "shape": (H, W, 3), "names": ["height", "width", "channels"]}}
ds = LeRobotDataset.create("test/robot", fps=10, features=feats, root=sys.argv[1], use_videos=False)
rng = np.random.default_rng(0)
c, s = np.cos(0.3), np.sin(0.3)
R = np.array([[c, -s, 0, 0], [s, c, 0, 0], [0, 0, c, -s], [0, 0, s, c]], np.float32)
for ep, n in enumerate([22, 18, 20]):
    x = rng.standard_normal(4).astype(np.float32)
    for i in range(n):
        nxt = (R @ x).astype(np.float32)
        img = np.zeros((H, W, 3), np.uint8)
        img[..., 0] = np.uint8(128 + 60 * np.tanh(x[0])); img[..., 1] = np.uint8(128 + 60 * np.tanh(x[1]))
        img[:, : W // 2, 2] = np.uint8(128 + 60 * np.tanh(x[2])); img[:, W // 2 :, 2] = np.uint8(128 + 60 * np.tanh(x[3]))
        ds.add_frame({"observation.state": x, "action": nxt, "observation.images.top": img, "task": tasks[ep]})
        x = nxt
    ds.save_episode()
ds.finalize()
'''

# LeRobot builds ACT's trunk with torchvision.models.resnet18: a narrow one here (widths / 8, one block per stage).
NARROW = r'''
import torch, torchvision
from torchvision.models.resnet import BasicBlock, ResNet
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.act.modeling_act import ACTPolicy
def narrow_resnet18(weights=None, **kw):
    make = ResNet._make_layer
    ResNet._make_layer = lambda self, block, planes, blocks, stride=1, dilate=False: make(self, block, planes // 8, blocks, stride, dilate)
    try:
        m = ResNet(BasicBlock, [1, 1, 1, 1], **kw)
    finally:
        ResNet._make_layer = make
    m.fc = torch.nn.Linear(64, 10)
    return m
torchvision.models.resnet18 = narrow_resnet18
'''

# A small ACT policy for that dataset (the narrow trunk, no dropout), saved to argv[1].
POLICY = NARROW + r'''
import sys
torch.manual_seed(0)
cfg = ACTConfig(input_features={"observation.state": PolicyFeature(FeatureType.STATE, (4,)),
                                "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 24, 32))},
                output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))},
                pretrained_backbone_weights=None, device="cpu", chunk_size=5, n_action_steps=5, dim_model=32,
                n_heads=4, dim_feedforward=64, n_encoder_layers=2, n_decoder_layers=1, n_vae_encoder_layers=1,
                latent_dim=4, dropout=0.0)
ACTPolicy(cfg).save_pretrained(sys.argv[1])
'''

# In the lerobot environment (test_pi0_train.py's and test_diffusion_policy_train.py's too): processed(ds, cfg, index,
# files, keys) -> (LeRobot's preprocessed batch of the frames INDEX of the LeRobotDataset DS with the dataset's stats,
# {KEYS of it, "files." + KEYS of the same raw batch through the processor files in FILES}); action_dataset(root, cfg)
# -> the dataset at ROOT with the policy's action delta_timestamps (10 fps).
PROCESSED = r'''
def action_dataset(root, cfg):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    return LeRobotDataset("test/robot", root=root, delta_timestamps={"action": [i / 10 for i in cfg.action_delta_indices]})
def processed(ds, cfg, index, files, keys):
    import torch
    from lerobot.policies.factory import make_pre_post_processors
    items = [ds[int(i)] for i in index]
    raw = {k: torch.stack([it[k] for it in items]) for k in items[0] if isinstance(items[0][k], torch.Tensor)}
    raw["task"] = [it["task"] for it in items]
    pre, _ = make_pre_post_processors(cfg, dataset_stats=ds.meta.stats)
    ref = pre(dict(raw))
    mine, _ = make_pre_post_processors(cfg, pretrained_path=files)
    via_ours = mine(dict(raw))
    res = {k: ref[k].clone().contiguous() for k in keys}
    for k in keys: res["files." + k] = via_ours[k].clone().contiguous()
    return ref, res
'''

# LeRobot's batch for the frames the source read (argv[3]'s "index"), its loss with our latent draw, and the
# processors LoongForge wrote (argv[4]) applied to the same raw batch.
LEROBOT_BATCH = NARROW + PROCESSED + r'''
import sys, torch
from safetensors.torch import load_file, save_file
from lerobot.policies.act.modeling_act import ACTPolicy
root, pol, ours, files, out = sys.argv[1:6]
policy = ACTPolicy.from_pretrained(pol)
ours = load_file(ours)
keys = ["observation.state", "observation.images.top", "action", "action_is_pad"]
ref, res = processed(action_dataset(root, policy.config), policy.config, ours["index"], files, keys)
policy.train()
torch.randn_like = lambda t, **kw: ours["vae_eps"].to(t.dtype)
loss, parts = policy.forward({k: ref[k] for k in keys})
res["loss"] = loss.detach().reshape(1)
save_file(res, out)
'''

# The trained checkpoint (argv[1]) as LeRobot loads it: policy, processors, an action for a raw observation.
# CHECK_LOADED (test_diffusion_policy_train.py's too) follows a script's lines that load the policy as `p`.
CHECK_LOADED = r'''
from lerobot.policies.factory import make_pre_post_processors
pre, post = make_pre_post_processors(p.config, pretrained_path=sys.argv[1])
obs = {"observation.state": torch.zeros(1, 4), "observation.images.top": torch.full((1, 3, 24, 32), 0.5)}
a = post(p.select_action(pre(obs)))
assert a.shape == (1, 4) and torch.isfinite(a).all()
print("ok")
'''
LOAD_CHECKPOINT = NARROW + r'''
import sys, torch
from lerobot.policies.act.modeling_act import ACTPolicy
p = ACTPolicy.from_pretrained(sys.argv[1])
''' + CHECK_LOADED


# LeRobot's own open-loop numbers for the checkpoint (argv[1]) on the held-out episode (argv[3]) of the dataset
# (argv[2]): a chunk every n_action_steps frames from its preprocessed observations, unnormalised by its
# postprocessor, against the recorded actions inside the episode.
OPEN_LOOP = NARROW + r'''
import sys, json, torch
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.policies.act.modeling_act import ACTPolicy
from lerobot.policies.factory import make_pre_post_processors
p = ACTPolicy.from_pretrained(sys.argv[1]); p.eval()
ds = LeRobotDataset("test/robot", root=sys.argv[2])
pre, post = make_pre_post_processors(p.config, dataset_stats=ds.meta.stats)
ep = int(sys.argv[3])
lo, hi = int(ds.meta.episodes["dataset_from_index"][ep]), int(ds.meta.episodes["dataset_to_index"][ep])
actions = torch.stack([ds[i]["action"] for i in range(lo, hi)])
sq, n = 0.0, 0
for f in range(0, hi - lo, p.config.n_action_steps):
    it = ds[lo + f]
    obs = pre({"observation.state": it["observation.state"][None], "observation.images.top": it["observation.images.top"][None]})
    with torch.no_grad():
        chunk = post(p.predict_action_chunk(obs))[0]
    k = min(len(chunk), hi - lo - f)
    sq += ((chunk[:k] - actions[f:f + k]) ** 2).sum().item(); n += k * chunk.shape[1]
print(json.dumps({"mse": sq / n}))
'''


def recipe(tmp_path, dataset, policy, robot="", steps=40):
    lines = [f"output_dir: {tmp_path / 'run'}", "seed: 7", f"model:\n  path: {policy}",
             f"data:\n  format: robot\n  train:\n    - path: {dataset}\n  robot:\n    threads: 1\n{robot}",
             f"train:\n  steps: {steps}\n  micro_batch_size: 6", "optim:\n  lr: 0.001\n  weight_decay: 0.0",
             "schedule:\n  kind: constant", "log:\n  tensorboard: false\n  plot: false\n  progress: lines",
             f"checkpoint:\n  every: {steps}"]
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


# The FSDP-style engine's layouts (ranks, settings; micro_batch_size: the rows of one data-parallel rank) for the
# policies' layout tests (test_pi0_train.py, test_diffusion_policy_train.py; ACT's: test_policy_dist.py).
LAYOUTS = {"dp2": (2, ["parallel.dp=2", "train.micro_batch_size=3"]),
           "fsdp2": (2, ["parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=3"]),
           "hsdp2x2": (4, ["parallel.dp=4", "parallel.zero=3", "parallel.hsdp_shard=2", "train.micro_batch_size=1"])}


def check_layout(tmp_path, make_recipe, layout, start, extra=(), frozen=None, steps=4):
    """`train` under LAYOUTS[layout] = one process taking the same global batch (per-step loss and gradient norm, the
    final weights; fp32, CPU, 1e-5); parameters whose names contain `frozen` stay at `start`'s values, others move.
    make_recipe(dir, steps) writes a recipe whose run goes to dir / "run"."""
    n, sets = LAYOUTS[layout]
    rows = n * int(sets[-1].split("=")[1])
    runs = {}
    for name, ranks, more in [("one", 1, ["parallel.zero=1", f"train.micro_batch_size={rows}"]), (layout, n, sets)]:
        d = tmp_path / name
        d.mkdir()
        args = ["train", make_recipe(d, steps), *sum((["--set", x] for x in [*extra, *more]), [])]
        if ranks == 1:
            run_lf(*args)
        else:
            for r, p in enumerate(launch_ranks(ranks, [LF_BIN, *args], timeout=600)):
                assert p.returncode == 0, f"rank {r}: {p.stderr[-3000:]}"
        ck = d / "run" / "checkpoints"
        ck = ck / (ck / "latest").read_text().strip()
        w = {}
        for f in sorted(ck.glob("model*.safetensors")):
            w.update(load_file(str(f)))
        m = [json.loads(l) for l in (d / "run" / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([x for x in m if "loss" in x], w)
    (ref, ref_w), (got, w) = runs["one"], runs[layout]
    assert len(got) == len(ref) == steps
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (layout, a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (layout, a["step"])
    assert w and sorted(w) == sorted(ref_w)
    first = load_file(str(start))
    moved, held = 0, 0
    for k, v in ref_w.items():
        diff, scale = np.abs(w[k] - v).max(), max(np.abs(v).max(), 1e-3)
        # + 5e-6 (half a percent of one step at lr 1e-3): Adam divides by sqrt(v), so an element whose gradient is
        # small carries the reduction order's rounding into its step (π0 hsdp2x2: a few elements at 2-3.5e-6, the
        # rest under 3e-7)
        assert diff <= 1e-5 * scale + 5e-6, (layout, k, diff, scale)
        if frozen and frozen in k:
            assert (w[k] == first[k]).all(), k
            held += 1
        else:
            moved += int(np.abs(w[k] - first[k]).max() > 0)
    assert moved > 0 and (held > 0) == bool(frozen), (moved, held)


_DATASET = []


def made_with(tmp_path_factory, policy_script):
    """The DATASET (written once a session: test_diffusion_policy_train.py reads it too) and a policy made by
    POLICY_SCRIPT."""
    if not _DATASET:
        _DATASET.append(tmp_path_factory.mktemp("robot") / "dataset")
        run_lerobot(DATASET, _DATASET[0])
    pol = tmp_path_factory.mktemp("policy") / "policy"
    run_lerobot(policy_script, pol)
    return _DATASET[0], pol


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return made_with(tmp_path_factory, POLICY)


def test_act_trains_from_a_lerobot_dataset_as_lerobot_batches_it(tmp_path, made):
    ds, pol = made
    rec = recipe(tmp_path, ds, pol)
    out = tmp_path / "hook"
    out.mkdir()
    run_gtest_hook("RobotSource.BatchHook", {"LF_TEST_ROBOT_RECIPE": str(rec), "LF_TEST_ROBOT_OUT": str(out)})
    run_lerobot(LEROBOT_BATCH, ds, pol, out / "batch.safetensors", out / "model_files", tmp_path / "ref.safetensors")
    ours, ref = load_file(out / "batch.safetensors"), load_file(tmp_path / "ref.safetensors")
    for k in ["observation.state", "observation.images.top", "action"]:
        assert ours[k].shape == ref[k].shape, k
        assert np.abs(ours[k] - ref[k]).max() <= 1e-5, (k, np.abs(ours[k] - ref[k]).max())
        assert np.abs(ref["files." + k] - ref[k]).max() <= 1e-6, k  # our processor files = LeRobot's own
    assert (ours["action_is_pad"] == ref["action_is_pad"]).all()
    # the loss of our batch (dump: the model as LeRobot's forward) = LeRobot's on its batch
    save_file({k: v for k, v in ours.items() if k != "index"}, tmp_path / "ours.safetensors")
    run_lf("dump", "--model", pol, "--batch", tmp_path / "ours.safetensors", "--out", tmp_path / "dump.safetensors")
    got = load_file(tmp_path / "dump.safetensors")
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * max(1.0, abs(ref["loss"][0]))

    run_lf("train", rec, "--set", "data.robot.valid_episodes=1", "--set", "eval.every=20")
    m = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in m if "loss" in x]
    assert len(losses) == 40
    assert [x["step"] for x in m if "open_loop_mse" in x] == [20, 40]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    ckpts = tmp_path / "run" / "checkpoints"
    ckpt = ckpts / (ckpts / "latest").read_text().strip()
    assert "ok" in run_lerobot(LOAD_CHECKPOINT, ckpt)

    # Open-loop evaluation on a held-out episode (data.robot.valid_episodes: 1 holds out episode 1 of 3) = LeRobot's
    # numbers for the same checkpoint, with one PNG per action dimension.
    proc = run_lf("eval", rec, "--model", ckpt, "--set", "data.robot.valid_episodes=1", "--open-loop", tmp_path / "ol")
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = json.loads(run_lerobot(OPEN_LOOP, ckpt, ds, 1).strip().splitlines()[-1])
    assert ours["episodes"] == 1 and ours["chunks"] == 4  # 18 frames, a chunk every 5
    assert abs(ours["mse"] - ref["mse"]) <= 1e-5 * max(ref["mse"], 1e-3), (ours["mse"], ref["mse"])
    assert abs(m[-1]["open_loop_mse"] - ours["mse"]) <= 1e-6 * max(ours["mse"], 1e-3)  # the same during training
    assert len(ours["mse_per_dim"]) == 4 and len(ours["mse_per_step"]) == 5
    assert sorted(p.split("/")[-1] for p in ours["plots"]) == [f"episode_1_action_{a}.png" for a in range(4)]
    assert (tmp_path / "ol" / "episode_1_action_0.png").read_bytes()[:4] == b"\x89PNG"


def test_image_transforms_per_row_whatever_the_split(tmp_path, made):
    """data.robot.image_transforms: a random crop, resized back to the policy's camera size, and LeRobot's jitters
    (each bitwise = torchvision: test_robot_transforms.py) drawn per row and camera from the seed and the row's stream
    index: ranks' shares and a resumed run give the same rows (the hook's checks); the frames did change."""
    ds, pol = made
    plain, jit = tmp_path / "plain", tmp_path / "jit"
    for d in (plain, jit):
        d.mkdir()
    run_gtest_hook("RobotSource.BatchHook", {"LF_TEST_ROBOT_RECIPE": str(recipe(plain, ds, pol)),
                                             "LF_TEST_ROBOT_OUT": str(plain)})
    transforms = ("    image_transforms:\n      enable: true\n      max_num_transforms: 2\n      crop: [20, 26]\n"
                  "      random_crop: true\n      resize: [24, 32]\n")
    run_gtest_hook("RobotSource.BatchHook", {"LF_TEST_ROBOT_RECIPE": str(recipe(jit, ds, pol, transforms)),
                                             "LF_TEST_ROBOT_OUT": str(jit)})
    a, b = load_file(plain / "batch.safetensors"), load_file(jit / "batch.safetensors")
    assert (a["index"] == b["index"]).all() and (a["action"] == b["action"]).all()
    cam = "observation.images.top"
    assert a[cam].shape == b[cam].shape == (6, 3, 24, 32)
    assert all(np.abs(a[cam][i] - b[cam][i]).max() > 1e-3 for i in range(6))
    # a shape the policy does not take is one line naming the key
    bad = recipe(tmp_path, ds, pol, "    image_transforms:\n      crop: [20, 26]\n")
    proc = run_lf("train", bad, check=False)
    assert proc.returncode != 0 and "data.robot.image_transforms" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

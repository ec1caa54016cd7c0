"""Diffusion Policy (LeRobot's DiffusionPolicy) in LoongForge = LeRobot's own, built from small configs in the lerobot
oracle environment: `dump` on a batch as LeRobot's policy.forward receives it (normalised, [B, n_obs_steps, ...]
observations, with the random draws passed in: the forward diffusion's `noise` and `timesteps`, the sampler's start
`sample_noise` and the DDPM sampler's per-step `sample_step_noise`) gives its loss, every parameter's gradient under
LeRobot's names and the eval-mode action chunk (diffusers' DDPM / DDIM schedulers against LoongForge's own); one
AdamW step equals torch.optim.AdamW's."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import assert_policy_grads_and_step_match, run_lerobot, run_lf

# In the lerobot environment: build DiffusionPolicy from CONFIG (json), save it to DIR (LeRobot's folder layout), draw
# a batch, run policy.forward in train mode with torch.randn / torch.randint fixed to the batch's noise / timesteps,
# backward, predict_action_chunk in eval mode from sample_noise with diffusers' randn_tensor (the DDPM step's
# variance noise) fixed to sample_step_noise, then one AdamW step; write the batch and the results.
# LeRobot builds "resnet18" through torchvision.models.resnet18: made narrow (widths / 4: GroupNorm needs 16 channels a
# group; fewer blocks) for small tests. LoongForge reads the layout from the weights.
NARROW = r'''
def narrow_resnet18():
    import torchvision
    from torchvision.models.resnet import BasicBlock, ResNet
    def build(weights=None, **kw):
        make = ResNet._make_layer
        ResNet._make_layer = lambda self, block, planes, blocks, stride=1, dilate=False: make(self, block, planes // 4, blocks, stride, dilate)
        try:
            return ResNet(BasicBlock, [2, 1, 1, 1], **kw)
        finally:
            ResNet._make_layer = make
    torchvision.models.resnet18 = build
'''

ORACLE = NARROW + r'''
import json, sys, torch
from safetensors.torch import save_file
import diffusers.schedulers.scheduling_ddpm as ddpm
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
spec = json.loads(sys.argv[1]); out = sys.argv[2]
if spec.pop("narrow", False):
    narrow_resnet18()
torch.manual_seed(spec.pop("seed"))
B = spec.pop("batch"); pad = spec.pop("pad")
feats = {k: PolicyFeature(FeatureType[t], tuple(s)) for k, (t, s) in spec.pop("inputs").items()}
for k in ("crop_shape", "resize_shape", "down_dims"):  # tuples in LeRobot's config (draccus encodes them so)
    if spec.get(k) is not None: spec[k] = tuple(spec[k])
cfg = DiffusionConfig(input_features=feats, output_features={"action": PolicyFeature(FeatureType.ACTION, (spec.pop("action_dim"),))},
                      pretrained_backbone_weights=None, device="cpu", **spec)
policy = DiffusionPolicy(cfg)
with torch.no_grad():  # non-trivial norm scales, biases and batch-norm statistics (a fresh model has identities)
    for n, b in policy.named_buffers():
        if "running_var" in n: b.uniform_(0.5, 2.0)
        elif "running_mean" in n: b.normal_(0, 0.1)
    for n, p in policy.named_parameters():
        if p.dim() == 1: (p.uniform_(0.5, 1.5) if n.endswith(".weight") else p.normal_(0, 0.1))
policy.save_pretrained(out + "/policy")
S, H, A = cfg.n_obs_steps, cfg.horizon, cfg.action_feature.shape[0]
batch = {}
for k, f in feats.items():
    batch[k] = torch.randn(B, S, *f.shape)
batch["action"] = torch.randn(B, H, A)
is_pad = torch.zeros(B, H, dtype=torch.bool)
for row, n in enumerate(pad):
    if n: is_pad[row, -n:] = True
batch["action_is_pad"] = is_pad
batch["noise"] = torch.randn(B, H, A)
batch["timesteps"] = torch.randint(0, cfg.num_train_timesteps, (B,))
batch["sample_noise"] = torch.randn(B, H, A)
steps = cfg.num_inference_steps or cfg.num_train_timesteps
if cfg.noise_scheduler_type == "DDPM":
    batch["sample_step_noise"] = torch.randn(steps - 1, B, H, A)
save_file({k: v.contiguous() for k, v in batch.items()}, out + "/batch.safetensors")
obs = {k: batch[k] for k in feats}
policy.train()
real = torch.randn, torch.randint
torch.randn = lambda *a, **kw: batch["noise"].clone()
torch.randint = lambda *a, **kw: batch["timesteps"].clone()
try:
    loss, _ = policy.forward({**obs, "action": batch["action"], "action_is_pad": batch["action_is_pad"]})
finally:
    torch.randn, torch.randint = real
loss.backward()
res = {"loss": loss.detach().reshape(1)}
for n, p in policy.named_parameters():
    res["grad." + n] = p.grad if p.grad is not None else torch.zeros_like(p)
draws = list(batch.get("sample_step_noise", torch.zeros(0)))
def step_noise(shape, **kw):
    z = draws.pop(0)
    assert tuple(z.shape) == tuple(shape)
    return z.clone()
ddpm.randn_tensor = step_noise
policy.eval()
policy.reset()
res["action_chunk"] = policy.predict_action_chunk(dict(obs), noise=batch["sample_noise"].clone())
assert not draws, "the sampler took fewer step draws than given"
policy.train()
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
opt.step()
for n, p in policy.named_parameters(): res["after_step." + n] = p.detach().clone()
save_file({k: v.contiguous() for k, v in res.items()}, out + "/ref.safetensors")
'''

SMALL = dict(down_dims=[16, 32], kernel_size=3, n_groups=4, diffusion_step_embed_dim=16, spatial_softmax_num_keypoints=4)
CASES = {
    # one camera (a narrow ResNet-18 with GroupNorm, centre crop) + state; DDPM, epsilon, the padding mask
    "ddpm_epsilon": dict(inputs={"observation.state": ["STATE", [3]], "observation.images.top": ["VISUAL", [3, 70, 80]]},
                         action_dim=2, n_obs_steps=2, horizon=8, n_action_steps=4, use_group_norm=True,
                         crop_shape=[64, 72], crop_is_random=False, num_train_timesteps=20, num_inference_steps=5,
                         do_mask_loss_for_padding=True, batch=2, pad=[0, 3], seed=0, narrow=True, **SMALL),
    # two cameras through one shared encoder + environment state, no crop; DDIM, sample prediction, linear betas,
    # bias-only FiLM, three U-Net levels
    "ddim_sample_shared": dict(inputs={"observation.state": ["STATE", [4]], "observation.environment_state": ["ENV", [3]],
                                       "observation.images.left": ["VISUAL", [3, 64, 64]],
                                       "observation.images.right": ["VISUAL", [3, 64, 64]]},
                               action_dim=3, n_obs_steps=3, horizon=16, n_action_steps=6, use_group_norm=True,
                               crop_shape=None, use_separate_rgb_encoder_per_camera=False, noise_scheduler_type="DDIM",
                               prediction_type="sample", beta_schedule="linear", use_film_scale_modulation=False,
                               num_train_timesteps=30, num_inference_steps=6, batch=3, pad=[0, 0, 5], seed=1, narrow=True,
                               **dict(SMALL, down_dims=[16, 32, 32])),
    # trainable batch norm (use_group_norm false: batch statistics in training, the updated running ones in eval), two
    # separate encoders, one observation step, DDPM with scaled_linear betas, no clipping, every inference step
    "ddpm_batchnorm": dict(inputs={"observation.state": ["STATE", [2]], "observation.images.a": ["VISUAL", [3, 48, 48]],
                                   "observation.images.b": ["VISUAL", [3, 48, 48]]},
                           action_dim=2, n_obs_steps=1, horizon=8, n_action_steps=8, use_group_norm=False,
                           crop_shape=[40, 40], crop_is_random=False, beta_schedule="scaled_linear", clip_sample=False,
                           num_train_timesteps=10, num_inference_steps=None, batch=2, pad=[0, 0], seed=2, narrow=True,
                           **SMALL),
    # resize_shape (torchvision's antialiased bilinear Resize) with crop_ratio 0.9 (a centre crop of 57 x 57)
    "resize_crop_ratio": dict(inputs={"observation.state": ["STATE", [3]], "observation.images.top": ["VISUAL", [3, 90, 100]]},
                              action_dim=2, n_obs_steps=2, horizon=8, n_action_steps=4, use_group_norm=True,
                              resize_shape=[64, 64], crop_ratio=0.9, crop_is_random=False, noise_scheduler_type="DDIM",
                              num_train_timesteps=20, num_inference_steps=4, batch=2, pad=[0, 1], seed=4, narrow=True,
                              **SMALL),
    # squaredcos betas with DDIM, epsilon, clip range 0.5; the environment state alone (no camera)
    "ddim_epsilon_env_only": dict(inputs={"observation.state": ["STATE", [2]], "observation.environment_state": ["ENV", [5]]},
                                  action_dim=4, n_obs_steps=2, horizon=8, n_action_steps=3, noise_scheduler_type="DDIM",
                                  clip_sample_range=0.5, num_train_timesteps=50, num_inference_steps=10, batch=2,
                                  pad=[1, 0], seed=3, **SMALL),
}


def check_against_reference(got, ref):
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * max(1.0, abs(ref["loss"][0])), (got["loss"], ref["loss"])
    assert got["action_chunk"].shape == ref["action_chunk"].shape
    assert np.abs(got["action_chunk"] - ref["action_chunk"]).max() <= 1e-4, np.abs(got["action_chunk"] - ref["action_chunk"]).max()
    assert_policy_grads_and_step_match(got, ref)


_ORACLE_RUNS = {}


def oracle(case, tmp_path_factory):
    """The oracle's folder for CASE (policy/, batch.safetensors, ref.safetensors), made once per session."""
    if case not in _ORACLE_RUNS:
        path = tmp_path_factory.mktemp("diffusion_" + case)
        run_lerobot(ORACLE, json.dumps(CASES[case]), path)
        _ORACLE_RUNS[case] = path
    return _ORACLE_RUNS[case]


@pytest.mark.parametrize("case", [c if c == "ddpm_epsilon" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_diffusion_dump_matches_lerobot(tmp_path, tmp_path_factory, case):
    src = oracle(case, tmp_path_factory)
    out = tmp_path / "lf.safetensors"
    run_lf("dump", "--model", src / "policy", "--batch", src / "batch.safetensors", "--out", out,
           "--adamw", "lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1")
    check_against_reference(load_file(out), load_file(src / "ref.safetensors"))


def test_diffusion_info_and_bad_batch(tmp_path, tmp_path_factory):
    """`info` describes the policy; a batch without the sampler's draws is refused in one line naming the tensor."""
    src = oracle("ddpm_epsilon", tmp_path_factory)
    info = json.loads(run_lf("info", src / "policy").stdout)
    assert info["model_type"] == "diffusion" and info["cameras"] == ["observation.images.top"]
    assert info["n_obs_steps"] == 2 and info["horizon"] == 8 and info["noise_scheduler_type"] == "DDPM"
    # `info` reads the config alone: the U-Net's count is exact, the trunk is the named resnet18, not the narrow one
    weights = load_file(src / "policy" / "model.safetensors")
    assert info["components"]["unet"]["parameters"] == sum(v.size for k, v in weights.items() if k.startswith("diffusion.unet."))
    batch = load_file(src / "batch.safetensors")
    del batch["sample_step_noise"]
    save_file(batch, tmp_path / "bad.safetensors")
    proc = run_lf("dump", "--model", src / "policy", "--batch", tmp_path / "bad.safetensors", "--out",
                  tmp_path / "x.safetensors", check=False)
    assert proc.returncode != 0 and "sample_step_noise" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# In the lerobot environment: the policy's pre / post-processors (normaliser stats) saved beside it (SRC), then the
# folder LoongForge wrote (DST) loaded by LeRobot: the same weights, the same processors, the same action chunk.
ROUND_TRIP = NARROW + r'''
import sys, torch
narrow_resnet18()
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
from lerobot.policies.factory import make_pre_post_processors
src, dst, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "save":
    p = DiffusionPolicy.from_pretrained(src)
    stats = {}
    for k, f in {**p.config.input_features, **p.config.output_features}.items():
        shape = (f.shape[0], 1, 1) if len(f.shape) == 3 else f.shape
        lo = torch.rand(*shape) - 1.5
        stats[k] = {"mean": torch.randn(*shape), "std": torch.rand(*shape) + 0.5, "min": lo, "max": lo + 1 + torch.rand(*shape)}
    pre, post = make_pre_post_processors(p.config, dataset_stats=stats)
    pre.save_pretrained(src)
    post.save_pretrained(src)
    sys.exit(0)
a, b = DiffusionPolicy.from_pretrained(src), DiffusionPolicy.from_pretrained(dst)
sa, sb = a.state_dict(), b.state_dict()
assert sorted(sa) == sorted(sb), set(sa) ^ set(sb)
for k in sa: assert torch.equal(sa[k], sb[k]), k
pa, _ = make_pre_post_processors(a.config, pretrained_path=src)
pb, _ = make_pre_post_processors(b.config, pretrained_path=dst)
S = a.config.n_obs_steps
obs = {k: torch.rand(1, S, *f.shape) for k, f in a.config.input_features.items()}
xa, xb = pa(dict(obs)), pb(dict(obs))
for k in obs: assert torch.equal(xa[k], xb[k]), k
a.eval(); b.eval()
torch.manual_seed(0); ya = a.predict_action_chunk(xa)
torch.manual_seed(0); yb = b.predict_action_chunk(xb)
assert torch.equal(ya, yb)
print("ok")
'''


@pytest.mark.slow
def test_diffusion_convert_writes_a_folder_lerobot_loads(tmp_path):
    run_lerobot(ORACLE, json.dumps(CASES["ddpm_epsilon"]), tmp_path)  # its own folder: the processors are saved there
    run_lerobot(ROUND_TRIP, tmp_path / "policy", "-", "save")
    run_lf("convert", "--model", tmp_path / "policy", "--out", tmp_path / "out", "--dtype", "fp32")
    cfg_in = json.loads((tmp_path / "policy" / "config.json").read_text())
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == cfg_in
    assert "ok" in run_lerobot(ROUND_TRIP, tmp_path / "policy", tmp_path / "out", "check")

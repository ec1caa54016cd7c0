"""The diffusion training objectives (issue 20): `diffusion.objective` turns rows of clean `latents` into a denoising
model's training batch as diffusers' training utilities do — flow matching with uniform / logit-normal / mode
timestep densities (compute_density_for_timestep_sampling), FlowMatchEulerDiscreteScheduler's shifted training
sigmas, x_t = (1 - sigma) x + sigma eps, target eps - x and compute_loss_weighting_for_sd3's weights; DDPM with
DDPMScheduler.add_noise and target eps; classifier-free-guidance dropout to the "no label" class. Each row draws u,
its noise and its dropout from a generator seeded by the run's seed and the row's stream index, so the first losses
equal diffusers' computation with those draws, and two data-parallel ranks equal one process."""
import json

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from safetensors.torch import save_file

from conftest import LF_BIN, launch_ranks, run_lf
from test_dit_parity import make_dit

SEED = 7


def row_seed(seed, k):
    return (seed * 6364136223846793005 + k * 1442695040888963407 + 1) % 2 ** 64 & (2 ** 63 - 1)


def recipe(tmp_path, objective, steps=2, mb=2, extra=""):
    r = tmp_path / "r.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
seed: {SEED}
model: {{path: {tmp_path / 'm'}}}
data: {{format: batch, train: [{{path: {tmp_path / 'b.safetensors'}}}], seq_len: 16}}
train: {{steps: {steps}, micro_batch_size: {mb}, threads: 1}}
optim: {{lr: 0.0, weight_decay: 0.0, clip: 0.0}}
schedule: {{kind: constant}}
diffusion: {{{objective}}}
log: {{progress: off, plot: false, tensorboard: false}}
{extra}
""")
    return r


def reference_losses(model, x, labels, kind, steps, mb, scheme="none", sampling="uniform", shift=1.0, drop=0.0,
                     mean=0.0, std=1.0, mode_scale=1.29):
    T = 1000
    flow = FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=shift)
    ddpm = DDPMScheduler(num_train_timesteps=T)
    c = model.config.in_channels
    losses = []
    with torch.no_grad():
        for s in range(steps):
            rows = []
            for j in range(mb):
                k = s * mb + j
                g = torch.Generator().manual_seed(row_seed(SEED, k))
                if kind == "flow_matching":
                    u = compute_density_for_timestep_sampling(sampling, 1, mean, std, mode_scale, generator=g)
                else:
                    u = torch.rand(1, generator=g)
                r = k % x.shape[0]
                xr = x[r:r + 1]
                noise = torch.randn(xr.shape, generator=g)
                label = labels[r:r + 1]
                if drop > 0 and torch.rand(1, generator=g).item() < drop:
                    label = torch.full_like(label, model.config.num_embeds_ada_norm)
                i = int((u * T).long().clamp(0, T - 1))
                if kind == "flow_matching":
                    sigma, t = flow.sigmas[i:i + 1], flow.timesteps[i:i + 1]
                    noisy = (1.0 - sigma) * xr + sigma * noise
                    target = noise - xr
                    w = compute_loss_weighting_for_sd3(scheme, sigma)
                else:
                    t = torch.tensor([i])
                    noisy = ddpm.add_noise(xr, noise, t)
                    target = noise
                    w = torch.ones(1)
                pred = model(noisy, timestep=t.float(), class_labels=label).sample[:, :c]
                rows.append((w * ((pred - target) ** 2).flatten(1).mean(1)).item())
            losses.append(sum(rows) / len(rows))
    return losses


def setup(tmp_path):
    model = make_dit(tmp_path / "m")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4, 8, 8, generator=g)
    labels = torch.tensor([0, 1, 2, 3])
    save_file({"latents": x, "class_labels": labels}, str(tmp_path / "b.safetensors"))
    return model, x, labels


def metrics(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("sampling,scheme,shift", [("uniform", "none", 1.0), ("logit_normal", "sigma_sqrt", 3.0),
                                                   ("mode", "cosmap", 1.0)])
def test_flow_matching_losses_match_diffusers(tmp_path, sampling, scheme, shift):
    model, x, labels = setup(tmp_path)
    obj = (f"objective: flow_matching, timestep_sampling: {sampling}, loss_weighting: {scheme}, shift: {shift}, "
           f"logit_mean: 0.2, logit_std: 0.8")
    run_lf("train", recipe(tmp_path, obj, steps=3))
    ours = [m["loss"] for m in metrics(tmp_path / "run")]
    ref = reference_losses(model, x, labels, "flow_matching", 3, 2, scheme, sampling, shift, mean=0.2, std=0.8)
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)


def test_ddpm_with_condition_dropout_matches_diffusers(tmp_path):
    model, x, labels = setup(tmp_path)
    run_lf("train", recipe(tmp_path, "objective: ddpm, condition_dropout: 0.5, vlb_weight: 0.0", steps=4))
    ours = [m["loss"] for m in metrics(tmp_path / "run")]
    ref = reference_losses(model, x, labels, "ddpm", 4, 2, drop=0.5)
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)
    # the same run without dropout differs (some rows were dropped)
    assert reference_losses(model, x, labels, "ddpm", 4, 2) != pytest.approx(ref, rel=1e-6)


def test_data_parallel_equals_one_process(tmp_path):
    """Each row's noise follows the row, not the rank: dp2 (one row each) = one process; training moves the weights
    (lr > 0), so later steps check the gradients too."""
    setup(tmp_path)
    obj = "objective: flow_matching, timestep_sampling: logit_normal, condition_dropout: 0.3"
    one = recipe(tmp_path, obj, steps=4)
    run_lf("train", one, "--set", "optim.lr=1e-3", "--set", f"output_dir={tmp_path / 'one'}")
    res = launch_ranks(2, [LF_BIN, "train", one, "--set", "optim.lr=1e-3", "--set", "parallel.dp=2",
                           "--set", "train.micro_batch_size=1", "--set", f"output_dir={tmp_path / 'two'}"])
    for r, p in enumerate(res):
        assert p.returncode == 0, f"rank {r}: {p.stderr[-2000:]}"
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]), (x, y)


def test_missing_latents_is_one_line(tmp_path):
    setup(tmp_path)
    save_file({"hidden_states": torch.randn(2, 4, 8, 8), "class_labels": torch.tensor([0, 1])},
              str(tmp_path / "b.safetensors"))
    err = run_lf("train", recipe(tmp_path, "objective: flow_matching"), check=False).stderr
    assert "b.safetensors" in err and "latents" in err and len(err.strip().splitlines()) == 1, err

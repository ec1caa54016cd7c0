"""`loongforge sample` against a diffusers sampling loop (issue 20): the same sigmas and timesteps as diffusers'
FlowMatchEulerDiscreteScheduler (with and without shift) and DDIMScheduler (linear / scaled-linear / cosine betas,
leading and trailing spacing), and every intermediate sample of a DiT denoising the batch's noise, with and without
classifier-free guidance (the unconditional prediction from the "no label" class), the learned-sigma output's first
in_channels channels being the prediction."""
import json

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_dit_parity import make_dit
from test_model_parity import rel_err


def diffusers_loop(model, scheduler, noise, labels, steps, guidance):
    scheduler.set_timesteps(steps)
    x = noise.clone()
    out = [x]
    c = model.config.in_channels
    null = torch.full_like(labels, model.config.num_embeds_ada_norm)
    with torch.no_grad():
        for t in scheduler.timesteps:
            tt = t.reshape(1).expand(x.shape[0])
            pred = model(x, timestep=tt, class_labels=labels).sample[:, :c]
            if guidance != 1.0:
                u = model(x, timestep=tt, class_labels=null).sample[:, :c]
                pred = u + guidance * (pred - u)
            x = scheduler.step(pred, t, x).prev_sample
            out.append(x)
    return torch.stack(out), scheduler


@pytest.mark.parametrize("kind,shift,guidance", [("flow", 1.0, 1.0), ("flow", 3.0, 4.0), ("ddim", None, 1.0),
                                                 ("ddim", None, 2.5)])
def test_samples_match_diffusers_loop(tmp_path, kind, shift, guidance):
    model = make_dit(tmp_path / "m")
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(2, 4, 8, 8, generator=g)
    labels = torch.tensor([1, 3])
    save_file({"noise": noise, "class_labels": labels}, str(tmp_path / "b.safetensors"))
    steps = 6
    args = ["sample", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--out",
            tmp_path / "o.safetensors", "--steps", steps, "--guidance", guidance]
    if kind == "flow":
        sched = FlowMatchEulerDiscreteScheduler(shift=shift)
        args += ["--shift", shift]
    else:
        sched = DDIMScheduler()
        args += ["--scheduler", "ddim"]
    ref, sched = diffusers_loop(model, sched, noise, labels, steps, guidance)
    run_lf(*args)
    got = load_file(str(tmp_path / "o.safetensors"))
    assert torch.equal(got["timesteps"], sched.timesteps.to(got["timesteps"].dtype))
    if kind == "flow":
        assert torch.equal(got["sigmas"], sched.sigmas)
    assert got["samples"].shape == ref.shape
    # DDIM's x0 estimate divides by sqrt(alpha_bar) (small at the first steps): float32 rounding of the model (e.g.
    # OpenBLAS's products on AMD CPUs against PyTorch's MKL ones) grows along the loop, measured up to 1.03e-5 after 6
    # steps with guidance 2.5 (8.5e-6 on MKL); the model's own outputs stay within 1e-5 (test_dit_parity).
    tol = 1e-5 if kind == "flow" else 2e-5
    for i in range(steps + 1):
        assert rel_err(got["samples"][i], ref[i]) <= tol, i


@pytest.mark.parametrize("config", [dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
                                    dict(beta_schedule="squaredcos_cap_v2", clip_sample=False),
                                    dict(timestep_spacing="trailing", set_alpha_to_one=False, steps_offset=1)])
def test_ddim_scheduler_configs(tmp_path, config):
    """A diffusers scheduler_config.json read as diffusers reads it."""
    model = make_dit(tmp_path / "m", learned_sigma=False)
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([2])
    save_file({"noise": noise, "class_labels": labels}, str(tmp_path / "b.safetensors"))
    sched = DDIMScheduler(**config)
    sched.save_config(tmp_path / "sched")
    ref, sched = diffusers_loop(model, sched, noise, labels, 5, 1.0)
    run_lf("sample", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--out",
           tmp_path / "o.safetensors", "--steps", 5, "--scheduler", tmp_path / "sched" / "scheduler_config.json")
    got = load_file(str(tmp_path / "o.safetensors"))
    assert torch.equal(got["timesteps"], sched.timesteps)
    # as the DDPM / DDIM loops above: the steps accumulate float32 rounding (the last step 1.2e-5 here since DiT's
    # feed-forward runs the fused GELU, within ~1e-7 of ATen's per call); the model's outputs stay within 1e-5
    for i in range(6):
        assert rel_err(got["samples"][i], ref[i]) <= 2e-5, i


def test_bad_sample_inputs_are_one_line(tmp_path):
    make_dit(tmp_path / "m")
    save_file({"class_labels": torch.tensor([1])}, str(tmp_path / "b.safetensors"))
    err = run_lf("sample", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--out",
                 tmp_path / "o.safetensors", check=False).stderr
    assert "b.safetensors" in err and "noise" in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "s.json").write_text(json.dumps({"_class_name": "EulerDiscreteScheduler"}))
    save_file({"noise": torch.randn(1, 4, 8, 8), "class_labels": torch.tensor([1])}, str(tmp_path / "b.safetensors"))
    err = run_lf("sample", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--out",
                 tmp_path / "o.safetensors", "--scheduler", tmp_path / "s.json", check=False).stderr
    assert "s.json" in err and "_class_name" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.safetensors").exists()

"""DiT against diffusers' own DiTTransformer2DModel, fp32 on the CPU (issue 20): `loongforge dump` on a batch of
noisy latents, timesteps and class labels gives diffusers' output (<= 1e-5 rel), the MSE loss against `target` (the
first in_channels channels of a learned-sigma model), every gradient (<= 1e-4 rel, under diffusers' names) and the
parameters after one AdamW step; `convert` writes a folder diffusers loads; `info` counts the parameters; bad
configs and batches are one line."""
import json

import pytest
import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, check_after_step, rel_err


def check_grad(name, ours, ref):
    """A key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by every key): both sides
    are rounding noise there, so only its size is checked."""
    if name.endswith("to_k.bias"):
        assert ours.abs().max() <= 1e-6 and ref.abs().max() <= 1e-6, name
    else:
        assert rel_err(ours, ref) <= 1e-4, name


def make_dit(d, learned_sigma=True, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=8, patch_size=2,
               num_embeds_ada_norm=5, out_channels=8 if learned_sigma else None)
    cfg.update(kw)
    model = DiTTransformer2DModel(**cfg)
    with torch.no_grad():  # every parameter random, so each gradient says something
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(d)
    return model.eval()


def make_batch(model, n=3, size=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = model.config.in_channels
    return {"hidden_states": torch.randn(n, c, size, size, generator=g),
            "timestep": torch.tensor([3.0, 517.5, 999.0][:n]),
            "class_labels": torch.tensor([0, 4, 5][:n]),  # 5 = num_embeds_ada_norm: the dropped label
            "target": torch.randn(n, c, size, size, generator=g)}


def reference(model, batch):
    out = model(batch["hidden_states"], timestep=batch["timestep"], class_labels=batch["class_labels"]).sample
    c = model.config.in_channels
    loss = ((out[:, :c] - batch["target"]) ** 2).mean()
    model.zero_grad()
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("learned_sigma", [True, False])
def test_dump_matches_diffusers(tmp_path, learned_sigma):
    model = make_dit(tmp_path / "m", learned_sigma)
    batch = make_batch(model)
    save_file(batch, str(tmp_path / "b.safetensors"))
    run_lf("dump", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--out", tmp_path / "o.safetensors",
           "--adamw", ADAMW)
    got = load_file(str(tmp_path / "o.safetensors"))
    out, loss, grads = reference(model, batch)
    assert rel_err(got["output"], out) <= 1e-5
    assert abs(got["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    for n, g in grads.items():
        check_grad(n, got["grad." + n], g)
    assert len([k for k in got if k.startswith("grad.")]) == len(grads)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt.step()
    for n, p in model.named_parameters():
        if n.endswith("to_k.bias"):  # Adam's step on rounding noise (see check_grad)
            continue
        check_after_step(got["after_step." + n], p.detach(), got["grad." + n], grads[n])


def test_other_sizes_and_integer_timesteps(tmp_path):
    """Latents larger than sample_size (positions recomputed for the grid, as diffusers) and int64 timesteps."""
    model = make_dit(tmp_path / "m", seed=2)
    batch = make_batch(model, n=2, size=12, seed=3)
    batch["timestep"] = torch.tensor([10, 900])
    save_file(batch, str(tmp_path / "b.safetensors"))
    run_lf("dump", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--out", tmp_path / "o.safetensors")
    got = load_file(str(tmp_path / "o.safetensors"))
    out, _, grads = reference(model, batch)
    assert rel_err(got["output"], out) <= 1e-5
    for n, g in grads.items():
        check_grad(n, got["grad." + n], g)


def test_convert_loads_in_diffusers_and_info_counts(tmp_path):
    model = make_dit(tmp_path / "m")
    run_lf("convert", "--model", tmp_path / "m", "--out", tmp_path / "c", "--dtype", "fp32")
    assert (tmp_path / "c" / "diffusion_pytorch_model.safetensors").exists()
    assert "dtype" not in json.loads((tmp_path / "c" / "config.json").read_text())
    back = DiTTransformer2DModel.from_pretrained(tmp_path / "c")
    ref = model.state_dict()
    for n, t in back.state_dict().items():
        assert torch.equal(t, ref[n]), n
    info = json.loads(run_lf("info", tmp_path / "m").stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def test_bad_configs_and_batches_are_one_line(tmp_path):
    model = make_dit(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    for field, value in [("norm_type", "ada_norm_single"), ("activation_fn", "geglu"), ("dropout", 0.1)]:
        bad = tmp_path / f"bad_{field}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, field: value}))
        (bad / "diffusion_pytorch_model.safetensors").write_bytes(
            (tmp_path / "m" / "diffusion_pytorch_model.safetensors").read_bytes())
        err = run_lf("info", bad, check=False).stderr
        assert "config.json" in err and field in err and len(err.strip().splitlines()) == 1, err
    batch = make_batch(model)
    for name, value in [("hidden_states", torch.randn(3, 3, 8, 8)), ("class_labels", torch.tensor([0, 1, 6])),
                        ("timestep", torch.tensor([1.0, 2.0]))]:
        save_file({**batch, name: value}, str(tmp_path / "b.safetensors"))
        err = run_lf("dump", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--out",
                     tmp_path / "o.safetensors", check=False).stderr
        assert "b.safetensors" in err and name in err and len(err.strip().splitlines()) == 1, err

"""Wan 2.1's video diffusion transformer against diffusers' WanTransformer3DModel, fp32 on the CPU: `loongforge dump`
on a batch of latents, timesteps, text states and a target gives diffusers' sample (<= 1e-5 rel), its MSE loss, every
gradient (<= 1e-4 rel, under diffusers' parameter names) and the parameters after one AdamW step; `convert` writes a
folder diffusers' from_pretrained loads; `info` shows the components and diffusers' parameter count; bad configs and
batches are one-line errors."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

diffusers = pytest.importorskip("diffusers")

from conftest import run_lf  # noqa: E402
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, check_after_step, rel_err  # noqa: E402

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            eps=1e-6, rope_max_seq_len=32)


def wan_model(seed=0, **kw):
    """The tiny model with every parameter perturbed (diffusers zero- / one-initialises norms and biases)."""
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(**{**TINY, **kw})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def make_batch(model, int_timestep=False, frames=3, size=8, text_len=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    latents = torch.randn(2, c.in_channels, frames, size, size, generator=g)
    if int_timestep:
        timestep = torch.tensor([999, 17], dtype=torch.int64)
    else:
        timestep = torch.tensor([731.25, 3.5])
    text = torch.randn(2, text_len, c.text_dim, generator=g)
    target = torch.randn(2, c.out_channels or c.in_channels, frames, size, size, generator=g)
    return {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": text, "target": target}


def diffusers_reference(model, batch):
    """diffusers' sample, MSE loss, gradients and parameters after one AdamW step."""
    model.train()
    out = model(hidden_states=batch["hidden_states"], timestep=batch["timestep"],
                encoder_hidden_states=batch["encoder_hidden_states"]).sample
    loss = F.mse_loss(out, batch["target"])
    loss.backward()
    ref = {"output": out.detach().clone(), "loss": loss.detach().reshape(1)}
    params = dict(model.named_parameters())
    for n, p in params.items():
        ref["grad." + n] = p.grad.clone()
    torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step()
    for n, p in params.items():
        ref["after_adamw." + n] = p.detach().clone()
    return ref


def run_dump(model_dir, batch, tmp_path, extra=("--adamw", ADAMW), check=True):
    path = tmp_path / "batch.safetensors"
    save_file({k: v.contiguous() for k, v in batch.items()}, str(path))
    out = tmp_path / "out.safetensors"
    proc = run_lf("dump", "--model", model_dir, "--batch", path, "--out", out, *extra, check=check)
    return load_file(str(out)) if check else proc


CASES = {
    "float_timestep_cross_attn_norm": dict(model={}, batch={}),
    "int_timestep_no_cross_attn_norm": dict(model=dict(cross_attn_norm=False), batch=dict(int_timestep=True)),
    "patch_2x2x2_odd_freq_dim": dict(model=dict(patch_size=(2, 2, 2), freq_dim=33, out_channels=6),
                                     batch=dict(frames=4, size=6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_wan_dump_matches_diffusers(case, tmp_path):
    model = wan_model(**CASES[case]["model"])
    model.save_pretrained(tmp_path / "model")
    batch = make_batch(model, **CASES[case]["batch"])
    ours = run_dump(tmp_path / "model", batch, tmp_path)
    ref = diffusers_reference(model, batch)
    assert ours["output"].shape == ref["output"].shape
    assert rel_err(ours["output"], ref["output"]) <= 1e-5
    assert abs(ours["loss"].item() - ref["loss"].item()) <= 1e-5 * abs(ref["loss"].item())
    grads = sorted(k for k in ref if k.startswith("grad."))
    assert sorted(k for k in ours if k.startswith("grad.")) == grads
    for k in grads:
        assert ref[k].abs().max() > 0, k  # the perturbation reaches every parameter
        assert rel_err(ours[k], ref[k]) <= 1e-4, k
    for k in ref:
        if k.startswith("after_adamw."):
            n = k[len("after_adamw."):]
            check_after_step(ours["after_step." + n], ref[k], ours["grad." + n], ref["grad." + n])


def test_wan_convert_loads_in_diffusers_and_info(tmp_path):
    model = wan_model(seed=2)
    model.save_pretrained(tmp_path / "src")
    run_lf("convert", "--model", tmp_path / "src", "--out", tmp_path / "out", "--dtype", "fp32")
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors").exists()
    assert not (tmp_path / "out" / "model.safetensors").exists()
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["_class_name"] == "WanTransformer3DModel" and "dtype" not in conf
    back = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    want, got = model.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k

    info = json.loads(run_lf("info", tmp_path / "src").stdout)
    n = lambda *ms: sum(p.numel() for m in ms for p in m.parameters())
    assert info["family"] == "diffusion" and info["model_type"] == "WanTransformer3DModel"
    assert info["parameters"] == n(model)
    comps = info["components"]
    assert set(comps) == {"patch_embedding", "condition_embedder", "blocks", "output"}
    assert comps["patch_embedding"]["parameters"] == n(model.patch_embedding)
    assert comps["condition_embedder"]["parameters"] == n(model.condition_embedder)
    assert comps["blocks"]["parameters"] == n(model.blocks)
    assert comps["output"]["parameters"] == n(model.proj_out) + model.scale_shift_table.numel()


def one_line(err, *words):
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("field,value", [("image_dim", 16), ("added_kv_proj_dim", 16), ("qk_norm", "rms_norm"),
                                         ("patch_size", [1, 2]), ("attention_head_dim", 15)])
def test_wan_bad_config_is_one_line(field, value, tmp_path):
    model = wan_model(seed=3)
    model.save_pretrained(tmp_path / "m")
    conf_path = tmp_path / "m" / "config.json"
    conf = json.loads(conf_path.read_text())
    conf[field] = value
    conf_path.write_text(json.dumps(conf))
    err = run_lf("info", tmp_path / "m", check=False).stderr
    one_line(err, "config.json", f"'{field}'")


def test_wan_bad_batch_is_one_line(tmp_path):
    model = wan_model(seed=4)
    model.save_pretrained(tmp_path / "m")
    good = make_batch(model)
    bad = {
        "hidden_states": {**good, "hidden_states": good["hidden_states"][:, :3]},  # channels
        "target": {**good, "target": good["target"][:, :, :2]},                    # shape differs
        "timestep": {**good, "timestep": good["timestep"][:1]},                    # one per row
        "encoder_hidden_states": {**good, "encoder_hidden_states": good["encoder_hidden_states"][..., :20]},
    }
    for field, batch in bad.items():
        err = run_dump(tmp_path / "m", batch, tmp_path, extra=(), check=False).stderr
        one_line(err, "batch.safetensors", f"'{field}'")
    odd = {**good, "hidden_states": good["hidden_states"][..., :7], "target": good["target"][..., :7]}
    err = run_dump(tmp_path / "m", odd, tmp_path, extra=(), check=False).stderr
    one_line(err, "batch.safetensors", "'hidden_states'", "patch_size")
    missing = {k: v for k, v in good.items() if k != "target"}
    err = run_dump(tmp_path / "m", missing, tmp_path, extra=(), check=False).stderr
    one_line(err, "batch.safetensors", "'target'", "missing")

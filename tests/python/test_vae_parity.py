"""diffusers' AutoencoderKL against diffusers' own class, fp32 on the CPU (issue 20): `loongforge dump` on a batch of
images gives diffusers' posterior moments (after quant_conv, logvar clamped), the decode of the mean and its MSE loss
(<= 1e-5 rel), every gradient (<= 1e-4 rel, under diffusers' parameter names) and the parameters after one AdamW
step; `convert` writes a folder AutoencoderKL.from_pretrained loads; `info` counts the components' parameters; bad
configs and batches are one line naming the file and the field."""
import json

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from safetensors.torch import load_file, save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import run_lf
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, check_after_step, rel_err

CASES = {
    # two levels, quant convs, mid-block attention (the SD / Flux layout, tiny)
    "sd_like": dict(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, latent_channels=4),
    # three levels with a level that keeps its width (no conv_shortcut), no quant convs, no mid-block attention,
    # gelu resnets, more channels in than out
    "plain": dict(block_out_channels=(8, 8, 16), layers_per_block=2, norm_num_groups=4, latent_channels=3,
                  in_channels=4, out_channels=4, act_fn="gelu", use_quant_conv=False, use_post_quant_conv=False,
                  mid_block_add_attention=False, shift_factor=0.1159, scaling_factor=0.3611),
}


def make_vae(seed=0, **kw):
    """A tiny AutoencoderKL with every parameter perturbed (diffusers sets norms to ones/zeros), saved by diffusers."""
    torch.manual_seed(seed)
    n = len(kw["block_out_channels"])
    model = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
                          sample_size=16, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.train()


def make_sample(model, b=2, hw=(16, 16), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, model.config.in_channels, *hw, generator=g)


def diffusers_reference(model, x):
    post = model.encode(x).latent_dist
    decoded = model.decode(post.mean).sample
    loss = F.mse_loss(decoded, x)
    loss.backward()
    ref = {"latent_mean": post.mean.detach().clone(), "latent_logvar": post.logvar.detach().clone(),
           "decoded": decoded.detach().clone(), "loss": loss.detach().reshape(1)}
    params = dict(model.named_parameters())
    for n, p in params.items():
        ref["grad." + n] = p.grad.clone()
    torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step()
    for n, p in params.items():
        ref["after_adamw." + n] = p.detach().clone()
    return ref


def run_dump(model_dir, x, tmp_path, extra=("--adamw", ADAMW)):
    batch = tmp_path / "batch.safetensors"
    save_file({"sample": x.contiguous()}, str(batch))
    out = tmp_path / "out.safetensors"
    run_lf("dump", "--model", model_dir, "--batch", batch, "--out", out, *extra)
    return load_file(str(out))


@pytest.mark.parametrize("case", list(CASES))
def test_vae_dump_matches_diffusers(case, tmp_path):
    model = make_vae(**CASES[case])
    model.save_pretrained(tmp_path / "m")
    x = make_sample(model)
    ours = run_dump(tmp_path / "m", x, tmp_path)
    ref = diffusers_reference(model, x)
    for k in ("latent_mean", "latent_logvar", "decoded"):
        assert ours[k].shape == ref[k].shape, k
        assert rel_err(ours[k], ref[k]) <= 1e-5, k
    assert abs(ours["loss"].item() - ref["loss"].item()) <= 1e-5 * abs(ref["loss"].item())
    grads = sorted(k for k in ref if k.startswith("grad."))
    assert sorted(k for k in ours if k.startswith("grad.")) == grads
    for k in grads:
        if k.endswith("to_k.bias"):  # zero in exact arithmetic (softmax ignores a shift shared by all keys)
            assert ours[k].abs().max() <= 1e-7 and ref[k].abs().max() <= 1e-7, k
        else:
            assert rel_err(ours[k], ref[k]) <= 1e-4, k
    for k in ref:
        if k.startswith("after_adamw."):
            n = k[len("after_adamw."):]
            check_after_step(ours["after_step." + n], ref[k], ours["grad." + n], ref["grad." + n])


def test_vae_deprecated_attention_names_load(tmp_path):
    """Folders saved with diffusers' old attention names (query, key, value, proj_attn) give the same model."""
    model = make_vae(seed=3, **CASES["sd_like"])
    model.save_pretrained(tmp_path / "m")
    x = make_sample(model)
    want = run_dump(tmp_path / "m", x, tmp_path, extra=())
    renames = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    old = {}
    for k, v in load_file(str(tmp_path / "m" / "diffusion_pytorch_model.safetensors")).items():
        for a, b in renames.items():
            k = k.replace(a, b)
        old[k] = v
    assert any(".proj_attn." in k for k in old)
    d = tmp_path / "old"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    save_file(old, str(d / "diffusion_pytorch_model.safetensors"))
    got = run_dump(d, x, tmp_path, extra=())
    assert torch.equal(got["decoded"], want["decoded"])


@pytest.mark.parametrize("case", list(CASES))
def test_vae_convert_loads_in_diffusers_and_info(case, tmp_path):
    model = make_vae(seed=2, **CASES[case])
    model.save_pretrained(tmp_path / "src")
    run_lf("convert", "--model", tmp_path / "src", "--out", tmp_path / "out", "--dtype", "fp32")
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors").exists()
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "dtype" not in conf and conf["_class_name"] == "AutoencoderKL"
    back = AutoencoderKL.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    want, got = model.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for k, v in model.config.items():
        if not k.startswith("_"):
            assert back.config[k] == v or list(back.config[k]) == list(v), k

    info = json.loads(run_lf("info", tmp_path / "src").stdout)
    n = lambda m: sum(p.numel() for p in m.parameters())
    comps = info["components"]
    want_comps = {"encoder": n(model.encoder), "decoder": n(model.decoder)}
    if model.quant_conv is not None:
        want_comps["quant_conv"] = n(model.quant_conv)
    if model.post_quant_conv is not None:
        want_comps["post_quant_conv"] = n(model.post_quant_conv)
    assert {k: v["parameters"] for k, v in comps.items()} == want_comps
    assert info["parameters"] == n(model)
    assert info["family"] == "diffusion" and info["model_type"] == "AutoencoderKL"
    # training FLOPs = 3 forwards at sample_size, as torch counts them (attention through the math kernel, which
    # the counter sees as two matmuls)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model.decode(model.encode(make_sample(model, b=1)).latent_dist.mean)
    assert info["train_flops_per_sample"] == 3 * fc.get_total_flops()


def one_line_error(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("field, value, words", [
    ("down_block_types", ["DownEncoderBlock2D", "AttnDownEncoderBlock2D"], ["AttnDownEncoderBlock2D"]),
    ("up_block_types", ["UpDecoderBlock2D"], ["1 blocks for 2 block_out_channels"]),
    ("act_fn", "tanh", ["tanh"]),
    ("block_out_channels", [8, 18], ["18", "norm_num_groups"]),
    ("latents_mean", [0.1, 0.2], ["2 values"]),
    ("use_quant_conv", "yes", ["expected"]),
])
def test_vae_bad_config_is_one_line(field, value, words, tmp_path):
    model = make_vae(**CASES["sd_like"])
    model.save_pretrained(tmp_path / "m")
    p = tmp_path / "m" / "config.json"
    conf = json.loads(p.read_text())
    conf[field] = value
    p.write_text(json.dumps(conf))
    batch = tmp_path / "batch.safetensors"
    save_file({"sample": make_sample(model)}, str(batch))
    for proc in (run_lf("info", tmp_path / "m", check=False),
                 run_lf("dump", "--model", tmp_path / "m", "--batch", batch, "--out", tmp_path / "o", check=False)):
        line = one_line_error(proc)
        assert str(p) in line and f"'{field}'" in line, line
        for w in words:
            assert w in line, line


@pytest.mark.parametrize("sample", [
    torch.randn(2, 1, 16, 16),       # channels
    torch.randn(3, 16, 16),          # rank
    torch.randn(2, 3, 15, 16),       # not a multiple of the downsampling
    torch.zeros(2, 3, 16, 16, dtype=torch.int64),
])
def test_vae_bad_batch_is_one_line(sample, tmp_path):
    model = make_vae(**CASES["sd_like"])
    model.save_pretrained(tmp_path / "m")
    batch = tmp_path / "batch.safetensors"
    save_file({"sample": sample}, str(batch))
    line = one_line_error(run_lf("dump", "--model", tmp_path / "m", "--batch", batch, "--out", tmp_path / "o",
                                 check=False))
    assert str(batch) in line and "'sample'" in line, line
    save_file({"pixel_values": torch.randn(2, 3, 16, 16)}, str(batch))
    line = one_line_error(run_lf("dump", "--model", tmp_path / "m", "--batch", batch, "--out", tmp_path / "o",
                                 check=False))
    assert str(batch) in line and "'sample'" in line and "missing" in line, line

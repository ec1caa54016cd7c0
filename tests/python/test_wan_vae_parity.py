"""diffusers' AutoencoderKLWan (Wan 2.1's causal video VAE) against diffusers' own class, fp32 on the CPU: `loongforge
dump` on a batch of videos (and of 1-frame videos: images) gives diffusers' posterior moments (encode: frame 0, then 4
frames at a time with the causal cache; logvar clamped), the decode of the mean (one latent frame at a time, clamped to
[-1, 1]) and its MSE loss (<= 1e-5 rel), every gradient (<= 1e-4 rel, under diffusers' parameter names) and the
parameters after one AdamW step; `convert` writes a folder AutoencoderKLWan.from_pretrained loads; `info` counts the
components' parameters and FLOPs; bad configs and batches are one line naming the file and the field."""
import json

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import run_lf
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, check_after_step, rel_err

CASES = {
    # Wan 2.1's layout, tiny: 8x spatial, 4x temporal (2d then two 3d downsamplings), mid-block attention
    "wan21": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                  temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                  latents_std=[1.5, 0.7, 2.0, 1.1]),
    # one level (2x, temporal 2x), a wider decoder, 4 channels in and out
    "variant": dict(base_dim=8, decoder_base_dim=12, z_dim=3, dim_mult=[1, 2], num_res_blocks=2, attn_scales=[],
                    temperal_downsample=[True], in_channels=4, out_channels=4, latents_mean=[0.5, 0.0, -0.5],
                    latents_std=[0.9, 1.2, 2.5]),
}


def make_vae(seed=0, **kw):
    """A tiny AutoencoderKLWan with every parameter perturbed (diffusers sets norms to ones), saved by diffusers."""
    torch.manual_seed(seed)
    model = AutoencoderKLWan(**kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.train()


def make_sample(model, b=2, frames=5, hw=(16, 16), seed=1):
    g = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(b, model.config.in_channels, frames, *hw, generator=g)


def diffusers_reference(model, x):
    post = model.encode(x).latent_dist
    decoded = model.decode(post.mean).sample
    loss = F.mse_loss(decoded, x)
    loss.backward()
    ref = {"latent_mean": post.mean.detach().clone(), "latent_logvar": post.logvar.detach().clone(),
           "decoded": decoded.detach().clone(), "loss": loss.detach().reshape(1)}
    params = dict(model.named_parameters())
    for n, p in params.items():  # a 1-frame clip does not reach the temporal convs (ours: zero, no AdamW step)
        ref["grad." + n] = torch.zeros_like(p) if p.grad is None else p.grad.clone()
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


@pytest.mark.parametrize("case, frames, hw", [("wan21", 5, (16, 16)), ("wan21", 1, (16, 8)), ("variant", 9, (8, 6))])
def test_wan_vae_dump_matches_diffusers(case, frames, hw, tmp_path):
    model = make_vae(**CASES[case])
    model.save_pretrained(tmp_path / "m")
    x = make_sample(model, frames=frames, hw=hw)
    ours = run_dump(tmp_path / "m", x, tmp_path)
    ref = diffusers_reference(model, x)
    for k in ("latent_mean", "latent_logvar", "decoded"):
        assert ours[k].shape == ref[k].shape, k
        assert rel_err(ours[k], ref[k]) <= 1e-5, k
    assert abs(ours["loss"].item() - ref["loss"].item()) <= 1e-5 * abs(ref["loss"].item())
    grads = sorted(k for k in ref if k.startswith("grad."))
    assert sorted(k for k in ours if k.startswith("grad.")) == grads
    for k in grads:
        assert rel_err(ours[k], ref[k]) <= 1e-4, k
    for k in ref:
        if k.startswith("after_adamw."):
            n = k[len("after_adamw."):]
            check_after_step(ours["after_step." + n], ref[k], ours["grad." + n], ref["grad." + n])


@pytest.mark.parametrize("case", list(CASES))
def test_wan_vae_convert_loads_in_diffusers_and_info(case, tmp_path):
    model = make_vae(seed=2, **CASES[case])
    model.save_pretrained(tmp_path / "src")
    run_lf("convert", "--model", tmp_path / "src", "--out", tmp_path / "out", "--dtype", "fp32")
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors").exists()
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "dtype" not in conf and conf["_class_name"] == "AutoencoderKLWan"
    back = AutoencoderKLWan.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    want, got = model.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for k, v in model.config.items():
        if not k.startswith("_"):
            assert back.config[k] == v or list(back.config[k]) == list(v), k

    info = json.loads(run_lf("info", tmp_path / "src").stdout)
    n = lambda m: sum(p.numel() for p in m.parameters())
    want_comps = {c: n(getattr(model, c)) for c in ("encoder", "quant_conv", "post_quant_conv", "decoder")}
    assert {k: v["parameters"] for k, v in info["components"].items()} == want_comps
    assert info["parameters"] == n(model)
    assert info["family"] == "diffusion" and info["model_type"] == "AutoencoderKLWan"
    c = model.config
    factor_t = 2 ** sum(c.temperal_downsample)
    assert info["latent_channels"] == c.z_dim and info["temporal_factor"] == factor_t
    assert info["spatial_factor"] == 2 ** (len(c.dim_mult) - 1)
    # training FLOPs = 3 forwards on the clip info names, as torch counts them (on the meta device: shapes only;
    # attention through the math kernel, which the counter sees as two matmuls)
    assert info["flops_clip"] == [5, 256, 256]
    meta = model.to("meta")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        meta.decode(meta.encode(torch.zeros(1, c.in_channels, *info["flops_clip"], device="meta")).latent_dist.mean)
    assert info["train_flops_per_sample"] == 3 * fc.get_total_flops()


def one_line_error(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("field, value, words", [
    ("is_residual", True, ["Wan 2.2"]),
    ("patch_size", 2, ["Wan 2.2"]),
    ("temperal_downsample", [False, True], ["2 values for 3"]),
    ("temperal_downsample", [True, True, True], ["two temporal"]),
    ("dim_mult", [1, 0, 2, 2], ["0 is not positive"]),
    ("latents_std", [1.0, 2.0], ["2 values for z_dim 4"]),
    ("base_dim", "wide", ["expected"]),
    ("attn_scales", [1.0], ["diffusers' encoder cannot run it"]),
])
def test_wan_vae_bad_config_is_one_line(field, value, words, tmp_path):
    model = make_vae(**CASES["wan21"])
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
    torch.randn(1, 1, 5, 16, 16),      # channels
    torch.randn(1, 3, 16, 16),         # rank (an image, not a 1-frame video)
    torch.randn(1, 3, 4, 16, 16),      # frames not 1 + 4k
    torch.randn(1, 3, 5, 12, 16),      # not a multiple of the downsampling
    torch.zeros(1, 3, 5, 16, 16, dtype=torch.int64),
])
def test_wan_vae_bad_batch_is_one_line(sample, tmp_path):
    model = make_vae(**CASES["wan21"])
    model.save_pretrained(tmp_path / "m")
    batch = tmp_path / "batch.safetensors"
    save_file({"sample": sample}, str(batch))
    line = one_line_error(run_lf("dump", "--model", tmp_path / "m", "--batch", batch, "--out", tmp_path / "o",
                                 check=False))
    assert str(batch) in line and "'sample'" in line, line
    save_file({"pixel_values": torch.randn(1, 3, 5, 16, 16)}, str(batch))
    line = one_line_error(run_lf("dump", "--model", tmp_path / "m", "--batch", batch, "--out", tmp_path / "o",
                                 check=False))
    assert str(batch) in line and "'sample'" in line and "missing" in line, line


def test_wan_vae_trains_on_a_batch_like_torch_adamw(tmp_path):
    """`loongforge train` on a batch file of videos (training runs the whole clip after frame 0 as one chunk): the
    losses of diffusers' model under torch's AdamW, step by step; the checkpoint is a folder diffusers loads."""
    model = make_vae(seed=4, **CASES["wan21"])
    model.save_pretrained(tmp_path / "m")
    x = make_sample(model, b=2, frames=5)
    save_file({"sample": x}, str(tmp_path / "b.safetensors"))
    steps, lr, wd = 2, 1e-3, 0.1
    (tmp_path / "r.yaml").write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {tmp_path / 'm'}}}
data: {{format: batch, train: [{{path: {tmp_path / 'b.safetensors'}}}], seq_len: 16}}
train: {{steps: {steps}, micro_batch_size: 2, threads: 2}}
optim: {{lr: {lr}, weight_decay: {wd}, no_decay: [], clip: 0.0}}
schedule: {{kind: constant}}
checkpoint: {{every: {steps}}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    run_lf("train", tmp_path / "r.yaml")
    ours = [json.loads(l)["loss"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    ref = []
    for _ in range(steps):
        loss = F.mse_loss(model.decode(model.encode(x).latent_dist.mean).sample, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    assert len(ours) == steps
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)
    ck = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    back = AutoencoderKLWan.from_pretrained(ck)
    want = dict(model.named_parameters())
    for n, p in back.named_parameters():
        d = (p - want[n]).abs()
        if n.endswith("to_qkv.bias"):  # the key bias's gradient is rounding noise (softmax ignores a shared shift)
            c = d.shape[0] // 3
            d = torch.cat([d[:c], d[2 * c:]])
        assert d.max() <= 1e-5, n

"""Issue 20's training extras: the weight average (`ema.*`) equals diffusers' EMAModel step by step, is written as a
diffusers folder beside each checkpoint (CKPT/ema), continues exactly on resume and under ZeRO-1 equals one process;
DDPM training of a learned-sigma DiT adds DiT's variational-bound term (guided diffusion's _vb_terms_bpd with the
mean frozen, its tables in float64 from diffusers' betas)."""
import json
import math

import pytest
import torch
from diffusers import DDPMScheduler, DiTTransformer2DModel
from diffusers.training_utils import EMAModel
from safetensors.torch import save_file

from conftest import LF_BIN, launch_ranks, run_lf
from test_diffusion_objective import SEED, metrics, recipe, row_seed, setup
from test_dit_parity import make_batch, make_dit


def train_recipe(tmp_path, steps, extra, mb=3):
    r = tmp_path / "r.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {tmp_path / 'm'}}}
data: {{format: batch, train: [{{path: {tmp_path / 'b.safetensors'}}}], seq_len: 16}}
train: {{steps: {steps}, micro_batch_size: {mb}, threads: 1}}
optim: {{lr: 1e-2, weight_decay: 0.0, no_decay: [], clip: 0.0}}
schedule: {{kind: constant}}
checkpoint: {{every: {steps}}}
log: {{progress: off, plot: false, tensorboard: false}}
{extra}
""")
    return r


def latest(run):
    ck = run / "checkpoints"
    return ck / (ck / "latest").read_text().strip()


def torch_run(model, batch, steps, **ema_kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ema = EMAModel(model.parameters(), **ema_kw)
    c = model.config.in_channels
    for _ in range(steps):
        out = model(batch["hidden_states"], timestep=batch["timestep"], class_labels=batch["class_labels"]).sample
        loss = ((out[:, :c] - batch["target"]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.step(model.parameters())
    return ema


def check_ema_folder(folder, model, ema):
    back = dict(DiTTransformer2DModel.from_pretrained(folder).named_parameters())
    for (n, _), s in zip(model.named_parameters(), ema.shadow_params):
        if n.endswith("to_k.bias"):  # its gradient is rounding noise (test_dit_parity.check_grad)
            continue
        assert (back[n] - s).abs().max() <= 2e-5 * max(1.0, s.abs().max().item()), n


@pytest.mark.parametrize("ema,kw", [
    ("{decay: 0.8, update_after_step: 1}", dict(decay=0.8, update_after_step=1)),
    ("{decay: 0.9, warmup: power, power: 0.75, inv_gamma: 2.0}",
     dict(decay=0.9, use_ema_warmup=True, power=0.75, inv_gamma=2.0)),
])
def test_ema_matches_diffusers_ema_model(tmp_path, ema, kw):
    model = make_dit(tmp_path / "m").train()
    batch = make_batch(model, n=3)
    save_file(batch, str(tmp_path / "b.safetensors"))
    run_lf("train", train_recipe(tmp_path, 5, f"ema: {ema}"))
    model.eval()
    ref = torch_run(model, batch, 5, **kw)
    check_ema_folder(latest(tmp_path / "run") / "ema", model, ref)
    # the model folder itself holds the trained (not averaged) weights
    back = dict(DiTTransformer2DModel.from_pretrained(latest(tmp_path / "run")).named_parameters())
    for n, p in model.named_parameters():
        if n.endswith("to_k.bias"):
            continue
        assert (back[n] - p).abs().max() <= 2e-5 * max(1.0, p.abs().max().item()), n


def test_ema_constant_decay_resume_and_zero1(tmp_path):
    """warmup none (DiT's own trainer: the average starts as the initial weights and moves by 1 - decay from the
    first step); a run stopped at step 2 and resumed = the run straight through; ZeRO-1 over dp2 = one process."""
    model = make_dit(tmp_path / "m").train()
    batch = make_batch(model, n=2)
    save_file(batch, str(tmp_path / "b.safetensors"))
    r = train_recipe(tmp_path, 4, "ema: {decay: 0.7, warmup: none}", mb=2)
    run_lf("train", r, "--set", f"output_dir={tmp_path / 'straight'}")
    run_lf("train", r, "--set", f"output_dir={tmp_path / 'resumed'}", "--set", "train.stop_at_step=2")
    run_lf("train", r, "--set", f"output_dir={tmp_path / 'resumed'}", "--resume")
    res = launch_ranks(2, [LF_BIN, "train", r, "--set", "parallel.dp=2", "--set", "parallel.zero=1",
                           "--set", "train.micro_batch_size=1", "--set", f"output_dir={tmp_path / 'zero1'}"])
    for k, p in enumerate(res):
        assert p.returncode == 0, f"rank {k}: {p.stderr[-2000:]}"
    # the reference: torch AdamW and a constant-decay average updated after every step
    model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    avg = [p.detach().clone() for p in model.parameters()]
    c = model.config.in_channels
    for _ in range(4):
        out = model(batch["hidden_states"], timestep=batch["timestep"], class_labels=batch["class_labels"]).sample
        loss = ((out[:, :c] - batch["target"]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for a, p in zip(avg, model.parameters()):
                a.sub_((a - p) * 0.3)
    names = [n for n, _ in model.named_parameters()]
    for run in ("straight", "resumed", "zero1"):
        back = dict(DiTTransformer2DModel.from_pretrained(latest(tmp_path / run) / "ema").named_parameters())
        for n, a in zip(names, avg):
            if n.endswith("to_k.bias"):
                continue
            assert (back[n] - a).abs().max() <= 2e-5 * max(1.0, a.abs().max().item()), (run, n)


def test_ema_with_lora_is_one_line(tmp_path):
    save_file(make_batch(make_dit(tmp_path / "m"), n=2), str(tmp_path / "b.safetensors"))
    err = run_lf("train", train_recipe(tmp_path, 1, "ema: {decay: 0.9}\nlora: {enabled: true, target_modules: [to_q]}"),
                 check=False).stderr
    assert "ema.decay" in err and len(err.strip().splitlines()) == 1, err


def guided_diffusion_vb(out, x_t, x0, t, betas):
    """guided diffusion's _vb_terms_bpd (LEARNED_RANGE, clip_denoised False, the mean's epsilon frozen): its tables in
    float64, its arithmetic in float32."""
    b = betas.double()
    alphas = 1 - b
    abar = abar64 = torch.cumprod(alphas, 0)
    abar_prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
    post_var = b * (1 - abar_prev) / (1 - abar)
    post_logvar = torch.log(torch.cat([post_var[1:2], post_var[1:]]))
    coef1 = b * abar_prev.sqrt() / (1 - abar)
    coef2 = (1 - abar_prev) * alphas.sqrt() / (1 - abar)
    # as guided diffusion's _extract_into_tensor: the float64 tables taken at t as float32, the rest in float32
    b, post_logvar, coef1, coef2 = b.float(), post_logvar.float(), coef1.float(), coef2.float()
    abar = abar.float()
    c = x_t.shape[1]
    eps, v = out[:, :c], out[:, c:]
    frac = (v + 1) / 2
    model_logvar = frac * b[t].log() + (1 - frac) * post_logvar[t]
    recip, recipm1 = (1 / abar64[t]).sqrt().float(), (1 / abar64[t] - 1).sqrt().float()
    pred_x0 = recip * x_t - recipm1 * eps
    model_mean = coef1[t] * pred_x0 + coef2[t] * x_t
    true_mean = coef1[t] * x0 + coef2[t] * x_t
    kl = 0.5 * (-1.0 + model_logvar - post_logvar[t] + torch.exp(post_logvar[t] - model_logvar)
                + (true_mean - model_mean) ** 2 * torch.exp(-model_logvar))
    if t == 0:
        def cdf(x):
            return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
        inv = torch.exp(-0.5 * model_logvar)
        cp, cm = cdf(inv * (x0 - model_mean + 1 / 255)), cdf(inv * (x0 - model_mean - 1 / 255))
        logp = torch.where(x0 < -0.999, cp.clamp(min=1e-12).log(),
                           torch.where(x0 > 0.999, (1 - cm).clamp(min=1e-12).log(), (cp - cm).clamp(min=1e-12).log()))
        return (-logp.mean() / math.log(2.0)).item()
    return (kl.mean() / math.log(2.0)).item()


@pytest.mark.parametrize("T,weight", [(1000, 1.0), (2, 0.5)])
def test_ddpm_learned_sigma_adds_dits_variational_bound(tmp_path, T, weight):
    model, x, labels = setup(tmp_path)
    steps, mb = 3, 2
    run_lf("train", recipe(tmp_path, f"objective: ddpm, num_train_timesteps: {T}, vlb_weight: {weight}", steps=steps))
    ours = [m["loss"] for m in metrics(tmp_path / "run")]
    sched = DDPMScheduler(num_train_timesteps=T)
    c = model.config.in_channels
    ref, firsts = [], 0
    with torch.no_grad():
        for s in range(steps):
            rows = []
            for j in range(mb):
                k = s * mb + j
                g = torch.Generator().manual_seed(row_seed(SEED, k))
                u = torch.rand(1, generator=g)
                r = k % x.shape[0]
                xr = x[r:r + 1]
                noise = torch.randn(xr.shape, generator=g)
                i = int((u * T).long().clamp(0, T - 1))
                t = torch.tensor([i])
                noisy = sched.add_noise(xr, noise, t)
                out = model(noisy, timestep=t.float(), class_labels=labels[r:r + 1]).sample
                mse = ((out[:, :c] - noise) ** 2).mean().item()
                rows.append(mse + weight * guided_diffusion_vb(out, noisy, xr, i, sched.betas))
                firsts += i == 0
            ref.append(sum(rows) / len(rows))
    if T == 2:
        assert firsts > 0  # the decoder's likelihood term was exercised
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)
    # weight 0 leaves the plain epsilon loss, which differs
    run_lf("train", recipe(tmp_path, f"objective: ddpm, num_train_timesteps: {T}, vlb_weight: 0.0", steps=steps),
           "--set", f"output_dir={tmp_path / 'plain'}")
    plain = [m["loss"] for m in metrics(tmp_path / "plain")]
    assert all(p < o for p, o in zip(plain, ours)), (plain, ours)

"""What a diffusion run shows as it trains (issue 20): eval.samples writes a grid of samples from fixed noise (the
run's seed) and the first rows' conditions, decoded by model.vae — the pixels of diffusers' own loop (DiT +
FlowMatchEulerDiscreteScheduler + AutoencoderKL.decode of latents / scaling_factor); `loongforge sample --vae`
decodes the same way; eval.timestep_buckets gives the validation loss per timestep bucket, each equal to diffusers'
computation with the bucket's timesteps."""
import json

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image
from safetensors.torch import save_file

from conftest import run_lf
from test_diffusion_objective import SEED, row_seed
from test_dit_parity import make_dit
from test_vae_parity import make_vae


def setup(tmp_path):
    dit = make_dit(tmp_path / "m", learned_sigma=False)
    vae = make_vae(block_out_channels=(8,), latent_channels=4, norm_num_groups=4, layers_per_block=1,
                   scaling_factor=0.5).eval()
    vae.save_pretrained(tmp_path / "vae")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4, 8, 8, generator=g)
    labels = torch.tensor([0, 1, 2, 3])
    save_file({"latents": x, "class_labels": labels}, str(tmp_path / "b.safetensors"))
    return dit, vae, x, labels


def write_recipe(tmp_path, extra):
    r = tmp_path / "r.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
seed: {SEED}
model: {{path: {tmp_path / 'm'}, vae: {tmp_path / 'vae'}}}
data: {{format: batch, train: [{{path: {tmp_path / 'b.safetensors'}}}], seq_len: 16, valid_fraction: 0.5}}
train: {{steps: 2, micro_batch_size: 2, threads: 1}}
optim: {{lr: 0.0, weight_decay: 0.0, clip: 0.0}}
schedule: {{kind: constant}}
diffusion: {{objective: flow_matching, shift: 2.0}}
log: {{progress: off, plot: false, tensorboard: false}}
{extra}
""")
    return r


def diffusers_pixels(dit, vae, noise, labels, steps, shift):
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    x = noise.clone()
    with torch.no_grad():
        for t in sched.timesteps:
            pred = dit(x, timestep=t.reshape(1).expand(x.shape[0]), class_labels=labels).sample
            x = sched.step(pred, t, x).prev_sample
        img = vae.decode(x / vae.config.scaling_factor).sample.clamp(-1, 1)
    return ((img + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def test_sample_grid_matches_diffusers_pipeline(tmp_path):
    dit, vae, x, labels = setup(tmp_path)
    run_lf("train", write_recipe(tmp_path, "eval: {every: 2, samples: 3, sample_steps: 4}"))
    line = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert line["samples"].endswith("grid.png")
    noise = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(SEED))
    want = diffusers_pixels(dit, vae, noise, labels[:3], 4, 2.0)
    folder = tmp_path / "run" / "samples" / "step_00000002"
    for i in range(3):
        got = np.asarray(Image.open(folder / f"sample_{i:02d}.png").convert("RGB"))
        assert np.abs(got.astype(int) - want[i].astype(int)).max() <= 1, i
    grid = np.asarray(Image.open(folder / "grid.png").convert("RGB"))
    assert grid.shape == (2 * 10 + 2, 2 * 10 + 2, 3)  # 2 x 2 tiles of 8 x 8 with 2-pixel gaps
    assert (grid[2:10, 12:20] == np.asarray(Image.open(folder / "sample_01.png").convert("RGB"))).all()

    # `loongforge sample --vae` decodes the same samples
    save_file({"noise": noise, "class_labels": labels[:3]}, str(tmp_path / "nb.safetensors"))
    run_lf("sample", "--model", tmp_path / "m", "--batch", tmp_path / "nb.safetensors", "--steps", 4, "--shift", 2.0,
           "--vae", tmp_path / "vae", "--images", tmp_path / "imgs")
    for i in range(3):
        got = np.asarray(Image.open(tmp_path / "imgs" / f"sample_{i:02d}.png").convert("RGB"))
        assert np.abs(got.astype(int) - want[i].astype(int)).max() <= 1, i
    bad = run_lf("sample", "--model", tmp_path / "m", "--batch", tmp_path / "nb.safetensors", "--vae", tmp_path / "m",
                 "--images", tmp_path / "imgs2", check=False).stderr
    assert "--vae" in bad and "not an autoencoder" in bad and len(bad.strip().splitlines()) == 1, bad


def test_validation_loss_per_timestep_bucket(tmp_path):
    dit, vae, x, labels = setup(tmp_path)
    K = 4
    run_lf("train", write_recipe(tmp_path, f"eval: {{every: 2, batches: 1, timestep_buckets: {K}}}"))
    line = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    ours = line["valid_loss_by_timestep"]
    assert len(ours) == K
    sched = FlowMatchEulerDiscreteScheduler(shift=2.0)
    T = 1000
    ref = []
    with torch.no_grad():
        for k in range(K):
            rows = []
            for j in range(2):  # the validation stream (seed + 1) from its start, rows 0 and 1
                g = torch.Generator().manual_seed(row_seed(SEED + 1, j))
                torch.rand(1, generator=g)  # the density's u (drawn all the same)
                xr = x[j:j + 1]
                noise = torch.randn(xr.shape, generator=g)
                tau = (k + torch.rand(1, generator=g).item()) / K * T
                i = int((sched.sigmas * T - tau).abs().argmin())
                sigma, t = sched.sigmas[i:i + 1], sched.timesteps[i:i + 1]
                pred = dit((1 - sigma) * xr + sigma * noise, timestep=t, class_labels=labels[j:j + 1]).sample
                rows.append(((pred - (noise - xr)) ** 2).mean().item())
            ref.append(sum(rows) / 2)
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)
    assert len(set(round(v, 6) for v in ours)) == K


def test_eval_extras_need_a_diffusion_run(tmp_path):
    setup(tmp_path)
    r = write_recipe(tmp_path, "eval: {every: 1, timestep_buckets: 2}")
    err = run_lf("train", r, "--set", "diffusion.objective=none", check=False).stderr
    assert "eval.timestep_buckets" in err and len(err.strip().splitlines()) == 1, err
    err = run_lf("train", r, "--set", "eval.timestep_buckets=0", "--set", "eval.samples=2",
                 "--set", "model.vae=", check=False).stderr
    assert "model.vae" in err and len(err.strip().splitlines()) == 1, err

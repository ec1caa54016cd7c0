"""Wan 2.1 trains and samples with text conditions (issue 20): flow-matching training on clean video latents with
classifier-free-guidance dropout to the data's own "no caption" embedding (negative_encoder_hidden_states, as data
encode writes the empty prompt's) = diffusers' WanTransformer3DModel with those draws; `loongforge sample` with
guidance takes the batch's negative embedding as WanPipeline takes negative_prompt_embeds."""
import json

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_diffusion_objective import SEED, row_seed
from test_wan_parity import wan_model


def test_text_dropout_to_the_null_embedding_matches_diffusers(tmp_path):
    model = wan_model()
    model.save_pretrained(tmp_path / "m")
    model.eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4, 3, 8, 8, generator=g)
    text = torch.randn(4, 5, 24, generator=g)
    null = torch.randn(1, 5, 24, generator=g)
    save_file({"latents": x, "encoder_hidden_states": text, "negative_encoder_hidden_states": null},
              str(tmp_path / "b.safetensors"))
    (tmp_path / "r.yaml").write_text(f"""
output_dir: {tmp_path / 'run'}
seed: {SEED}
model: {{path: {tmp_path / 'm'}}}
data: {{format: batch, train: [{{path: {tmp_path / 'b.safetensors'}}}], seq_len: 16}}
train: {{steps: 3, micro_batch_size: 2, threads: 1}}
optim: {{lr: 0.0, weight_decay: 0.0, clip: 0.0}}
schedule: {{kind: constant}}
diffusion: {{objective: flow_matching, shift: 3.0, condition_dropout: 0.5}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    run_lf("train", tmp_path / "r.yaml")
    ours = [json.loads(l)["loss"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref, dropped = [], 0
    with torch.no_grad():
        for s in range(3):
            rows = []
            for j in range(2):
                k = s * 2 + j
                gen = torch.Generator().manual_seed(row_seed(SEED, k))
                u = torch.rand(1, generator=gen)
                r = k % 4
                xr = x[r:r + 1]
                noise = torch.randn(xr.shape, generator=gen)
                cond = text[r:r + 1]
                if torch.rand(1, generator=gen).item() < 0.5:
                    cond, dropped = null, dropped + 1
                i = int((u * 1000).long())
                sigma, t = sched.sigmas[i], sched.timesteps[i:i + 1]
                pred = model((1 - sigma) * xr + sigma * noise, timestep=t, encoder_hidden_states=cond).sample
                rows.append(((pred - (noise - xr)) ** 2).mean().item())
            ref.append(sum(rows) / 2)
    assert 0 < dropped < 6
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)


def test_guided_sampling_with_the_negative_embedding_matches_diffusers(tmp_path):
    model = wan_model()
    model.save_pretrained(tmp_path / "m")
    model.eval()
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(2, 4, 3, 8, 8, generator=g)
    text = torch.randn(2, 5, 24, generator=g)
    neg = torch.randn(1, 5, 24, generator=g)
    save_file({"noise": noise, "encoder_hidden_states": text, "negative_encoder_hidden_states": neg},
              str(tmp_path / "b.safetensors"))
    run_lf("sample", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--steps", 3, "--shift", 5.0,
           "--guidance", 4.0, "--out", tmp_path / "o.safetensors")
    ours = load_file(str(tmp_path / "o.safetensors"))["samples"]
    sched = FlowMatchEulerDiscreteScheduler(shift=5.0)
    sched.set_timesteps(3)
    xs, x = [noise], noise.clone()
    with torch.no_grad():
        for t in sched.timesteps:
            tt = t.reshape(1).expand(2)
            c = model(x, timestep=tt, encoder_hidden_states=text).sample
            u = model(x, timestep=tt, encoder_hidden_states=neg.expand(2, -1, -1)).sample
            x = sched.step(u + 4.0 * (c - u), t, x).prev_sample
            xs.append(x)
    want = torch.stack(xs)
    assert (ours - want).abs().max() <= 1e-4 * want.abs().max()
    # without a negative embedding a text model has no unconditional input: one line
    save_file({"noise": noise, "encoder_hidden_states": text}, str(tmp_path / "b2.safetensors"))
    err = run_lf("sample", "--model", tmp_path / "m", "--batch", tmp_path / "b2.safetensors", "--steps", 2,
                 "--guidance", 4.0, "--out", tmp_path / "o2.safetensors", check=False).stderr
    assert len(err.strip().splitlines()) == 1, err

"""Training step of a DiT: `loongforge train` against diffusers' own DiTTransformer2DModel (eager, AdamW, clipping) on
the same batch (noisy latents, timesteps, class labels, targets), same threads, in one run (issue 20's speed goal on
the CPU: >= 1.3x). Rounds alternate the two sides; the table shows images/s from the medians of the per-step times
after warm-up and the ratio per round.

  .venv/bin/python bench/dit_train.py [--shape small|B/2|XL/2] [--batch N] [--rounds 3] [--steps 6] [--warmup 2]
                                      [--threads 2] [--device cpu|cuda] [--precision fp32|bf16] [--out FILE.md]
                                      [--lf build/loongforge]
small: 4 x 256 (4 heads), 16 x 16 latents (64 tokens), batch 8 (the CPU row). B/2 and XL/2: DiT-B/2 and DiT-XL/2 at
256 x 256 (32 x 32 latents, 256 tokens), the GPU rows bench/gpu_check.sh runs (batch 256; bf16 autocast on the
diffusers side when --precision bf16).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LF = ROOT / "build" / "loongforge"

SHAPES = {
    "small": dict(num_attention_heads=4, attention_head_dim=64, num_layers=4, sample_size=16, batch=8),
    "B/2": dict(num_attention_heads=12, attention_head_dim=64, num_layers=12, sample_size=32, batch=256),
    "XL/2": dict(num_attention_heads=16, attention_head_dim=72, num_layers=28, sample_size=32, batch=256),
}


def make_model(tmp, shape):
    import torch
    from diffusers import DiTTransformer2DModel
    torch.manual_seed(0)
    s = {k: v for k, v in SHAPES[shape].items() if k != "batch"}
    model = DiTTransformer2DModel(in_channels=4, out_channels=8, patch_size=2, num_embeds_ada_norm=1000, **s)
    model.save_pretrained(tmp / "model")
    return model


def make_batch(tmp, shape, batch):
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(1)
    n = SHAPES[shape]["sample_size"]
    b = {"hidden_states": torch.randn(batch, 4, n, n, generator=g),
         "timestep": torch.randint(0, 1000, (batch,), generator=g).float(),
         "class_labels": torch.randint(0, 1000, (batch,), generator=g),
         "target": torch.randn(batch, 4, n, n, generator=g)}
    save_file(b, str(tmp / "batch.safetensors"))
    return b


def loongforge_steps(lf, tmp, batch, steps, warmup, threads, device, precision):
    recipe = tmp / "r.yaml"
    recipe.write_text(f"""
output_dir: {tmp / 'run'}
device: {device}
precision: {precision}
model: {{path: {tmp / 'model'}}}
data: {{format: batch, train: [{{path: {tmp / 'batch.safetensors'}}}]}}
train: {{steps: {steps + warmup}, micro_batch_size: {batch}, threads: {threads}}}
optim: {{lr: 1.0e-4, clip: 1.0}}
checkpoint: {{every: 0, keep: 1}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    if (tmp / "run").exists():
        subprocess.run(["rm", "-rf", str(tmp / "run")], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([str(lf), "train", str(recipe)], check=True, env=env, stdout=subprocess.DEVNULL)
    m = [json.loads(l) for l in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(x["step_time_s"] for x in m[warmup:]), m[0]["loss"]


def diffusers_steps(model, b, steps, warmup, device, precision):
    import torch
    model.to(device).eval()  # no label dropout (training mode would drop labels): the same loss as LoongForge's
    b = {k: v.to(device) for k, v in b.items()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    times, first = [], None
    c = model.config.in_channels
    for i in range(steps + warmup):
        t = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(b["hidden_states"], timestep=b["timestep"], class_labels=b["class_labels"]).sample
        loss = ((out[:, :c].float() - b["target"]) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        first = first if first is not None else loss.item()
    return statistics.median(times), first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out")
    ap.add_argument("--lf", default=str(LF))
    a = ap.parse_args()
    import diffusers
    import torch
    from diffusers import DiTTransformer2DModel
    torch.set_num_threads(a.threads)
    batch = a.batch or SHAPES[a.shape]["batch"]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="lf_dit_bench_"))
    make_model(tmp, a.shape)
    b = make_batch(tmp, a.shape, batch)
    lf_t, hf_t, ratios = [], [], []
    for r in range(a.rounds):
        order = ["lf", "hf"] if r % 2 == 0 else ["hf", "lf"]
        res = {}
        for side in order:
            if side == "lf":
                res["lf"] = loongforge_steps(a.lf, tmp, batch, a.steps, a.warmup, a.threads, a.device, a.precision)
            else:  # a fresh copy of the initial weights each round
                m = DiTTransformer2DModel.from_pretrained(tmp / "model")
                res["hf"] = diffusers_steps(m, b, a.steps, a.warmup, a.device, a.precision)
        lf_t.append(res["lf"][0])
        hf_t.append(res["hf"][0])
        ratios.append(res["hf"][0] / res["lf"][0])
        print(f"round {r + 1}: loongforge {batch / res['lf'][0]:,.1f} img/s, diffusers {batch / res['hf'][0]:,.1f} "
              f"img/s ({ratios[-1]:.2f}x); first-step losses {res['lf'][1]:.5f} / {res['hf'][1]:.5f}", flush=True)
    lf_med, hf_med = statistics.median(lf_t), statistics.median(hf_t)
    ratio = hf_med / lf_med
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    where = f"{a.device}" + (f" ({torch.cuda.get_device_name(0)})" if a.device == "cuda" else f", {a.threads} threads")
    s = SHAPES[a.shape]
    name = (f"DiT {a.shape}: {s['num_layers']} x {s['num_attention_heads'] * s['attention_head_dim']}, "
            f"{(s['sample_size'] // 2) ** 2} tokens, batch {batch}")
    lines = [f"DiT training step, {a.precision}, {where}, median of {a.rounds} rounds of {a.steps} steps after "
             f"{a.warmup} warm-up (torch {torch.__version__}, diffusers {diffusers.__version__}, {cpu})", "",
             "| shape | LoongForge img/s | diffusers eager img/s | ratio (goal >= 1.3x) | per round |",
             "|---|---|---|---|---|",
             f"| {name} | {batch / lf_med:,.1f} | {batch / hf_med:,.1f} | {ratio:.2f}x "
             f"({'met' if ratio >= 1.3 else 'not met'}) | {' '.join(f'{x:.2f}' for x in ratios)} |"]
    print("\n".join(lines))
    if a.out:
        pathlib.Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU training throughput: LoongForge (`loongforge train`) against PyTorch eager in Python on the same machine,
same shapes, same thread count, fp32, in one run. Prints a table of tokens/s and the ratio; with --out, writes it as
markdown too.

The reference is a plain nn.Module Llama (RMSNorm, RoPE, SDPA attention with GQA, SwiGLU MLP, untied head) trained
with torch.optim.AdamW, as a user would write it. Both sides see random token data.

    [LOONGFORGE_BIN=build/loongforge] .venv/bin/python bench/cpu_train.py [--threads 2] [--steps 8] [--rounds 5]
        [--out bench/results/cpu_train.md]

The environment passes through to `loongforge train` (e.g. LOONGFORGE_SPLIT_GEMM=1: row-split GEMMs, kernels/linear.h).
The table notes the load average before and after: on a shared machine other processes skew both sides.
"""
import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# LOONGFORGE_BIN points to another build (e.g. build-<name>/loongforge).
LF = pathlib.Path(os.environ.get("LOONGFORGE_BIN", ROOT / "build" / "loongforge"))

SHAPES = [
    dict(name="d256 L4 h8 kv4 ffn688 V8192, 8x256", d=256, layers=4, heads=8, kv=4, ffn=688, vocab=8192, batch=8, seq=256),
    dict(name="d512 L8 h8 kv8 ffn1376 V16384, 4x512", d=512, layers=8, heads=8, kv=8, ffn=1376, vocab=16384, batch=4, seq=512),
]


def torch_reference(shape, steps, warmup, threads):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    d, h, kv, hd = shape["d"], shape["heads"], shape["kv"], shape["d"] // shape["heads"]

    class RMSNorm(nn.Module):
        def __init__(self, n, eps=1e-6):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(x, cos, sin):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(d, h * hd, bias=False), nn.Linear(d, kv * hd, bias=False)
            self.v, self.o = nn.Linear(d, kv * hd, bias=False), nn.Linear(h * hd, d, bias=False)
            self.gate = nn.Linear(d, shape["ffn"], bias=False)
            self.up = nn.Linear(d, shape["ffn"], bias=False)
            self.down = nn.Linear(shape["ffn"], d, bias=False)
            self.n1, self.n2 = RMSNorm(d), RMSNorm(d)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            y = self.n1(x)
            q = rope(self.q(y).view(b, t, h, hd).transpose(1, 2), cos, sin)
            k = rope(self.k(y).view(b, t, kv, hd).transpose(1, 2), cos, sin)
            v = self.v(y).view(b, t, kv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(shape["vocab"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(shape["layers"]))
            self.norm = RMSNorm(d)
            self.head = nn.Linear(d, shape["vocab"], bias=False)
            inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
            f = torch.outer(torch.arange(shape["seq"]).float(), inv)
            emb = torch.cat((f, f), -1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

        def forward(self, ids):
            x = self.embed(ids)
            for blk in self.blocks:
                x = blk(x, self.cos, self.sin)
            return self.head(self.norm(x))

    model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for i in range(warmup + steps):
        ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1))
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, shape["vocab"]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return shape["batch"] * shape["seq"] / statistics.median(times)


def loongforge_run(shape, steps, warmup, threads, tmp):
    import numpy as np
    tmp = pathlib.Path(tmp)
    cfg = {"model_type": "llama", "vocab_size": shape["vocab"], "hidden_size": shape["d"],
           "intermediate_size": shape["ffn"], "num_hidden_layers": shape["layers"],
           "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv"],
           "max_position_embeddings": shape["seq"] + 1, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    (tmp / "model.json").write_text(json.dumps(cfg))
    # a token shard of random ids (the .bin/.idx layout of docs/data_format.md)
    n_tokens = (warmup + steps + 2) * shape["batch"] * (shape["seq"] + 1) * 2
    ids = np.random.default_rng(0).integers(0, shape["vocab"], n_tokens, dtype=np.uint16)
    ids.tofile(tmp / "rand.bin")
    docs = 64
    offsets = np.linspace(0, n_tokens, docs + 1).astype(np.uint64)
    with open(tmp / "rand.idx", "wb") as f:
        f.write(b"LFIDX\0\0\0")
        f.write(np.array([1, 2], dtype=np.uint32).tobytes())
        f.write(np.array([docs, n_tokens], dtype=np.uint64).tobytes())
        f.write(offsets.tobytes())
    recipe = tmp / "bench.yaml"
    recipe.write_text(f"""
output_dir: {tmp / 'run'}
model: {{config: {tmp / 'model.json'}}}
data: {{train: [{{path: {tmp / 'rand'}}}], seq_len: {shape['seq']}}}
train: {{steps: {warmup + steps}, micro_batch_size: {shape['batch']}, threads: {threads}}}
optim: {{lr: 3.0e-4, weight_decay: 0.1, clip: 1.0}}
log: {{progress: off, tensorboard: false, plot: false}}
checkpoint: {{every: 0}}
""")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([str(LF), "train", str(recipe)], check=True, env=env, stdout=subprocess.DEVNULL)
    m = [json.loads(l) for l in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    times = [x["step_time_s"] for x in m[warmup:]]
    return shape["batch"] * shape["seq"] / statistics.median(times)


def cpu_model():
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternate LoongForge and PyTorch this many times per shape; the table shows the medians")
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    rows = []
    load_before = os.getloadavg()[0]
    for shape in SHAPES:
        ours_r, ref_r = [], []
        for _ in range(a.rounds):  # alternating runs: a slow spell of a noisy machine hits both sides alike
            with tempfile.TemporaryDirectory() as tmp:
                ours_r.append(loongforge_run(shape, a.steps, a.warmup, a.threads, tmp))
            ref_r.append(torch_reference(shape, a.steps, a.warmup, a.threads))
            print(f"{shape['name']}: loongforge {ours_r[-1]:,.0f} tok/s, pytorch eager {ref_r[-1]:,.0f} tok/s, "
                  f"ratio {ours_r[-1] / ref_r[-1]:.2f}", file=sys.stderr)
        ours, ref = statistics.median(ours_r), statistics.median(ref_r)
        paired = sorted(o / r for o, r in zip(ours_r, ref_r))  # each round's two runs share the machine's state
        rows.append((shape["name"], ours, ref, ours / ref, paired))
    lines = [f"CPU training, fp32, {a.threads} threads, median of {a.rounds} alternating rounds of {a.steps} steps after "
             f"{a.warmup} warm-up each "
             f"(torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs ({cpu_model()}), 1-min load average "
             f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after"
             + (", LOONGFORGE_SPLIT_GEMM=" + os.environ["LOONGFORGE_SPLIT_GEMM"] if "LOONGFORGE_SPLIT_GEMM" in os.environ else "")
             + ")", "",
             "| shape (batch x seq) | LoongForge tok/s | PyTorch eager tok/s | ratio of medians | per-round ratios |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {o:,.0f} | {r:,.0f} | {x:.2f}x | {' '.join(f'{p:.2f}' for p in ps)} |" for n, o, r, x, ps in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)


if __name__ == "__main__":
    main()

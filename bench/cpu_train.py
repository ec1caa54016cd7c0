"""CPU training throughput: LoongForge (`loongforge train`) against PyTorch in Python, eager and torch.compile, on the
same machine, same shapes, same thread count, fp32, in one run. Prints a table of tokens/s, LoongForge's ratio to
each and whether issue 18's goals hold; with --out, writes it as markdown too.

The reference is a plain nn.Module Llama (RMSNorm, RoPE, SDPA attention with GQA, SwiGLU MLP, untied head) trained
with torch.optim.AdamW and global-norm clipping, as a user would write it. The torch.compile column runs the same
model and step with two functions compiled by inductor (default mode): the loss (model forward + cross-entropy, so the
backward is compiled too, through AOTAutograd) and the optimizer step (clipping + AdamW, as in PyTorch's "compiling
the optimizer" recipe). Compilation happens in its first steps, which are warm-up: at least --warmup of them, and
until a step compiles nothing new; recompiling during the timed steps is reported. Both sides see random token data;
the two PyTorch runs see the same data from the same initial weights, and the table's notes compare their losses.

    [LOONGFORGE_BIN=build/loongforge] .venv/bin/python bench/cpu_train.py [--threads 2] [--steps 8] [--rounds 5]
        [--compile default|max-autotune-no-cudagraphs|off] [--out FILE.md]

Each round runs LoongForge, eager and compile once per shape (the order rotates from round to round), so a slow
spell of a noisy machine hits all sides alike; the table shows medians over the rounds and each round's own ratios.
torch.compile needs a C++ compiler (inductor's CPU kernels); if it fails, the table says why and the other columns
stay. The environment passes through to `loongforge train` (e.g. LOONGFORGE_SPLIT_GEMM=1: row-split GEMMs,
kernels/linear.h). The table notes the load average before and after: on a shared machine other processes skew all
sides.
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

# goal_eager / goal_compile: issue 18's goals for LoongForge's tokens/s over PyTorch eager / torch.compile
SHAPES = [
    dict(name="d256 L4 h8 kv4 ffn688 V8192, 8x256", d=256, layers=4, heads=8, kv=4, ffn=688, vocab=8192, batch=8, seq=256,
         goal_eager=1.5, goal_compile=1.2),
    dict(name="d512 L8 h8 kv8 ffn1376 V16384, 4x512", d=512, layers=8, heads=8, kv=8, ffn=1376, vocab=16384, batch=4,
         seq=512, goal_eager=1.2, goal_compile=1.0),
]


def torch_reference(shape, steps, warmup, threads, compile_mode=None):
    """tokens/s of the Python reference (median step time), eager or compiled (compile_mode: a torch.compile mode).
    Returns dict(tok_s, losses (every step, warm-up included), compile_s (compiled: warm-up time beyond steady-state
    steps), warmup (steps taken as warm-up), recompiled (graphs compiled during the timed steps))."""
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

    def loss_fn(ids):
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, shape["vocab"]), ids[:, 1:].reshape(-1))

    def opt_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    graphs = lambda: 0  # noqa: E731
    if compile_mode:
        import torch._inductor.config
        from torch._dynamo.utils import counters
        # inductor writes the thread count into its OpenMP kernels, but its on-disk cache does not key on
        # torch.get_num_threads(): set it in the config (which is keyed), or a cached 2-thread kernel runs at --threads 1
        torch._inductor.config.cpp.threads = threads
        torch._dynamo.reset()  # a fresh model each round: no stale cache entries (the on-disk kernel cache stays)
        loss_fn = torch.compile(loss_fn, mode=compile_mode)
        opt_step = torch.compile(opt_step, mode=compile_mode)
        graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    data = torch.Generator().manual_seed(1)  # a generator of its own: the same batches for eager and compile
    times, losses, warm, recompiled, i = [], [], [], 0, 0
    while len(times) < steps:
        ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=data)
        g0 = graphs()
        t0 = time.perf_counter()
        loss = loss_fn(ids)
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        compiled_now = graphs() - g0
        # warm-up: the first `warmup` steps, and a compiled run's steps until one compiles nothing
        if len(times) == 0 and (i < warmup or compiled_now):
            warm.append(dt)
        else:
            times.append(dt)
            recompiled += compiled_now
        i += 1
    med = statistics.median(times)
    return dict(tok_s=shape["batch"] * shape["seq"] / med, losses=losses, warmup=len(warm), recompiled=recompiled,
                compile_s=sum(warm) - len(warm) * med if compile_mode else 0.0)


def write_random_shard(prefix, vocab, n_tokens, docs=64):
    """A token shard of random ids in 64 documents (the .bin/.idx layout of docs/data_format.md)."""
    import numpy as np
    np.random.default_rng(0).integers(0, vocab, n_tokens, dtype=np.uint16).tofile(f"{prefix}.bin")
    offsets = np.linspace(0, n_tokens, docs + 1).astype(np.uint64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"LFIDX\0\0\0")
        f.write(np.array([1, 2], dtype=np.uint32).tobytes())
        f.write(np.array([docs, n_tokens], dtype=np.uint64).tobytes())
        f.write(offsets.tobytes())


def loongforge_run(shape, steps, warmup, threads, tmp):
    tmp = pathlib.Path(tmp)
    cfg = {"model_type": "llama", "vocab_size": shape["vocab"], "hidden_size": shape["d"],
           "intermediate_size": shape["ffn"], "num_hidden_layers": shape["layers"],
           "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv"],
           "max_position_embeddings": shape["seq"] + 1, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    (tmp / "model.json").write_text(json.dumps(cfg))
    write_random_shard(tmp / "rand", shape["vocab"], (warmup + steps + 2) * shape["batch"] * (shape["seq"] + 1) * 2)
    return train_tokens_per_s(tmp, f"{{config: {tmp / 'model.json'}}}", shape, steps, warmup, threads)


def train_tokens_per_s(tmp, model, shape, steps, warmup, threads):
    """`loongforge train` of `model` (the recipe's model value) on the random shard tmp/rand (write_random_shard):
    tokens/s at the median step time after the warm-up steps."""
    recipe = tmp / "bench.yaml"
    recipe.write_text(f"""
output_dir: {tmp / 'run'}
model: {model}
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


def fmt_ratio(x, goal):
    return f"{x:.2f}x (>= {goal}x: {'met' if x >= goal else 'not met'})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5,
                    help="run LoongForge, eager and compile this many times per shape; the table shows the medians")
    ap.add_argument("--compile", default="default",
                    help="torch.compile mode of the compile column (default, max-autotune-no-cudagraphs, ...); off: none")
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    sides = ["loongforge", "eager"] + (["compile"] if a.compile != "off" else [])
    compile_error = None if a.compile != "off" else "off (--compile off)"
    rows, notes = [], []
    load_before = os.getloadavg()[0]
    for shape in SHAPES:
        res = {k: [] for k in sides}
        for rnd in range(a.rounds):
            # each round runs every side once, the order rotating: a slow spell of a noisy machine hits all sides alike
            for side in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
                if side == "loongforge":
                    with tempfile.TemporaryDirectory() as tmp:
                        res[side].append(dict(tok_s=loongforge_run(shape, a.steps, a.warmup, a.threads, tmp)))
                elif side == "eager":
                    res[side].append(torch_reference(shape, a.steps, a.warmup, a.threads))
                elif compile_error is None:
                    try:
                        res[side].append(torch_reference(shape, a.steps, a.warmup, a.threads, compile_mode=a.compile))
                    except Exception as e:  # no C++ compiler, an inductor failure: say why, keep the other columns
                        msg = " ".join(f"{type(e).__name__}: {e}".split()).split(" Set TORCHDYNAMO_VERBOSE")[0]
                        compile_error = "failed: " + (msg[:200] + " ..." if len(msg) > 200 else msg)
                        print(f"torch.compile {compile_error}", file=sys.stderr)
            ours, eag = res["loongforge"][-1]["tok_s"], res["eager"][-1]["tok_s"]
            line = f"{shape['name']}: loongforge {ours:,.0f} tok/s, eager {eag:,.0f} ({ours / eag:.2f}x)"
            if len(res.get("compile", [])) == rnd + 1:
                c = res["compile"][-1]
                line += (f", compile {c['tok_s']:,.0f} ({ours / c['tok_s']:.2f}x; {c['warmup']} warm-up steps, "
                         f"compiling ~{c['compile_s']:.0f} s)")
            print(line, file=sys.stderr)
        med = {k: statistics.median(r["tok_s"] for r in v) if v else None for k, v in res.items()}
        # each round's runs share the machine's state: per-round ratios
        paired = {k: sorted(o["tok_s"] / r["tok_s"] for o, r in zip(res["loongforge"], v))
                  for k, v in res.items() if k != "loongforge" and v}
        rows.append((shape, med, paired))
        if res.get("compile"):
            e, c = res["eager"][-1]["losses"], res["compile"][-1]["losses"]
            n = min(len(e), len(c))
            diff = max(abs(x - y) for x, y in zip(e[:n], c[:n]))
            notes.append(f"- {shape['name']}: losses of the last round, step 1 / step {n}: eager {e[0]:.5f} / {e[n - 1]:.5f}, "
                         f"compile {c[0]:.5f} / {c[n - 1]:.5f}; max |difference| over the {n} steps {diff:.1e}. "
                         f"Compiling (warm-up time beyond steady-state steps) per round: "
                         + ", ".join(f"{r['compile_s']:.0f} s" for r in res["compile"])
                         + f"; warm-up steps {'/'.join(str(r['warmup']) for r in res['compile'])}"
                         + (f"; RECOMPILED during timed steps: {sum(r['recompiled'] for r in res['compile'])} graphs"
                            if any(r["recompiled"] for r in res["compile"]) else ""))
    lines = [f"CPU training, fp32, {a.threads} threads, median of {a.rounds} round{'s' if a.rounds != 1 else ''} ({', '.join(sides)} in turn, order rotating) "
             f"of {a.steps} steps after {a.warmup} warm-up each "
             f"(torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs ({cpu_model()}), 1-min load average "
             f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after"
             + (", LOONGFORGE_SPLIT_GEMM=" + os.environ["LOONGFORGE_SPLIT_GEMM"] if "LOONGFORGE_SPLIT_GEMM" in os.environ else "")
             + ")", "",
             "| shape (batch x seq) | LoongForge tok/s | PyTorch eager tok/s | torch.compile tok/s | vs eager (goal) "
             "| vs compile (goal) | per-round vs eager | per-round vs compile |",
             "|---|---|---|---|---|---|---|---|"]
    for shape, med, paired in rows:
        ours, eag, comp = med["loongforge"], med["eager"], med.get("compile")
        pr = lambda k: " ".join(f"{p:.2f}" for p in paired[k]) if k in paired else "-"  # noqa: E731
        lines.append(f"| {shape['name']} | {ours:,.0f} | {eag:,.0f} | "
                     + (f"{comp:,.0f}" if comp else "n/a") + f" | {fmt_ratio(ours / eag, shape['goal_eager'])} | "
                     + (fmt_ratio(ours / comp, shape["goal_compile"]) if comp else f"n/a (>= {shape['goal_compile']}x: not measured)")
                     + f" | {pr('eager')} | {pr('compile')} |")
    lines.append("")
    if compile_error:
        lines.append(f"torch.compile: {compile_error}")
    if a.compile != "off" and notes:
        lines.append(f"torch.compile (mode {a.compile}, inductor): the loss (forward + cross-entropy; backward via "
                     "AOTAutograd) and the clipping + AdamW step; warm-up until a step compiles nothing.")
    lines += notes
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)


if __name__ == "__main__":
    main()

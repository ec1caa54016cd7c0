"""GPU training throughput (issue 4): LoongForge (`loongforge train`, device cuda, bf16) against PyTorch in Python on
the same GPU in the same call: transformers' LlamaForCausalLM (attn_implementation="sdpa") with bf16 autocast and
torch.optim.AdamW(fused=True), eager and torch.compile. Random tokens, fp32 master weights on both sides, gradient
clipping at 1.0 on both sides, a few warm-up steps, then timed steps.

Prints a table (tokens/s, MFU, peak memory, LoongForge / eager and / compile) and writes JSON (--out). Every run is
its own process (clean peak memory, a crash or timeout costs one row); runs are skipped once --budget seconds are
spent, and the table says so.

    python3 bench/gpu_train.py --lf build-gpu/loongforge [--shapes small,1b] [--steps 8 --warmup 3] [--budget 240]
                               [--out DIR] [--fp8] [--curves]
    # the CPU-side logic with a tiny shape (no GPU needed; torch.compile on the CPU takes minutes, so without it):
    .venv/bin/python bench/gpu_train.py --lf build/loongforge --device cpu --shapes tiny --steps 2 --warmup 1 \
        --runs loongforge,eager --curves

MFU: 6 * parameters + 12 * layers * heads * head_dim * seq FLOPs per token (the trainer's formula, embeddings
included) over the H200's dense bf16 peak, 989 TFLOP/s (--peak-tflops; the issue's measured GEMM ceiling is 742).
--curves: fp32 vs bf16 loss curves of LoongForge on the small shape (200 steps, batch 4; same data and init), the
issue's "within 1 %" check. --fp8: LoongForge with precision: fp8 too (the issue wants >= 1.3x bf16 on the 1B shape).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

SHAPES = {
    "small": dict(name="d768 L12 h12 ffn3072 V32000 untied, 16x1024", d=768, layers=12, heads=12, kv=12, ffn=3072,
                  vocab=32000, tied=False, batch=16, seq=1024, goal=450e3),
    "1b": dict(name="Llama-3.2-1B shape (d2048 L16 h32 kv8 ffn8192 V128256 tied), 4x2048", d=2048, layers=16,
               heads=32, kv=8, ffn=8192, vocab=128256, tied=True, batch=4, seq=2048, goal=65e3),
    "tiny": dict(name="tiny (CPU check) d64 L2 h4 kv2 ffn128 V512, 2x64", d=64, layers=2, heads=4, kv=2, ffn=128,
                 vocab=512, tied=False, batch=2, seq=64, goal=0),
}


def hf_config(s):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["d"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv"],
        "intermediate_size": s["ffn"], "vocab_size": s["vocab"], "tie_word_embeddings": s["tied"],
        "max_position_embeddings": max(2048, s["seq"]), "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
    }


def n_params(s):
    d, hd = s["d"], s["d"] // s["heads"]
    per_layer = d * (s["heads"] * hd) * 2 + d * (s["kv"] * hd) * 2 + 3 * d * s["ffn"] + 2 * d
    emb = s["vocab"] * d * (1 if s["tied"] else 2)
    return s["layers"] * per_layer + emb + d


def flops_per_token(s):
    return 6 * n_params(s) + 12 * s["layers"] * s["heads"] * (s["d"] // s["heads"]) * s["seq"]


# ---- PyTorch side (runs in a child process: --worker torch) ---------------------------------------------------------
def torch_worker(a):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[a.shape]
    dev = torch.device(a.device)
    torch.manual_seed(0)
    cfg = LlamaConfig(**hf_config(s), attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(dev)  # fp32 masters
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    model.train()
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused)
    fwd = torch.compile(model) if a.mode == "compile" else model
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, s["vocab"], (4, s["batch"], s["seq"]), generator=g)
    batches = [b.pin_memory().to(dev, non_blocking=True) if fused else b.to(dev) for b in data]

    def step(i):
        x = batches[i % len(batches)]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = fwd(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if fused else (lambda: None)
    t_warm = time.time()
    for i in range(a.warmup):
        loss = step(i)
    sync()
    warm_s = time.time() - t_warm
    if fused:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for i in range(a.steps):
        loss = step(a.warmup + i)
    sync()
    dt = time.time() - t0
    out = {"tokens_per_s": a.steps * s["batch"] * s["seq"] / dt, "final_loss": float(loss.item()),
           "warmup_s": warm_s, "timed_s": dt,
           "max_memory_allocated": torch.cuda.max_memory_allocated() if fused else None}
    print("RESULT " + json.dumps(out), flush=True)


# ---- LoongForge side ------------------------------------------------------------------------------------------------
def write_inputs(s, work, rows=64):
    """config.json and a batch file of random tokens (format: batch cycles over its rows)."""
    import torch
    from safetensors.torch import save_file

    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(hf_config(s)))
    g = torch.Generator().manual_seed(1)
    save_file({"input_ids": torch.randint(0, s["vocab"], (rows, s["seq"]), generator=g)}, str(work / "batch.safetensors"))


def lf_recipe(s, work, out_dir, device, precision, steps, batch):
    return f"""output_dir: {out_dir}
seed: 0
device: {device}
precision: {precision}
model:
  config: {work / 'config.json'}
data:
  format: batch
  train:
    - path: {work / 'batch.safetensors'}
  seq_len: {s['seq']}
train:
  steps: {steps}
  micro_batch_size: {batch}
optim:
  lr: 3.0e-4
  beta1: 0.9
  beta2: 0.95
  weight_decay: 0.1
  clip: 1.0
schedule:
  kind: constant
checkpoint:
  every: 0
log:
  progress: lines
  tensorboard: false
  plot: false
"""


def run_lf(a, s, work, tag, precision, steps, warmup, batch, timeout):
    """Runs `loongforge train` and stops it once metrics.jsonl has every step (the final checkpoint of a 1B model
    would write ~15 GB). Returns tokens/s over the steps after the warm-up, peak memory, losses."""
    out_dir = work / f"run-{tag}"
    recipe = work / f"{tag}.yaml"
    recipe.write_text(lf_recipe(s, work, out_dir, a.device, precision, steps, batch))
    metrics = out_dir / "metrics.jsonl"
    log = open(work / f"{tag}.log", "w")
    t0 = time.time()
    proc = subprocess.Popen([a.lf, "train", str(recipe)], stdout=log, stderr=subprocess.STDOUT)
    lines = []
    while True:
        rc = proc.poll()
        if metrics.exists():
            lines = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
        if len(lines) >= steps or rc is not None:
            break
        if time.time() - t0 > timeout:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"timeout after {timeout:.0f} s with {len(lines)}/{steps} steps (see {log.name})")
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()  # the steps are done: skip the final save
    proc.wait()
    log.close()
    if len(lines) < steps:
        text = (work / f"{tag}.log").read_text()
        errs = [l for l in text.splitlines() if l.startswith("loongforge:")]  # the one-line error, if any
        raise RuntimeError(f"exited with {proc.returncode} after {len(lines)}/{steps} steps: "
                           + (errs[-1] if errs else text[-300:].replace("\n", " / ")))
    timed = lines[warmup:]
    tokens = sum(batch * s["seq"] for _ in timed)
    secs = sum(l["step_time_s"] for l in timed)
    note = [l for l in (work / f"{tag}.log").read_text().splitlines() if l.startswith("loongforge: device")]
    return {"tokens_per_s": tokens / secs, "final_loss": lines[-1]["loss"], "timed_s": secs,
            "warmup_s": sum(l["step_time_s"] for l in lines[:warmup]),
            "max_memory_allocated": max((l.get("max_memory_allocated", 0) for l in lines), default=0) or None,
            "losses": [l["loss"] for l in lines], "device_note": note[0] if note else None}


def run_torch(a, shape, mode, timeout):
    cmd = [sys.executable, __file__, "--worker", "torch", "--shape", shape, "--mode", mode, "--device", a.device,
           "--steps", str(a.steps), "--warmup", str(a.warmup)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for l in p.stdout.splitlines():
        if l.startswith("RESULT "):
            return json.loads(l[7:])
    raise RuntimeError(f"rc {p.returncode}: " + (p.stderr or p.stdout)[-600:].replace("\n", " | "))


def gib(b):
    return f"{b / 2**30:.1f}" if b else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["torch"], help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    ap.add_argument("--lf", default=os.environ.get("LOONGFORGE_BIN", str(ROOT / "build-gpu" / "loongforge")))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", default="small,1b")
    ap.add_argument("--runs", default="loongforge,eager,compile", help="which runs per shape (comma list)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=float, default=600, help="seconds for all runs; later runs are skipped")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--curves", action="store_true")
    ap.add_argument("--out", default=None, help="folder for gpu_train.json / gpu_train.md")
    a = ap.parse_args()
    if a.worker:
        return torch_worker(a)

    t_start = time.time()
    left = lambda: a.budget - (time.time() - t_start)
    work = pathlib.Path(tempfile.mkdtemp(prefix="lf-gpu-train-"))
    results = []
    plan = []
    for sh in a.shapes.split(","):
        plan += [(sh, m) for m in a.runs.split(",")]
        if a.fp8:
            plan.append((sh, "loongforge-fp8"))
    if a.curves:
        plan.append(("small" if a.device == "cuda" else "tiny", "curves"))
    # Rough seconds a run needs (startup, compile); a run starts only if that much budget is left.
    need = {"loongforge": 25, "loongforge-fp8": 25, "eager": 25, "compile": 90, "curves": 120}
    for sh, mode in plan:
        s = SHAPES[sh]
        row = {"shape": sh, "name": s["name"], "mode": mode}
        results.append(row)
        if left() < need[mode] * (0.2 if a.device == "cpu" else 1):
            row["status"] = "skipped (time budget)"
            continue
        t0 = time.time()
        try:
            if not (work / sh / "config.json").exists():
                write_inputs(s, work / sh)
            if mode.startswith("loongforge"):
                prec = "fp8" if mode.endswith("fp8") else "bf16"
                row.update(run_lf(a, s, work / sh, mode, prec, a.warmup + a.steps, a.warmup, s["batch"], left()))
                row.pop("losses", None)
            elif mode == "curves":
                n = 200 if a.device == "cuda" else 10
                c32 = run_lf(a, s, work / sh, "curve-fp32", "fp32", n, 0, 4, left())
                c16 = run_lf(a, s, work / sh, "curve-bf16", "bf16", n, 0, 4, left())
                l32, l16 = c32["losses"], c16["losses"]
                rel = [abs(x - y) / abs(x) for x, y in zip(l32, l16)]
                # averaged over windows of 10 steps (single steps are noisy), as a loss curve is read
                w = [abs(sum(l16[i:i + 10]) - sum(l32[i:i + 10])) / abs(sum(l32[i:i + 10])) for i in range(0, n, 10)]
                row.update({"steps": n, "max_rel_step": max(rel), "max_rel_10step_mean": max(w),
                            "final_fp32": l32[-1], "final_bf16": l16[-1], "within_1pct": max(w) <= 0.01})
            else:
                row.update(run_torch(a, sh, mode, left()))
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - a failed run is a row of the table, the others go on
            row["status"] = "FAIL: " + str(e)[:300].replace("|", "/").replace("\n", " / ")
        row["wall_s"] = round(time.time() - t0, 1)
        if "tokens_per_s" in row:
            row["mfu"] = flops_per_token(s) * row["tokens_per_s"] / (a.peak_tflops * 1e12)
        print(f"[{time.time() - t_start:5.0f} s] {sh} {mode}: {row['status']}"
              + (f" {row['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in row else ""), flush=True)

    # ---- table ----
    lines = [f"GPU training, {a.steps} timed steps after {a.warmup} warm-up; MFU vs {a.peak_tflops:.0f} TFLOP/s "
             f"dense bf16 ({'H200 spec' if a.peak_tflops == 989 else 'given'}); flops/token = 6N + 12 L H hd T", "",
             "| shape | run | tok/s | MFU | peak GiB | vs eager | vs compile | status |",
             "|---|---|---|---|---|---|---|---|"]
    for sh in dict.fromkeys(r["shape"] for r in results):
        rows = [r for r in results if r["shape"] == sh and r["mode"] != "curves"]
        ref = {r["mode"]: r.get("tokens_per_s") for r in rows}
        for r in rows:
            tps = r.get("tokens_per_s")
            ratio = lambda m: f"{tps / ref[m]:.2f}x" if tps and ref.get(m) else "-"
            lines.append(f"| {r['name']} | {r['mode']} | {tps:.0f} | {r['mfu'] * 100:.1f} % | "
                         f"{gib(r.get('max_memory_allocated'))} | {ratio('eager')} | {ratio('compile')} | {r['status']} |"
                         if tps else f"| {r['name']} | {r['mode']} | - | - | - | - | - | {r['status']} |")
        goal = SHAPES[sh]["goal"]
        if goal and ref.get("loongforge"):
            lines.append(f"| | goal >= {goal / 1e3:.0f}k tok/s | {'met' if ref['loongforge'] >= goal else 'not met'} | | | | | |")
    for r in results:
        if r["mode"] == "curves":
            lines.append("")
            lines.append(f"fp32 vs bf16 loss curves ({r['name']}, batch 4): " + (
                f"{r['steps']} steps, max rel. difference of 10-step means {r['max_rel_10step_mean'] * 100:.2f} % "
                f"(single steps {r['max_rel_step'] * 100:.2f} %), final {r['final_fp32']:.4f} vs {r['final_bf16']:.4f}: "
                f"{'within 1 %' if r['within_1pct'] else 'NOT within 1 %'}" if r["status"] == "ok" else r["status"]))
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_train.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
        (out / "gpu_train.md").write_text(table + "\n")
    ok = all(r["status"] in ("ok",) or r["status"].startswith("skipped") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

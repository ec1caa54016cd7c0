"""GPU training throughput (issues 4 and 6): LoongForge (`loongforge train`, device cuda, bf16) against PyTorch in
Python on the same GPU in the same call: transformers' LlamaForCausalLM (attn_implementation="sdpa") with bf16 autocast
and torch.optim.AdamW(fused=True), eager and torch.compile. Random tokens, fp32 master weights on both sides, gradient
clipping at 1.0 on both sides, a few warm-up steps, then timed steps.

MoE (issue 6, shape "moe"; "tiny_moe" checks it on the CPU): a Qwen3-MoE model (d1024 L8 h16 kv4 head_dim 64, 64
experts top-8, expert ffn 512, norm_topk_prob, every layer sparse, V32000 untied, 8x1024). The reference is
transformers' Qwen3MoeForCausalLM (AutoModelForCausalLM.from_config, sdpa; its experts use transformers' default
experts_implementation, "grouped_mm" where torch supports it, and the row records which one ran; runs
"eager-loop" / "compile-loop" force experts_implementation="eager", the per-expert Python loop), same autocast, fused
AdamW and clipping. Both sides add the load-balancing loss, router_aux_loss_coef 0.001 x aux: config.json sets
output_router_logits=True, since transformers' default (False) skips the aux loss, while LoongForge takes the
coefficient from router_aux_loss_coef (recipe moe.aux_loss_coef -1). Goal: LoongForge >= 2 x 54.9k tok/s (the
issue's transformers-eager figure on an H200 with PyTorch 2.11); the table also gives the ratio to the eager run
measured in the same call.

Prints a table (tokens/s, MFU, peak memory, LoongForge / eager and / compile) and writes JSON (--out). Every run is
its own process (clean peak memory, a crash or timeout costs one row); runs are skipped once --budget seconds are
spent, and the table says so.

    python3 bench/gpu_train.py --lf build-gpu/loongforge [--shapes small,1b,moe] [--steps 8 --warmup 3] [--budget 240]
                               [--out DIR] [--fp8] [--curves]
    # the CPU-side logic with a tiny shape (no GPU needed; torch.compile on the CPU takes minutes, so without it):
    .venv/bin/python bench/gpu_train.py --lf build/loongforge --device cpu --shapes tiny --steps 2 --warmup 1 \
        --runs loongforge,eager --curves
    .venv/bin/python bench/gpu_train.py --lf build/loongforge --device cpu --shapes tiny_moe --steps 2 --warmup 1 \
        --runs loongforge,eager

MFU: 6 * parameters + 12 * layers * heads * head_dim * seq FLOPs per token (the trainer's formula, embeddings
included; for MoE the ACTIVE parameters: router + top_k experts per MoE layer, as `loongforge info` and the trainer
count them; the script checks its count against `loongforge info` on the generated config.json) over the H200's
dense bf16 peak, 989 TFLOP/s (--peak-tflops; the issue's measured GEMM ceiling is 742).
--curves: fp32 vs bf16 loss curves of LoongForge on the small shape (200 steps, batch 4; same data and init), the
issue's "within 1 %" check. --fp8: LoongForge with precision: fp8 too (the issue wants >= 1.3x bf16 on the 1B shape);
--fp8-blockwise: and with fp8_scaling: blockwise. --graphs: LoongForge bf16 with train.cuda_graphs: true too (row
"loongforge-graphs", dense shapes; after the torch.compile runs).
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
    # issue 6: goal 2 x the 54.9k tok/s of transformers eager on an H200 (PyTorch 2.11)
    "moe": dict(name="Qwen3-MoE shape (d1024 L8 h16 kv4 hd64, 64 experts top-8 ffn512, V32000 untied), 8x1024",
                family="qwen3_moe", d=1024, layers=8, heads=16, kv=4, head_dim=64, ffn=3072, experts=64, top_k=8,
                moe_ffn=512, vocab=32000, tied=False, batch=8, seq=1024, goal=2 * 54.9e3,
                goal_note="2 x the issue's 54.9k of HF eager"),
    "tiny_moe": dict(name="tiny MoE (CPU check) d64 L2 h4 kv2 hd16, 8 experts top-2 ffn32, V512, 2x64",
                     family="qwen3_moe", d=64, layers=2, heads=4, kv=2, head_dim=16, ffn=128, experts=8, top_k=2,
                     moe_ffn=32, vocab=512, tied=False, batch=2, seq=64, goal=0),
    # the MoE row scaled down for a CPU comparison (same experts / top-k / expert-ffn proportions)
    "cpu_moe": dict(name="CPU MoE d256 L4 h8 kv4 hd32, 32 experts top-4 ffn128, V8192, 4x256",
                    family="qwen3_moe", d=256, layers=4, heads=8, kv=4, head_dim=32, ffn=768, experts=32, top_k=4,
                    moe_ffn=128, vocab=8192, tied=False, batch=4, seq=256, goal=0),
}


def is_moe(s):
    return s.get("family") == "qwen3_moe"


def head_dim(s):
    return s.get("head_dim", s["d"] // s["heads"])


def hf_config(s):
    if is_moe(s):
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": s["d"],
            "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv"],
            "head_dim": s["head_dim"], "intermediate_size": s["ffn"],  # unused: every layer is sparse
            "num_experts": s["experts"], "num_experts_per_tok": s["top_k"], "moe_intermediate_size": s["moe_ffn"],
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001, "output_router_logits": True,  # both sides add the load-balancing loss
            "vocab_size": s["vocab"], "tie_word_embeddings": s["tied"], "attention_bias": False,
            "max_position_embeddings": max(2048, s["seq"]), "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
        }
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["d"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv"],
        "intermediate_size": s["ffn"], "vocab_size": s["vocab"], "tie_word_embeddings": s["tied"],
        "max_position_embeddings": max(2048, s["seq"]), "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
    }


def n_params(s, active=True):
    """Parameters; for MoE (every layer sparse) the active ones by default: router + top_k experts per layer."""
    d, hd = s["d"], head_dim(s)
    attn = d * (s["heads"] * hd) * 2 + d * (s["kv"] * hd) * 2
    if is_moe(s):
        attn += 2 * hd  # Qwen3's q_norm / k_norm
        mlp = d * s["experts"] + (s["top_k"] if active else s["experts"]) * 3 * d * s["moe_ffn"]
    else:
        mlp = 3 * d * s["ffn"]
    emb = s["vocab"] * d * (1 if s["tied"] else 2)
    return s["layers"] * (attn + mlp + 2 * d) + emb + d


def flops_per_token(s):
    return 6 * n_params(s) + 12 * s["layers"] * s["heads"] * head_dim(s) * s["seq"]


def check_params(lf, s, work):
    """`loongforge info` on the generated config.json against n_params: (ours, info's active, info's total)."""
    p = subprocess.run([lf, "info", str(work / "config.json")], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"loongforge info: rc {p.returncode}: {(p.stderr or p.stdout)[-300:]}")
    info = json.loads(p.stdout)
    got = (n_params(s), info["active_parameters"], info["parameters"])
    if got[1] != got[0] or got[2] != n_params(s, active=False) or \
            info["train_flops_per_token_excl_attention"] != 6 * got[1]:
        raise RuntimeError(f"parameter count mismatch: script {got[0]} active / {n_params(s, active=False)} total, "
                           f"loongforge info {json.dumps(info)}")
    return got


# ---- PyTorch side (runs in a child process: --worker torch) ---------------------------------------------------------
def torch_worker(a):
    import torch

    s = SHAPES[a.shape]
    dev = torch.device(a.device)
    torch.manual_seed(0)
    experts_impl = None
    if is_moe(s):
        from transformers import AutoConfig, AutoModelForCausalLM
        c = dict(hf_config(s))
        cfg = AutoConfig.for_model(c.pop("model_type"), **c)
        kw = {"experts_implementation": "eager"} if a.mode.endswith("-loop") else {}
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", **kw).to(dev)  # fp32 masters
        assert type(model).__name__ == "Qwen3MoeForCausalLM", type(model).__name__
        assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.001
        experts_impl = model.config._experts_implementation
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(**hf_config(s), attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).to(dev)  # fp32 masters
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    n_model = sum(p.numel() for p in model.parameters())
    assert n_model == n_params(s, active=False), (n_model, n_params(s, active=False))
    model.train()
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused)
    fwd = torch.compile(model) if a.mode.startswith("compile") else model
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, s["vocab"], (4, s["batch"], s["seq"]), generator=g)
    batches = [b.pin_memory().to(dev, non_blocking=True) if fused else b.to(dev) for b in data]

    def step(i):
        x = batches[i % len(batches)]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            o = fwd(input_ids=x, labels=x)
        if is_moe(s) and i == 0:
            assert o.aux_loss is not None, "no load-balancing loss: output_router_logits is off"
        loss = o.loss
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
    if experts_impl:
        out["hf_experts_implementation"] = experts_impl
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


def lf_recipe(s, work, out_dir, device, precision, steps, batch, graphs=False):
    # "fp8-block": precision fp8 with blockwise scales
    scaling = "blockwise" if precision == "fp8-block" else "tensorwise"
    precision = "fp8" if precision == "fp8-block" else precision
    return f"""output_dir: {out_dir}
seed: 0
device: {device}
precision: {precision}
fp8_scaling: {scaling}
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
  cuda_graphs: {'true' if graphs else 'false'}
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
    recipe.write_text(lf_recipe(s, work, out_dir, a.device, precision, steps, batch, graphs=tag.endswith("-graphs")))
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
    ap.add_argument("--shapes", default="small,1b,moe", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--runs", default="loongforge,eager,compile",
                    help="which runs per shape (comma list; MoE shapes also take eager-loop, compile-loop: "
                         "transformers' per-expert loop instead of its default grouped_mm experts); compile runs go "
                         "last, after every shape's other runs, so a short budget skips them first")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=float, default=600, help="seconds for all runs; later runs are skipped")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--fp8-blockwise", action="store_true", help="LoongForge with fp8_scaling: blockwise too")
    ap.add_argument("--graphs", action="store_true", help="LoongForge bf16 with train.cuda_graphs: true too")
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
    shapes = a.shapes.split(",")
    for sh in shapes:
        if sh not in SHAPES:
            ap.error(f"--shapes: unknown shape '{sh}' (known: {', '.join(SHAPES)})")
    runs = [m for m in a.runs.split(",") if not m.startswith("compile")]
    for sh in shapes:
        plan += [(sh, m) for m in runs if is_moe(SHAPES[sh]) or not m.endswith("-loop")]
        if a.fp8:
            plan.append((sh, "loongforge-fp8"))
        if a.fp8_blockwise:
            plan.append((sh, "loongforge-fp8-block"))
    # torch.compile runs (minutes of compiling each) after every shape's LoongForge and eager runs
    plan += [(sh, m) for sh in shapes for m in a.runs.split(",")
             if m.startswith("compile") and (is_moe(SHAPES[sh]) or not m.endswith("-loop"))]
    if a.graphs:  # CUDA graphs capture dense steps only (an MoE step sends its expert counts to the host)
        plan += [(sh, "loongforge-graphs") for sh in shapes if not is_moe(SHAPES[sh])]
    if a.curves:
        plan.append(("small" if a.device == "cuda" else "tiny", "curves"))
    # Rough seconds a run needs (startup, compile); a run starts only if that much budget is left.
    need = {"loongforge": 25, "loongforge-graphs": 25, "loongforge-fp8": 25, "loongforge-fp8-block": 25, "eager": 25, "compile": 90, "curves": 120, "eager-loop": 40,
            "compile-loop": 120}
    params = {}  # shape -> (script's active count, loongforge info's active, info's total), or the error
    for sh, mode in plan:
        s = SHAPES[sh]
        row = {"shape": sh, "name": s["name"], "mode": mode}
        results.append(row)
        if left() < need[mode] * (0.2 if a.device == "cpu" else 1):
            row["status"] = "skipped (time budget)"
            continue
        if mode == "loongforge-graphs" and a.device != "cuda":
            row["status"] = "skipped (CUDA graphs need device cuda)"
            continue
        t0 = time.time()
        try:
            if not (work / sh / "config.json").exists():
                write_inputs(s, work / sh)
            if sh not in params:
                try:
                    params[sh] = check_params(a.lf, s, work / sh)
                except Exception as e:  # noqa: BLE001 - reported under the table; fatal on the CPU check
                    params[sh] = str(e)[:300]
                    if a.device == "cpu":
                        raise
            if mode.startswith("loongforge"):
                prec = {"loongforge-fp8": "fp8", "loongforge-fp8-block": "fp8-block"}.get(mode, "bf16")
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
        if row.get("hf_experts_implementation") and row["status"] == "ok":
            row["status"] = f"ok (HF experts: {row['hf_experts_implementation']})"
        print(f"[{time.time() - t_start:5.0f} s] {sh} {mode}: {row['status']}"
              + (f" {row['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in row else ""), flush=True)

    # ratios and goals into the rows too (bench/gpu_check.sh's summary reads them from the JSON)
    for r in results:
        ref = {q["mode"]: q.get("tokens_per_s") for q in results if q["shape"] == r["shape"]}
        tps = r.get("tokens_per_s")
        for m in ("eager", "compile"):
            if tps and ref.get(m) and r["mode"] != m:
                r[f"vs_{m}"] = tps / ref[m]
        if r["mode"] in ("loongforge", "loongforge-graphs") and SHAPES[r["shape"]]["goal"]:
            r["goal_tokens_per_s"] = SHAPES[r["shape"]]["goal"]
            r["goal_met"] = bool(tps and tps >= r["goal_tokens_per_s"])

    # ---- table ----
    lines = [f"GPU training, {a.steps} timed steps after {a.warmup} warm-up; MFU vs {a.peak_tflops:.0f} TFLOP/s "
             f"dense bf16 ({'H200 spec' if a.peak_tflops == 989 else 'given'}); flops/token = 6N + 12 L H hd T "
             f"(MoE: N = active parameters)", "",
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
        best = max((ref.get(m) or 0 for m in ("loongforge", "loongforge-graphs")), default=0)
        if goal and best:
            note = f" ({SHAPES[sh]['goal_note']})" if SHAPES[sh].get("goal_note") else ""
            lines.append(f"| | goal >= {goal / 1e3:.1f}k tok/s{note} | {'met' if best >= goal else 'not met'}"
                         f" | | | | | |")
    lines.append("")
    for sh, v in params.items():
        lines.append(f"{sh}: " + (f"N = {v[0] / 1e6:.2f} M {'active ' if is_moe(SHAPES[sh]) else ''}parameters "
                                  f"(loongforge info: {v[1] / 1e6:.2f} M active of {v[2] / 1e6:.2f} M: "
                                  f"{'match' if v[0] == v[1] else 'MISMATCH'}), {flops_per_token(SHAPES[sh]) / 1e9:.2f}"
                                  f" GFLOP/token" if isinstance(v, tuple) else f"parameter check failed: {v}"))
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
        (out / "gpu_train.json").write_text(json.dumps({"args": vars(a), "results": results, "params": {
            sh: dict(zip(("script_active", "info_active", "info_total"), v)) if isinstance(v, tuple) else {"error": v}
            for sh, v in params.items()}}, indent=1))
        (out / "gpu_train.md").write_text(table + "\n")
    ok = all(r["status"].startswith(("ok", "skipped")) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""CPU training step of a small Qwen3-Next-shaped model (Gated DeltaNet linear attention + gated full attention, MoE
with a gated shared expert) or, with --family kimi_linear, a Kimi-Linear-shaped one (KDA linear attention + latent
attention, MoE with a shared expert): LoongForge (`loongforge train`) against transformers' own class (its torch
chunk-wise delta rule: fla / causal-conv1d are not installed) trained with torch.optim.AdamW, same weights, shapes,
thread count, fp32, in one run. Prints a table of tokens/s per training step (forward + backward + AdamW) and
LoongForge's ratio; with --out, writes it as markdown too.

    [LOONGFORGE_BIN=build/loongforge] .venv/bin/python bench/qwen3_next_cpu.py [--family qwen3_next|kimi_linear]
        [--threads 2] [--steps 6] [--rounds 3] [--out FILE.md]

Each round runs both sides once per shape (the order alternating), the table shows medians over the rounds.
"""
import argparse
import os
import pathlib
import statistics
import tempfile
import time

# (LOONGFORGE_BIN: as bench/cpu_train.py, whose recipe runner this uses)

COMMON = dict(max_position_embeddings=4096, rms_norm_eps=1e-6, head_dim=64, linear_conv_kernel_dim=4,
              linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=False)
SHAPES = [
    dict(name="moe: d256 L4 (3 linear + 1 full) E16 top4, 4x256", batch=4, seq=256, goal=1.5,
         cfg=dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8, num_experts=16,
                  num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=256)),
    dict(name="dense: d384 L4 (3 linear + 1 full) ffn1024, 2x512", batch=2, seq=512, goal=1.5,
         cfg=dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8, num_experts=0,
                  mlp_only_layers=[0, 1, 2, 3])),
]

KIMI_COMMON = dict(max_position_embeddings=4096, rms_norm_eps=1e-6, kv_lora_rank=128, q_lora_rank=None,
                   qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, tie_word_embeddings=False,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
KIMI_SHAPES = [
    dict(name="moe: d256 L4 (3 KDA + 1 MLA) E16 top4, 4x256", batch=4, seq=256, goal=1.5, model_type="kimi_linear",
         cfg=dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, moe_intermediate_size=128, num_local_experts=16, num_experts_per_tok=4,
                  n_shared_experts=1, first_k_dense_replace=1,
                  linear_attn_config=dict(head_dim=64, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
                                          full_attn_layers=[4])),
         common=KIMI_COMMON),
]
FAMILIES = {"qwen3_next": SHAPES, "kimi_linear": KIMI_SHAPES}


def make_model(shape):
    import torch
    import transformers
    cfg = transformers.AutoConfig.for_model(shape.get("model_type", "qwen3_next"), **shape.get("common", COMMON),
                                            **shape["cfg"])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def transformers_run(shape, model_dir, steps, warmup, threads):
    import torch
    import transformers
    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.Generator().manual_seed(1)
    times = []
    for i in range(warmup + steps):
        ids = torch.randint(0, shape["cfg"]["vocab_size"], (shape["batch"], shape["seq"]), generator=data)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return shape["batch"] * shape["seq"] / statistics.median(times)


def loongforge_run(shape, model_dir, steps, warmup, threads, tmp):
    from cpu_train import train_tokens_per_s, write_random_shard
    tmp = pathlib.Path(tmp)
    write_random_shard(tmp / "rand", shape["cfg"]["vocab_size"],
                       (warmup + steps + 2) * shape["batch"] * (shape["seq"] + 1) * 2)
    return train_tokens_per_s(tmp, f"{{path: {model_dir}}}", shape, steps, warmup, threads)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_next")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    rows = []
    for shape in FAMILIES[a.family]:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = pathlib.Path(tmp) / "model"
            make_model(shape).save_pretrained(model_dir)
            lf, hf = [], []
            for r in range(a.rounds):
                sides = [("lf", lambda: loongforge_run(shape, model_dir, a.steps, a.warmup, a.threads,
                                                       tempfile.mkdtemp(dir=tmp))),
                         ("hf", lambda: transformers_run(shape, model_dir, a.steps, a.warmup, a.threads))]
                for name, fn in (sides if r % 2 == 0 else sides[::-1]):
                    (lf if name == "lf" else hf).append(fn())
            ratios = [x / y for x, y in zip(lf, hf)]
            rows.append((shape, statistics.median(lf), statistics.median(hf), statistics.median(ratios), ratios))
    load1 = os.getloadavg()[0]
    title = {"qwen3_next": "Qwen3-Next", "kimi_linear": "Kimi Linear"}[a.family]
    from cpu_train import cpu_model
    lines = [f"{title} training step on the CPU ({cpu_model()}, {a.threads} threads, fp32, forward + backward + clip + AdamW; "
             f"medians of {a.rounds} rounds x {a.steps} steps after {a.warmup} warm-up; load average {load0:.1f} -> "
             f"{load1:.1f})", "",
             "| shape | LoongForge tok/s | transformers tok/s | ratio | goal | per-round ratios |",
             "|---|---|---|---|---|---|"]
    for shape, lf, hf, ratio, ratios in rows:
        ok = "met" if ratio >= shape["goal"] else "missed"
        lines.append(f"| {shape['name']} | {lf:.0f} | {hf:.0f} | {ratio:.2f}x | {shape['goal']}x ({ok}) | "
                     f"{', '.join(f'{x:.2f}' for x in ratios)} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""CPU training step of a small Qwen2.5-VL-shape model: `loongforge train` against transformers' own
Qwen2_5_VLForConditionalGeneration (eager, AdamW, clipping) on the same batch, same threads, fp32, in one run
(issue 19's speed goal: >= 1.3x). Rounds alternate the two sides; the table shows medians of the per-step times
after warm-up and the ratio per round.

  .venv/bin/python bench/vlm_train.py [--rounds 3] [--steps 6] [--warmup 2] [--threads 2] [--out FILE.md]
                                     [--device cpu|cuda] [--lf build/loongforge]
bench/gpu_check.sh runs it with --device cuda (both sides on the GPU, fp32).
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

# ViT 4 x 128 (window attention, full attention in blocks 1 and 3), LLM 4 x 256 (GQA 4/2), vocab 8192; per row one
# 224 x 224 image (16 x 16 patches -> 64 tokens) and 192 text tokens.
SHAPE = dict(name="ViT 4x128 + LLM 4x256 V8192, 4 rows x (64 image + 192 text tokens)", rows=4, grid=16, text=192)


def make_model(tmp):
    import torch
    import transformers
    torch.manual_seed(0)
    vision = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3], out_hidden_size=256)
    text = dict(model_type="qwen2_5_vl_text", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096,
                rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}, tie_word_embeddings=False)
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=8000,
                                        video_token_id=8001, vision_start_token_id=8002, vision_end_token_id=8003)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    model.save_pretrained(tmp / "model")
    return model, cfg


def make_batch(cfg, tmp):
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(1)
    rows, grid, text = SHAPE["rows"], SHAPE["grid"], SHAPE["text"]
    n_img = grid * grid // 4
    ids = torch.randint(0, 7999, (rows, n_img + text + 2), generator=g)
    ids[:, 1] = cfg.vision_start_token_id
    ids[:, 2:2 + n_img] = cfg.image_token_id
    ids[:, 2 + n_img] = cfg.vision_end_token_id
    patches = grid * grid
    pixel_values = torch.randn(rows * patches, 3 * 2 * 14 * 14, generator=g)
    grid_thw = torch.tensor([[1, grid, grid]] * rows)
    batch = {"input_ids": ids, "pixel_values": pixel_values, "image_grid_thw": grid_thw,
             "pixel_values.row": torch.arange(rows).repeat_interleave(patches),
             "image_grid_thw.row": torch.arange(rows)}
    save_file(batch, str(tmp / "batch.safetensors"))
    return ids, pixel_values, grid_thw


def loongforge_steps(lf, tmp, steps, warmup, threads, device):
    recipe = tmp / "r.yaml"
    recipe.write_text(f"""
output_dir: {tmp / 'run'}
device: {device}
model: {{path: {tmp / 'model'}}}
data: {{format: batch, train: [{{path: {tmp / 'batch.safetensors'}}}], seq_len: {SHAPE['text'] + SHAPE['grid'] ** 2 // 4 + 2}}}
train: {{steps: {steps + warmup}, micro_batch_size: {SHAPE['rows']}, threads: {threads}}}
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


def transformers_steps(model, ids, pixel_values, grid_thw, steps, warmup, device):
    import torch
    model.to(device).train()
    ids, pixel_values, grid_thw = ids.to(device), pixel_values.to(device), grid_thw.to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    times, first = [], None
    for i in range(steps + warmup):
        t = time.perf_counter()
        # mm_token_type_ids (as transformers' processor gives it): multimodal positions, as LoongForge uses
        out = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid_thw, labels=ids,
                    mm_token_type_ids=(ids == model.config.image_token_id).long())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        first = first if first is not None else out.loss.item()
    return statistics.median(times), first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--lf", default=str(LF))
    a = ap.parse_args()
    import torch
    import transformers
    torch.set_num_threads(a.threads)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="lf_vlm_bench_"))
    model, cfg = make_model(tmp)
    ids, px, grid = make_batch(cfg, tmp)
    tokens = ids.numel()
    lf_t, hf_t, ratios = [], [], []
    for r in range(a.rounds):
        order = ["lf", "hf"] if r % 2 == 0 else ["hf", "lf"]
        res = {}
        for side in order:
            if side == "lf":
                res["lf"] = loongforge_steps(a.lf, tmp, a.steps, a.warmup, a.threads, a.device)
            else:  # a fresh copy of the initial weights each round
                m = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp / "model", dtype=torch.float32,
                                                                                   attn_implementation="eager")
                res["hf"] = transformers_steps(m, ids, px, grid, a.steps, a.warmup, a.device)
        lf_t.append(res["lf"][0])
        hf_t.append(res["hf"][0])
        ratios.append(res["hf"][0] / res["lf"][0])
        print(f"round {r + 1}: loongforge {tokens / res['lf'][0]:,.0f} tok/s, transformers {tokens / res['hf'][0]:,.0f} "
              f"tok/s ({ratios[-1]:.2f}x); first-step losses {res['lf'][1]:.5f} / {res['hf'][1]:.5f}", flush=True)
    lf_med, hf_med = statistics.median(lf_t), statistics.median(hf_t)
    ratio = hf_med / lf_med
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    where = f"{a.device}" + (f" ({torch.cuda.get_device_name(0)})" if a.device == "cuda" else f", {a.threads} threads")
    lines = [f"VLM training step, fp32, {where}, median of {a.rounds} rounds of {a.steps} steps after "
             f"{a.warmup} warm-up (torch {torch.__version__}, transformers {transformers.__version__}, {cpu})", "",
             "| shape | LoongForge tok/s | transformers eager tok/s | ratio (goal >= 1.3x) | per round |",
             "|---|---|---|---|---|",
             f"| {SHAPE['name']} | {tokens / lf_med:,.0f} | {tokens / hf_med:,.0f} | {ratio:.2f}x "
             f"({'met' if ratio >= 1.3 else 'not met'}) | {' '.join(f'{x:.2f}' for x in ratios)} |"]
    print("\n".join(lines))
    if a.out:
        pathlib.Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data-parallel load balancing on a skewed multimodal mix (issue 19, `data.balance: cost`): a small LLaVA trained
with dp2 on the CPU (two processes, one thread each) from a mix where a few conversations carry several large images
and a long answer and many are short text-only questions (packed). Rounds alternate `data.balance: none` and
`cost` on the same data; the table gives the step time (median, mean and the slowest step after warm-up; every rank
waits for the slowest one at the gradient exchange, so the step time is the slowest rank's forward + backward plus
the exchange) and the ranks' cost imbalance (max / mean of the per-rank summed row cost, from metrics.jsonl) before
and after placement.

  .venv/bin/python bench/vlm_balance.py [--rounds 2] [--steps 10] [--warmup 2] [--out FILE.md] [--lf build/loongforge]
"""
import argparse
import json
import os
import pathlib
import platform
import random
import socket
import statistics
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
LF = ROOT / "build" / "loongforge"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SEQ_LEN = 640
SHAPE = ("LLaVA: CLIP 6x384 (168 px, patch 14: 144 tokens per image) + LLM 4x256, seq 640 packed; "
         "dp2 x 4 micro-batches of 1 row")


def make_model(d):
    import torch
    import transformers
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(ROOT / "tests" / "fixtures" / "tok_bytelevel_gpt2" / "tokenizer.json"))
    tok.add_special_tokens(["<image>"])
    image_id = tok.token_to_id("<image>")
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                                           num_attention_heads=6, image_size=168, patch_size=14)
    text = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=image_id + 8, max_position_embeddings=1024,
                                    eos_token_id=2, bos_token_id=None)
    cfg = transformers.LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=image_id,
                                   vision_feature_layer=-1)
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None,
                                                         "chat_template": TEMPLATE}))
    transformers.CLIPImageProcessor(size={"shortest_edge": 168},
                                    crop_size={"height": 168, "width": 168}).save_pretrained(d)


def make_mix(d, n=800, heavy_every=30, seed=0):
    """Every heavy_every-th conversation: 2-3 images (144 tokens each) and a ~150-token answer; the rest: a short
    question and answer (~40 tokens). Packed, a heavy conversation fills most of a row on its own."""
    from PIL import Image
    rng = random.Random(seed)
    words = ["red", "green", "blue", "large", "small", "square", "round", "left", "right", "sky", "tree", "car"]
    data = []
    for i in range(n):
        if i % heavy_every == 0:
            names = []
            for j in range(2 + rng.randrange(2)):
                name = f"i{i}_{j}.png"
                img = Image.new("RGB", (180 + 7 * j, 170), (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
                img.save(d / name)
                names.append(name)
            answer = " ".join(rng.choice(words) for _ in range(30))
            data.append({"images": names, "conversations": [
                {"from": "human", "value": "<image>" * len(names) + "\nDescribe them."},
                {"from": "gpt", "value": answer}]})
        else:
            data.append({"conversations": [{"from": "human", "value": f"What is {i}?"},
                                           {"from": "gpt", "value": " ".join(rng.choice(words) for _ in range(3))}]})
    (d / "data.json").write_text(json.dumps(data))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(lf, d, out, balance, steps):
    recipe = out / "r.yaml"
    recipe.write_text(f"""
output_dir: {out / 'run'}
seed: 1
model: {{path: {d / 'model'}}}
data: {{format: sft, train: [{{path: {d / 'data.json'}}}], seq_len: {SEQ_LEN}, packing: true, balance: {balance}}}
train: {{steps: {steps}, micro_batch_size: 1, grad_accum: 4, threads: 1}}
parallel: {{dp: 2}}
optim: {{lr: 1.0e-4}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    port = str(free_port())
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([str(lf), "train", str(recipe)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for r, p in enumerate(procs):
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"rank {r} ({balance}) failed:\n{err[-3000:]}")
    return [json.loads(l) for l in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--lf", type=pathlib.Path, default=LF)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        (d / "model").mkdir()
        make_model(d / "model")
        make_mix(d)
        res = {"none": [], "cost": []}
        for k in range(a.rounds):
            for balance in ("none", "cost") if k % 2 == 0 else ("cost", "none"):
                out = d / f"{balance}{k}"
                out.mkdir()
                res[balance].append(run(a.lf, d, out, balance, a.steps))
                print(f"round {k + 1} {balance}: median step "
                      f"{statistics.median(m['step_time_s'] for m in res[balance][-1][a.warmup:]):.3f} s", flush=True)
    rows = []
    for balance in ("none", "cost"):
        steps = [m for r in res[balance] for m in r[a.warmup:]]
        t = [m["step_time_s"] for m in steps]
        before = [m["dp_cost_imbalance_before"] for m in steps]
        after = [m["dp_cost_imbalance_after"] for m in steps]
        per_round = " ".join(f"{statistics.median(m['step_time_s'] for m in r[a.warmup:]):.3f}" for r in res[balance])
        rows.append((balance, statistics.median(t), statistics.mean(t), max(t), statistics.pstdev(t),
                     statistics.mean(before), max(before), statistics.mean(after), max(after), per_round))
    cpu = platform.processor() or platform.machine()
    head = (f"dp2 on the CPU, {a.rounds} rounds x {a.steps} steps ({a.warmup} warm-up dropped per run), {SHAPE}; "
            f"{cpu}, load {os.getloadavg()[0]:.1f} at the end")
    lines = [head, "",
             "| data.balance | step s median | mean | slowest | std | cost imbalance before (mean / max) "
             "| after (mean / max) | median per round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} / {r[6]:.3f} "
                     f"| {r[7]:.3f} / {r[8]:.3f} | {r[9]} |")
    none, cost = rows
    lines += ["", f"step time median: cost / none = {cost[1] / none[1]:.3f}; mean {cost[2] / none[2]:.3f}; "
                  f"slowest step {cost[3] / none[3]:.3f}"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

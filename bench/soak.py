"""Soak test: a long CPU training run of many small steps, checkpointing every few hundred and stopped / resumed in
between, watched from outside for resource leaks; the resumed run's losses must equal an uninterrupted run's.

For each process it samples resident memory (VmRSS), open file descriptors and threads once a second, and prints a
table per segment (first / last sample, peak) plus the verdicts: RSS growth within a segment bounded (after the first
checkpoint, the steady state), descriptor and thread counts flat, losses bitwise equal to the uninterrupted run.

    .venv/bin/python bench/soak.py [--steps 20000] [--segments 4] [--checkpoint-every 500] [--out bench/results/soak.md]
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LF = ROOT / "build" / "loongforge"

MODEL = {"model_type": "llama", "vocab_size": 17, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def proc_stats(pid):
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        rss = next(int(l.split()[1]) for l in status.splitlines() if l.startswith("VmRSS:")) / 1024
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
        return rss, fds, threads
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


def run(args, watch=True):
    p = subprocess.Popen([str(LF), *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    samples = []
    while p.poll() is None:
        if watch:
            s = proc_stats(p.pid)
            if s:
                samples.append((time.monotonic(), *s))
        time.sleep(1.0)
    err = p.stderr.read()
    if p.returncode != 0:
        sys.exit(f"soak: loongforge {' '.join(map(str, args))} failed:\n{err}")
    return samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--segments", type=int, default=4, help="the watched run is stopped and resumed this many times")
    ap.add_argument("--checkpoint-every", type=int, default=500)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="lf-soak-"))
    data = work / "data"
    subprocess.run([str(LF), "data", "synth", "--task", "addition", "--docs", "3000", "--digits", "2", "--out", data],
                   check=True, capture_output=True)
    subprocess.run([str(LF), "data", "tokenize", "--tokenizer", data, "--input", data / "train.jsonl", "--out",
                    data / "train"], check=True, capture_output=True)
    (work / "model.json").write_text(json.dumps(MODEL))

    def recipe(name):
        r = work / f"{name}.yaml"
        r.write_text(f"""
output_dir: {work / name}
seed: 5
model: {{config: {work / 'model.json'}, tokenizer: {data}}}
data: {{train: [{{path: {data / 'train'}}}], seq_len: 32, valid_fraction: 0.05}}
train: {{steps: {a.steps}, micro_batch_size: 4, threads: 2}}
optim: {{lr: 1.0e-3}}
eval: {{every: {a.checkpoint_every}, batches: 2}}
checkpoint: {{every: {a.checkpoint_every}, keep: 2}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
        return r

    t0 = time.monotonic()
    run(["train", recipe("straight")], watch=False)
    t_straight = time.monotonic() - t0
    segs = []
    bounds = [a.steps * (k + 1) // a.segments for k in range(a.segments)]
    for k, stop in enumerate(bounds):
        extra = ["--set", f"train.stop_at_step={stop}"] + (["--resume"] if k else [])
        segs.append((stop, run(["train", recipe("resumed"), *extra])))

    def losses(name):
        return [json.loads(l) for l in (work / name / "metrics.jsonl").read_text().splitlines()]
    la, lb = losses("straight"), losses("resumed")
    same = [x["loss"] for x in la] == [y["loss"] for y in lb] and \
        [x.get("valid_loss") for x in la] == [y.get("valid_loss") for y in lb]

    rows, verdicts = [], []
    for k, (stop, samples) in enumerate(segs):
        if not samples:
            continue
        steady = samples[len(samples) // 5:] or samples  # after start-up (model, data, first checkpoint)
        rss0, rss1 = steady[0][1], steady[-1][1]
        peak = max(s[1] for s in samples)
        fds = {s[2] for s in steady}
        thr = {s[3] for s in steady}
        rows.append(f"| {k + 1} | {stop} | {samples[-1][0] - samples[0][0]:.0f} | {rss0:.1f} | {rss1:.1f} | "
                    f"{peak:.1f} | {min(fds)}-{max(fds)} | {min(thr)}-{max(thr)} |")
        verdicts.append(rss1 - rss0 <= max(8.0, 0.05 * rss0) and max(fds) - min(fds) <= 2 and len(thr) <= 2)
    table = "\n".join([
        f"Soak: {a.steps} steps of a 2-layer Llama (micro-batch 4, seq 32), checkpoint + validation every "
        f"{a.checkpoint_every}, stopped and resumed {a.segments - 1} times; uninterrupted run {t_straight:.0f} s.",
        "",
        "| segment | ends at step | s | RSS MiB (steady start) | RSS MiB (end) | RSS MiB peak | open fds | threads |",
        "|---|---|---|---|---|---|---|---|",
        *rows, "",
        f"- RSS growth bounded (<= max(8 MiB, 5%) over each segment's steady part), fds and threads flat: "
        f"{'yes' if all(verdicts) else 'NO'}",
        f"- losses and validation losses of the resumed run equal the uninterrupted run's at all {len(la)} steps: "
        f"{'yes' if same else 'NO'}",
    ])
    print(table)
    if a.out:
        pathlib.Path(a.out).write_text(table + "\n")
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if all(verdicts) and same else 1)


if __name__ == "__main__":
    main()

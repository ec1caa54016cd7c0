"""CPU training step of a robot policy: LoongForge (`loongforge train` on a LeRobot policy folder) against LeRobot's own
policy class (ACTPolicy, in the lerobot oracle environment .venv-lerobot) on the same machine, in one run: the same
saved policy (one save_pretrained folder), the same batch (one safetensors file of normalised rows, as LeRobot's
policy.forward receives them after its preprocessor: observation.state, observation.images.<camera>, action,
action_is_pad), fp32, the same thread count, and the same step (forward + backward + clip_grad_norm 10 + AdamW with
LeRobot's ACT preset: lr 1e-5, weight decay 1e-4; dropout 0.1 in both). Prints a table of the median step times and
LoongForge's ratio (issue 24's goal: >= 1.5x on the CPU); with --out, writes it as markdown too.

    [LOONGFORGE_BIN=build/loongforge] .venv/bin/python bench/policy_cpu.py [--shapes act256,act512] [--threads 2]
        [--steps 6] [--warmup 2] [--rounds 3] [--out FILE.md]

Each round runs both sides once per shape (the order alternating); the table shows medians over the rounds and each
round's ratio. The batch: 8 rows, one 3 x 96 x 128 camera, state 14, action 14, chunk 50 (the last rows padded at
the chunk's end); ACT's other settings are LeRobot's defaults (resnet18 at its real width, 4 encoder, 1 decoder and
4 CVAE-encoder layers, 8 heads, feed-forward 3200, latent 32), dim_model 256 or 512 (the default).
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
LF = pathlib.Path(os.environ.get("LOONGFORGE_BIN", ROOT / "build" / "loongforge"))
LEROBOT_PY = pathlib.Path(os.environ.get("LOONGFORGE_LEROBOT_PYTHON", ROOT / ".venv-lerobot" / "bin" / "python"))

BATCH = dict(batch=8, image=[3, 96, 128], state=14, action=14, chunk=50)
SHAPES = {
    "act256": dict(name="ACT d256, resnet18, 1 camera 96x128, chunk 50, batch 8", goal=1.5, cfg=dict(dim_model=256)),
    "act512": dict(name="ACT d512 (LeRobot's default), resnet18, 1 camera 96x128, chunk 50, batch 8", goal=1.5,
                   cfg=dict(dim_model=512)),
}

# In the lerobot environment. "make": ACTPolicy from the shape's config (random weights, no pretrained backbone)
# saved to DIR/policy, and the batch to DIR/batch.safetensors. "train": the policy loaded from DIR/policy, trained
# STEPS + WARMUP steps on the batch as LeRobot's update_policy does; prints the step times and losses (JSON).
LEROBOT = r'''
import json, sys, time
import torch
from safetensors.torch import load_file, save_file
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.act.modeling_act import ACTPolicy
mode, out, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(spec["threads"])
b = spec["batch"]
if mode == "make":
    torch.manual_seed(0)
    feats = {"observation.state": PolicyFeature(FeatureType.STATE, (b["state"],)),
             "observation.images.top": PolicyFeature(FeatureType.VISUAL, tuple(b["image"]))}
    cfg = ACTConfig(input_features=feats, output_features={"action": PolicyFeature(FeatureType.ACTION, (b["action"],))},
                    chunk_size=b["chunk"], n_action_steps=b["chunk"], pretrained_backbone_weights=None, device="cpu",
                    **spec["cfg"])
    ACTPolicy(cfg).save_pretrained(out + "/policy")
    g = torch.Generator().manual_seed(1)
    n = b["batch"]
    pad = torch.zeros(n, b["chunk"], dtype=torch.bool)
    for row in range(n // 2, n):
        pad[row, b["chunk"] - 5 * (row - n // 2 + 1):] = True
    save_file({"observation.state": torch.randn(n, b["state"], generator=g),
               "observation.images.top": torch.randn(n, *b["image"], generator=g),
               "action": torch.randn(n, b["chunk"], b["action"], generator=g), "action_is_pad": pad},
              out + "/batch.safetensors")
    sys.exit(0)
policy = ACTPolicy.from_pretrained(out + "/policy")
policy.train()
batch = load_file(out + "/batch.safetensors")
opt = torch.optim.AdamW(policy.get_optim_params(), lr=policy.config.optimizer_lr,
                        weight_decay=policy.config.optimizer_weight_decay)
times, losses = [], []
for i in range(spec["steps"] + spec["warmup"]):
    t0 = time.perf_counter()
    loss, _ = policy.forward(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 10.0)
    opt.step()
    opt.zero_grad()
    if i >= spec["warmup"]:
        times.append(time.perf_counter() - t0)
    losses.append(loss.item())
print(json.dumps({"times": times, "losses": losses}))
'''


def lerobot(mode, tmp, spec):
    proc = subprocess.run([str(LEROBOT_PY), "-c", LEROBOT, mode, str(tmp), json.dumps(spec)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.exit(f"lerobot {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]) if mode == "train" else None


def loongforge(tmp, spec):
    run = tmp / "run"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    recipe = tmp / "bench.yaml"
    recipe.write_text(f"""
output_dir: {run}
model: {{path: {tmp / 'policy'}}}
data: {{format: batch, train: [{{path: {tmp / 'batch.safetensors'}}}]}}
train: {{steps: {spec['steps'] + spec['warmup']}, micro_batch_size: {spec['batch']['batch']}, threads: {spec['threads']}}}
optim: {{lr: 1.0e-5, weight_decay: 1.0e-4, beta1: 0.9, beta2: 0.999, eps: 1.0e-8, clip: 10.0}}
log: {{progress: off, tensorboard: false, plot: false}}
checkpoint: {{every: 0}}
""")
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    proc = subprocess.run([str(LF), "train", str(recipe)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"loongforge train failed:\n{proc.stderr[-3000:]}")
    m = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    m = [x for x in m if "step_time_s" in x]
    return {"times": [x["step_time_s"] for x in m[spec["warmup"]:]], "losses": [x["loss"] for x in m]}


def cpu_model():
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="act256,act512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    rows = []
    for key in a.shapes.split(","):
        shape = SHAPES[key]
        spec = dict(cfg=shape["cfg"], batch=BATCH, threads=a.threads, steps=a.steps, warmup=a.warmup)
        with tempfile.TemporaryDirectory(prefix="lf_policy_bench_") as tmp:
            tmp = pathlib.Path(tmp)
            lerobot("make", tmp, spec)
            lf, lr, first = [], [], None
            for r in range(a.rounds):
                res = {}
                for side in (["lf", "lr"] if r % 2 == 0 else ["lr", "lf"]):
                    res[side] = loongforge(tmp, spec) if side == "lf" else lerobot("train", tmp, spec)
                lf.append(statistics.median(res["lf"]["times"]))
                lr.append(statistics.median(res["lr"]["times"]))
                first = (res["lf"]["losses"][0], res["lr"]["losses"][0])
                print(f"{key} round {r + 1}: loongforge {lf[-1]:.3f} s/step, lerobot {lr[-1]:.3f} s/step "
                      f"({lr[-1] / lf[-1]:.2f}x); first-step losses {first[0]:.4f} / {first[1]:.4f}",
                      file=sys.stderr, flush=True)
            ratios = [y / x for x, y in zip(lf, lr)]
            rows.append((shape, statistics.median(lf), statistics.median(lr), statistics.median(ratios), ratios, first))
    load1 = os.getloadavg()[0]
    lines = [f"Robot-policy training step on the CPU ({cpu_model()}, {a.threads} threads, fp32, forward + backward + "
             f"clip + AdamW; medians of {a.rounds} rounds x {a.steps} steps after {a.warmup} warm-up; "
             f"{time.strftime('%Y-%m-%d')}; load average {load0:.1f} -> {load1:.1f})", "",
             "| shape | LoongForge s/step | LeRobot s/step | ratio | goal | per-round ratios | first-step loss (LF / LeRobot) |",
             "|---|---|---|---|---|---|---|"]
    for shape, lf, lr, ratio, ratios, first in rows:
        ok = "met" if ratio >= shape["goal"] else "missed"
        lines.append(f"| {shape['name']} | {lf:.3f} | {lr:.3f} | {ratio:.2f}x | {shape['goal']}x ({ok}) | "
                     f"{', '.join(f'{x:.2f}' for x in ratios)} | {first[0]:.4f} / {first[1]:.4f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

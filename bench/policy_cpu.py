"""CPU training step of a robot policy: LoongForge (`loongforge train` on a LeRobot policy folder) against LeRobot's own
policy class (ACTPolicy, PI0Policy, DiffusionPolicy, in the lerobot oracle environment .venv-lerobot) on the same
machine, in one run: the same saved policy (one save_pretrained folder), the same batch (one safetensors file of
normalised rows, as LeRobot's policy.forward receives them after its preprocessor: observation.state,
observation.images.<camera> / observation.image, π0's language tokens and mask, action, action_is_pad), fp32, the same
thread count, and the same step (forward + backward + clip_grad_norm + the optimizer of the policy's LeRobot preset:
ACT AdamW lr 1e-5, weight decay 1e-4, clip 10, dropout 0.1 in both; π0 AdamW lr 2.5e-5, betas 0.9 / 0.95, weight decay
0.01, clip 1; Diffusion Policy Adam lr 1e-4, betas 0.95 / 0.999, L2 1e-6, clip 10, where LoongForge runs AdamW with a
decoupled 1e-6). The random draws of the training forward (π0's noise and time, the diffusion noise and timesteps,
Diffusion Policy's random crop) are each side's own. Prints a table of the median step times and LoongForge's ratio
(issue 24's goal: >= 1.5x on the CPU); with --out, writes it as markdown too.

    [LOONGFORGE_BIN=build/loongforge] .venv/bin/python bench/policy_cpu.py [--shapes act256,act512,pi0small,pi0prompt,pi05prompt,diffusion]
        [--threads 2] [--steps 6] [--warmup 2] [--rounds 3] [--out FILE.md] [--device cpu|cuda]

With --device cuda (bench/gpu_check.sh, when a Python with lerobot is there: LOONGFORGE_LEROBOT_PYTHON) both sides
train on the GPU, fp32, each step timed between two synchronizes.

Each round runs both sides once per shape (the order alternating); the table shows medians over the rounds and each
round's ratio. ACT's batch: 8 rows, one 3 x 96 x 128 camera, state 14, action 14, chunk 50 (the last rows padded at
the chunk's end); ACT's other settings are LeRobot's defaults (resnet18 at its real width, 4 encoder, 1 decoder and
4 CVAE-encoder layers, 8 heads, feed-forward 3200, latent 32), dim_model 256 or 512 (the default). π0 small: LeRobot's
PI0Policy built small as tests/python/test_pi0_parity.py builds it (SMALL_PI0), sizes in SHAPES. Diffusion Policy:
LeRobot's PushT configuration (2 observation steps, horizon 16, 84 x 84 crops of a 96 x 96 camera, resnet18 with group
norm) with the U-Net at a quarter of its widths (the full 512/1024/2048 U-Net, 263 M parameters, takes over a minute
a LeRobot step on 2 loaded cores).
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
sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_pi0_parity import SMALL_PI0  # noqa: E402  (LeRobot's π0 built small: its size-table patches)
LF = pathlib.Path(os.environ.get("LOONGFORGE_BIN", ROOT / "build" / "loongforge"))
LEROBOT_PY = pathlib.Path(os.environ.get("LOONGFORGE_LEROBOT_PYTHON", ROOT / ".venv-lerobot" / "bin" / "python"))

ACT_BATCH = dict(batch=8, image=[3, 96, 128], state=14, action=14, chunk=50)
# LeRobot's optimizer presets (make_optimizer_and_scheduler builds them; LoongForge's AdamW with the same numbers,
# every parameter decayed; Diffusion Policy's preset is torch.optim.Adam with a coupled L2 of 1e-6)
ACT_OPTIM = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-4, clip=10.0)
# A small π0: the PaliGemma / expert / SigLIP shapes of test_pi0_parity.py scaled up (heads and head_dim shared by
# the two stacks, as π0's joint attention needs).
PI0_SIZES = {"gemma_bench": dict(width=512, depth=4, mlp_dim=2048, num_heads=8, num_kv_heads=1, head_dim=64),
             "gemma_bench_expert": dict(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=64)}
PI0_VISION = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, patch_size=14, intermediate_size=1024,
                  projection_dim=512)


def pi0_shape(kind, name, tokens, real=None):
    """A small π0 / π0.5 (PI0_SIZES, PI0_VISION) on one 112x112 camera with `tokens` prompt slots, the first `real`
    (cycled over the rows) valid when given, else 3 padded in half the rows."""
    batch = dict(batch=8, image=[3, 112, 112], state=14, action=14, chunk=50, tokens=tokens)
    if real:
        batch["real_tokens"] = real
    return dict(kind="pi0", goal=1.5, name=name, batch=batch,
                cfg=dict(type=kind, variant_sizes=PI0_SIZES, vocab_size=1024, vision_config=PI0_VISION,
                         paligemma_variant="gemma_bench", action_expert_variant="gemma_bench_expert",
                         image_resolution=[112, 112], chunk_size=50, n_action_steps=50, tokenizer_max_length=tokens),
                optim=dict(lr=2.5e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, clip=1.0))


SHAPES = {
    "act256": dict(kind="act", name="ACT d256, resnet18, 1 camera 96x128, chunk 50, batch 8", goal=1.5,
                   cfg=dict(dim_model=256), batch=ACT_BATCH, optim=ACT_OPTIM),
    "act512": dict(kind="act", name="ACT d512 (LeRobot's default), resnet18, 1 camera 96x128, chunk 50, batch 8",
                   goal=1.5, cfg=dict(dim_model=512), batch=ACT_BATCH, optim=ACT_OPTIM),
    "pi0small": pi0_shape("pi0", "π0 small (PaliGemma w512 d4, expert w256 d4, 8 heads / 1 kv, SigLIP w256 d4), 1 camera "
                                 "112x112, 16 tokens, chunk 50, batch 8", tokens=16),
    # LeRobot's π0 / π0.5 processors pad every prompt to tokenizer_max_length (48 / 200, padding="max_length"): the
    # batches users train on. Real lengths: a short task (π0), the task plus the 14 state bins and π0.5's framing.
    "pi0prompt": pi0_shape("pi0", "π0 small as above, the prompt padded to LeRobot's default 48 tokens (9-15 real)",
                           tokens=48, real=[9, 11, 13, 15]),
    "pi05prompt": pi0_shape("pi05", "π0.5 small (π0 small's sizes), the prompt padded to LeRobot's default 200 tokens "
                                    "(36-48 real)", tokens=200, real=[36, 40, 44, 48]),
    "diffusion": dict(kind="diffusion", goal=1.5,
                      name="Diffusion Policy, LeRobot's PushT shape with the U-Net at a quarter width (resnet18 "
                           "with group norm, down_dims 128/256/512), 2 x 1 camera 96x96 cropped to 84, horizon 16, "
                           "batch 8",
                      cfg=dict(n_obs_steps=2, horizon=16, n_action_steps=8, crop_shape=[84, 84], use_group_norm=True,
                               down_dims=[128, 256, 512]),
                      batch=dict(batch=8, image=[3, 96, 96], state=2, action=2, chunk=16, steps=2),
                      optim=dict(lr=1e-4, beta1=0.95, beta2=0.999, eps=1e-8, weight_decay=1e-6, clip=10.0)),
}

# In the lerobot environment. "make": the shape's policy (random weights, no pretrained backbone) saved to
# DIR/policy, and the batch to DIR/batch.safetensors. "train": the policy loaded from DIR/policy, trained
# STEPS + WARMUP steps on the batch as LeRobot's update_policy does (its config's optimizer preset, clip_grad_norm of
# the preset's grad_clip_norm); prints the step times and losses (JSON). π0 is built small as the parity test does
# (SMALL_PI0) and reloaded by building it again and loading the saved weights.
LEROBOT = "SMALL_PI0 = " + repr(SMALL_PI0) + r"""
import json, sys, time
import torch
from safetensors.torch import load_file, save_file
from lerobot.configs.types import FeatureType, PolicyFeature
mode, out, S = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(S["threads"])
b, kind, n = S["batch"], S["kind"], S["batch"]["batch"]
vec = lambda d: PolicyFeature(FeatureType.STATE, (d,))
g = torch.Generator().manual_seed(1)
pad = torch.zeros(n, b["chunk"], dtype=torch.bool)
for row in range(n // 2, n):
    pad[row, max(1, b["chunk"] - 5 * (row - n // 2 + 1)):] = True
if kind == "act":
    from lerobot.policies.act.configuration_act import ACTConfig as Config
    from lerobot.policies.act.modeling_act import ACTPolicy as Policy
    feats = {"observation.state": vec(b["state"]), "observation.images.top": PolicyFeature(FeatureType.VISUAL, tuple(b["image"]))}
    kw = dict(chunk_size=b["chunk"], n_action_steps=b["chunk"], pretrained_backbone_weights=None)
    batch = {"observation.state": torch.randn(n, b["state"], generator=g),
             "observation.images.top": torch.randn(n, *b["image"], generator=g)}
elif kind == "diffusion":
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig as Config
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy as Policy
    feats = {"observation.state": vec(b["state"]), "observation.image": PolicyFeature(FeatureType.VISUAL, tuple(b["image"]))}
    kw = dict(pretrained_backbone_weights=None)
    S["cfg"]["crop_shape"], S["cfg"]["down_dims"] = tuple(S["cfg"]["crop_shape"]), tuple(S["cfg"]["down_dims"])
    batch = {"observation.state": torch.randn(n, b["steps"], b["state"], generator=g),
             "observation.image": torch.rand(n, b["steps"], *b["image"], generator=g)}
else:
    spec = S["cfg"]
    exec(SMALL_PI0)  # defines small_pi0
    vocab = spec.pop("vocab_size"); sizes = spec.pop("variant_sizes"); vision = spec.pop("vision_config")
    M, Config, Policy = small_pi0(spec.pop("type"), sizes, vocab, vision)
    S["cfg"] = spec
    S["cfg"]["image_resolution"] = tuple(S["cfg"]["image_resolution"])
    feats = {"observation.state": vec(b["state"]), "observation.images.top": PolicyFeature(FeatureType.VISUAL, tuple(b["image"]))}
    kw = {}
    batch = {"observation.state": torch.randn(n, b["state"], generator=g),
             "observation.images.top": torch.rand(n, *b["image"], generator=g),
             "observation.language.tokens": torch.randint(0, vocab, (n, b["tokens"]), generator=g),
             "observation.language.attention_mask": torch.ones(n, b["tokens"], dtype=torch.bool)}
    if "real_tokens" in b:  # right padding with Gemma's pad id 0, as LeRobot's tokenizer step writes it
        for row in range(n):
            real = b["real_tokens"][row % len(b["real_tokens"])]
            batch["observation.language.attention_mask"][row, real:] = False
            batch["observation.language.tokens"][row, real:] = 0
    else:
        batch["observation.language.attention_mask"][n // 2:, -3:] = False
cfg = Config(input_features=feats, output_features={"action": PolicyFeature(FeatureType.ACTION, (b["action"],))},
             device=S.get("device", "cpu"), **kw, **S["cfg"])
if mode == "make":
    torch.manual_seed(0)
    policy = Policy(cfg)
    policy.save_pretrained(out + "/policy")
    if kind == "pi0":  # the sizes LoongForge reads for variants LeRobot does not know
        saved = json.loads(open(out + "/policy/config.json").read())
        saved.update(variant_sizes=sizes, vocab_size=vocab, vision_config=dict(vision, image_size=cfg.image_resolution[0]))
        open(out + "/policy/config.json", "w").write(json.dumps(saved, indent=4))
    batch["action"] = torch.randn(n, b["chunk"], b["action"], generator=g)
    batch["action_is_pad"] = pad
    save_file(batch, out + "/batch.safetensors")
    sys.exit(0)
if kind == "pi0":
    policy = Policy(cfg)
    missing, unexpected = policy.load_state_dict(load_file(out + "/policy/model.safetensors"), strict=False)
    assert not unexpected and all("embed_tokens" in k or "lm_head" in k for k in missing), (missing, unexpected)
else:
    policy = Policy.from_pretrained(out + "/policy")
dev = torch.device(S.get("device", "cpu"))
policy.to(dev).train()
batch = {k: v.to(dev) for k, v in load_file(out + "/batch.safetensors").items()}
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
preset = policy.config.get_optimizer_preset()
opt = preset.build(policy.get_optim_params())
times, losses = [], []
for i in range(S["steps"] + S["warmup"]):
    sync()
    t0 = time.perf_counter()
    loss, _ = policy.forward(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), preset.grad_clip_norm)
    opt.step()
    opt.zero_grad()
    sync()
    if i >= S["warmup"]:
        times.append(time.perf_counter() - t0)
    losses.append(loss.item())
print(json.dumps({"times": times, "losses": losses}))
"""


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
    o = spec["optim"]
    recipe.write_text(f"""
output_dir: {run}
model: {{path: {tmp / 'policy'}}}
data: {{format: batch, train: [{{path: {tmp / 'batch.safetensors'}}}]}}
device: {spec.get('device', 'cpu')}
train: {{steps: {spec['steps'] + spec['warmup']}, micro_batch_size: {spec['batch']['batch']}, threads: {spec['threads']}}}
optim: {{lr: {o['lr']}, weight_decay: {o['weight_decay']}, beta1: {o['beta1']}, beta2: {o['beta2']}, eps: {o['eps']}, clip: {o['clip']}, no_decay: []}}
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
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    rows = []
    for key in a.shapes.split(","):
        shape = SHAPES[key]
        spec = dict(kind=shape["kind"], cfg=shape["cfg"], batch=shape["batch"], optim=shape["optim"],
                    threads=a.threads, steps=a.steps, warmup=a.warmup, device=a.device)
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
    where = "the GPU (CUDA" if a.device == "cuda" else f"the CPU ({cpu_model()}, {a.threads} threads"
    lines = [f"Robot-policy training step on {where}, fp32, forward + backward + "
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

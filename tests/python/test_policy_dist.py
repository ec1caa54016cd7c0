"""Robot policies under the FSDP-style engine's layouts: the small ACT policy of test_policy_train.py trained 6 steps
on its LeRobot dataset (data.format: robot; each row's latent draw from its own seeded stream) with a frozen backbone
stage (model.freeze), a per-module learning rate (optim.lr_multipliers) and a weight average (ema.decay) gives the
per-step losses, gradient norms and validation losses and the final weights of one process (fp32, CPU, <= 1e-5
relative) under DDP (dp2), ZeRO-1 (dp2), FSDP (dp2) and HSDP (dp_shard 2 x dp_replicate 2). ACT's loss counts
non-padded action steps across the ranks, so rows with padded chunks weigh as in one process.

Tests marked slow run with LF_SLOW=1; the CI set covers DDP and FSDP."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import LF_BIN, launch_ranks, run_lerobot, run_lf
from test_policy_train import DATASET, POLICY

STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("policy")
    run_lerobot(DATASET, d / "dataset")
    run_lerobot(POLICY, d / "policy")
    return d


def recipe(d, out):
    r = out / "r.yaml"
    r.write_text(f"""
output_dir: {out / 'run'}
seed: 5
model: {{path: {d / 'policy'}, freeze: ["model.backbone.layer1"]}}
data: {{format: robot, train: [{{path: {d / 'dataset'}}}], robot: {{valid_episodes: 1, threads: 1}}}}
train: {{steps: {STEPS}, micro_batch_size: 4, threads: 1}}
optim: {{lr: 1.0e-3, weight_decay: 0.01, clip: 1.0, lr_multipliers: [{{pattern: "model.backbone", multiplier: 0.1}}]}}
ema: {{decay: 0.9, warmup: none}}
checkpoint: {{every: {STEPS}}}
eval: {{every: 3, batches: 2}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


def metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir):
    ck = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    w = {}
    for f in sorted(ck.glob("model*.safetensors")) + sorted((ck / "ema").glob("model*.safetensors")):
        w.update({("ema." if f.parent.name == "ema" else "") + k: v for k, v in load_file(str(f)).items()})
    assert w, f"no weights in {ck}"
    return w


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_lf("train", recipe(setup, out), "--set", "parallel.zero=1")
    return metrics(out / "run"), final_weights(out / "run")


LAYOUTS = {  # ranks, settings (micro_batch_size: the rows of one data-parallel rank)
    "dp2": (2, ["parallel.dp=2", "train.micro_batch_size=2"]),
    "dp2_zero1": (2, ["parallel.dp=2", "parallel.zero=1", "train.micro_batch_size=2"]),
    "fsdp2": (2, ["parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=2"]),
    "hsdp2x2": (4, ["parallel.dp=4", "parallel.zero=3", "parallel.hsdp_shard=2", "train.micro_batch_size=1"]),
}
CI = {"dp2", "fsdp2"}


@pytest.mark.parametrize("layout", [l if l in CI else pytest.param(l, marks=pytest.mark.slow) for l in LAYOUTS])
def test_policy_layout_matches_one_process(setup, reference, tmp_path, layout):
    n, sets = LAYOUTS[layout]
    res = launch_ranks(n, [LF_BIN, "train", recipe(setup, tmp_path), *sum((["--set", s] for s in sets), [])],
                       timeout=600)
    for r, p in enumerate(res):
        assert p.returncode == 0, f"rank {r}: {p.stderr[-3000:]}"
    got = metrics(tmp_path / "run")
    ref, ref_w = reference
    assert len(got) == len(ref) == STEPS
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (layout, a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (layout, a["step"])
        assert ("valid_loss" in a) == ("valid_loss" in b) == (a["step"] % 3 == 0)
        if "valid_loss" in b:
            assert abs(a["valid_loss"] - b["valid_loss"]) <= 1e-5 * abs(b["valid_loss"]), (layout, a["step"])
    w = final_weights(tmp_path / "run")
    assert sorted(w) == sorted(ref_w)
    for k, v in ref_w.items():
        got = w[k]
        if k.endswith("in_proj_bias"):  # the key bias: softmax ignores it, so its gradient is rounding noise that
            d = v.shape[0] // 3         # AdamW turns into steps of about lr either way
            got, v = torch.cat([got[:d], got[2 * d:]]), torch.cat([v[:d], v[2 * d:]])
        diff, scale = (got - v).abs().max().item(), max(v.abs().max().item(), 1e-3)
        # 1e-6: a thousandth of one step's change (lr 1e-3); elements whose gradients are near rounding noise (the
        # decoder's first self-attention sees only positions) take Adam steps whose sign that noise decides
        assert diff <= 1e-5 * scale + 1e-6, (layout, k, diff, scale)
    # the frozen stage did not move
    start = load_file(str(setup / "policy" / "model.safetensors"))
    frozen = [k for k in start if k.startswith("model.backbone.layer1.") and "conv" in k]
    assert frozen and all((w[k] == start[k]).all() for k in frozen)


def test_policy_bf16_fsdp_follows_one_process_bf16(setup, reference, tmp_path):
    """`precision: bf16` for a policy: bf16 compute (autocast in one process; FSDP's bf16 copies of the gathered
    weights) over fp32 masters. As for the LLMs (test_dist_fsdp_mp.py), FSDP's losses stay within 3x of the rounding
    DDP at bf16 shows against one process, and follow the bf16 run much more closely than the fp32 one; the
    checkpoint holds fp32 weights."""
    runs = {}
    for name, n, sets in [("one", 1, []), ("ddp", 2, ["parallel.dp=2", "train.micro_batch_size=2"]),
                          ("fsdp", 2, ["parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=2"])]:
        out = tmp_path / name
        out.mkdir()
        args = [LF_BIN, "train", recipe(setup, out), *sum((["--set", s] for s in ["precision=bf16", *sets]), [])]
        if n == 1:
            run_lf(*args[1:], "--set", "parallel.zero=1")
        else:
            for r, p in enumerate(launch_ranks(n, args, timeout=600)):
                assert p.returncode == 0, f"{name} rank {r}: {p.stderr[-3000:]}"
        runs[name] = metrics(out / "run")
    fp32 = reference[0]

    def rel(a, b):
        return abs(a - b) / max(abs(a), abs(b), 1e-12)

    one, ddp, fsdp = runs["one"], runs["ddp"], runs["fsdp"]
    assert len(one) == len(ddp) == len(fsdp) == STEPS
    assert any(rel(a["loss"], b["loss"]) > 1e-5 for a, b in zip(one, fp32))  # bf16 compute happened
    assert all(abs(a["loss"] - b["loss"]) <= 0.05 * abs(b["loss"]) for a, b in zip(one, fp32))  # and trains alike
    worst_ddp = max(rel(a["loss"], b["loss"]) for a, b in zip(one, ddp))
    for a, b in zip(one, fsdp):
        assert rel(a["loss"], b["loss"]) <= max(3 * worst_ddp, 1e-5), (a["step"], a["loss"], b["loss"], worst_ddp)
    to_bf16 = sum(rel(a["loss"], b["loss"]) for a, b in zip(one, fsdp))
    to_fp32 = sum(rel(a["loss"], b["loss"]) for a, b in zip(fp32, fsdp))
    assert to_bf16 < 0.5 * to_fp32, (to_bf16, to_fp32)
    w = final_weights(tmp_path / "fsdp" / "run")
    assert all(v.dtype == torch.float32 for v in w.values())

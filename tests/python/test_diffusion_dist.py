"""The diffusion transformers under the parallel layouts: a tiny class-conditional DiT and a tiny text-conditioned Wan
2.1 (video latents [B, C, F, H, W]) trained 10 steps with the diffusion objective (flow matching, per-row seeds: a
row draws the same timestep and noise wherever it runs) give the per-step losses, gradient norms and validation
losses and the final weights of one process (fp32, CPU, <= 1e-5 relative) under DDP (dp2), ZeRO-1 (dp2), FSDP (dp2),
HSDP (dp_shard 2 x dp_replicate 2) and context parallelism over the token sequence the model makes in embed() (cp2,
Ulysses all-to-all and ring attention, bidirectional; also dp2 x cp2 and cp4). DiT's output layer is conditioned
through block 0's embedder: FSDP keeps that module in its root unit (Split::shared). Layouts the family cannot take
(tensor / pipeline parallel) and a token sequence cp does not divide are one-line errors naming the recipe key.

Tests marked slow run with LF_SLOW=1; the CI set covers each layout at least once."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

diffusers = pytest.importorskip("diffusers")

from conftest import LF_BIN, launch_ranks, run_lf  # noqa: E402
from test_dit_parity import make_dit  # noqa: E402
from test_wan_parity import wan_model  # noqa: E402

STEPS = 10
ROWS = 4  # rows per step (one micro-batch in one process)


def make_dit_setup(d):
    make_dit(d / "m", seed=2)
    g = torch.Generator().manual_seed(3)
    save_file({"latents": torch.randn(8, 4, 8, 8, generator=g), "class_labels": torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])},
              str(d / "b.safetensors"))
    # 16 tokens of 2 x 2 patches; label dropout to the "no label" class
    return "objective: flow_matching, timestep_sampling: logit_normal, loss_weighting: cosmap, condition_dropout: 0.3"


def make_wan_setup(d):
    model = wan_model(seed=4)
    model.save_pretrained(d / "m")
    g = torch.Generator().manual_seed(5)
    # 2 frames of 4 x 4 latents, patches 1 x 2 x 2: 8 tokens
    save_file({"latents": torch.randn(8, 4, 2, 4, 4, generator=g),
               "encoder_hidden_states": torch.randn(8, 5, model.config.text_dim, generator=g)},
              str(d / "b.safetensors"))
    return "objective: flow_matching, timestep_sampling: uniform, shift: 3.0"


def make_dit_ddpm_setup(d):
    make_dit_setup(d)
    # DDPM on the learned-sigma DiT: DiT's variational-bound term joins the loss, cut by tokens under cp
    return "objective: ddpm, condition_dropout: 0.3"


SETUPS = {"dit": make_dit_setup, "wan": make_wan_setup, "dit_ddpm": make_dit_ddpm_setup}


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    out = {}
    for name, make in SETUPS.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, make(d))
    return out


def recipe(d, objective, out, steps=STEPS):
    r = out / "r.yaml"
    r.write_text(f"""
output_dir: {out / 'run'}
seed: 11
model: {{path: {d / 'm'}}}
data: {{format: batch, train: [{{path: {d / 'b.safetensors'}}}], seq_len: 16, valid_fraction: 0.5}}
train: {{steps: {steps}, micro_batch_size: {ROWS}, threads: 1}}
optim: {{lr: 2.0e-3, weight_decay: 0.01, clip: 0.5}}
schedule: {{warmup_steps: 2}}
checkpoint: {{every: {steps}}}
eval: {{every: 5, batches: 2}}
diffusion: {{{objective}}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


def metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir):
    ck = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    weights = {}
    for f in sorted(ck.glob("*.safetensors")):
        if not f.name.startswith("optimizer"):
            weights.update(load_file(str(f)))
    assert weights, f"no weights in {ck}"
    return weights


@pytest.fixture(scope="module")
def reference(setups, tmp_path_factory):
    """One process through the distributed engine (a world of one, ZeRO-1: its gradient norm sums in float64 as
    every layout's does)."""
    runs = {}
    for name, (d, objective) in setups.items():
        out = tmp_path_factory.mktemp(name + "_one")
        run_lf("train", recipe(d, objective, out), "--set", "parallel.zero=1")
        runs[name] = (metrics(out / "run"), final_weights(out / "run"))
    return runs


LAYOUTS = {  # ranks, settings (micro_batch_size: the rows of one data-parallel rank)
    "dp2": (2, ["parallel.dp=2", "train.micro_batch_size=2"]),
    "dp2_zero1": (2, ["parallel.dp=2", "parallel.zero=1", "train.micro_batch_size=2"]),
    "fsdp2": (2, ["parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=2"]),
    "hsdp2x2": (4, ["parallel.dp=4", "parallel.zero=3", "parallel.hsdp_shard=2", "train.micro_batch_size=1"]),
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_mode=a2a"]),
    "dp2_cp2_zero1": (4, ["parallel.dp=2", "parallel.cp=2", "parallel.zero=1", "train.micro_batch_size=2"]),
    "cp4_ring": (4, ["parallel.cp=4", "parallel.cp_mode=ring"]),
}
# The CI set covers every layout once (Wan: the model); the rest run with LF_SLOW=1.
CI = {("wan", l) for l in ("dp2", "dp2_zero1", "fsdp2", "hsdp2x2", "cp2_ring", "cp2_a2a")} | {
    ("dit", "cp2_ring"), ("dit", "fsdp2"), ("dit_ddpm", "cp2_a2a")}
CASES = [pytest.param(m, l, marks=() if (m, l) in CI else pytest.mark.slow) for m in SETUPS for l in LAYOUTS]


@pytest.mark.parametrize("model,layout", CASES)
def test_layout_matches_one_process(setups, reference, tmp_path, model, layout):
    d, objective = setups[model]
    n, sets = LAYOUTS[layout]
    res = launch_ranks(n, [LF_BIN, "train", recipe(d, objective, tmp_path), *sum((["--set", s] for s in sets), [])],
                       timeout=600)
    for r, p in enumerate(res):
        assert p.returncode == 0, f"rank {r}: {p.stderr[-3000:]}"
    got = metrics(tmp_path / "run")
    ref, ref_w = reference[model]
    assert len(got) == len(ref) == STEPS
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (layout, a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (layout, a["step"])
        assert ("valid_loss" in a) == ("valid_loss" in b) == (a["step"] % 5 == 0)
        if "valid_loss" in b:  # validation (its own noise stream) through the layout's forward
            assert abs(a["valid_loss"] - b["valid_loss"]) <= 1e-5 * abs(b["valid_loss"]), (layout, a["step"])
    # the training moved the weights (lr > 0), and every one ends where one process's does
    w = final_weights(tmp_path / "run")
    assert set(w) == set(ref_w)
    for k, t in ref_w.items():
        if model.startswith("dit") and k.endswith("attn1.to_k.bias"):
            # a key bias adds the same to every score of a query (softmax ignores it): its gradient is rounding noise,
            # which AdamW turns into lr-sized steps of any sign (test_dit_train skips it too)
            continue
        assert (w[k] - t).norm() <= 1e-5 * t.norm() + 1e-7, (layout, k)


def one_line_error(res):
    err = next((p.stderr for p in res if p.returncode != 0), None)
    assert err is not None, "expected a failure"
    return err.strip()


@pytest.mark.parametrize("sets,key", [(["parallel.tp=2"], "parallel.tp"), (["parallel.pp=2"], "parallel.pp")])
def test_unsupported_layouts_are_one_line_errors(setups, tmp_path, sets, key):
    for model in SETUPS:
        d, objective = setups[model]
        # validated before the processes meet: one process shows it
        err = run_lf("train", recipe(d, objective, tmp_path, steps=1), *sum((["--set", s] for s in sets), []),
                     check=False).stderr.strip()
        assert key in err and len(err.splitlines()) == 1, (model, err)


def test_sequence_not_divisible_by_cp_is_one_line(setups, tmp_path):
    d, objective = setups["wan"]
    g = torch.Generator().manual_seed(5)
    # 3 frames of 2 x 2 latents: 3 tokens
    save_file({"latents": torch.randn(2, 4, 3, 2, 2, generator=g),
               "encoder_hidden_states": torch.randn(2, 5, 24, generator=g)}, str(tmp_path / "b.safetensors"))
    (tmp_path / "m").symlink_to(d / "m")
    res = launch_ranks(2, [LF_BIN, "train", recipe(tmp_path, objective, tmp_path, steps=1), "--set", "parallel.cp=2",
                           "--set", "train.micro_batch_size=2"], timeout=300)
    err = one_line_error(res)
    assert "parallel.cp" in err and "3 tokens" in err and len(err.splitlines()) == 1, err

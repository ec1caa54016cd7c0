"""Data-parallel load balancing of packed multimodal rows (data.balance: cost, issue 19): on a skewed mix (a few
conversations with several images and long answers, many short text-only ones) a dp2 run that places the step's rows
by cost gives the losses of one process (the loss is a sum over counted tokens divided by the global count, so only
the rounding may differ), logs the ranks' cost imbalance before and after (after <= before, both >= 1, lower on some
step), resumes exactly, and without the key places rows as before (after == before)."""
import json
import random

import pytest

from conftest import LF_BIN, launch_ranks, run_lf
from test_vlm_train import draw, make_model_dir

STEPS = 4
COLOURS = [(220, 30, 30), (30, 200, 60), (30, 40, 210), (230, 210, 40)]


def skewed_mix(d, n=32, heavy_every=5, max_images=3, image_size=(30, 34), seed=3):
    """n conversations in d/data.json: every heavy_every-th has 1..max_images images and a long answer, the rest are
    short text-only questions. Returns the path."""
    rng = random.Random(seed)
    data = []
    for i in range(n):
        if i % heavy_every == 0:
            k = 1 + rng.randrange(max_images)
            names = []
            for j in range(k):
                name = f"img{i}_{j}.png"
                draw(d / name, COLOURS[(i + j) % 4], size=(image_size[0] + j, image_size[1] - j))
                names.append(name)
            answer = " ".join(rng.choice(["red", "green", "blue", "yellow"]) for _ in range(3 + 2 * k))
            data.append({"images": names, "conversations": [
                {"from": "human", "value": "<image>" * k + "\nColours?"}, {"from": "gpt", "value": answer}]})
        else:
            data.append({"conversations": [{"from": "human", "value": f"Say {i}."},
                                           {"from": "gpt", "value": rng.choice(["Ok.", "Fine.", "Yes!"])}]})
    p = d / "data.json"
    p.write_text(json.dumps(data))
    return p


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("balance")
    make_model_dir(d / "m", seed=11)
    skewed_mix(d)
    return d


def recipe(d, out):
    r = out / "r.yaml"
    r.write_text(f"""
output_dir: {out / 'run'}
seed: 5
model: {{path: {d / 'm'}}}
data: {{format: sft, train: [{{path: {d / 'data.json'}}}], seq_len: 96, packing: true}}
train: {{steps: {STEPS}, micro_batch_size: 2, grad_accum: 2, threads: 1}}
optim: {{lr: 1.0e-3, clip: 0.5}}
checkpoint: {{every: 2}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


def metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def dp2(setup, out, *sets, resume=False):
    args = sum((["--set", s] for s in ("parallel.dp=2", *sets)), [])
    res = launch_ranks(2, [LF_BIN, "train", recipe(setup, out), *args, *(["--resume"] if resume else [])],
                       timeout=600)
    for r, p in enumerate(res):
        assert p.returncode == 0, f"rank {r}: {p.stderr[-3000:]}"
    return metrics(out / "run")


@pytest.fixture(scope="module")
def one_process(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_lf("train", recipe(setup, out), "--set", "train.micro_batch_size=4")
    return metrics(out / "run")


@pytest.fixture(scope="module")
def balanced(setup, tmp_path_factory):
    return dp2(setup, tmp_path_factory.mktemp("cost"), "data.balance=cost")


def test_balanced_dp2_matches_one_process(one_process, balanced):
    assert len(one_process) == len(balanced) == STEPS
    for a, b in zip(balanced, one_process):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-5 * abs(b["grad_norm"]), a["step"]
        assert "dp_cost_imbalance_before" not in b  # one process, no balancing: nothing to report


def test_imbalance_metrics(balanced):
    for m in balanced:
        before, after = m["dp_cost_imbalance_before"], m["dp_cost_imbalance_after"]
        assert 1.0 <= after <= before + 1e-12, m
    # the mix is skewed enough that contiguous slices are uneven on some step and balancing helps there
    assert max(m["dp_cost_imbalance_before"] for m in balanced) > 1.05
    assert any(m["dp_cost_imbalance_after"] < m["dp_cost_imbalance_before"] - 0.02 for m in balanced)


def test_unbalanced_dp2_reports_and_keeps_placement(setup, one_process, tmp_path):
    got = dp2(setup, tmp_path)
    for a, b in zip(got, one_process):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["dp_cost_imbalance_after"] == a["dp_cost_imbalance_before"] >= 1.0


def test_balanced_resume_is_exact(setup, balanced, tmp_path):
    dp2(setup, tmp_path, "data.balance=cost", f"train.stop_at_step={STEPS // 2}")
    got = dp2(setup, tmp_path, "data.balance=cost", resume=True)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, balanced):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], a["step"]
        assert a["dp_cost_imbalance_after"] == b["dp_cost_imbalance_after"]


def test_bad_value_names_the_key(setup, tmp_path):
    err = run_lf("train", recipe(setup, tmp_path), "--set", "data.balance=lpt", check=False).stderr
    assert "data.balance" in err and len(err.strip().splitlines()) == 1

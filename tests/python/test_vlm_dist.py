"""A vision-language model under the parallel layouts (issue 19): LLaVA trained from image + chat data gives the
per-step losses and gradient norms of one process (fp32, 1e-5) with data parallelism (images go with their rows),
ZeRO-1, tensor parallelism of the language model with the vision tower replicated over the tp group (+ sequence
parallelism), and pipeline parallelism with the tower on the first stage (also with tp2). Qwen2.5-VL trained on packed
chat data (several conversations per row: per-document attention and multimodal positions) likewise under dp2,
tp2 + sp and pp2; Qwen3-VL under tp2 (+ sp) and FSDP dp2. Qwen3.5 / Qwen3.5-MoE (Gated DeltaNet + gated attention),
packed or not, under dp2, tp2 (+ sp), pp2, FSDP dp2, tp2 x pp2 and (MoE) ep2, ep2 x tp2 + sp, ep2 x pp2; context
parallelism with a VLM is one line."""
import json

import pytest

from conftest import LF_BIN, launch_ranks, run_lf
from test_vlm_train import draw, make_model_dir

STEPS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm_dist")
    make_model_dir(d / "m", seed=5)
    colours = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 40, 210), "yellow": (230, 210, 40)}
    data = []
    for i in range(16):
        name = list(colours)[i % 4]
        draw(d / f"{i}.png", colours[name], size=(30 + i, 44 - i))
        data.append({"image": f"{i}.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour?"},
                                                             {"from": "gpt", "value": f"It is {name}."}]})
    (d / "data.json").write_text(json.dumps(data))
    return d


def recipe(d, out):
    r = out / "r.yaml"
    r.write_text(f"""
output_dir: {out / 'run'}
seed: 7
model: {{path: {d / 'm'}}}
data: {{format: sft, train: [{{path: {d / 'data.json'}}}], seq_len: 48, packing: false}}
train: {{steps: {STEPS}, micro_batch_size: 2, grad_accum: 2, threads: 1}}
optim: {{lr: 1.0e-3, clip: 0.5}}
schedule: {{warmup_steps: 2}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


def metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """One process with the single-process engine, and one process through the distributed engine (a world of one,
    ZeRO-1): the same losses; their gradient norms differ by ~2e-6 at the first step already because the single
    engine sums the norm in float32 as torch.nn.utils.clip_grad_norm_ does and the distributed one in float64."""
    runs = {}
    for name, sets in (("single", []), ("world_of_one", ["--set", "parallel.zero=1"])):
        out = tmp_path_factory.mktemp(name)
        run_lf("train", recipe(setup, out), "--set", "train.micro_batch_size=4", *sets)
        runs[name] = metrics(out / "run")
    return runs


LAYOUTS = {
    "dp2": (2, ["parallel.dp=2"]),
    "dp2_zero1": (2, ["parallel.dp=2", "parallel.zero=1"]),
    "tp2": (2, ["parallel.tp=2", "train.micro_batch_size=4"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true", "train.micro_batch_size=4"]),
    "pp2": (2, ["parallel.pp=2", "train.micro_batch_size=4"]),
    # the tower replicated over the language model's tp group, on the first of two pipeline stages
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=4"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vlm_layout_matches_one_process(setup, reference, tmp_path, layout):
    n, sets = LAYOUTS[layout]
    args = sum((["--set", s] for s in sets), [])
    res = launch_ranks(n, [LF_BIN, "train", recipe(setup, tmp_path), *args], timeout=600)
    for r, p in enumerate(res):
        assert p.returncode == 0, f"rank {r}: {p.stderr[-3000:]}"
    got = metrics(tmp_path / "run")
    single, one = reference["single"], reference["world_of_one"]
    assert len(got) == len(single) == len(one) == STEPS
    for a, b, c in zip(got, single, one):
        for ref in (b, c):
            assert abs(a["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (layout, a["step"], a["loss"], ref["loss"])
        assert abs(a["grad_norm"] - c["grad_norm"]) <= 1e-5 * abs(c["grad_norm"]), (layout, a["step"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-5 * abs(b["grad_norm"]), (layout, a["step"])


class QwenSetups(dict):
    """The tiny model folder and data of each family, made when a test first asks for it."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, family):
        self[family] = make_qwen_setup(self.factory, family)
        return self[family]


@pytest.fixture(scope="module")
def qwen_setups(tmp_path_factory):
    return QwenSetups(tmp_path_factory)


def make_qwen_setup(tmp_path_factory, family):
    from test_qwen_vl_train import make_model_dir as make_qwen
    d = tmp_path_factory.mktemp(family)
    make_qwen(d / "m", family, seed=6)
    colours = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 40, 210)}
    data = []
    for i in range(12):
        name = list(colours)[i % 3]
        draw(d / f"{i}.png", colours[name], size=(20 + 2 * i, 24))
        data.append({"image": f"{i}.png", "conversations": [{"from": "human", "value": "<image>Colour?"},
                                                             {"from": "gpt", "value": name}]})
    (d / "data.json").write_text(json.dumps(data))
    return d


def qwen_recipe(d, out, packing=True):
    r = out / "r.yaml"
    r.write_text(f"""
output_dir: {out / 'run'}
seed: 3
model: {{path: {d / 'm'}}}
data: {{format: sft, train: [{{path: {d / 'data.json'}}}], seq_len: 160, packing: {'true' if packing else 'false'}}}
train: {{steps: 6, micro_batch_size: 2, threads: 1}}
optim: {{lr: 1.0e-3, clip: 0.5}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


QWEN_LAYOUTS = {"dp2": ["parallel.dp=2", "train.micro_batch_size=1"], "tp2": ["parallel.tp=2"],
                "tp2_sp": ["parallel.tp=2", "parallel.sp=true"], "pp2": ["parallel.pp=2"],
                "fsdp2": ["parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=1"],
                "ep2": ["parallel.dp=2", "parallel.ep=2", "train.micro_batch_size=1"],
                # four ranks
                "tp2_pp2": ["parallel.tp=2", "parallel.pp=2"],
                "ep2_tp2_sp": ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.sp=true",
                               "train.micro_batch_size=1"],
                "ep2_pp2": ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "train.micro_batch_size=1"]}


def check_qwen_layout(setup, tmp_path, layout, packing=True):
    """The per-step losses and gradient norms of the layout (two or four ranks) = a world of one (distributed
    engine)."""
    one = tmp_path / "one"
    one.mkdir()
    run_lf("train", qwen_recipe(setup, one, packing), "--set", "parallel.zero=1")
    ref = metrics(one / "run")
    sets = sum((["--set", s] for s in QWEN_LAYOUTS[layout]), [])
    n = 4 if layout in ("tp2_pp2", "ep2_tp2_sp", "ep2_pp2") else 2
    res = launch_ranks(n, [LF_BIN, "train", qwen_recipe(setup, tmp_path, packing), *sets], timeout=600)
    for r, p in enumerate(res):
        assert p.returncode == 0, f"rank {r}: {p.stderr[-3000:]}"
    got = metrics(tmp_path / "run")
    assert len(got) == len(ref) == 6
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (layout, a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (layout, a["step"])


@pytest.mark.parametrize("family,layout", [("qwen2_5_vl", "dp2"), ("qwen2_5_vl", "tp2_sp"), ("qwen2_5_vl", "pp2"),
                                           ("qwen3_vl", "tp2"), ("qwen3_vl", "tp2_sp"), ("qwen3_vl", "fsdp2")])
def test_qwen_vl_packed_layout_matches_one_process(qwen_setups, tmp_path, family, layout):
    """(Qwen3-VL under sequence parallelism: its deepstack features cut like the sequence; as FSDP units: the
    features added after each unit, outside its recomputation.)"""
    check_qwen_layout(qwen_setups[family], tmp_path, layout)


QWEN3_5_CASES = [(f, l, p) for f in ("qwen3_5", "qwen3_5_moe") for l in QWEN_LAYOUTS
                 if not l.startswith("ep2") or f == "qwen3_5_moe" for p in (True, False)]
QWEN3_5_FAST = {("qwen3_5", "tp2_sp", True), ("qwen3_5_moe", "ep2", True)}


@pytest.mark.parametrize("family,layout,packing", [
    pytest.param(*c, marks=() if c in QWEN3_5_FAST else pytest.mark.slow) for c in QWEN3_5_CASES])
def test_qwen3_5_vl_layout_matches_one_process(qwen_setups, tmp_path, family, layout, packing):
    """Qwen3.5 / Qwen3.5-MoE (Gated DeltaNet + gated attention decoder): packed rows restart the linear-attention
    state and convolution at each conversation under every layout; the linear-attention heads split over tp."""
    check_qwen_layout(qwen_setups[family], tmp_path, layout, packing)


def test_qwen3_5_vl_under_context_parallelism_is_one_line(qwen_setups, tmp_path):
    """The cp chunks would be cut from the token rows before the image features join them: one line naming the key."""
    res = launch_ranks(2, [LF_BIN, "train", qwen_recipe(qwen_setups["qwen3_5"], tmp_path), "--set", "parallel.cp=2"],
                       timeout=300)
    for p in res:
        assert p.returncode == 1
        err = p.stderr.strip()
        assert "parallel.cp" in err and "vision-language" in err and len(err.splitlines()) == 1, err

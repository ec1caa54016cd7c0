"""LoRA in distributed runs (CPU, Gloo): data parallel (DDP, ZeRO-1), tensor parallel (+sp) and pipeline parallel
give the per-step losses and gradient norms of the single-process LoRA run (fp32, 1e-5), and the PEFT adapter they
save equals the single-process one (1e-5). Unsupported combinations are one-line errors naming the field."""
import json

import pytest
from safetensors.torch import load_file

from conftest import run_lf
from test_dist_train import close, data_dir, metrics, recipe, train_ranks  # noqa: F401 (data_dir is a fixture)

TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
COMMON = ["train.steps=4", "lora.enabled=true", "lora.r=4", "lora.alpha=8", f"lora.target_modules={TARGETS}",
          "optim.lr=2.0e-2", "optim.eps=1.0e-5"]
# optim.eps: Adam's update lr * m / (sqrt(v) + eps) amplifies a gradient difference by lr / eps where the gradient
# itself is ~eps. With eps 1e-8 a few adapter elements whose gradients cancel to ~1e-8 turned fp32 summation-order
# differences (other row splits, other reduction order) into 1e-5..1e-4 relative weight differences (measured:
# single elements, norm-relative 2e-6); eps 1e-5 keeps every step well-conditioned. The weights then agree to
# 1e-6..1.6e-5 of their largest element depending on the CPU's GEMM kernels (1.6e-5 with MKL's AVX-512 ones, pp2),
# hence 5e-5; a wrong layout is off by O(1) (the losses and grad norms are checked to 1e-5 besides).
CKPT = "run/checkpoints/step_00000004"


def sets_args(sets):
    return sum((["--set", s] for s in sets), [])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):  # noqa: F811
    tmp = tmp_path_factory.mktemp("lora_ref")
    # one process, one thread part (train.cpu_split=1): the reference sums its batch in one order
    run_lf("train", recipe(tmp, data_dir), *sets_args(COMMON + ["train.micro_batch_size=4", "train.cpu_split=1"]))
    return metrics(tmp / "run"), tmp / CKPT


LAYOUTS = {
    "dp2": (2, ["parallel.dp=2", "train.micro_batch_size=2"]),
    "dp2_zero1": (2, ["parallel.dp=2", "parallel.zero=1", "train.micro_batch_size=2"]),
    "tp2": (2, ["parallel.tp=2", "train.micro_batch_size=4"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true", "train.micro_batch_size=4"]),
    "pp2": (2, ["parallel.pp=2", "train.micro_batch_size=4"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_one_process(tmp_path, data_dir, reference, name):  # noqa: F811
    ref_metrics, ref_ckpt = reference
    n, sets = LAYOUTS[name]
    train_ranks(n, recipe(tmp_path, data_dir), COMMON + sets)
    got = metrics(tmp_path / "run")
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert ref_metrics[-1]["loss"] != ref_metrics[0]["loss"]  # the adapter trains
    for m, ref in zip(got, ref_metrics):
        assert close(m["loss"], ref["loss"]), (name, m["step"], m["loss"], ref["loss"])
        assert close(m["grad_norm"], ref["grad_norm"]), (name, m["step"], m["grad_norm"], ref["grad_norm"])
    ckpt = tmp_path / CKPT
    assert not (ckpt / "model.safetensors.index.json").exists() and not list(ckpt.glob("adapter-rank-*"))
    assert json.loads((ckpt / "adapter_config.json").read_text()) == json.loads((ref_ckpt / "adapter_config.json").read_text())
    want, have = load_file(ref_ckpt / "adapter_model.safetensors"), load_file(ckpt / "adapter_model.safetensors")
    assert sorted(have) == sorted(want)
    for k, w in want.items():
        assert have[k].shape == w.shape, k
        err = (have[k] - w).abs().max().item() / max(w.abs().max().item(), 1e-12)
        assert err <= 5e-5, (name, k, err)


@pytest.mark.parametrize("sets,needle", [
    (["parallel.dp=2", "parallel.zero=3"], "recipe: field 'parallel.zero': 3 (FSDP) does not train LoRA adapters"),
    (["parallel.cp=2"], "recipe: field 'parallel.cp': context parallel does not train LoRA adapters"),
    (["parallel.tp=2", "lora.dropout=0.1"], "recipe: field 'lora.dropout': must be 0 with parallel.tp > 1"),
    (["parallel.dp=2", "lora.target_modules=[q_proj,lm_head]"], "recipe: field 'lora.target_modules'"),
])
def test_lora_unsupported_layouts_one_line(tmp_path, data_dir, sets, needle):  # noqa: F811
    proc = run_lf("train", recipe(tmp_path, data_dir), *sets_args(COMMON + sets), check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr

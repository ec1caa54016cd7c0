"""`device: cuda` on a machine without a usable GPU (CI: CUDA toolkit, no driver): `loongforge train` (and `eval`,
`generate --device cuda`) says so in exactly one line and runs the CPU run (same losses as `device: cpu`, bitwise; `train.cuda_graphs` is then moot); the
GPU-only options (`precision: fp8` without a GPU, `train.cuda_graphs` with `device: cpu`) are one-line errors naming
their field."""
import json

import pytest
import torch

from conftest import run_lf

MODEL = {
    "model_type": "llama", "vocab_size": 17, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is usable here: no fallback to test")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    run_lf("data", "synth", "--task", "addition", "--docs", 400, "--digits", 2, "--out", d)
    run_lf("data", "tokenize", "--tokenizer", d, "--input", d / "train.jsonl", "--out", d / "train")
    (d / "model.json").write_text(json.dumps(MODEL))
    return d


def recipe(tmp_path, data_dir, name):
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"""
output_dir: {tmp_path / name}
seed: 3
model:
  config: {data_dir / 'model.json'}
  tokenizer: {data_dir}
data:
  train:
    - path: {data_dir / 'train'}
  seq_len: 32
train:
  steps: 4
  micro_batch_size: 4
  grad_accum: 2
  threads: 2
optim:
  lr: 1.0e-2
log:
  progress: lines
  plot: false
  tensorboard: false
""")
    return p


def losses(run_dir):
    return [(m["loss"], m["grad_norm"]) for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_without_gpu_says_so_once_and_trains_as_cpu(tmp_path, data_dir, precision):
    cpu = run_lf("train", recipe(tmp_path, data_dir, "cpu"), "--set", f"precision={precision}")
    # bf16 also asks for CUDA graphs: on the CPU fallback there is nothing to capture, the run is the same.
    graphs = ["--set", "train.cuda_graphs=true"] if precision == "bf16" else []
    gpu = run_lf("train", recipe(tmp_path, data_dir, "cuda"), "--set", "device=cuda", "--set", f"precision={precision}",
                 *graphs)
    assert "device" not in cpu.stderr
    lines = [l for l in gpu.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, gpu.stderr
    line = lines[0]
    assert line.startswith("loongforge: device 'cuda' requested but no usable GPU (") and line.endswith(
        "); running on the CPU"), line
    # The reason: the CUDA runtime's error (CUDA build, no driver) or the build without CUDA.
    assert "cudaGetDeviceCount" in line or "LOONGFORGE_CUDA=OFF" in line, line
    assert gpu.stdout.count("loongforge: device") == 0
    a, b = losses(tmp_path / "cpu"), losses(tmp_path / "cuda")
    assert len(a) == 4 and a == b  # the same run, bitwise
    assert "max_memory_allocated" not in (tmp_path / "cuda" / "metrics.jsonl").read_text()
    if precision == "fp32":  # `eval` takes the recipe's device the same way
        root = tmp_path / "cpu" / "checkpoints"
        ck = root / (root / "latest").read_text().strip()
        r = recipe(tmp_path, data_dir, "cpu")
        e_cpu = run_lf("eval", r, "--model", ck, "--set", "eval.batches=2")
        e_gpu = run_lf("eval", r, "--model", ck, "--set", "eval.batches=2", "--set", "device=cuda")
        assert e_cpu.stdout == e_gpu.stdout and "device" not in e_cpu.stderr
        assert [l for l in e_gpu.stderr.splitlines() if l.strip()] == [line]
        # and `generate --device cuda`: the same line, then the CPU's continuation
        gen = ["generate", "--model", ck, "--prompt-ids", "1,5,6", "--max-new-tokens", 6, "--ids"]
        g_cpu, g_gpu = run_lf(*gen), run_lf(*gen, "--device", "cuda")
        assert 0 < len(json.loads(g_cpu.stdout)) <= 6 and g_cpu.stdout == g_gpu.stdout and "device" not in g_cpu.stderr
        assert [l for l in g_gpu.stderr.splitlines() if l.strip()] == [line]


@pytest.mark.parametrize("sets, needle", [
    (["precision=fp8"], "recipe: field 'precision': fp8 needs a CUDA GPU (Hopper)"),
    (["precision=fp8", "device=cuda"], "recipe: field 'precision': fp8 needs a CUDA GPU (Hopper)"),
    (["train.cuda_graphs=true"], "recipe: field 'train.cuda_graphs': CUDA graphs need device: cuda"),
    (["parallel.zero=1", "parallel.backend=nccl"], "recipe: field 'parallel.backend': nccl needs GPUs"),
    (["device=tpu"], "'device': 'tpu' is not one of"),
])
def test_gpu_only_options_fail_in_one_line(tmp_path, data_dir, sets, needle):
    proc = run_lf("train", recipe(tmp_path, data_dir, "bad"), *sum((["--set", s] for s in sets), []), check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr

"""Oracle tests of the safetensors reader/writer (src/loongforge/io/safetensors.*) against Python safetensors and
transformers.

There is no CLI subcommand for safetensors, so these tests drive the SafetensorsOracle.* gtests of
tests/cpp/test_safetensors.cpp (skipped unless their environment variables are set) in the gtest binary:
  $LOONGFORGE_TESTS_BIN if set, else loongforge_tests beside the loongforge binary (conftest.py).
A missing binary fails the tests (build it first: `bash scripts/build.sh`).
"""
import json
import os
import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TESTS_BIN, ROOT






def run_oracle(test, **env):
    """Runs one SafetensorsOracle gtest with the environment variables; fails unless it ran and passed."""
    assert TESTS_BIN.exists(), f"{TESTS_BIN} not found: build it first (bash scripts/build.sh)"
    proc = subprocess.run([str(TESTS_BIN), f"--gtest_filter=SafetensorsOracle.{test}"], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "2", **{k: str(v) for k, v in env.items()}})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{test} failed ({proc.returncode}):\n{out}"
    assert f"[       OK ] SafetensorsOracle.{test}" in out, f"{test} did not run:\n{out}"


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
          torch.bool]


def sample(dtype, shape, scale=0.5):
    """The same values as sample() in test_safetensors.cpp."""
    n = 1
    for d in shape:
        n *= d
    x = torch.arange(n, dtype=torch.float64)
    if dtype == torch.bool:
        return (x.fmod(2) == 1).reshape(shape)
    if dtype.is_floating_point:
        x = x * scale - 1.0
    return x.to(dtype).reshape(shape)


def random_tensors():
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dt in enumerate(DTYPES):
        name = str(dt).replace("torch.", "")
        if dt == torch.bool:
            out[f"{name}.w"] = torch.rand(5, 3, generator=g) > 0.5
        elif dt.is_floating_point:
            out[f"{name}.w"] = (torch.randn(5, 3, generator=g) * 4).to(dt)
        else:
            out[f"{name}.w"] = torch.randint(0, 100, (5, 3), generator=g).to(dt)
        out[f"{name}.scalar"] = out[f"{name}.w"][0, 0].clone()
        out[f"{name}.empty"] = out[f"{name}.w"][:0].clone()
        out[f"layer.{i}.vec"] = out[f"{name}.w"][1].clone()
    return out


def assert_same(a, b, name):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.dtype.itemsize == 0 or a.numel() == 0:
        return
    assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}, {"format": "pt", "b": "x\ny\"é", "c": "", "d": "4"}])
def test_python_written_files_read_and_rewrite_exactly(tmp_path, metadata):
    tensors = random_tensors()
    src = tmp_path / "py.safetensors"
    save_file(tensors, str(src), metadata=metadata)
    out, f64 = tmp_path / "lf.safetensors", tmp_path / "f64.safetensors"
    run_oracle("Rewrite", LF_ST_ROUNDTRIP_IN=src, LF_ST_ROUNDTRIP_OUT=out, LF_ST_F64_OUT=f64)
    assert out.read_bytes() == src.read_bytes()
    # Values as our reader interprets them (converted to F64 by ATen) equal Python's.
    ours = load_file(str(f64))
    assert sorted(ours) == sorted(tensors)
    for name, t in tensors.items():
        assert ours[name].dtype == torch.float64 and ours[name].shape == t.shape, name
        assert torch.equal(ours[name], t.to(torch.float64)), name


def test_files_we_write_are_read_by_python(tmp_path):
    run_oracle("WriteSamples", LF_ST_WRITE_DIR=tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "sample.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "by": "lf"}
    got = load_file(str(tmp_path / "sample.safetensors"))
    assert len(got) == 3 * len(DTYPES)
    for dt in DTYPES:
        from safetensors.torch import _TYPES  # dtype name as the file spells it
        d = next(k for k, v in _TYPES.items() if v == dt)
        assert_same(got[f"{d}.matrix"], sample(dt, (3, 4)), d)
        assert_same(got[f"{d}.scalar"], sample(dt, ()), d)
        assert_same(got[f"{d}.empty"], sample(dt, (2, 0)), d)
    # The sharded copy: an index as transformers writes it, and shards Python reads.
    sharded = tmp_path / "sharded"
    index_text = (sharded / "model.safetensors.index.json").read_text()
    index = json.loads(index_text)
    assert index_text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for name, shard in index["weight_map"].items():
        t = load_file(str(sharded / shard))[name]
        total += t.numel() * t.element_size()
        assert_same(t, got[name], name)
    assert index["metadata"]["total_size"] == total
    assert len(index["weight_map"]) == len(DTYPES)


def test_transformers_sharded_checkpoint(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(str(ckpt), max_shard_size="20KB")
    assert (ckpt / "model.safetensors.index.json").exists()
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) > 1
    out = tmp_path / "all.safetensors"
    run_oracle("CheckpointDump", LF_ST_CHECKPOINT_IN=ckpt, LF_ST_CHECKPOINT_OUT=out)
    ours = load_file(str(out))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert sorted(ours) == sorted(index["weight_map"])
    state = model.state_dict()
    for name, t in ours.items():
        assert_same(t, state[name], name)
    from safetensors import safe_open
    with safe_open(str(out), "pt") as f:
        dtypes = dict(line.split("=") for line in f.metadata()["dtypes"].splitlines())
    assert set(dtypes.values()) == {"BF16"} and len(dtypes) == len(ours)
    # A shard transformers wrote is rewritten byte for byte.
    run_oracle("Rewrite", LF_ST_ROUNDTRIP_IN=shards[0], LF_ST_ROUNDTRIP_OUT=tmp_path / "shard.safetensors")
    assert (tmp_path / "shard.safetensors").read_bytes() == shards[0].read_bytes()

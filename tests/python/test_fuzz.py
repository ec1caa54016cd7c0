"""The fuzz targets (tests/fuzz/) in CI: seed corpora from scripts/fuzz_seeds.py (the repository's files and the
reference libraries' outputs), each seed and deterministic mutations of it through every target in the gtest
binary (FuzzHook.Smoke): success or an lf::Error, never another exception or a crash. scripts/fuzz.sh runs the same
targets under libFuzzer with AddressSanitizer + UndefinedBehaviorSanitizer (bench/results/fuzz.md)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, run_gtest_hook


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz_corpus")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz_seeds.py"), str(out), "--quick"], check=True,
                   capture_output=True)
    # the inputs of fixed findings (scripts/fuzz.sh) are seeds too: replayed, and mutated, in every run
    for f in (ROOT / "tests" / "fuzz" / "regressions").glob("*/*"):
        (out / f.parent.name).mkdir(exist_ok=True)
        shutil.copy(f, out / f.parent.name / f"regression-{f.name}")
    return out


# mutations per seed: model_config describes the config with every family per run (slower), the rest are cheap
MUTATIONS = {"model_config": 12}
TARGETS = ["safetensors", "safetensors_index", "model_config", "tokenizer_json", "sentencepiece", "bpe_text",
           "recipe", "token_shard", "sft_data", "chat_template", "moe_plan", "image", "depth_tiff", "parquet", "video",
           "lerobot", "hdf5_episode", "serve_request"]


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_smoke(corpus, tmp_path, target):
    if target == "hdf5_episode" and not (corpus / target).exists():
        pytest.skip("no HDF5 seeds: h5py is in neither .venv nor .venv-lerobot")
    if target == "serve_request" and not (corpus / target).exists():
        pytest.skip("no policy-server seeds: no openpi-client (.venv-openpi)")
    assert any((corpus / target).iterdir()), f"no seeds for {target}"
    run_gtest_hook("FuzzHook.Smoke", {"LF_FUZZ_CORPUS": str(corpus), "LF_FUZZ_TARGETS": target,
                                      "LF_FUZZ_MUTATIONS": os.environ.get("LF_FUZZ_MUTATIONS", str(MUTATIONS.get(target, 60))),
                                      "LF_FUZZ_FAILURES": str(tmp_path / "failures")})

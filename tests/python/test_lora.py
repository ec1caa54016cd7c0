"""LoRA adapters against PEFT, fp32 on the CPU.

`loongforge dump --lora` must give PEFT's logits/loss (rel 1e-5), adapter gradients (rel 1e-4, named as in
adapter_model.safetensors) and parameters after one AdamW step (check_after_step); `convert --lora` must equal
merge_and_unload (rel 1e-5); adapters we save (gtest LoraSave.PeftOracle) must load in PeftModel.from_pretrained;
bad adapter folders are exit 1 with one line naming the file and the field/tensor.
"""
import json
import os
import pathlib
import shutil
import subprocess

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import TESTS_BIN, ROOT, run_lf
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, check_after_step, make_batch, make_model, rel_err

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {
    "llama": ("llama", dict()),
    "qwen3_tied_bias": ("qwen3", dict(head_dim=16, attention_bias=True, tie_word_embeddings=True)),
}




def adapter_key(name):
    """PEFT's in-memory parameter name -> its name in adapter_model.safetensors."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def make_peft(model, tmp_path, dropout=0.0, seed=3):
    """Base model saved to tmp_path/base; a LoRA adapter with random non-zero B saved to tmp_path/adapter."""
    model.save_pretrained(tmp_path / "base")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(tmp_path / "adapter")
    return pm


def dump(model_dir, adapter, ids, labels, tmp_path, extra=()):
    batch, out = tmp_path / "batch.safetensors", tmp_path / "out.safetensors"
    save_file({"input_ids": ids, "labels": labels}, str(batch))
    run_lf("dump", "--model", model_dir, "--lora", adapter, "--batch", batch, "--out", out, *extra)
    return load_file(str(out))


@pytest.mark.parametrize("case", sorted(CASES))
def test_dump_matches_peft(case, tmp_path):
    model_type, overrides = CASES[case]
    pm = make_peft(make_model(model_type, overrides), tmp_path)
    ids, labels = make_batch(pm.config.vocab_size)
    ours = dump(tmp_path / "base", tmp_path / "adapter", ids, labels, tmp_path, ["--adamw", ADAMW])

    pm.train()
    out = pm(input_ids=ids, labels=labels)
    out.loss.backward()
    trainable = {adapter_key(n): p for n, p in pm.named_parameters() if p.requires_grad}
    file_keys = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert set(trainable) == file_keys and len(file_keys) == 2 * len(TARGETS) * pm.config.num_hidden_layers
    assert rel_err(ours["logits"], out.logits) <= 1e-5
    assert abs(ours["loss"].item() - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    assert {k[len("grad."):] for k in ours if k.startswith("grad.")} == file_keys
    assert {k[len("after_step."):] for k in ours if k.startswith("after_step.")} == file_keys
    grads = {n: p.grad.clone() for n, p in trainable.items()}
    for n in file_keys:
        assert grads[n].abs().max() > 0, n
        assert rel_err(ours["grad." + n], grads[n]) <= 1e-4, n
    torch.optim.AdamW(trainable.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step()
    for n, p in trainable.items():
        check_after_step(ours["after_step." + n], p.detach(), ours["grad." + n], grads[n])


def test_dump_disables_adapter_dropout(tmp_path):
    pm = make_peft(make_model("llama", dict()), tmp_path, dropout=0.3)
    ids, labels = make_batch(pm.config.vocab_size)
    ours = dump(tmp_path / "base", tmp_path / "adapter", ids, labels, tmp_path)
    pm.eval()
    with torch.no_grad():
        want = pm(input_ids=ids, labels=labels)
    assert rel_err(ours["logits"], want.logits) <= 1e-5
    assert abs(ours["loss"].item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())


@pytest.mark.parametrize("case", sorted(CASES))
def test_convert_merges_like_merge_and_unload(case, tmp_path):
    model_type, overrides = CASES[case]
    pm = make_peft(make_model(model_type, overrides), tmp_path)
    ids, _ = make_batch(pm.config.vocab_size)
    merged = pm.merge_and_unload().eval()
    with torch.no_grad():
        want = merged(input_ids=ids).logits
    out = tmp_path / "merged"
    run_lf("convert", "--model", tmp_path / "base", "--lora", tmp_path / "adapter", "--out", out, "--dtype", "fp32")
    assert not any("lora" in k for k in load_file(str(out / "model.safetensors")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        got = hf.eval()(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-5


def test_saved_adapter_loads_in_peft(tmp_path):
    model = make_model("llama", dict())
    model.save_pretrained(tmp_path / "base")
    adapter = tmp_path / "ours"
    tests_bin = TESTS_BIN
    assert tests_bin.exists(), f"{tests_bin} not found: build it first (bash scripts/build.sh)"
    proc = subprocess.run([str(tests_bin), "--gtest_filter=LoraSave.PeftOracle"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "2", "LF_LORA_SAVE_BASE": str(tmp_path / "base"),
                               "LF_LORA_SAVE_OUT": str(adapter)})
    assert proc.returncode == 0 and "[       OK ] LoraSave.PeftOracle" in proc.stdout, proc.stdout + proc.stderr

    pm = peft.PeftModel.from_pretrained(model, adapter).eval()
    assert pm.peft_config["default"].use_rslora
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    lora = {adapter_key(n): p for n, p in pm.named_parameters() if "lora_" in n}
    assert set(lora) == set(saved)  # PEFT adapted exactly the modules we did (q, v, mlp up/down)
    assert len(saved) == 2 * 4 * model.config.num_hidden_layers
    for n, t in saved.items():
        assert torch.equal(lora[n].detach(), t), n
    ids, labels = make_batch(model.config.vocab_size)
    with torch.no_grad():
        want = pm(input_ids=ids, labels=labels)
    ours = dump(tmp_path / "base", adapter, ids, labels, tmp_path)
    assert rel_err(ours["logits"], want.logits) <= 1e-5
    with pm.disable_adapter(), torch.no_grad():  # the adapter is not a no-op
        assert rel_err(pm(input_ids=ids).logits, want.logits) > 1e-3


def _bad_bias(d):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["bias"] = "all"
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _bad_type(d):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["peft_type"] = "PREFIX_TUNING"
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _dora(d):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _bad_json(d):
    (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4,')


def _missing_tensor(d):
    p = d / "adapter_model.safetensors"
    t = load_file(str(p))
    del t["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    save_file(t, str(p))


def _misshapen_tensor(d):
    p = d / "adapter_model.safetensors"
    t = load_file(str(p))
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(3, 64)
    save_file(t, str(p))


BAD = {
    "bias_all": (_bad_bias, ["adapter_config.json", "'bias'", "all"]),
    "peft_type": (_bad_type, ["adapter_config.json", "'peft_type'", "PREFIX_TUNING"]),
    "dora": (_dora, ["adapter_config.json", "'use_dora'"]),
    "bad_json": (_bad_json, ["adapter_config.json"]),
    "missing_tensor": (_missing_tensor, ["adapter_model.safetensors",
                                         "'base_model.model.model.layers.1.mlp.up_proj.lora_B.weight'", "missing"]),
    "misshapen_tensor": (_misshapen_tensor, ["adapter_model.safetensors",
                                             "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'"]),
}


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_good")
    make_peft(make_model("llama", dict(num_hidden_layers=2)), d)
    return d


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("cmd", ["dump", "convert"])
def test_bad_adapter_is_one_line_error(case, cmd, good_adapter, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(good_adapter / "adapter", adapter)
    edit, needles = BAD[case]
    edit(adapter)
    out = tmp_path / "out"
    if cmd == "dump":
        batch = tmp_path / "batch.safetensors"
        save_file({"input_ids": torch.randint(0, 384, (1, 8))}, str(batch))
        args = ["dump", "--model", good_adapter / "base", "--lora", adapter, "--batch", batch, "--out", out]
    else:
        args = ["convert", "--model", good_adapter / "base", "--lora", adapter, "--out", out, "--dtype", "fp32"]
    proc = run_lf(*args, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists()

"""Bad model folders and batches: exit code 1 and a single-line error that names the file and the field/tensor."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, run_lf


@pytest.fixture()
def model_dir(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(FIXTURES / "hf_llama", d)
    return d


@pytest.fixture()
def batch(tmp_path):
    p = tmp_path / "batch.safetensors"
    save_file({"input_ids": torch.randint(0, 512, (1, 8))}, str(p))
    return p


def dump_error(model_dir, batch, tmp_path):
    out = tmp_path / "out.safetensors"
    proc = run_lf("dump", "--model", model_dir, "--batch", batch, "--out", out, check=False)
    assert proc.returncode == 1, proc.stderr
    assert not out.exists()  # nothing written on failure
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def edit_config(model_dir, fn):
    p = model_dir / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(model_type="gpt_neox"), "model_type"),
    (lambda c: c.pop("hidden_size"), "hidden_size"),
    (lambda c: c.update(num_attention_heads="four"), "num_attention_heads"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_parameters.rope_type"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     "rope_parameters.low_freq_factor"),
    (lambda c: c.update(hidden_act="swish_beta"), "hidden_act"),
    (lambda c: c.update(attention_dropout=0.1), "attention_dropout"),
    (lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_bad_config_names_file_and_field(model_dir, batch, tmp_path, edit, field):
    edit_config(model_dir, edit)
    line = dump_error(model_dir, batch, tmp_path)
    assert "config.json" in line and f"'{field}'" in line, line


def test_invalid_json_config(model_dir, batch, tmp_path):
    (model_dir / "config.json").write_text('{"model_type": "llama",')
    line = dump_error(model_dir, batch, tmp_path)
    assert "config.json" in line and "JSON" in line


def test_weight_shape_mismatch_names_tensor(model_dir, batch, tmp_path):
    sd = load_file(str(model_dir / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(65)
    save_file(sd, str(model_dir / "model.safetensors"))
    line = dump_error(model_dir, batch, tmp_path)
    assert "model.norm.weight" in line and "shape" in line


def test_missing_and_unexpected_weights(model_dir, batch, tmp_path):
    sd = load_file(str(model_dir / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(model_dir / "model.safetensors"))
    assert "lm_head.weight" in dump_error(model_dir, batch, tmp_path)
    sd["lm_head.weight"] = torch.zeros(512, 64)
    sd["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(sd, str(model_dir / "model.safetensors"))
    assert "model.layers.0.extra.weight" in dump_error(model_dir, batch, tmp_path)


def test_truncated_weights_file(model_dir, batch, tmp_path):
    p = model_dir / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    assert "model.safetensors" in dump_error(model_dir, batch, tmp_path)


def test_bad_batch(model_dir, tmp_path):
    p = tmp_path / "b.safetensors"
    save_file({"tokens": torch.zeros(1, 4, dtype=torch.int64)}, str(p))
    line = dump_error(model_dir, p, tmp_path)
    assert "b.safetensors" in line and "input_ids" in line
    save_file({"input_ids": torch.zeros(1, 4, dtype=torch.int32)}, str(p))
    assert "input_ids" in dump_error(model_dir, p, tmp_path)
    save_file({"input_ids": torch.full((1, 4), 600, dtype=torch.int64)}, str(p))
    assert "input_ids" in dump_error(model_dir, p, tmp_path)


def test_existing_output_kept_on_failure(model_dir, batch, tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    edit_config(model_dir, lambda c: c.update(model_type="bert"))
    proc = run_lf("dump", "--model", model_dir, "--batch", batch, "--out", out, check=False)
    assert proc.returncode == 1 and out.read_bytes() == b"precious"


def test_bad_adamw_spec(model_dir, batch, tmp_path):
    proc = run_lf("dump", "--model", model_dir, "--batch", batch, "--out", tmp_path / "o.safetensors",
                  "--adamw", "lr=1e-3,momentum=0.9", check=False)
    assert proc.returncode == 1 and "momentum" in proc.stderr


def test_old_rotary_buffers_are_ignored(model_dir, batch, tmp_path):
    """Checkpoints from older transformers carry rotary_emb.inv_freq buffers; transformers ignores them, so do we."""
    sd = load_file(str(model_dir / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, str(model_dir / "model.safetensors"))
    run_lf("dump", "--model", model_dir, "--batch", batch, "--out", tmp_path / "o.safetensors")


@pytest.mark.parametrize("cfg, field, known", [
    ({"model_type": "gpt_neox"}, "model_type", "deepseek_v3, deepseek_v32, deepseek_v4, glm4_moe, glm_moe_dsa, kimi_linear, llama, llava, minimax_m2, mistral, mistral4, mixtral, qwen2, qwen2_5_vl, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next"),
    ({"_class_name": "NoSuchTransformer2DModel"}, "_class_name", None),
    ({"type": "no_such_policy"}, "type", None),
    ({"hidden_size": 8}, "model_type", "llama"),
])
def test_unknown_family_is_one_line_naming_the_field_and_the_known_values(tmp_path, cfg, field, known):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    proc = run_lf("info", p, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert str(p) in lines[0] and f"'{field}'" in lines[0] and "known" in lines[0], lines[0]
    if known:
        assert known in lines[0], lines[0]


def test_token_ids_past_the_vocabulary_name_the_shard(model_dir, tmp_path):
    """Pretraining data tokenized for another model (ids at or past the model's vocab_size): one line naming the
    shard, at the batch that holds one (it was an internal error from the embedding, with a stack trace)."""
    import numpy as np
    from test_dist_ep import write_shard
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    toks = np.random.default_rng(0).integers(0, vocab, 4000)
    toks[1234] = vocab + 5
    write_shard(tmp_path / "data", toks, docs=4)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{path: {model_dir}}}\n"
                      f"data: {{train: [{{path: {tmp_path / 'data'}}}], seq_len: 1000}}\n"
                      "train: {steps: 4, micro_batch_size: 2, threads: 1}\ncheckpoint: {every: 0}\n"
                      "log: {progress: off, tensorboard: false, plot: false}\n")
    r = run_lf("train", recipe, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-2000:]
    assert f"{tmp_path / 'data'}.bin" in lines[0] and f"token id {vocab + 5}" in lines[0] and str(vocab) in lines[0]

"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers' own model code, in fp32 on the CPU.

`loongforge dump` logits/loss/gradients/AdamW step as in test_model_parity.py; per-expert checkpoint names
(save_pretrained's layout) on load and on export; a missing expert tensor is an error naming the file and tensor.
"""
import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_model_parity import ADAMW, check_export, compare, hf_reference, make_batch, rel_err, run_dump

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)

CASES = {
    # layers 0 and 2 dense, layer 1 sparse; top-k weights not renormalized
    "qwen3_moe_sparse_step": ("qwen3_moe", dict(num_hidden_layers=3, decoder_sparse_step=2, num_experts=8,
                                                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                                                head_dim=16)),
    # layer 0 dense via mlp_only_layers; renormalized top-k; tied embeddings
    "qwen3_moe_mlp_only_norm": ("qwen3_moe", dict(mlp_only_layers=[0], num_experts=6, num_experts_per_tok=3,
                                                  moe_intermediate_size=24, norm_topk_prob=True,
                                                  tie_word_embeddings=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=7)),
}


def make_model(model_type, overrides, seed=0):
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms; routers with spread-out logits so top-k choices are clear
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_dump_parity(case, tmp_path):
    model_type, overrides = CASES[case]
    model = make_model(model_type, overrides)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    ids, labels = make_batch(model.config.vocab_size)
    ours = run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW])
    compare(ours, hf_reference(model, ids, labels))


@pytest.mark.parametrize("case", ["qwen3_moe_sparse_step", "mixtral"])
def test_moe_export_per_expert_names(case, tmp_path):
    model_type, overrides = CASES[case]
    model = make_model(model_type, overrides)
    src = tmp_path / "src"
    model.save_pretrained(src)
    check_export(model, src, tmp_path / "out")  # the same tensor names as save_pretrained writes, bit for bit


def test_missing_expert_tensor_is_an_error(tmp_path):
    model = make_model(*CASES["mixtral"])
    src = tmp_path / "src"
    model.save_pretrained(src)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    del tensors[name]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = run_lf("convert", "--model", src, "--out", tmp_path / "out", check=False)
    assert r.returncode == 1
    msg = r.stderr.strip()
    assert len(msg.splitlines()) == 1 and str(src) in msg and name in msg, msg


def test_moe_config_errors(tmp_path):
    model = make_model(*CASES["qwen3_moe_sparse_step"])
    src = tmp_path / "src"
    model.save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    for field, value in (("num_experts_per_tok", 9), ("decoder_sparse_step", 0), ("mlp_only_layers", [5])):
        bad = dict(cfg, **{field: value})
        (src / "config.json").write_text(json.dumps(bad))
        r = run_lf("info", src, check=False)
        assert r.returncode == 1 and f"field '{field}'" in r.stderr and "config.json" in r.stderr, r.stderr


def write_periodic_shard(prefix, pattern, repeats):
    """A one-document uint16 token shard (docs/data_format.md) whose stream is `pattern` repeated: with seq_len a
    multiple of len(pattern) every training sample is the same window, so transformers can see the same batch."""
    import numpy as np
    toks = np.tile(np.asarray(pattern, dtype=np.uint16), repeats)
    toks.tofile(str(prefix) + ".bin")
    idx = b"LFIDX\0\0\0" + np.array([1, 2], dtype="<u4").tobytes() + np.array([1, len(toks)], dtype="<u8").tobytes()
    idx += np.array([0, len(toks)], dtype="<u8").tobytes()
    pathlib.Path(str(prefix) + ".idx").write_bytes(idx)


def train_three_steps(tmp_path, model_dir, seq, mb):
    """`loongforge train` of model_dir for 3 steps (constant lr 1e-2, no decay) on tmp_path/train; the step losses."""
    (tmp_path / "r.yaml").write_text(f"""
output_dir: {tmp_path / 'run'}
seed: 7
model:
  path: {model_dir}
data:
  train:
    - path: {tmp_path / 'train'}
  seq_len: {seq}
  valid_fraction: 0.0
train:
  steps: 3
  micro_batch_size: {mb}
  threads: 2
optim:
  lr: 1.0e-2
  weight_decay: 0.0
schedule:
  kind: constant
  warmup_steps: 0
log:
  progress: lines
  plot: false
""")
    run_lf("train", tmp_path / "r.yaml")
    losses = [json.loads(l)["loss"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(l) and "step" in json.loads(l)]
    return losses


def test_train_first_step_loss_matches_transformers_with_aux(tmp_path):
    """`loongforge train` on a tiny Qwen3-MoE (dense + sparse layers): the first step's loss is transformers' mean
    token loss + router_aux_loss_coef * load_balancing_loss on the same batch; 3 steps run and the loss falls."""
    overrides = dict(CASES["qwen3_moe_sparse_step"][1], router_aux_loss_coef=0.05)
    model = make_model("qwen3_moe", overrides)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(0, BASE["vocab_size"], (16,), generator=g).tolist()
    write_periodic_shard(tmp_path / "train", pattern, 40)
    seq, mb = 32, 2
    losses = train_three_steps(tmp_path, model_dir, seq, mb)
    assert len(losses) == 3 and losses[2] < losses[0]
    window = torch.tensor((pattern * 3)[: seq + 1])
    ids = window[:seq].unsqueeze(0).repeat(mb, 1)
    tgt = window[1:].unsqueeze(0).repeat(mb, 1)
    model.config.output_router_logits = True
    model.train()
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
        token = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), tgt.reshape(-1))
        want = token + 0.05 * out.aux_loss
    assert out.aux_loss.item() > 0.5
    assert abs(losses[0] - want.item()) <= 1e-5 * want.item(), (losses[0], want.item(), token.item())


@pytest.mark.parametrize("case", ["qwen3_moe_mlp_only_norm", "mixtral"])
def test_moe_info_parameter_count(case, tmp_path):
    model = make_model(*CASES[case])
    model.save_pretrained(tmp_path)
    info = json.loads(run_lf("info", tmp_path).stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    # a token goes through top_k of the routed experts: the stacked expert tensors count k / E of their size
    cfg = model.config
    e = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    k = cfg.num_experts_per_tok
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert routed > 0 and info["active_parameters"] == info["parameters"] - routed * (e - k) // e
    assert info["train_flops_per_token_excl_attention"] == 6 * info["active_parameters"]


def test_stacked_expert_names_also_load(tmp_path):
    """A checkpoint written name for name from the in-memory parameters (experts.gate_up_proj / down_proj whole,
    as transformers' state_dict() and a name-for-name writer store them) loads as well as per-expert names."""
    model = make_model(*CASES["mixtral"])
    model.save_pretrained(tmp_path / "model")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    (tmp_path / "model" / "model.safetensors").unlink()
    save_file(sd, str(tmp_path / "model" / "model.safetensors"), metadata={"format": "pt"})
    ids, labels = make_batch(model.config.vocab_size)
    ours = run_dump(tmp_path / "model", ids, labels, tmp_path)
    with torch.no_grad():
        assert rel_err(ours["logits"], model(input_ids=ids).logits) <= 1e-5

"""Qwen3-Next (Gated DeltaNet linear attention interleaved with gated full attention, zero-centred RMSNorm, partial
rotary, MoE with a sigmoid-gated shared expert) and the Qwen3.5 text decoders against transformers' own model code,
in fp32 on the CPU: `loongforge dump` logits, loss, every gradient and the parameters after one AdamW step (the
tolerances of test_model_parity), export that transformers loads, greedy `generate` with the recurrent state cache.
transformers runs its torch chunk-wise delta rule (no fla / causal-conv1d installed)."""
import json

import pytest
import torch
import transformers

from conftest import run_lf
from test_model_parity import ADAMW, compare, hf_reference, make_batch, rel_err, run_dump

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=32, norm_topk_prob=True)

LT = ["linear_attention", "full_attention"]
CASES = {
    # dense MLPs everywhere, linear / full alternating; a sequence shorter than one chunk
    "dense_alternating": ("qwen3_next", dict(mlp_only_layers=[0, 1, 2, 3], layer_types=LT * 2), 24),
    # MoE everywhere, transformers' default layout (3 linear + 1 full), 100 tokens: two chunks, the last partial
    "moe_default_layout_long": ("qwen3_next", dict(), 100),
    # MoE every 2nd layer, linear first and last, tied embeddings, attention biases, 70 tokens. (Seed 1: with seed 0
    # the per-head decay gradients (dt_bias, A_log) of layer 2 sum with enough cancellation that transformers' own
    # fp32 result is 1.0e-4 from its float64 one, ours 1.9e-5.)
    "moe_sparse_step_tied": ("qwen3_next", dict(decoder_sparse_step=2, layer_types=LT[:1] + LT[::-1] + LT[:1],
                                                tie_word_embeddings=True, attention_bias=True, num_key_value_heads=4,
                                                linear_num_value_heads=2, partial_rotary_factor=0.5), 70, 1),
    "qwen3_5_text": ("qwen3_5_text", dict(layer_types=LT * 2), 80),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(), 66),
}


def perturb(model, wide=("mlp.gate.weight", "shared_expert_gate.weight")):
    """Makes every norm, gate and decay parameter of a linear-attention model matter (the parameters ending in one of
    `wide` get a wider spread)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.5)
            if n.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())
            if n.endswith("conv1d.weight"):
                p.normal_(0.0, 0.4)
            if n.endswith(wide):
                p.normal_(0.0, 0.5)
    return model


def make_model(model_type, overrides, seed=0):
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    return perturb(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32))


def check_generate_greedy(model, model_dir):
    """`generate --ids` from model_dir (model's checkpoint, eos 2) = transformers' greedy ids for a fixed prompt, up to
    the first eos, over at least 6 steps."""
    prompt = [1, 17, 42, 99, 5, 250, 31, 7, 8, 9, 100, 101]
    model.eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    got = json.loads(run_lf("generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-new-tokens", 12, "--ids").stdout)
    n = got.index(2) + 1 if 2 in got else len(got)
    assert n >= 6  # enough steps to exercise the recurrent cache
    assert got[:n] == ref[:n]


# The default set: MoE + 3 linear / 1 full over two chunks, and Qwen3.5's split projections; the rest with LF_SLOW=1.
FAST = {"moe_default_layout_long", "qwen3_5_text"}


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)])
def test_qwen3_next_dump_parity(case, tmp_path):
    model_type, overrides, t, *seed = CASES[case]
    model = make_model(model_type, overrides, *seed)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    ids, labels = make_batch(model.config.vocab_size, t=t)
    ours = run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW])
    compare(ours, hf_reference(model, ids, labels))


def test_qwen3_next_info_counts_parameters(tmp_path):
    for case in ("moe_sparse_step_tied", "qwen3_5_moe_text"):
        model = make_model(*CASES[case][:2])
        model_dir = tmp_path / case
        model.save_pretrained(model_dir)
        info = json.loads(run_lf("info", model_dir).stdout)
        assert info["parameters"] == sum(p.numel() for p in model.parameters()), case


@pytest.mark.slow
def test_qwen3_next_export_loads_in_transformers(tmp_path):
    model = make_model(*CASES["moe_default_layout_long"][:2])
    model.save_pretrained(tmp_path / "src")
    check_export_loads(model, tmp_path / "src", tmp_path / "out")


def check_export_loads(model, src, out):
    """`convert` of src (model's checkpoint) to out: transformers loads it and gives model's logits over 70 tokens."""
    run_lf("convert", "--model", src, "--out", out, "--dtype", "fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ids, _ = make_batch(model.config.vocab_size, t=70)
    with torch.no_grad():
        assert rel_err(hf(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-6


@pytest.mark.parametrize("case", ["moe_default_layout_long", pytest.param("qwen3_5_text", marks=pytest.mark.slow)])
def test_qwen3_next_generate_greedy_matches_transformers(case, tmp_path):
    """Greedy ids: the prompt chunk-wise, then one token at a time from the conv + recurrent state cache (and the
    key/value cache of the full-attention layers)."""
    model_type, overrides = CASES[case][:2]
    model = make_model(model_type, dict(overrides, bos_token_id=1, eos_token_id=2))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    check_generate_greedy(model, model_dir)


def test_qwen3_next_bad_config(tmp_path):
    model = make_model(*CASES["dense_alternating"][:2])
    src = tmp_path / "src"
    model.save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    for field, value in (("linear_num_value_heads", 3), ("layer_types", ["linear_attention", "sliding_attention"] * 2),
                         ("linear_conv_kernel_dim", 0)):
        (src / "config.json").write_text(json.dumps(dict(cfg, **{field: value})))
        r = run_lf("info", src, check=False)
        msg = r.stderr.strip()
        assert r.returncode == 1 and len(msg.splitlines()) == 1, msg
        assert f"field '{field}'" in msg and "config.json" in msg, msg

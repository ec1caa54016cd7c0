"""DeepSeek-V3 (multi-head latent attention, dense-first layers, sigmoid-routed MoE with shared experts and
group-limited top-k) against transformers' own DeepseekV3ForCausalLM, in fp32 on the CPU: `loongforge dump`
logits, loss, every gradient and the parameters after one AdamW step, with the tolerances of test_model_parity."""
import json

import pytest
import torch
import transformers

from conftest import run_lf
from test_model_parity import ADAMW, check_greedy_generate, compare, hf_reference, make_batch, rel_err, run_dump
from test_new_moe_parity import bias_matters

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=0.8,
            mscale_all_dim=0.7, beta_fast=32.0, beta_slow=1.0)

DENSE = dict(first_k_dense_replace=2)  # every layer dense: MLA alone
CASES = {
    "dense_q_lora": DENSE,
    "dense_q_proj_yarn_bias": dict(DENSE, q_lora_rank=None, attention_bias=True, rope_parameters=YARN),
    "dense_not_interleaved": dict(DENSE, rope_interleave=False, q_lora_rank=None),
    "moe_q_lora": dict(),
    "moe_q_proj_yarn": dict(q_lora_rank=None, rope_parameters=YARN, num_hidden_layers=3, norm_topk_prob=False,
                            routed_scaling_factor=1.5, n_shared_experts=2),
}


def make_model(overrides, seed=0):
    cfg = transformers.AutoConfig.for_model("deepseek_v3", **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):  # non-trivial norms and biases
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("mlp.gate.weight"):  # spread router scores (init std 0.02 makes them all ~0.5)
                p.copy_(torch.randn_like(p) * 0.3)
        for n, b in model.named_buffers():
            # transformers initialises the selection-only bias to zeros; make it matter
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def has_moe(model):
    return any(n.endswith("e_score_correction_bias") for n, _ in model.named_buffers())


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_parity(case, tmp_path):
    model = make_model(CASES[case])
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    ids, labels = make_batch(model.config.vocab_size)
    if has_moe(model):  # the correction bias changes the experts chosen, hence the output
        assert bias_matters(model, ids)
    ours = run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW])
    compare(ours, hf_reference(model, ids, labels))


def test_deepseek_info_counts_parameters(tmp_path):
    for case in ("dense_q_proj_yarn_bias", "moe_q_lora"):
        model = make_model(CASES[case])
        model_dir = tmp_path / case
        model.save_pretrained(model_dir)
        info = json.loads(run_lf("info", model_dir).stdout)
        assert info["parameters"] == sum(p.numel() for p in model.parameters()), case


def test_deepseek_generate_greedy_matches_transformers(tmp_path):
    """Greedy ids with our latent KV cache (MLA + MoE layers) equal transformers' generate."""
    model = make_model(dict(CASES["moe_q_proj_yarn"], attention_bias=True, bos_token_id=1, eos_token_id=2))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    check_greedy_generate(model, model_dir, [1, 17, 42, 99, 5, 250, 31])


def test_deepseek_export_loads_in_transformers(tmp_path):
    """convert writes the MoE checkpoint back (the correction bias included) so that transformers loads it."""
    model = make_model(CASES["moe_q_lora"])
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "out"
    run_lf("convert", "--model", src, "--out", out, "--dtype", "fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ids, _ = make_batch(model.config.vocab_size)
    with torch.no_grad():
        assert rel_err(hf(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-6
    want = dict(model.named_buffers())
    for n, b in hf.named_buffers():
        if n.endswith("e_score_correction_bias"):
            assert torch.equal(b, want[n]), n

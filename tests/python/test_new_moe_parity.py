"""GLM-4-MoE (glm4_moe), MiniMax-M2 (minimax_m2) and Mistral 4 (mistral4) against transformers' own model code, in
fp32 on the CPU, built from small configs (no downloads): `loongforge dump` logits, loss, every gradient and the
parameters after one AdamW step with the tolerances of test_model_parity; `convert` writes save_pretrained's tensor
names and transformers loads them with equal outputs; greedy `generate` = transformers' generate; a bad config is one
line naming the field; expert parallelism (ep2) trains as one process.

Variants: GLM-4-MoE with / without per-head q/k norms, attention biases, its default half-head rotary and another
factor, group-limited routing, dense-first layers, several shared experts; MiniMax-M2 with its whole-projection q/k
norms, partial rotary from the legacy rotary_dim field or none, the block's correction bias, no shared experts;
Mistral 4 with latent attention (q LoRA or plain q_proj, interleaved rope or not), yarn, the per-position query scale
(llama_4_scaling_beta), softmax routing limited to groups, shared experts and stacked expert tensors."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import LF_BIN, launch_ranks, run_lf
from test_dist_ep import ep_metrics, ep_recipe, write_shard
from test_model_parity import (ADAMW, check_bad_field_one_line, check_export, check_greedy_generate, compare,
                               hf_reference, make_batch, rel_err, run_dump)
from test_moe_parity import train_three_steps, write_periodic_shard

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

GLM = dict(COMMON, model_type="glm4_moe", intermediate_size=96, moe_intermediate_size=24, num_key_value_heads=2,
           head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
           first_k_dense_replace=1, routed_scaling_factor=2.0, norm_topk_prob=True, rms_norm_eps=1e-5)
MINIMAX = dict(COMMON, model_type="minimax_m2", intermediate_size=24, num_key_value_heads=2, head_dim=16,
               num_local_experts=6, num_experts_per_tok=2, rms_norm_eps=1e-6)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, mscale=0.8,
            mscale_all_dim=0.7, beta_fast=32.0, beta_slow=1.0, llama_4_scaling_beta=0.1, partial_rotary_factor=1 / 3)
MISTRAL4 = dict(COMMON, model_type="mistral4", intermediate_size=96, moe_intermediate_size=24, num_key_value_heads=4,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True, rope_parameters=YARN,
                rms_norm_eps=1e-6, pad_token_id=None)

CASES = {
    # per-head q/k norms, q/k/v biases, the default half-head rotary, groups, one dense layer first
    "glm4_moe_qk_norm_bias": dict(GLM, use_qk_norm=True, attention_bias=True),
    # no q/k norm, a quarter of the head rotated, every layer MoE, 2 shared experts, weights not renormalised
    "glm4_moe_quarter_rotary": dict(GLM, partial_rotary_factor=0.25, first_k_dense_replace=0, n_shared_experts=2,
                                    norm_topk_prob=False, n_group=1, topk_group=1, num_hidden_layers=3),
    # half the head rotated, given by the legacy rotary_dim field alone (rope_parameters' factor removed below)
    "minimax_m2_rotary_dim": dict(MINIMAX, rotary_dim=8),
    "minimax_m2_full_rotary": dict(MINIMAX, num_experts_per_tok=3, tie_word_embeddings=True, rope_theta=10000.0),
    # q LoRA, interleaved yarn rope, positions past original_max_position_embeddings (query scale > 1), groups
    "mistral4_q_lora_yarn": dict(MISTRAL4),
    # plain q_proj, rope not interleaved, biases, top-k weights not renormalised, every layer MoE, 2 shared experts
    "mistral4_q_proj_plain_rope": dict(MISTRAL4, q_lora_rank=None, rope_interleave=False, attention_bias=True,
                                       norm_topk_prob=False, n_group=1, topk_group=1, first_k_dense_replace=0,
                                       n_shared_experts=2, pad_token_id=11),
}


def model_class(model_type):
    # Mistral 4 is not in AutoModelForCausalLM's mapping (ORACLES.md)
    return transformers.Mistral4ForCausalLM if model_type == "mistral4" else transformers.AutoModelForCausalLM


def make_model(cfg, seed=0):
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    if model_type == "mistral4":
        model = transformers.Mistral4ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):  # non-trivial norms and biases
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("mlp.gate.weight"):  # spread router scores so the choices are clear
                p.copy_(torch.randn_like(p) * 0.4)
        for n, b in model.named_buffers():  # the selection-only bias starts at zero; make it matter
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def save(model, case, d):
    model.save_pretrained(d)
    if case == "minimax_m2_rotary_dim":  # only the legacy field says how much of the head rotates
        cfg = json.loads((d / "config.json").read_text())
        del cfg["rope_parameters"]["partial_rotary_factor"]
        assert cfg["rotary_dim"] == 8
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def bias_matters(model, ids):
    """Zeroing the correction biases changes the logits (they pick the experts)."""
    saved = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    if not saved:
        return True
    with torch.no_grad():
        with_bias = model(input_ids=ids).logits
        for n, b in model.named_buffers():
            if n in saved:
                b.zero_()
        without = model(input_ids=ids).logits
        for n, b in model.named_buffers():
            if n in saved:
                b.copy_(saved[n])
    return rel_err(with_bias, without) > 1e-3


# CI time: one variant per family by default, the others (and the layouts, the training run) with LF_SLOW=1
SLOW = {"glm4_moe_quarter_rotary", "minimax_m2_full_rotary", "mistral4_q_proj_plain_rope"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in sorted(CASES)])
def test_dump_parity(case, tmp_path):
    model = make_model(CASES[case])
    model_dir = save(model, case, tmp_path / "model")
    ids, labels = make_batch(model.config.vocab_size, t=24)
    assert bias_matters(model, ids)
    ours = run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW])
    compare(ours, hf_reference(model, ids, labels))
    info = json.loads(run_lf("info", model_dir).stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", ["glm4_moe_qk_norm_bias", "minimax_m2_rotary_dim", "mistral4_q_lora_yarn"])
def test_export_loads_in_transformers(case, tmp_path):
    """convert writes save_pretrained's tensor names (GLM-4-MoE: per-expert gate/up/down_proj; MiniMax-M2:
    block_sparse_moe.experts.E.w1/w2/w3 and block_sparse_moe.e_score_correction_bias; Mistral 4: stacked
    experts.gate_up_proj / down_proj) bit for bit, and transformers loads them with equal outputs."""
    model = make_model(CASES[case])
    src = save(model, case, tmp_path / "src")
    check_export(model, src, tmp_path / "out", model_class(CASES[case]["model_type"]))


@pytest.mark.parametrize("case", ["glm4_moe_qk_norm_bias", "minimax_m2_rotary_dim", "mistral4_q_lora_yarn"])
def test_generate_greedy_matches_transformers(case, tmp_path):
    """Greedy ids with our KV cache (Mistral 4: the latent cache and the query scale of the new positions)."""
    model = make_model(CASES[case])
    model_dir = save(model, case, tmp_path / "model")
    check_greedy_generate(model, model_dir, [1, 17, 42, 99, 5, 250, 31])


@pytest.mark.parametrize("case,field,value,needle", [
    ("glm4_moe_qk_norm_bias", "num_experts_per_tok", 5, "field 'num_experts_per_tok'"),
    ("minimax_m2_full_rotary", "router_jitter_noise", 0.1, "field 'router_jitter_noise'"),
    ("mistral4_q_lora_yarn", "rope_parameters", dict(YARN, llama_4_scaling_beta=None),
     "field 'rope_parameters.llama_4_scaling_beta'"),
])
def test_bad_config_one_line(case, field, value, needle, tmp_path):
    model = make_model(CASES[case])
    src = save(model, case, tmp_path / "src")
    check_bad_field_one_line(src, field, value, needle)


@pytest.mark.parametrize("case,dp,ep,tp", [
    ("glm4_moe_qk_norm_bias", 2, 2, 1), ("minimax_m2_full_rotary", 2, 2, 1), ("mistral4_q_lora_yarn", 2, 2, 1),
    ("glm4_moe_qk_norm_bias", 1, 1, 2),  # tp2: biased q/k/v split by heads, per-head norms, partial rotary
])
@pytest.mark.slow
def test_train_layout_matches_one_process(case, dp, ep, tp, tmp_path):
    """Expert parallelism ep2 x dp2 (the experts split over 2 ranks, all-to-all of the tokens), and GLM-4-MoE under
    tensor parallelism tp2: per-step losses and grad norms of one process (fp32, 1e-5; MiniMax-M2 with its
    load-balancing loss)."""
    model = make_model(dict(CASES[case], vocab_size=64))
    model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(7)
    write_shard(tmp_path / "train", torch.randint(0, 64, (2000,), generator=g).numpy(), docs=20)
    steps = 2
    run_lf("train", ep_recipe(tmp_path, tmp_path, "one", steps), "--set", f"train.micro_batch_size={dp}")
    res = launch_ranks(dp * tp, [LF_BIN, "train", ep_recipe(tmp_path, tmp_path, "dist", steps), "--set",
                                 f"parallel.dp={dp}", "--set", f"parallel.ep={ep}", "--set", f"parallel.tp={tp}"],
                       threads=1)
    for r in res:
        assert r.returncode == 0, r.stderr[-3000:]
    one, got = ep_metrics(tmp_path / "one"), ep_metrics(tmp_path / "dist")
    assert len(one) == len(got) == steps
    for a, b in zip(one, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a, b)


@pytest.mark.slow
def test_minimax_train_first_step_loss_with_router_aux(tmp_path):
    """`loongforge train` on MiniMax-M2: the first step's loss is transformers' token loss + router_aux_loss_coef x
    its load_balancing_loss_func, which takes softmax(router logits) and that softmax's own top-k (not the experts
    the sigmoid + correction-bias router chose); 3 steps run and the loss falls."""
    model = make_model(dict(CASES["minimax_m2_full_rotary"], router_aux_loss_coef=0.05))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(0, model.config.vocab_size, (16,), generator=g).tolist()
    write_periodic_shard(tmp_path / "train", pattern, 40)
    seq, mb = 32, 2
    losses = train_three_steps(tmp_path, model_dir, seq, mb)
    assert len(losses) == 3 and losses[2] < losses[0]
    window = torch.tensor((pattern * 3)[: seq + 1])
    ids, tgt = window[:seq].unsqueeze(0).repeat(mb, 1), window[1:].unsqueeze(0).repeat(mb, 1)
    model.train()
    chosen = []  # the experts each router picked (sigmoid + correction bias)
    hooks = [l.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2])) for l in model.model.layers]
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
        token = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), tgt.reshape(-1))
        want = token + 0.05 * out.aux_loss
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    # the balancing statistics' top-k differs from the routing's choice somewhere (what the test is about)
    assert any(not torch.equal(c.sort(-1).values, r.softmax(-1).topk(k).indices.sort(-1).values)
               for c, r in zip(chosen, out.router_logits))
    assert abs(losses[0] - want.item()) <= 1e-5 * want.item(), (losses[0], want.item(), token.item())


@pytest.mark.slow
def test_mistral4_defaults_when_the_file_has_none(tmp_path):
    """A Mistral 4 config.json without rope_parameters or pad_token_id gets Mistral4Config's defaults: its yarn
    block (factor 128 over 8192 positions, llama_4_scaling_beta 0.1, rotary width qk_rope_head_dim) and pad 11."""
    cfg = dict(MISTRAL4, pad_token_id=11)
    del cfg["rope_parameters"]
    model = make_model(cfg)
    model.save_pretrained(tmp_path / "model")
    c = json.loads((tmp_path / "model" / "config.json").read_text())
    del c["rope_parameters"], c["pad_token_id"]
    (tmp_path / "model" / "config.json").write_text(json.dumps(c))
    ids, labels = make_batch(model.config.vocab_size)
    ours = run_dump(tmp_path / "model", ids, labels, tmp_path, ["--adamw", ADAMW])
    compare(ours, hf_reference(model, ids, labels))


def test_glm4_moe_unknown_tensor_is_an_error(tmp_path):
    """A tensor the model does not have is one line naming it (GLM-4.5's multi-token prediction layers,
    model.layers.<num_hidden_layers>.*, load as MTP layers: test_deepseek_mtp.py)."""
    model = make_model(CASES["glm4_moe_qk_norm_bias"])
    model.save_pretrained(tmp_path / "model")
    sd = load_file(str(tmp_path / "model" / "model.safetensors"))
    sd["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model" / "model.safetensors"), metadata={"format": "pt"})
    r = run_lf("convert", "--model", tmp_path / "model", "--out", tmp_path / "out", check=False)
    assert r.returncode == 1 and "model.layers.1.mlp.extra.weight" in r.stderr, r.stderr

"""DeepSeek-V4 (hyper-connection streams with Sinkhorn mixing and a hyper head; sliding-window attention with sinks,
one shared key/value head, interleaved partial rotary and a grouped output projection; compressed sparse attention
(overlapping compressed windows + a lightning indexer's top-k) and heavily compressed attention; hash-routed and
sqrt(softplus) top-k MoE with swiglu clamps) against transformers' DeepseekV4ForCausalLM, in fp32 on the CPU:
`loongforge dump` logits, loss, every gradient and the parameters after one AdamW step (test_model_parity's
tolerances), also with the router load-balancing loss (output_router_logits), export that transformers loads, greedy
`generate` (incremental, through the generation cache: tests/cpp/test_deepseek_v4.cpp), one-line errors for
unsupported fields. Expert, pipeline, tensor and context parallelism: test_deepseek_v4_dist.py."""
import json

import pytest
import torch
import transformers

from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_dsa_parity import check_first_loss_and_read_checkpoint, train_recipe
from test_model_parity import ADAMW, check_bad_field_one_line, check_export, check_greedy_generate, compare, \
    hf_reference, make_batch, run_dump
from test_moe_parity import write_periodic_shard

# 4 layers: sliding only, CSA, HCA, CSA; hash MoE first; windows of 8 keys, CSA every 4 tokens (top 3 entries per
# query), HCA every 8
BASE = dict(vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
            head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, num_experts_per_tok=2, n_routed_experts=4,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            hc_mult=2, hc_sinkhorn_iters=3, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=2,
            index_head_dim=8, index_topk=3, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)

CASES = {
    # 40 tokens: windows slide, 10 CSA entries of which the indexer keeps 3, 5 HCA entries
    "mixed_layers": (dict(), 40),
    # 4 hc streams, sigmoid-free defaults elsewhere, a tied head, 3 experts of 6, swiglu clamps that bite; 21 tokens
    # (partial last windows)
    "wide_streams_tied": (dict(hc_mult=4, n_routed_experts=6, num_experts_per_tok=3, tie_word_embeddings=True,
                               swiglu_limit=0.05, index_topk=2, o_groups=4, o_lora_rank=4), 21),
}


def make_model(overrides, seed=0):
    cfg = transformers.DeepseekV4Config(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():  # every norm, sink, bias, position bias and stream mixer matters; hash routes random
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("sinks") or n.endswith(".base") or n.endswith("hc_base"):
                p.add_(torch.randn_like(p) * 0.3)
            if n.endswith(".scale") or n.endswith("hc_scale"):
                p.add_(torch.randn_like(p) * 0.3)
            if n.endswith("position_bias"):
                p.normal_(0.0, 0.5)
            if n.endswith(".fn") or n.endswith("hc_fn") or n.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
        for n, b in model.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[:cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def saved(model, path):
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_v4_dump_parity(case, tmp_path):
    overrides, t = CASES[case]
    model = make_model(overrides)
    ids, labels = make_batch(model.config.vocab_size, t=t)
    ours = run_dump(saved(model, tmp_path / "model"), ids, labels, tmp_path, ["--adamw", ADAMW])
    compare(ours, hf_reference(model, ids, labels))


def test_deepseek_v4_dump_parity_with_router_aux_loss(tmp_path):
    """output_router_logits: transformers' loss + router_aux_loss_coef x load_balancing_loss_func over the top-k
    routers' logits (softmax and its own top-k; the hash-routed layer makes none), its gradients and the AdamW step."""
    model = make_model(dict(output_router_logits=True, router_aux_loss_coef=0.3))
    ids, labels = make_batch(model.config.vocab_size, t=40)
    ours = run_dump(saved(model, tmp_path / "model"), ids, labels, tmp_path, ["--adamw", ADAMW])
    ref = hf_reference(model, ids, labels)
    with torch.no_grad():  # the aux term is part of the compared loss
        plain = model(input_ids=ids, labels=labels, output_router_logits=False).loss
    assert abs(ref["loss"].item() - plain.item()) > 1e-3
    compare(ours, ref)


def test_deepseek_v4_info_counts_parameters(tmp_path):
    for case, (overrides, _) in CASES.items():
        model = make_model(overrides)
        info = json.loads(run_lf("info", saved(model, tmp_path / case)).stdout)
        assert info["parameters"] == sum(p.numel() for p in model.parameters()), case


def test_deepseek_v4_export_loads_in_transformers(tmp_path):
    model = make_model(CASES["mixed_layers"][0])
    check_export(model, saved(model, tmp_path / "src"), tmp_path / "out")


def test_deepseek_v4_reads_deepseeks_own_names(tmp_path):
    """A folder in DeepSeek's layout (embed.weight, layers.N.*, norm.weight, hc_head_fn, an mtp.* layer, as the
    Hub's files name them) converts to save_pretrained's file (names and tensors bit for bit)."""
    model = make_model(CASES["mixed_layers"][0])
    src = saved(model, tmp_path / "src")
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text((src / "config.json").read_text())
    renamed = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        k = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(k, k)
        k = k.replace("model.hc_head.hc_", "hc_head_").replace("model.layers.", "layers.")
        renamed[k] = v
    renamed["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)  # skipped, as transformers skips it
    save_file(renamed, str(hub / "model.safetensors"))
    run_lf("convert", "--model", hub, "--out", tmp_path / "out", "--dtype", "fp32")
    want, got = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_deepseek_v4_generate_greedy_matches_transformers(tmp_path):
    """transformers decodes from its compressor / sliding-window cache, ours from its own (each new token runs
    alone against the cached sliding-window keys, compressed entries and indexer keys)."""
    model = make_model(CASES["mixed_layers"][0])
    prompt = list(range(3, 25))  # 22 tokens: complete and partial windows of both compressors
    check_greedy_generate(model, saved(model, tmp_path / "model"), prompt, eos=1, new_tokens=12)


@pytest.mark.parametrize("field, value, needle", [
    ("layer_types", ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"], "'layer_types'"),
    ("mlp_layer_types", ["moe", "dense", "moe", "moe"], "'mlp_layer_types'"),
    ("scoring_func", "softmax", "'scoring_func'"),
    ("num_key_value_heads", 2, "'num_key_value_heads'"),
    ("swiglu_limit", 0.0, "'swiglu_limit'"),
    ("router_aux_loss_coef", -1.0, "'router_aux_loss_coef'"),
])
def test_deepseek_v4_bad_config_one_line(field, value, needle, tmp_path):
    check_bad_field_one_line(saved(make_model({}), tmp_path / "src"), field, value, needle)


def test_deepseek_v4_train_moves_all_but_the_indexers(tmp_path):
    """`loongforge train` (one process, weight decay): the first step's loss is
    transformers' on the same batch; the checkpoint's indexer tensors are the loaded ones bit for bit (no gradient,
    frozen) while every other weight moved."""
    model = make_model(dict(vocab_size=64))
    model_dir = saved(model, tmp_path / "model")
    pattern = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    write_periodic_shard(tmp_path / "train", pattern, 40)
    seq, mb = 32, 2
    run_lf("train", train_recipe(tmp_path, model_dir, seq, mb))
    got = check_first_loss_and_read_checkpoint(tmp_path, model, pattern, seq, mb)
    for k, v in load_file(str(model_dir / "model.safetensors")).items():
        if ".indexer." in k:
            assert torch.equal(got[k], v), k
        elif k.endswith("weight") and "norm" not in k:
            assert not torch.equal(got[k], v), k

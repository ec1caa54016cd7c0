"""Training DeepSeek sparse attention's lightning indexers (`model.indexer_loss_coef`, `model.indexer_dense_warmup`;
`dump --indexer-loss-coef`, `--indexer-dense-warmup`) as DeepSeek-V3.2 trains them: a KL loss pulls each layer's
index distribution softmax(I_t) towards the attention's own distribution p_t (the heads' softmaxes summed and
L1-normalised), over the kept keys (the sparse stage: the top-k selection; the warm-up stage: every visible key, with
dense attention and everything but the indexers frozen). The indexer reads its inputs detached and the target is
detached, so the language-model loss trains the model and the KL loss the indexers alone.

transformers runs the indexers under no_grad and has no such loss, so the reference here is written from that
description on top of transformers' own modules: their captured inputs (hidden states, q_resid, rotary tables), the
eager attention's probabilities (output_attentions) and the selections the indexers made, the scores recomputed with
autograd from the indexer's weights, the KL summed over queries and layers, times the coefficient, over the counted
tokens, added to transformers' loss; then torch.optim.AdamW. `loongforge dump` must give the same loss, every gradient
and the AdamW step; `loongforge train` logs the KL and lowers it."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

from conftest import run_lf
from test_dsa_parity import CASES, check_layout_follows_one_process, dump_case, first_batch, indexers, latest_checkpoint, make_model, train_recipe, train_setup
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, compare, make_batch, run_dump
from test_moe_parity import write_periodic_shard

COEF = 0.3


def index_scores(ix, hidden, q_resid, cos, sin):
    """The lightning indexer's scores [B,S,T] with autograd (transformers' DeepseekV32Indexer / GlmMoeDsaIndexer
    formula: relu(q_h . k * D^-0.5) summed over heads with weights_proj(x) * H^-0.5)."""
    b, s, _ = hidden.shape
    rope = ix.qk_rope_head_dim
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)
    q_rot, q_pass = q.split([rope, ix.head_dim - rope], -1)
    k_rot, k_pass = k.split([rope, ix.head_dim - rope], -1)
    rotate = glm.apply_rotary_pos_emb_interleave if isinstance(ix, glm.GlmMoeDsaIndexer) else v32.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1).squeeze(2)
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.head_dim ** -0.5)
    w = ix.weights_proj(hidden).float() * ix.n_heads ** -0.5
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def reference(model, ids, targets, coef, warmup):
    """Loss, every gradient and the AdamW step of transformers' model trained with the indexer KL loss; targets
    [B,S]: the token each position predicts (-100: none)."""
    model = copy.deepcopy(model)
    model.train()
    if warmup:  # dense attention; only the indexers train
        for ix in indexers(model):
            ix.index_topk = 10 ** 6
        for n, p in model.named_parameters():
            p.requires_grad_(".indexer." in n)
    calls = []
    hooks = [ix.register_forward_hook(lambda m, a, kw, o: calls.append((m, a, kw, o)), with_kwargs=True)
             for ix in indexers(model)]
    out = model(input_ids=ids, output_attentions=True)
    for h in hooks:
        h.remove()
    layer_of = {id(l.self_attn.indexer): i for i, l in enumerate(model.model.layers)
                if getattr(l.self_attn, "indexer", None) is not None}
    t = ids.shape[1]
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    kl = 0.0
    for ix, args, kwargs, topk in calls:
        hidden, q_resid = args[0].detach(), args[1].detach()  # the indexer's own graph
        cos, sin = args[2] if len(args) > 2 else kwargs["position_embeddings"]
        keep = torch.zeros(ids.shape[0], t, t, dtype=torch.bool).scatter(-1, topk.long(), True) & visible
        p = out.attentions[layer_of[id(ix)]].detach().double().sum(1)  # [B,S,T]: zero off the kept keys
        p = p / p.sum(-1, keepdim=True)
        logq = torch.log_softmax(index_scores(ix, hidden, q_resid, cos, sin).masked_fill(~keep, float("-inf")), -1)
        kl = kl + (torch.xlogy(p, p) - p * logq.double().masked_fill(~keep, 0)).sum()
    terms = (targets != -100).sum().item()
    lm = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), targets.reshape(-1))
    loss = lm + (coef * kl / terms).float()
    loss.backward()
    ref = {"logits": out.logits.detach(), "loss": loss.detach().reshape(1), "kl_per_layer_token": kl.item() / len(calls) / terms}
    params = dict(model.named_parameters())
    for n, p in params.items():
        ref["grad." + n] = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
    opt = torch.optim.AdamW([p for p in params.values() if p.grad is not None], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD)
    opt.step()
    for n, p in params.items():
        ref["after_adamw." + n] = p.detach().clone()
    return ref


@pytest.mark.parametrize("case,warmup", [("v32", False), ("v32", True), pytest.param("glm_shared", False, marks=pytest.mark.slow)])
def test_dump_indexer_loss_matches_the_reference(case, warmup, tmp_path):
    extra = ["--indexer-loss-coef", str(COEF)] + (["--indexer-dense-warmup"] if warmup else [])
    model, ids, labels, before, ours = dump_case(case, tmp_path, extra)
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)  # transformers' shift
    ref = reference(model, ids, targets, COEF, warmup)
    if warmup:  # dense attention: other logits than the sparse model's
        assert (ref["logits"] - model(input_ids=ids).logits.detach()).abs().max() > 1e-3
    ref.pop("kl_per_layer_token")
    compare(ours, ref)
    names = [n for n in before if ".indexer." in n]
    assert names
    for n in names:  # the indexers get gradients and move
        assert ours["grad." + n].abs().max() > 0, n
        assert not torch.equal(ours["after_step." + n], before[n]), n
    if warmup:  # every other parameter is frozen: no gradient, no step (not even weight decay)
        for n in before:
            if ".indexer." not in n:
                assert not ours["grad." + n].any(), n
                assert torch.equal(ours["after_step." + n], before[n]), n


def test_train_logs_and_lowers_the_indexer_kl(tmp_path):
    """`loongforge train` in the warm-up stage: the metrics line's indexer_kl of the first step is the reference's KL
    per layer and token on the same batch, the loss is transformers' loss plus coef x that KL, and the KL falls
    over the steps while only the indexer tensors change in the checkpoint."""
    model, model_dir, pattern, recipe = train_setup(tmp_path, 200)
    run_lf("train", recipe, "--set", f"model.indexer_loss_coef={COEF}", "--set", "model.indexer_dense_warmup=true",
           "--set", "train.steps=12", "--set", "optim.lr=3e-2")
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "indexer_kl" in r]
    assert len(rows) == 12
    ids, tgt = first_batch(pattern, 32, 2)
    ref = reference(model, ids, tgt, COEF, True)
    assert abs(rows[0]["indexer_kl"] - ref["kl_per_layer_token"]) <= 1e-4 * ref["kl_per_layer_token"]
    assert abs(rows[0]["loss"] - ref["loss"].item()) <= 1e-5 * ref["loss"].item()
    assert rows[-1]["indexer_kl"] < 0.7 * rows[0]["indexer_kl"], [r["indexer_kl"] for r in rows]
    saved, loaded = latest_checkpoint(tmp_path / "run"), load_file(str(model_dir / "model.safetensors"))
    for k, v in loaded.items():
        assert torch.equal(saved[k], v) != (".indexer." in k), k  # frozen, or trained


@pytest.mark.parametrize("case,layout", [
    ("v32", ["parallel.tp=2"]),
    ("v32", ["parallel.cp=2"]),
    pytest.param("glm_shared", ["parallel.tp=2", "parallel.sp=true"], marks=pytest.mark.slow),
])
def test_layout_indexer_training_follows_one_process(case, layout, tmp_path):
    """Indexer training under tensor parallelism: each rank has half the heads, and the KL's target (the mean over
    every head of the attention probabilities) sums the ranks' parts; the indexers are whole and their loss the same
    on every rank, so their gradients are never summed. Under context parallelism each rank's queries score the
    whole sequence's index keys (gathered with autograd: their gradients go back to the rank that made them) and the
    KL terms and gradients sum over the ranks. Loss, indexer_kl and gradient norm per step = one process, and the
    trained indexer tensors alike."""
    one, _ = check_layout_follows_one_process(tmp_path, case, layout, [f"model.indexer_loss_coef={COEF}"],
                                              keys=("loss", "indexer_kl"))
    saved, loaded = latest_checkpoint(tmp_path / "one"), load_file(str(tmp_path / "model" / "model.safetensors"))
    assert any(not torch.equal(saved[k], v) for k, v in loaded.items() if ".indexer." in k)


@pytest.mark.parametrize("sets,needle", [
    (["model.indexer_dense_warmup=true"], "model.indexer_dense_warmup"),
    (["model.indexer_loss_coef=0.1", "model.recompute=full"], "model.recompute"),
    (["model.indexer_loss_coef=0.1", "lora.enabled=true"], "lora.enabled"),
])
def test_indexer_training_errors_are_one_line(sets, needle, tmp_path):
    model_dir = tmp_path / "model"
    make_model(dict(CASES["v32"], vocab_size=64)).save_pretrained(model_dir)
    write_periodic_shard(tmp_path / "train", list(range(3, 19)), 40)
    args = [x for s in sets for x in ("--set", s)]
    r = run_lf("train", train_recipe(tmp_path, model_dir, 16, 1), *args, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and needle in lines[0], r.stderr


def test_dense_model_has_no_indexer(tmp_path):
    model_dir = tmp_path / "model"
    cfg = dict(CASES["v32"], model_type="deepseek_v3", vocab_size=64)
    for k in ("index_topk", "index_head_dim", "index_n_heads"):
        cfg.pop(k)
    make_model(cfg).save_pretrained(model_dir)
    ids, _ = make_batch(64, t=8)
    save_file({"input_ids": ids}, str(tmp_path / "b.safetensors"))
    r = run_lf("dump", "--model", model_dir, "--batch", tmp_path / "b.safetensors", "--out", tmp_path / "o.safetensors",
               "--indexer-loss-coef", "0.1", check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "--indexer-loss-coef" in lines[0] and "no sparse-attention indexer" in lines[0], r.stderr

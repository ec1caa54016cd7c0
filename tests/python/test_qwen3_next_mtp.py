"""Qwen3-Next / Qwen3.5 multi-token prediction (config `mtp_num_hidden_layers`, weights `mtp.*`). transformers skips
these weights (`_keys_to_ignore_on_load_unexpected = ["^mtp.*"]`) and has no MTP module for these families; the
module the checkpoints are made for (vLLM's Qwen3NextMultiTokenPredictor) joins RMSNorm(embedding of token i+1)
(mtp.pre_fc_norm_embedding) and RMSNorm(main model's final hidden state at i) (mtp.pre_fc_norm_hidden) through mtp.fc,
runs one gated full-attention decoder layer (mtp.layers.0, the main model's MLP kind) and mtp.norm, and the shared
lm_head predicts token i+2. The reference here is that computation assembled from transformers' own Qwen3-Next
modules (its decoder layer, zero-centred RMSNorm and rotary): `dump`'s teacher-forced mtp_logits.0, and with
`--mtp-loss-weight` (w x the depth's cross-entropy over the counted tokens joins the loss) the loss, every gradient
(the main model's and the MTP layer's) and one AdamW step; `convert` keeps the mtp.* tensors bit for bit; a folder
without them loads the main model."""
import copy

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_next import modeling_qwen3_next as qn

from conftest import run_lf
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, compare, make_batch, rel_err, run_dump
from test_qwen3_next_parity import make_model, perturb

W = 0.5
CASES = {
    "qwen3_next_moe": ("qwen3_next", dict()),
    "qwen3_5_dense": ("qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"] * 2)),
}


class Mtp(torch.nn.Module):
    """vLLM's Qwen3NextMultiTokenPredictor (one layer) from transformers' Qwen3-Next modules."""

    def __init__(self, layer_model):
        super().__init__()
        c = layer_model.config
        self.pre_fc_norm_embedding = qn.Qwen3NextRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.pre_fc_norm_hidden = qn.Qwen3NextRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.layers = layer_model.model.layers  # one full-attention layer
        self.norm = qn.Qwen3NextRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary = layer_model.model.rotary_emb
        with torch.no_grad():
            for n in (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm):
                n.weight.normal_(0.0, 0.1)
            self.fc.weight.normal_(0.0, 0.1)

    def forward(self, main, ids):
        """Depth 0's logits at positions 0..T-2 (token i+1 in, token i+2 predicted), teacher-forced."""
        h = main.model(input_ids=ids).last_hidden_state[:, :-1]
        e = main.model.embed_tokens(ids[:, 1:])
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], -1))
        n = x.shape[1]
        pos = torch.arange(1, n + 1).unsqueeze(0).expand(ids.shape[0], n)
        mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None].expand(ids.shape[0], 1, n, n)
        out = self.layers[0](x, position_embeddings=self.rotary(x, pos), attention_mask=mask, position_ids=pos)
        x = out[0] if isinstance(out, tuple) else out
        return main.lm_head(self.norm(x))


def build(case, tmp_path):
    """transformers' model + the MTP module, saved as one folder (config with mtp_num_hidden_layers = 1)."""
    model_type, overrides = CASES[case]
    main = make_model(model_type, overrides)
    lt = overrides.get("layer_types")
    one = make_model(model_type, dict(overrides, num_hidden_layers=1, layer_types=["full_attention"],
                                      **({"mlp_only_layers": []} if "mlp_only_layers" in overrides else {})), seed=5)
    torch.manual_seed(6)
    mtp = Mtp(one)
    model_dir = tmp_path / "model"
    main.config.mtp_num_hidden_layers = 1
    main.save_pretrained(model_dir)
    one_dir = tmp_path / "one"
    one.save_pretrained(one_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for k, v in load_file(str(one_dir / "model.safetensors")).items():
        if k.startswith("model.layers.0."):
            tensors["mtp.layers.0." + k[len("model.layers.0."):]] = v
    for k, v in mtp.state_dict().items():
        if not k.startswith(("layers.", "rotary.")):
            tensors["mtp." + k] = v.clone()
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return main, mtp, model_dir


def reference(main, mtp, ids, labels, w):
    """transformers' loss + w x the MTP depth's summed cross-entropy over the counted tokens; grads; AdamW."""
    main, mtp = copy.deepcopy(main), copy.deepcopy(mtp)
    main.train()
    mtp.train()
    out = main(input_ids=ids, labels=labels)
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    terms = (targets != -100).sum()
    lg = mtp(main, ids)  # position i predicts targets[i+1]
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.size(-1)), targets[:, 1:].reshape(-1), reduction="sum")
    loss = out.loss + w * ce / terms if w else out.loss  # w = 0: the MTP layer gets no gradient (AdamW skips it)
    loss.backward()
    ref = {"logits": out.logits.detach(), "loss": loss.detach().reshape(1), "mtp_logits.0": lg.detach()}
    params = {**dict(main.named_parameters()), **{"mtp." + n: p for n, p in mtp.named_parameters() if not n.startswith("rotary.")}}
    for n, p in params.items():
        ref["grad." + n] = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
    torch.optim.AdamW(list(params.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step()
    for n, p in params.items():
        ref["after_adamw." + n] = p.detach().clone()
    return ref


def ours_named(ours):
    """Our in-memory names of the MTP block's stacked experts (mtp.layers.0.mtp_block.*) as the reference's."""
    return {k.replace("mtp.layers.0.mtp_block.", "mtp.layers.0."): v for k, v in ours.items()}


@pytest.mark.parametrize("case", ["qwen3_next_moe", pytest.param("qwen3_5_dense", marks=pytest.mark.slow)])
def test_mtp_logits_and_training_match_the_reference(case, tmp_path):
    main, mtp, model_dir = build(case, tmp_path)
    ids, labels = make_batch(main.config.vocab_size, t=24)
    ours = ours_named(run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW, "--mtp-loss-weight", str(W)]))
    ref = reference(main, mtp, ids, labels, W)
    assert rel_err(ours["mtp_logits.0"], ref.pop("mtp_logits.0")) <= 1e-5
    compare(ours, ref)
    assert ours["grad.mtp.fc.weight"].abs().max() > 0
    # without the weight: transformers' own loss and gradients (the MTP layer untouched)
    plain = ours_named(run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW]))
    ref0 = reference(main, mtp, ids, labels, 0.0)
    ref0.pop("mtp_logits.0")
    compare(plain, ref0)
    assert not plain["grad.mtp.fc.weight"].any()


def test_convert_keeps_the_mtp_tensors(tmp_path):
    main, mtp, model_dir = build("qwen3_next_moe", tmp_path)
    out = tmp_path / "out"
    run_lf("convert", "--model", model_dir, "--out", out, "--dtype", "fp32")
    want, got = load_file(str(model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want) and any(k.startswith("mtp.") for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ids, _ = make_batch(main.config.vocab_size)
    with torch.no_grad():
        assert rel_err(hf(input_ids=ids).logits, main(input_ids=ids).logits) <= 1e-6


def test_speculative_generate_equals_greedy(tmp_path):
    """`generate --mtp` (the MTP head drafts, the main model verifies; its linear-attention state is rerun from the
    cache before verification after a rejected draft) gives plain greedy decoding's ids. The head here is random,
    so drafts get rejected; a head trained to copy would be accepted (test_deepseek_mtp)."""
    main, _, model_dir = build("qwen3_next_moe", tmp_path)
    args = ["generate", "--model", model_dir, "--prompt-ids", "1,17,42,99,5,250,31,7", "--max-new-tokens", 16, "--ids"]
    plain = run_lf(*args).stdout
    spec = run_lf(*args, "--mtp")
    assert spec.stdout == plain
    assert "mtp drafts accepted" in spec.stderr

"""The T5 / UMT5 text encoder against transformers' T5EncoderModel / UMT5EncoderModel, fp32 on the CPU: `loongforge
dump` on a padded batch gives last_hidden_state (<= 1e-5 rel), the loss (mean of last_hidden_state^2 over the tokens
and channels), every gradient (<= 1e-4 rel, under transformers' parameter names) and the parameters after one AdamW
step; a whole T5ForConditionalGeneration folder loads as its encoder; `convert` writes a folder the encoder class
loads; `info` counts transformers' parameters; bad configs are one line naming config.json and the field; `tokenize`
gives transformers' T5 tokenizer's ids (with the appended </s>)."""
import json
import random
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, check_after_step, rel_err

TINY = dict(vocab_size=100, d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=48, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, dropout_rate=0.0)
CASES = {
    "t5_relu": ("t5", dict(feed_forward_proj="relu")),
    "t5_gated_gelu": ("t5", dict(feed_forward_proj="gated-gelu")),
    "umt5": ("umt5", dict(feed_forward_proj="gated-gelu")),
}
ENCODER = {"t5": transformers.T5EncoderModel, "umt5": transformers.UMT5EncoderModel}
SEQ2SEQ = {"t5": transformers.T5ForConditionalGeneration, "umt5": transformers.UMT5ForConditionalGeneration}


def config(kind, **kw):
    cls = transformers.T5Config if kind == "t5" else transformers.UMT5Config
    return cls(**{**TINY, **kw})


def perturbed(model, seed=0):
    """Every parameter moved randomly (norms start at one), so that each gradient says something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def make_batch(vocab, lengths=(12, 7, 10), seed=1):
    """input_ids [B,T] with padding (id 0, mask 0) at the end of the shorter rows."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        ids[i, n:] = 0
    return ids, mask


def hf_reference(model, ids, mask):
    """transformers' last_hidden_state, our loss on it, gradients and parameters after one AdamW step."""
    model.train()
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).to(h.dtype)
    loss = (h.pow(2) * m).sum() / (m.sum() * h.size(-1))
    loss.backward()
    ref = {"last_hidden_state": h.detach().clone(), "loss": loss.detach().reshape(1)}
    params = dict(model.named_parameters())
    for n, p in params.items():
        ref["grad." + n] = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
    torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step()
    for n, p in params.items():
        ref["after_adamw." + n] = p.detach().clone()
    return ref


def run_dump(model_dir, ids, mask, tmp_path, extra=("--adamw", ADAMW)):
    batch = tmp_path / "batch.safetensors"
    tensors = {"input_ids": ids}
    if mask is not None:
        tensors["attention_mask"] = mask
    save_file(tensors, str(batch))
    out = tmp_path / "out.safetensors"
    run_lf("dump", "--model", model_dir, "--batch", batch, "--out", out, *extra)
    return load_file(str(out))


def compare(ours, ref):
    assert rel_err(ours["last_hidden_state"], ref["last_hidden_state"]) <= 1e-5
    assert abs(ours["loss"].item() - ref["loss"].item()) <= 1e-5 * abs(ref["loss"].item())
    grads = sorted(k for k in ref if k.startswith("grad."))
    assert sorted(k for k in ours if k.startswith("grad.")) == grads
    for k in grads:
        assert ref[k].abs().max() > 0, k  # the test says something about every parameter
        assert rel_err(ours[k], ref[k]) <= 1e-4, k
    for k in ref:
        if k.startswith("after_adamw."):
            n = k[len("after_adamw."):]
            check_after_step(ours["after_step." + n], ref[k], ours["grad." + n], ref["grad." + n])


@pytest.mark.parametrize("case", list(CASES))
def test_t5_dump_matches_transformers(case, tmp_path):
    kind, kw = CASES[case]
    torch.manual_seed(0)
    cfg = config(kind, **kw)
    model = perturbed(ENCODER[kind](cfg))
    model.save_pretrained(tmp_path / "model")
    ids, mask = make_batch(cfg.vocab_size)
    ours = run_dump(tmp_path / "model", ids, mask, tmp_path)
    compare(ours, hf_reference(model, ids, mask))


def test_t5_dump_without_mask(tmp_path):
    """No attention_mask: every position is a token (transformers' default)."""
    torch.manual_seed(0)
    cfg = config("t5", feed_forward_proj="gated-gelu")
    model = perturbed(ENCODER["t5"](cfg))
    model.save_pretrained(tmp_path / "model")
    ids, _ = make_batch(cfg.vocab_size, lengths=(9, 9))
    ours = run_dump(tmp_path / "model", ids, None, tmp_path)
    compare(ours, hf_reference(model, ids, torch.ones_like(ids)))


@pytest.mark.parametrize("kind", ["t5", "umt5"])
def test_seq2seq_folder_loads_as_its_encoder(kind, tmp_path):
    """A whole T5ForConditionalGeneration / UMT5ForConditionalGeneration folder: its decoder and lm_head are skipped
    and the encoder equals transformers' encoder class loaded from the same folder. The tied embedding also loads
    from encoder.embed_tokens.weight alone, and from a checkpoint that stores both names."""
    torch.manual_seed(2)
    cfg = config(kind, feed_forward_proj="gated-gelu")
    full = perturbed(SEQ2SEQ[kind](cfg), seed=3)
    full.save_pretrained(tmp_path / "full")
    saved = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert any(k.startswith("decoder.") for k in saved)
    encoder = ENCODER[kind].from_pretrained(tmp_path / "full").eval()
    ids, mask = make_batch(cfg.vocab_size, seed=4)
    ref = hf_reference(encoder, ids, mask)
    compare(run_dump(tmp_path / "full", ids, mask, tmp_path), ref)
    enc = {k: v for k, v in saved.items() if k.startswith("encoder.") or k == "shared.weight"}
    layouts = {"embed_tokens_only": {("encoder.embed_tokens.weight" if k == "shared.weight" else k): v
                                     for k, v in enc.items()},
               "both_names": {**enc, "encoder.embed_tokens.weight": enc["shared.weight"].clone()}}
    for name, tensors in layouts.items():
        d = tmp_path / name
        d.mkdir()
        shutil.copy(tmp_path / "full" / "config.json", d / "config.json")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        out = run_dump(d, ids, mask, tmp_path, extra=())
        assert rel_err(out["last_hidden_state"], ref["last_hidden_state"]) <= 1e-5, name
        assert rel_err(out["grad.shared.weight"], ref["grad.shared.weight"]) <= 1e-4, name


@pytest.mark.parametrize("kind,source", [("t5", "encoder"), ("umt5", "encoder"), ("t5", "seq2seq")])
def test_convert_loads_in_transformers(kind, source, tmp_path):
    torch.manual_seed(5)
    cfg = config(kind, feed_forward_proj="relu" if kind == "t5" else "gated-gelu")
    model = perturbed((ENCODER if source == "encoder" else SEQ2SEQ)[kind](cfg), seed=6)
    model.save_pretrained(tmp_path / "src")
    run_lf("convert", "--model", tmp_path / "src", "--out", tmp_path / "out", "--dtype", "fp32")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [ENCODER[kind].__name__]
    assert written["model_type"] == kind
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not any(k.startswith("decoder.") or k == "lm_head.weight" for k in stored)
    loaded, info = ENCODER[kind].from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = dict(model.named_parameters())
    got = dict(loaded.named_parameters())
    assert sorted(got) == sorted(n for n in want if n.startswith("encoder.") or n == "shared.weight")
    for n, p in got.items():
        assert torch.equal(p, want[n]), n


@pytest.mark.parametrize("case", list(CASES))
def test_info_counts_transformers_parameters(case, tmp_path):
    kind, kw = CASES[case]
    cfg = config(kind, **kw)
    model = ENCODER[kind](cfg)
    model.save_pretrained(tmp_path / "m")
    info = json.loads(run_lf("info", tmp_path / "m").stdout)
    assert info["family"] == "text_encoder" and info["model_type"] == kind
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert (info["layers"], info["d_model"], info["heads"], info["d_kv"], info["d_ff"], info["vocab_size"]) == (
        cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.d_kv, cfg.d_ff, cfg.vocab_size)


@pytest.mark.parametrize("field,value,says", [
    ("is_decoder", True, "encoder"),
    ("feed_forward_proj", "gated-gelu-x", "gated-ACT"),
    ("feed_forward_proj", "swiglu", "not supported"),
    ("feed_forward_proj", "fancy-relu", "gated-ACT"),
    ("architectures", ["T5ForSequenceClassification"], "T5EncoderModel"),
    ("d_model", 0, "positive"),
])
def test_bad_config_is_one_line(field, value, says, tmp_path):
    model = ENCODER["t5"](config("t5"))
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    for argv in (["info", tmp_path / "m"], ["convert", "--model", tmp_path / "m", "--out", tmp_path / "o"]):
        proc = run_lf(*argv, check=False)
        assert proc.returncode != 0
        line = proc.stderr.strip().splitlines()[-1]
        assert "config.json" in line and f"'{field}'" in line and says in line, line


def test_bad_batch_names_the_tensor(tmp_path):
    ENCODER["t5"](config("t5")).save_pretrained(tmp_path / "m")
    ids, mask = make_batch(100)
    for tensors, field in [({"input_ids": ids, "attention_mask": mask[:, :3]}, "attention_mask"),
                           ({"input_ids": ids.float()}, "input_ids"),
                           ({"input_ids": ids + 100}, "input_ids"),
                           ({"input_ids": ids, "attention_mask": mask * 2}, "attention_mask")]:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "b.safetensors"))
        proc = run_lf("dump", "--model", tmp_path / "m", "--batch", tmp_path / "b.safetensors", "--out",
                      tmp_path / "o.safetensors", check=False)
        assert proc.returncode != 0
        line = proc.stderr.strip().splitlines()[-1]
        assert "b.safetensors" in line and f"'{field}'" in line, line


def t5_tokenizer_folder(tmp_path):
    """A T5 tokenizer from a tiny sentencepiece unigram model trained here (T5's ids: pad 0, </s> 1, unk 2, no
    <s>): the folder transformers saves (tokenizer.json, tokenizer_config.json) plus the spiece.model hub folders
    carry; and the sentences it was trained on."""
    spm = pytest.importorskip("sentencepiece")
    rng = random.Random(0)
    words = ("a photo of the cat dog red blue green tree house sky over under big small running sitting on in with "
             "A The Photo, painting. bright; 2024 café").split()
    sents = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    (tmp_path / "corpus.txt").write_text("\n".join(sents) + "\n")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=60, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   character_coverage=1.0, minloglevel=2)
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(tmp_path / "sp.model", src / "spiece.model")
    tok = transformers.T5Tokenizer.from_pretrained(src, extra_ids=5)
    out = tmp_path / "tokenizer"
    tok.save_pretrained(out)
    shutil.copy(tmp_path / "sp.model", out / "spiece.model")
    return out, tok, sents


CAPTIONS = ["a photo of  the cat", " big red dog ", "A painting, bright; café 2024.", "日本 cat on a tree", "",
            "The  CAT\tsat on the   house!", "über-green sky"]


def test_tokenize_matches_transformers_t5_tokenizer(tmp_path):
    """`loongforge tokenize` on a T5 folder gives transformers' T5Tokenizer ids, the appended </s> included; without
    special tokens, sentencepiece's own; decoding drops the </s>."""
    folder, tok, sents = t5_tokenizer_folder(tmp_path)
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "Unigram"
    texts = CAPTIONS + sents[:40]
    want = [tok(t).input_ids for t in texts]
    assert all(ids[-1] == tok.eos_token_id for ids in want)
    for where in (folder, folder / "tokenizer.json"):
        got = json.loads(run_lf("tokenize", "--tokenizer", where, input=json.dumps(texts)).stdout)
        assert got == want
    plain = json.loads(run_lf("tokenize", "--tokenizer", folder, "--no-add-special-tokens",
                              input=json.dumps(texts)).stdout)
    assert plain == [tok(t, add_special_tokens=False).input_ids for t in texts]
    ids = want[0]
    text = run_lf("tokenize", "--tokenizer", folder, "--decode", ",".join(map(str, ids))).stdout.rstrip("\n")
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_tokenize_t5_sentencepiece_folder(tmp_path):
    """A folder with spiece.model and tokenizer_config.json alone (the slow tokenizer's files): the T5 tokenizer
    appends </s> there too."""
    folder, tok, _ = t5_tokenizer_folder(tmp_path)
    (folder / "tokenizer.json").unlink()
    got = json.loads(run_lf("tokenize", "--tokenizer", folder, input=json.dumps(CAPTIONS)).stdout)
    assert got == [tok(t).input_ids for t in CAPTIONS]


def test_unigram_tokenizer_json_without_sentencepiece_model(tmp_path):
    folder, _, _ = t5_tokenizer_folder(tmp_path)
    (folder / "spiece.model").unlink()
    proc = run_lf("tokenize", "--tokenizer", folder, "--text", "a cat", check=False)
    assert proc.returncode != 0
    line = proc.stderr.strip().splitlines()[-1]
    assert "tokenizer.json" in line and "'model.type'" in line and "spiece.model" in line, line

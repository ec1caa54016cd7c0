"""`loongforge dump` against transformers' own model code, in fp32 on the CPU.

Tolerances (the issue's): logits max|a-b|/max|b| <= 1e-5; every gradient max|a-b|/max|b| <= 1e-4; parameters after
one AdamW step max|a-b| <= 1e-6 wherever the step is well-conditioned (see check_after_step).
"""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, run_lf

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
ADAMW = f"lr={LR},beta1={BETAS[0]},beta2={BETAS[1]},eps={EPS},weight_decay={WD}"


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def check_after_step(ours, ref, g_ours, g_ref):
    """After one AdamW step p' = p(1 - lr*wd) - lr*g/(|g| + eps) (bias-corrected m/sqrt(v) = g/|g|). Where |g| is
    near eps the update's sensitivity to g is lr*eps/(|g|+eps)^2 (up to 1e5 here), so gradients that agree to 1e-9
    absolute still move p by up to ~lr there. We require 1e-6 everywhere, plus that sensitivity times the observed
    gradient difference, which is 0 wherever |g| >> eps."""
    g_min = torch.minimum(g_ours.abs(), g_ref.abs()).double()
    sensitivity = LR * EPS / (g_min + EPS) ** 2
    allowed = 1e-6 + 2 * sensitivity * (g_ours.double() - g_ref.double()).abs()
    diff = (ours.double() - ref.double()).abs()
    bad = diff > allowed
    assert not bad.any(), f"after-step max excess {(diff - allowed).max().item():.3e}"
    well = g_min > 1e-6  # the update there is insensitive to gradient noise
    if well.any():
        assert diff[well].max().item() <= 1e-6


def run_dump(model_dir, input_ids, labels, tmp_path, extra=()):
    batch = tmp_path / "batch.safetensors"
    tensors = {"input_ids": input_ids}
    if labels is not None:
        tensors["labels"] = labels
    save_file(tensors, str(batch))
    out = tmp_path / "out.safetensors"
    run_lf("dump", "--model", model_dir, "--batch", batch, "--out", out, *extra)
    return load_file(str(out))


def hf_reference(model, input_ids, labels):
    """Logits, loss, grads and params after one AdamW step, computed by transformers + torch.optim.AdamW."""
    model.train()
    out = model(input_ids=input_ids, labels=labels if labels is not None else input_ids)
    out.loss.backward()
    ref = {"logits": out.logits.detach().clone(), "loss": out.loss.detach().reshape(1)}
    params = dict(model.named_parameters())
    for n, p in params.items():
        ref["grad." + n] = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
    opt = torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt.step()
    for n, p in params.items():
        ref["after_adamw." + n] = p.detach().clone()
    return ref


def compare(ours, ref):
    assert rel_err(ours["logits"], ref["logits"]) <= 1e-5
    assert abs(ours["loss"].item() - ref["loss"].item()) <= 1e-5 * abs(ref["loss"].item())
    grads = [k for k in ref if k.startswith("grad.")]
    assert sorted(k for k in ours if k.startswith("grad.")) == sorted(grads)
    for k in grads:
        assert rel_err(ours[k], ref[k]) <= 1e-4, k
    for k in ref:
        if k.startswith("after_adamw."):
            n = k[len("after_adamw."):]
            check_after_step(ours["after_step." + n], ref[k], ours["grad." + n], ref["grad." + n])


def check_export(model, src, out, model_class=transformers.AutoModelForCausalLM):
    """`convert` of SRC (model's save_pretrained folder) into OUT writes save_pretrained's tensor names bit for bit,
    and transformers loads OUT with model's logits. Returns the loaded model."""
    run_lf("convert", "--model", src, "--out", out, "--dtype", "fp32")
    want, got = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    hf = model_class.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ids, _ = make_batch(model.config.vocab_size)
    with torch.no_grad():
        assert rel_err(hf(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-6
    return hf


def check_greedy_generate(model, model_dir, prompt, eos=2, new_tokens=10):
    """Greedy `loongforge generate` ids = transformers' generate, up to our first eos (at least 5 tokens compared, to
    exercise the cache)."""
    model.eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    got = json.loads(run_lf("generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-new-tokens", new_tokens, "--ids").stdout)
    n = got.index(eos) + 1 if eos in got else len(got)
    assert n >= 5
    assert got[:n] == ref[:n]


def check_bad_field_one_line(src, field, value, needle):
    """`info` on the folder SRC after its config.json's FIELD is set to VALUE: exit status 1 and one line naming
    config.json and NEEDLE."""
    cfg = json.loads((src / "config.json").read_text())
    cfg[field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    r = run_lf("info", src, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and needle in lines[0] and "config.json" in lines[0], r.stderr


def test_fixture_hf_llama(tmp_path):
    ref = load_file(str(FIXTURES / "hf_llama" / "reference.safetensors"))
    ours = run_dump(FIXTURES / "hf_llama", ref["input_ids"], ref["labels"], tmp_path, ["--adamw", ADAMW])
    compare(ours, ref)
    assert abs(ours["loss"].item() - json.loads((FIXTURES / "hf_llama" / "reference.json").read_text())["loss"]) < 1e-5


BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)

CASES = {
    "llama_untied": ("llama", dict()),
    "llama_tied_biases": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                        num_key_value_heads=4)),
    "llama_pad_token": ("llama", dict(pad_token_id=3, hidden_act="gelu_pytorch_tanh")),
    "llama3_rope": ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=16))),
    "llama_linear_rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama_dynamic_rope": ("llama", dict(max_position_embeddings=16,
                                         rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "llama_yarn_rope": ("llama", dict(max_position_embeddings=64,
                                      rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                           original_max_position_embeddings=16))),
    "mistral_sliding": ("mistral", dict(sliding_window=7, head_dim=24)),
    "qwen2_bias_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                         tie_word_embeddings=True)),
    "qwen3_qknorm": ("qwen3", dict(head_dim=32, num_attention_heads=4, num_key_value_heads=1)),
    "qwen3_tied_bias": ("qwen3", dict(head_dim=16, attention_bias=True, tie_word_embeddings=True)),
}


def make_model(model_type, overrides, seed=0):
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # make norms and biases non-trivial so their gradients and effects are tested
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make_batch(vocab, b=2, t=24, seed=1, ignore=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    if ignore:
        labels[0, :5] = -100
    return ids, labels


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_parity(case, tmp_path):
    model_type, overrides = CASES[case]
    model = make_model(model_type, overrides)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    ids, labels = make_batch(model.config.vocab_size)
    ours = run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW])
    compare(ours, hf_reference(model, ids, labels))


def test_rope_theta_top_level_layout(tmp_path):
    """Checkpoints written by transformers 4 keep rope_theta (and rope_scaling) at the top level."""
    model = make_model("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=5000.0, factor=2.0)))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ids, labels = make_batch(model.config.vocab_size)
    ours = run_dump(model_dir, ids, None, tmp_path)
    ref = hf_reference(model, ids, None)
    assert rel_err(ours["logits"], ref["logits"]) <= 1e-5


def test_sharded_bf16_checkpoint_loads(tmp_path):
    model = make_model("qwen2", dict(num_hidden_layers=3))
    model_dir = tmp_path / "model"
    model.to(torch.bfloat16).save_pretrained(model_dir, max_shard_size="60KB")
    assert (model_dir / "model.safetensors.index.json").exists()
    assert len(list(model_dir.glob("model-*.safetensors"))) > 2
    ids, labels = make_batch(model.config.vocab_size)
    ours = run_dump(model_dir, ids, labels, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ref = hf_reference(hf, ids, labels)
    assert rel_err(ours["logits"], ref["logits"]) <= 1e-5
    for k in ref:
        if k.startswith("grad."):
            assert rel_err(ours[k], ref[k]) <= 1e-4, k


def test_steps_with_clipping_match_torch(tmp_path):
    model = make_model("llama", dict())
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    ids, labels = make_batch(model.config.vocab_size)
    n, clip = 5, 0.5
    ours = run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW, "--steps", n, "--clip", clip])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, norms = [], []
    for _ in range(n):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    assert torch.allclose(ours["losses"].double(), torch.tensor(losses, dtype=torch.float64), rtol=1e-5, atol=0)
    assert torch.allclose(ours["grad_norms"].double(), torch.tensor(norms, dtype=torch.float64), rtol=1e-4, atol=0)


def test_export_loads_in_transformers(tmp_path):
    model = make_model("qwen3", dict(tie_word_embeddings=True))
    src = tmp_path / "src"
    model.save_pretrained(src)
    ids, _ = make_batch(model.config.vocab_size)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    for dtype, shard in (("fp32", "5GB"), ("bf16", "40KB")):
        out = tmp_path / f"out_{dtype}"
        run_lf("convert", "--model", src, "--out", out, "--dtype", dtype, "--max-shard-size", shard)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            got = hf(input_ids=ids).logits
        if dtype == "fp32":
            assert rel_err(got, want) <= 1e-6
        else:
            assert (out / "model.safetensors.index.json").exists()
            sd = {k: v for k, v in model.state_dict().items()}
            for k, v in hf.state_dict().items():
                assert torch.equal(v, sd[k].to(torch.bfloat16).float()), k


def test_generate_greedy_matches_transformers(tmp_path):
    model = make_model("llama", dict(tie_word_embeddings=True, bos_token_id=1, eos_token_id=2))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    prompt = [1, 17, 42, 99, 5, 250, 31]
    model.eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    out = run_lf("generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", 12, "--ids").stdout
    got = json.loads(out)
    if 2 in got:  # we stop at eos; transformers was told not to
        got = got[: got.index(2) + 1]
        ref = ref[: len(got)]
    assert got == ref


def test_generate_sliding_window_with_cache(tmp_path):
    model = make_model("mistral", dict(sliding_window=4))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    prompt = [3, 4, 5, 6, 7, 8]
    model.eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    got = json.loads(run_lf("generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-new-tokens", 10, "--ids").stdout)
    n = got.index(model.config.eos_token_id) + 1 if model.config.eos_token_id in got else len(got)
    assert got[:n] == ref[:n]

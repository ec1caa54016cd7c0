"""Block-quantized checkpoints as the Hub ships them (config.json quantization_config, quant_method fp8): FP8 e4m3
weights with per-block `weight_scale_inv` (DeepSeek-V3, Qwen3-FP8) and DeepSeek-V4's files (FP8 linears and packed
FP4 e2m1 experts, E8M0 scales stored as `<module>.scale`). LoongForge dequantizes on load; the reference is
transformers loading the same folder on the CPU (it dequantizes too, having no FP8 matmul there): `dump` logits and
loss equal its, `convert` writes plain weights without the quantization_config that transformers loads with the same
logits; a grid with a partial last block follows DeepSeek's definition (the config's block, ceil grid); an unsupported
method or a grid that fits no block is one line naming the file and the field or tensor."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_model_parity import make_batch, rel_err, run_dump

FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e8m0(x):
    """The power-of-two scales >= x as E8M0 bytes (2^(byte - 127))."""
    return (torch.ceil(torch.log2(x.clamp(min=2.0 ** -126))) + 127).to(torch.uint8)


def block_scales(w, bm, bn, top, pow2):
    """Per-block amax / top over DeepSeek's ceil grid; float32, or E8M0 bytes when pow2."""
    r, c = w.shape
    gr, gc = -(-r // bm), -(-c // bn)
    s = torch.stack([torch.stack([w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].abs().max() for j in range(gc)])
                     for i in range(gr)]) / top
    if pow2:
        b = e8m0(s)
        return b, torch.exp2(b.float() - 127)
    return s.float(), s.float()


def expand(s, bm, bn, shape):
    return s.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:shape[0], :shape[1]]


def quant_fp8(w, bm, bn, pow2=False):
    stored, s = block_scales(w, bm, bn, 448.0, pow2)
    return (w / expand(s, bm, bn, w.shape)).to(torch.float8_e4m3fn), stored


def quant_fp4(w, bn):
    """Packed e2m1 (two per byte, low nibble first) with [1, bn] E8M0 scales."""
    stored, s = block_scales(w, 1, bn, 6.0, True)
    x = w / expand(s, 1, bn, w.shape)
    code = (x.abs().unsqueeze(-1) - FP4_GRID).abs().argmin(-1) + 8 * (x < 0).long()
    return (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8), stored


def dequant_deepseek(q, s, bm, bn):
    """DeepSeek's weight_dequant: q * s over bm x bn blocks, the last ones partial."""
    return q.float() * expand(s.float(), bm, bn, q.shape)


def write_quantized(model, src, dst, pick, block, scale_name="weight_scale_inv", extra=None):
    """save_pretrained into SRC, then DST: the same tensors with those `pick(name, tensor)` names "fp8" / "fp4"
    quantized, and the config's quantization_config."""
    model.save_pretrained(src)
    out = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        kind = pick(k, v) if k.endswith(".weight") and v.dim() == 2 else None
        scale_key = k + "_scale_inv" if scale_name == "weight_scale_inv" else k[:-len(".weight")] + "." + scale_name
        if kind == "fp8":
            q, s = quant_fp8(v, *block, pow2=scale_name != "weight_scale_inv")
        elif kind == "fp4":
            q, s = quant_fp4(v, min(32, v.shape[1]))
        else:
            out[k] = v
            continue
        out[k] = q
        out[scale_key] = s.view(torch.float8_e8m0fnu) if s.dtype == torch.uint8 else s
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), **(extra or {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return out


def transformers_logits(folder, ids, labels):
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = m(input_ids=ids, labels=labels)
    return m, out.logits, out.loss


def check_against_transformers(qdir, tmp_path, vocab, t=24):
    ids, labels = make_batch(vocab, t=t)
    ours = run_dump(qdir, ids, labels, tmp_path)
    _, logits, loss = transformers_logits(qdir, ids, labels)
    assert rel_err(ours["logits"], logits) <= 1e-5
    assert abs(ours["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    return ids, labels, logits


def test_qwen3_fp8_loads_as_transformers_and_converts_to_plain(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    qdir = tmp_path / "fp8"
    stored = write_quantized(model, tmp_path / "src", qdir, lambda k, v: "fp8" if "layers" in k else None, (16, 16))
    ids, labels, logits = check_against_transformers(qdir, tmp_path, cfg.vocab_size)
    # the quantization mattered: the original model's logits differ
    with torch.no_grad():
        assert rel_err(model.eval()(input_ids=ids).logits, logits) > 1e-4
    out = tmp_path / "plain"
    run_lf("convert", "--model", qdir, "--out", out, "--dtype", "fp32")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    plain = load_file(str(out / "model.safetensors"))
    assert not any(k.endswith("_scale_inv") for k in plain)
    k = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(plain[k], dequant_deepseek(stored[k], stored[k + "_scale_inv"], 16, 16))
    _, logits2, _ = transformers_logits(out, ids, labels)
    assert rel_err(logits2, logits) <= 1e-6


def deepseek_v3(**overrides):
    from test_deepseek_parity import make_model
    return make_model(overrides)


def test_deepseek_v3_fp8_moe_per_expert(tmp_path):
    model = deepseek_v3()
    qdir = tmp_path / "fp8"
    fp8 = lambda k, v: "fp8" if "layers" in k and not k.endswith("mlp.gate.weight") else None  # noqa: E731
    stored = write_quantized(model, tmp_path / "src", qdir, fp8, (8, 8))
    assert any(".experts." in k and k.endswith("_scale_inv") for k in stored)
    check_against_transformers(qdir, tmp_path, model.config.vocab_size)


def test_partial_last_block_follows_deepseeks_grid(tmp_path):
    """[16, 16] blocks over q_a_proj [24, 64] make a 2 x 4 grid whose second row of blocks has 8 rows (DeepSeek's
    ceil grid; dividing the weight by the grid would wrongly give 12-row blocks)."""
    model = deepseek_v3()
    qdir = tmp_path / "fp8"
    stored = write_quantized(model, tmp_path / "src", qdir, lambda k, v: "fp8" if "q_a_proj" in k else None, (16, 16))
    k = "model.layers.0.self_attn.q_a_proj.weight"
    assert tuple(stored[k].shape) == (24, 64) and tuple(stored[k + "_scale_inv"].shape) == (2, 4)
    out = tmp_path / "plain"
    run_lf("convert", "--model", qdir, "--out", out, "--dtype", "fp32")
    got = load_file(str(out / "model.safetensors"))[k]
    assert torch.equal(got, dequant_deepseek(stored[k], stored[k + "_scale_inv"], 16, 16))


def test_deepseek_v4_fp8_linears_and_fp4_experts(tmp_path):
    from test_deepseek_v4_parity import CASES, make_model
    model = make_model(CASES["mixed_layers"][0])

    def pick(k, v):
        if ".experts." in k and ".shared_experts." not in k:
            return "fp4"
        if (".attn." in k or ".shared_experts." in k) and "weights_proj" not in k and "compressor" not in k:
            return "fp8"
        return None

    stored = write_quantized(model, tmp_path / "src", tmp_path / "fp8", pick, (8, 8), scale_name="scale",
                             extra={"scale_fmt": "ue8m0"})
    assert stored["model.layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert stored["model.layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    check_against_transformers(tmp_path / "fp8", tmp_path, model.config.vocab_size, t=CASES["mixed_layers"][1])


def test_bad_quantization_is_one_line(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    qdir = tmp_path / "fp8"
    write_quantized(transformers.Qwen3ForCausalLM(cfg), tmp_path / "src", qdir,
                    lambda k, v: "fp8" if "layers" in k else None, (16, 16))
    ids, labels = make_batch(cfg.vocab_size, t=8)
    save_file({"input_ids": ids}, str(tmp_path / "b.safetensors"))

    def one_line(*needles):
        r = run_lf("dump", "--model", qdir, "--batch", tmp_path / "b.safetensors", "--out", tmp_path / "o.safetensors",
                   check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and all(n in lines[0] for n in needles), r.stderr

    good = json.loads((qdir / "config.json").read_text())
    (qdir / "config.json").write_text(json.dumps({**good, "quantization_config": {"quant_method": "awq", "bits": 4}}))
    one_line("config.json", "quantization_config.quant_method", "awq")
    (qdir / "config.json").write_text(json.dumps(good))
    tensors = load_file(str(qdir / "model.safetensors"))
    k = "model.layers.0.mlp.up_proj.weight"
    tensors[k + "_scale_inv"] = torch.ones(3, 5)  # fits no block of a [64, 32] weight
    save_file(tensors, str(qdir / "model.safetensors"))
    one_line(str(qdir), k, "scale grid")

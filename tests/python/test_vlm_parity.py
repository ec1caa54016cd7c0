"""Vision-language models against transformers' own classes, fp32 on the CPU (issue 19): `loongforge dump` on a batch
with images gives transformers' logits (<= 1e-5 rel), loss, every gradient (<= 1e-4 rel, under transformers'
parameter names) and parameters after one AdamW step; the checkpoint loads under every key layout transformers takes;
`convert` writes a folder transformers loads; `info` shows the components."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_model_parity import ADAMW, BETAS, EPS, LR, WD, check_after_step, rel_err

IMAGE_TOKEN = 7


def llava_config(tower, text="llama", **kw):
    if tower == "clip":
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                               num_attention_heads=4, image_size=28, patch_size=7)
    else:
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                                 num_attention_heads=4, image_size=28, patch_size=7)
    text_kw = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
    text_cfg = (transformers.LlamaConfig if text == "llama" else transformers.Qwen2Config)(**text_kw)
    return transformers.LlavaConfig(vision_config=vision.to_dict(), text_config=text_cfg.to_dict(),
                                    image_token_id=IMAGE_TOKEN, **kw)


def tokens_per_image(cfg):
    v = cfg.vision_config
    n = (v.image_size // v.patch_size) ** 2 + (1 if v.model_type == "clip_vision_model" else 0)
    return n - (1 if cfg.vision_feature_select_strategy == "default" else 0)


def make_batch(cfg, images_per_row=(1, 2), text_len=9, seed=0):
    """input_ids with each row's image tokens in a block after a few text tokens; pixel_values in token order."""
    g = torch.Generator().manual_seed(seed)
    n = tokens_per_image(cfg)
    seq = text_len + n * max(images_per_row)
    rows = []
    for k in images_per_row:
        ids = torch.randint(IMAGE_TOKEN + 1, cfg.text_config.vocab_size, (seq,), generator=g)
        for i in range(k):
            ids[2 + i * n: 2 + (i + 1) * n] = IMAGE_TOKEN
        rows.append(ids)
    ids = torch.stack(rows)
    pixels = torch.randn(sum(images_per_row), 3, cfg.vision_config.image_size, cfg.vision_config.image_size,
                         generator=g)
    labels = ids.clone()
    labels[ids == IMAGE_TOKEN] = -100
    labels[:, :2] = -100
    return ids, pixels, labels


def hf_reference(model, ids, pixels, labels, **inputs):
    """transformers' logits, loss, gradients and parameters after one AdamW step (inputs: the model's other
    arguments, e.g. image_grid_thw)."""
    model.train()
    out = model(input_ids=ids, pixel_values=pixels, labels=labels, **inputs)
    out.loss.backward()
    ref = {"logits": out.logits.detach().clone(), "loss": out.loss.detach().reshape(1)}
    params = dict(model.named_parameters())
    for n, p in params.items():
        ref["grad." + n] = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
    torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step()
    for n, p in params.items():
        ref["after_adamw." + n] = p.detach().clone()
    return ref


def run_dump(model_dir, ids, pixels, labels, tmp_path, extra=("--adamw", ADAMW)):
    batch = tmp_path / "batch.safetensors"
    save_file({"input_ids": ids, "pixel_values": pixels.contiguous(), "labels": labels}, str(batch))
    out = tmp_path / "out.safetensors"
    run_lf("dump", "--model", model_dir, "--batch", batch, "--out", out, *extra)
    return load_file(str(out))


def compare(ours, ref):
    assert rel_err(ours["logits"], ref["logits"]) <= 1e-5
    assert abs(ours["loss"].item() - ref["loss"].item()) <= 1e-5 * abs(ref["loss"].item())
    grads = sorted(k for k in ref if k.startswith("grad."))
    assert sorted(k for k in ours if k.startswith("grad.")) == grads
    for k in grads:
        if ref[k].abs().max() == 0:  # layers past the selected feature layer, SigLIP's pooling head: no gradient
            assert ours[k].abs().max() == 0, k
        elif "vision_tower" in k and k.endswith("k_proj.bias"):  # zero in exact arithmetic (softmax ignores a shift shared by all keys)
            assert ours[k].abs().max() <= 1e-9 and ref[k].abs().max() <= 1e-9, k
        else:
            assert rel_err(ours[k], ref[k]) <= 1e-4, k
    for k in ref:
        if k.startswith("after_adamw."):
            n = k[len("after_adamw."):]
            check_after_step(ours["after_step." + n], ref[k], ours["grad." + n], ref["grad." + n])


CASES = {
    "clip_llama": dict(tower="clip"),
    "siglip_qwen2_full_multi_layer": dict(tower="siglip", text="qwen2", vision_feature_select_strategy="full",
                                          vision_feature_layer=[-3, -1], projector_hidden_act="gelu_pytorch_tanh"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_llava_dump_matches_transformers(case, tmp_path):
    torch.manual_seed(0)
    cfg = llava_config(**CASES[case])
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    ids, pixels, labels = make_batch(cfg)
    ours = run_dump(model_dir, ids, pixels, labels, tmp_path)
    compare(ours, hf_reference(model, ids, pixels, labels))


def test_llava_loads_every_key_layout(tmp_path):
    """transformers 5's save_pretrained layout, llava-hf's (vision_tower.vision_model.*), and the in-memory names
    (model.*, lm_head.weight) give the same model; a layout mixing two spellings of one tensor is an error."""
    torch.manual_seed(1)
    cfg = llava_config("clip")
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    base = tmp_path / "saved"
    model.save_pretrained(base)
    saved = load_file(str(base / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in saved)
    ids, pixels, labels = make_batch(cfg, images_per_row=(2, 1))
    want = run_dump(base, ids, pixels, labels, tmp_path, extra=())
    layouts = {
        "llava_hf": {(k.replace("vision_tower.", "vision_tower.vision_model.", 1) if k.startswith("vision_tower.")
                      else k): v for k, v in saved.items()},
        "in_memory": {k: v.detach().clone() for k, v in model.named_parameters()},
    }
    for name, tensors in layouts.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((base / "config.json").read_text())
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        got = run_dump(d, ids, pixels, labels, tmp_path, extra=())
        assert torch.equal(got["logits"], want["logits"]), name
    tensors = dict(saved)
    tensors["model.multi_modal_projector.linear_1.weight"] = saved["multi_modal_projector.linear_1.weight"].clone()
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "config.json").write_text((base / "config.json").read_text())
    save_file(tensors, str(d / "model.safetensors"))
    batch = tmp_path / "batch.safetensors"
    err = run_lf("dump", "--model", d, "--batch", batch, "--out", tmp_path / "x.safetensors", check=False).stderr
    assert "multi_modal_projector.linear_1.weight" in err and "two key layouts" in err
    assert len(err.strip().splitlines()) == 1


def test_llava_convert_loads_in_transformers_and_info(tmp_path):
    torch.manual_seed(2)
    cfg = llava_config("siglip", vision_feature_select_strategy="full")
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path / "src")
    run_lf("convert", "--model", tmp_path / "src", "--out", tmp_path / "out", "--dtype", "fp32")
    back = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32)
    want = model.state_dict()
    got = back.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    info = json.loads(run_lf("info", tmp_path / "src").stdout)
    comps = info["components"]
    assert set(comps) == {"vision_tower", "multi_modal_projector", "language_model"}
    n = lambda m: sum(p.numel() for p in m.parameters())
    assert comps["vision_tower"]["parameters"] == n(model.model.vision_tower)
    assert comps["multi_modal_projector"]["parameters"] == n(model.model.multi_modal_projector)
    assert comps["language_model"]["parameters"] == n(model.model.language_model) + n(model.lm_head)
    assert info["parameters"] == n(model)


def test_llava_bad_input_is_one_line(tmp_path):
    torch.manual_seed(3)
    cfg = llava_config("clip")
    model = transformers.LlavaForConditionalGeneration(cfg)
    model.save_pretrained(tmp_path / "m")
    ids, pixels, labels = make_batch(cfg)
    batch = tmp_path / "batch.safetensors"
    save_file({"input_ids": ids, "pixel_values": pixels[:2].contiguous()}, str(batch))
    err = run_lf("dump", "--model", tmp_path / "m", "--batch", batch, "--out", tmp_path / "o", check=False).stderr
    assert "image tokens" in err and str(batch) in err and len(err.strip().splitlines()) == 1
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    conf["vision_config"]["model_type"] = "dinov2"
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    err = run_lf("info", tmp_path / "m", check=False).stderr
    assert "vision_config.model_type" in err and "dinov2" in err and len(err.strip().splitlines()) == 1


def test_llava_generate_with_image_matches_transformers(tmp_path):
    """`generate --image`: the folder's CLIP processor on a PNG, one image token in the prompt expanded to the image's
    run, greedy ids = transformers' generate on the processor's pixel_values (KV cache on both sides)."""
    from PIL import Image
    torch.manual_seed(4)
    cfg = llava_config("clip")
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path / "m")
    proc = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    proc.save_pretrained(tmp_path / "m")
    g = torch.Generator().manual_seed(5)
    img = Image.fromarray(torch.randint(0, 256, (40, 52, 3), generator=g, dtype=torch.uint8).numpy())
    img.save(tmp_path / "img.png")
    prompt = [1, 12, IMAGE_TOKEN, 30, 31]
    out = run_lf("generate", "--model", tmp_path / "m", "--image", tmp_path / "img.png", "--prompt-ids",
                 ",".join(map(str, prompt)), "--max-new-tokens", 8, "--ids")
    ours = json.loads(out.stdout)
    n = tokens_per_image(cfg)
    ids = torch.tensor([prompt[:2] + [IMAGE_TOKEN] * n + prompt[3:]])
    pixels = transformers.AutoImageProcessor.from_pretrained(tmp_path / "m")(img, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    # we stop at the text config's end-of-sequence id; transformers was told not to
    eos = cfg.text_config.eos_token_id
    assert ours == ref[:len(ours)] and (len(ours) == 8 or ours[-1] == eos)
    err = run_lf("generate", "--model", tmp_path / "m", "--image", tmp_path / "img.png", "--prompt-ids",
                 f"1,{IMAGE_TOKEN},{IMAGE_TOKEN}", check=False).stderr
    assert "2 image tokens" in err and len(err.strip().splitlines()) == 1

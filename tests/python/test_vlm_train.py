"""Training a vision-language model from image + chat data (issue 19): LLaVA-format JSON and OpenAI messages with
image parts, rendered with the model's chat template, image markers expanded to the image's run of tokens, images
preprocessed by the folder's image processor. The first step's loss equals transformers' loss on what its own
processor and chat template make of the same data; a conversation whose markers and images disagree is one line."""
import json
import shutil

import pytest
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer

from conftest import FIXTURES, run_lf

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_model_dir(d, seed=0):
    """A tiny LLaVA (CLIP tower 28x28, patch 7 -> 16 tokens per image) with a byte-level tokenizer holding <image>,
    a ChatML-style template that renders image parts, and a CLIP processor."""
    tok = Tokenizer.from_file(str(FIXTURES / "tok_bytelevel_gpt2" / "tokenizer.json"))
    tok.add_special_tokens(["<image>"])
    image_id = tok.token_to_id("<image>")
    torch.manual_seed(seed)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=28, patch_size=7)
    text = transformers.LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=image_id + 8, max_position_embeddings=256,
                                    eos_token_id=2, bos_token_id=None)
    cfg = transformers.LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=image_id,
                                   vision_feature_layer=-1)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None,
                                                         "chat_template": TEMPLATE}))
    transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(d)
    return model, tok, image_id


def draw(path, colour, size=(36, 30)):
    img = Image.new("RGB", size, colour)
    for x in range(size[0] // 3):
        img.putpixel((x, x % size[1]), (255 - colour[0], 40, 90))
    img.save(path)
    return img


def recipe(tmp_path, model_dir, data, **train):
    r = tmp_path / "vlm.yaml"
    t = dict(steps=1, micro_batch_size=2, threads=2)
    t.update(train)
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {model_dir}}}
data: {{format: sft, train: [{{path: {data}}}], seq_len: 64, packing: false, assistant_only_loss: false}}
train: {json.dumps(t)}
optim: {{lr: 1.0e-3, weight_decay: 0.0}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


def test_first_step_loss_matches_transformers(tmp_path):
    model_dir = tmp_path / "m"
    model, tok, image_id = make_model_dir(model_dir)
    draw(tmp_path / "red.png", (220, 30, 30))
    draw(tmp_path / "blue.jpg", (30, 40, 210), size=(30, 44))
    data = [
        {"image": "red.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour?"},
                                               {"from": "gpt", "value": "Red."}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                                    {"type": "image", "image": "blue.jpg"},
                                                    {"type": "text", "text": " which colour?"}]},
                      {"role": "assistant", "content": "Blue, I think."}]},
    ]
    (tmp_path / "data.json").write_text(json.dumps(data))
    run_lf("train", recipe(tmp_path, model_dir, tmp_path / "data.json"))
    ours = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][0]["loss"]

    # transformers: its template renderer, the processor's expansion of <image> and its CLIP processor
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    proc = transformers.AutoImageProcessor.from_pretrained(model_dir)
    n = (28 // 7) ** 2  # vision_feature_layer -1, "default": the class token dropped
    msgs = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat colour?"}]},
             {"role": "assistant", "content": "Red."}],
            [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"},
                                          {"type": "text", "text": " which colour?"}]},
             {"role": "assistant", "content": "Blue, I think."}]]
    ids, labels = [], []
    for m in msgs:
        text = hf_tok.apply_chat_template(m, chat_template=TEMPLATE, tokenize=False).replace("<image>", "<image>" * n)
        t = hf_tok(text, add_special_tokens=False)["input_ids"]
        ids.append(torch.tensor(t + [0] * (64 - len(t))))
        lab = torch.tensor(t + [-100] * (64 - len(t)))
        lab[lab == image_id] = -100
        labels.append(lab)
    # the data's second conversation is the one packing=false puts in row 1 only if the order is kept: compare with
    # both orders (the shuffle is ours), the loss being a mean over all counted tokens of the two rows
    files = [Image.open(tmp_path / f).convert("RGB") for f in ("red.png", "blue.jpg")]  # the JPEG as decoded
    pixels = proc(files, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model(input_ids=torch.stack(ids), pixel_values=pixels, labels=torch.stack(labels))
        swapped = model(input_ids=torch.stack(ids[::-1]), pixel_values=pixels.flip(0), labels=torch.stack(labels[::-1]))
    assert abs(out.loss.item() - swapped.loss.item()) < 1e-6  # per-token mean: the row order does not matter
    assert abs(ours - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (ours, out.loss.item())


def test_image_marker_mismatch_is_one_line(tmp_path):
    model_dir = tmp_path / "m"
    make_model_dir(model_dir)
    draw(tmp_path / "a.png", (10, 200, 10))
    data = [{"images": ["a.png", "a.png"], "conversations": [{"from": "human", "value": "<image> once"},
                                                             {"from": "gpt", "value": "ok"}]}]
    (tmp_path / "d.json").write_text(json.dumps(data))
    err = run_lf("train", recipe(tmp_path, model_dir, tmp_path / "d.json"), check=False).stderr
    assert "d.json:[0]" in err and "2 images but 1 <image> markers" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "e.json").write_text(json.dumps([{"image": "missing.png", "conversations": [
        {"from": "human", "value": "<image>"}, {"from": "gpt", "value": "ok"}]}]))
    err = run_lf("train", recipe(tmp_path, model_dir, tmp_path / "e.json"), check=False).stderr
    assert "missing.png" in err and len(err.strip().splitlines()) == 1


def test_component_learning_rates_and_frozen_parts(tmp_path):
    """optim.lr_multipliers: multiplier 0 on the vision tower leaves it bitwise as loaded while the rest trains; the
    tower's parts its features never reach (CLIP's post_layernorm) stay as loaded too (no weight decay); a multiplier
    of 0.5 at lr 2e-3 gives bitwise the run at lr 1e-3."""
    from safetensors.torch import load_file
    model_dir = tmp_path / "m"
    make_model_dir(model_dir)
    draw(tmp_path / "a.png", (220, 30, 30))
    draw(tmp_path / "b.png", (30, 40, 210))
    data = [{"image": f, "conversations": [{"from": "human", "value": "<image>\nWhat colour?"},
                                           {"from": "gpt", "value": c}]} for f, c in (("a.png", "Red."), ("b.png", "Blue."))]
    (tmp_path / "d.json").write_text(json.dumps(data))
    start = load_file(str(model_dir / "model.safetensors"))

    def run(name, *sets):
        r = recipe(tmp_path, model_dir, tmp_path / "d.json", steps=3)
        run_lf("train", r, "--set", f"output_dir={tmp_path / name}", "--set", "schedule.kind=constant",
               "--set", "optim.weight_decay=0.1", *sets)
        ck = tmp_path / name / "checkpoints" / (tmp_path / name / "checkpoints" / "latest").read_text().strip()
        return load_file(str(ck / "model.safetensors"))

    frozen = run("frozen", "--set", 'optim.lr_multipliers=[{pattern: "^vision_tower\\\\.", multiplier: 0}]')
    for k, v in start.items():
        same = torch.equal(frozen[k], v)
        assert same == k.startswith("vision_tower."), k
    full = run("full", "--set", "optim.lr=1e-3")
    assert not torch.equal(full["vision_tower.encoder.layers.0.mlp.fc1.weight"],
                           start["vision_tower.encoder.layers.0.mlp.fc1.weight"])
    for k in ("vision_tower.post_layernorm.weight", "vision_tower.post_layernorm.bias"):
        assert torch.equal(full[k], start[k]), k
    half = run("half", "--set", "optim.lr=2e-3", "--set", 'optim.lr_multipliers=[{pattern: ".", multiplier: 0.5}]')
    for k in full:
        assert torch.equal(half[k], full[k]), k


def test_batch_file_with_images_trains_like_dump(tmp_path):
    """data.format: batch takes a safetensors batch with item fields (pixel_values + pixel_values.row): the first
    step's loss equals `dump`'s on the same rows (micro-batches of 2 rows: one image, then two)."""
    from safetensors.torch import load_file, save_file
    from test_vlm_parity import llava_config, make_batch
    torch.manual_seed(6)
    cfg = llava_config("clip")
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(tmp_path / "m")
    ids, pixels, labels = make_batch(cfg, images_per_row=(1, 2))
    save_file({"input_ids": ids, "labels": labels, "pixel_values": pixels.contiguous(),
               "pixel_values.row": torch.tensor([0, 1, 1])}, str(tmp_path / "b.safetensors"))
    save_file({"input_ids": ids, "labels": labels, "pixel_values": pixels.contiguous()}, str(tmp_path / "d.safetensors"))
    run_lf("dump", "--model", tmp_path / "m", "--batch", tmp_path / "d.safetensors", "--out", tmp_path / "o.safetensors")
    dump = load_file(str(tmp_path / "o.safetensors"))["loss"].item()
    r = tmp_path / "r.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {tmp_path / 'm'}}}
data: {{format: batch, train: [{{path: {tmp_path / 'b.safetensors'}}}], seq_len: {ids.shape[1]}}}
train: {{steps: 1, micro_batch_size: 2, threads: 2}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    run_lf("train", r)
    loss = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(loss - dump) <= 1e-5 * abs(dump), (loss, dump)
    bad = tmp_path / "bad.safetensors"
    save_file({"input_ids": ids, "pixel_values": pixels.contiguous(), "pixel_values.row": torch.tensor([1, 0, 1])},
              str(bad))
    err = run_lf("train", r, "--set", f"data.train=[{{path: {bad}}}]", check=False).stderr
    assert "pixel_values.row" in err and len(err.strip().splitlines()) == 1


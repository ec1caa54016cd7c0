"""Qwen2.5-VL / Qwen3-VL from image + chat data and with images in generation (issue 19): a Qwen-style chat template
writes <|vision_start|><|image_pad|><|vision_end|> for an image part (and LLaVA-style "<image>" markers become the
same), each image's pad token is expanded to its merged patch grid as Qwen's processor does, and the first step's loss
equals transformers' on what its own image processor and template make of the data — unpacked, and packed (several
conversations in one row: per-document attention, multimodal RoPE positions restarting at each conversation, as if
each were its own sample). `generate --image` gives transformers' greedy ids (multimodal positions carried on from
the prompt through the key/value cache)."""
import json

import pytest
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer

from conftest import FIXTURES, run_lf
from test_vlm_train import draw

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# A Qwen-VL-style ChatML template: a default system turn, image parts as the vision markers around one pad token.
TEMPLATE = (
    "{% set seen = namespace(images=0) %}"
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{% set seen.images = seen.images + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_model_dir(d, family="qwen2_5_vl", seed=0):
    """A tiny Qwen2.5-VL (or Qwen3-VL, Qwen3.5, Qwen3.5-MoE) over a byte-level tokenizer with Qwen's special tokens, the template above and
    a Qwen2-VL image processor with 2x2 patches merged 2x2 (a 36x30 image: a 14x18 grid, 63 tokens)."""
    tok = Tokenizer.from_file(str(FIXTURES / "tok_bytelevel_gpt2" / "tokenizer.json"))
    tok.add_special_tokens(SPECIAL)
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    torch.manual_seed(seed)
    text = dict(vocab_size=tok.get_vocab_size() + 4, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                max_position_embeddings=512,
                rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 3], rope_theta=10000.0))
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if family == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=4, in_channels=3, patch_size=2,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=8, out_hidden_size=48,
                      fullatt_block_indexes=[1])
        cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, **tokens)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    elif family == "qwen3_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=4, in_channels=3, patch_size=2,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])
        text.update(head_dim=12)
        cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=text, **tokens)
        model = transformers.Qwen3VLForConditionalGeneration(cfg).eval()
    else:  # qwen3_5 / qwen3_5_moe: Gated DeltaNet + gated attention, partial rotary (12 of head_dim 24)
        from test_qwen3_5_vl_parity import qwen3_5_config
        from test_qwen3_next_parity import perturb
        moe = family == "qwen3_5_moe"
        cfg = qwen3_5_config(moe=moe)
        cfg.text_config.vocab_size = text["vocab_size"]
        cfg.text_config.eos_token_id, cfg.text_config.bos_token_id = text["eos_token_id"], None
        cfg.text_config.max_position_embeddings = 512
        for k, v in tokens.items():
            setattr(cfg, k, v)
        cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
        model = perturb(cls(cfg)).eval()
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None,
                                                         "chat_template": TEMPLATE}))
    processor().save_pretrained(d)
    return model, ids


def processor():
    return transformers.Qwen2VLImageProcessor(patch_size=2, merge_size=2, temporal_patch_size=2,
                                              size={"shortest_edge": 16 * 16, "longest_edge": 48 * 48})


def hf_encode(model_dir, messages, images, add_generation_prompt=False):
    """transformers' side: its template renderer, the processor's pixels and grids, each <|image_pad|> expanded to
    its image's merged grid (as Qwen2_5_VLProcessor does)."""
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    px = processor()(images, return_tensors="pt")
    runs = (px["image_grid_thw"].prod(-1) // 4).tolist()
    text = hf_tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    parts = text.split("<|image_pad|>")
    assert len(parts) == len(runs) + 1
    text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(runs, parts[1:]))
    return hf_tok(text, add_special_tokens=False)["input_ids"], px


def recipe(tmp_path, model_dir, data, seq_len, packing):
    r = tmp_path / "qwen.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {model_dir}}}
data: {{format: sft, train: [{{path: {data}}}], seq_len: {seq_len}, packing: {str(packing).lower()}, assistant_only_loss: false}}
train: {{steps: 1, micro_batch_size: {1 if packing else 2}, threads: 2}}
optim: {{lr: 1.0e-3, weight_decay: 0.0}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


def conversations(tmp_path):
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
    # the same conversations as transformers' messages with their images (the JPEG as decoded)
    msgs = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat colour?"}]},
             {"role": "assistant", "content": "Red."}],
            [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"},
                                          {"type": "text", "text": " which colour?"}]},
             {"role": "assistant", "content": "Blue, I think."}]]
    images = [Image.open(tmp_path / f).convert("RGB") for f in ("red.png", "blue.jpg")]
    return msgs, images


def hf_loss_sum(model, ids, px, image_id):
    """transformers' summed loss and counted tokens of one conversation (labels: every token but the images)."""
    x = torch.tensor([ids])
    labels = x.clone()
    labels[x == image_id] = -100
    with torch.no_grad():
        out = model(input_ids=x, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"], labels=labels,
                    mm_token_type_ids=(x == image_id).int())  # as Qwen's processor returns them
    n = int((labels[:, 1:] != -100).sum())
    return out.loss.item() * n, n


QWEN3_5 = [pytest.param(f, marks=pytest.mark.slow) for f in ("qwen3_5", "qwen3_5_moe")]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", *QWEN3_5])
@pytest.mark.parametrize("packing", [False, True])
def test_first_step_loss_matches_transformers(tmp_path, family, packing):
    model_dir = tmp_path / "m"
    model, ids = make_model_dir(model_dir, family)
    msgs, images = conversations(tmp_path)
    sums, counts, lengths = [], [], []
    for m, img in zip(msgs, images):
        seq, px = hf_encode(model_dir, m, [img])
        s, n = hf_loss_sum(model, seq, px, ids["<|image_pad|>"])
        sums.append(s)
        counts.append(n)
        lengths.append(len(seq))
    # unpacked: a row each; packed: both conversations in one row, no room for a third
    seq_len = max(lengths) + 4 if not packing else sum(lengths) + 2
    run_lf("train", recipe(tmp_path, model_dir, tmp_path / "data.json", seq_len, packing))
    ours = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    ref = sum(sums) / sum(counts)
    assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)


def test_packed_positions_restart_per_conversation(tmp_path):
    """Packing without per-conversation positions would give another loss: the packed row run as one sample through
    transformers (positions and attention across both conversations) differs from the per-sample reference."""
    model_dir = tmp_path / "m"
    model, ids = make_model_dir(model_dir)
    msgs, images = conversations(tmp_path)
    seqs, pxs = zip(*[hf_encode(model_dir, m, [img]) for m, img in zip(msgs, images)])
    s, n = zip(*[hf_loss_sum(model, q, p, ids["<|image_pad|>"]) for q, p in zip(seqs, pxs)])
    joined = {k: torch.cat([p[k] for p in pxs]) for k in ("pixel_values", "image_grid_thw")}
    js, jn = hf_loss_sum(model, seqs[0] + seqs[1], joined, ids["<|image_pad|>"])
    assert abs(js / jn - sum(s) / sum(n)) > 1e-4


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", *QWEN3_5])
def test_generate_with_image_matches_transformers(tmp_path, family):
    model_dir = tmp_path / "m"
    model, ids = make_model_dir(model_dir, family, seed=3)
    img = draw(tmp_path / "a.png", (40, 200, 60), size=(36, 30)).convert("RGB")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    prompt = hf_tok.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    short = hf_tok(prompt, add_special_tokens=False)["input_ids"]  # one pad token: we expand it
    full, px = hf_encode(model_dir, msgs, [img], add_generation_prompt=True)
    with torch.no_grad():
        x = torch.tensor([full])
        ref = model.generate(input_ids=x, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                             mm_token_type_ids=(x == ids["<|image_pad|>"]).int(), max_new_tokens=12, do_sample=False,
                             eos_token_id=ids["<|im_end|>"], pad_token_id=0)
    ref = ref[0, len(full):].tolist()
    out = run_lf("generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, short)), "--image",
                 tmp_path / "a.png", "--max-new-tokens", "12", "--ids").stdout
    assert json.loads(out.strip().splitlines()[-1]) == ref
    # a prompt with no image token gets <|vision_start|> run <|vision_end|> first
    plain = hf_tok("What is it?", add_special_tokens=False)["input_ids"]
    first = [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * int(px["image_grid_thw"].prod() // 4) + \
        [ids["<|vision_end|>"]] + plain
    with torch.no_grad():
        x = torch.tensor([first])
        ref2 = model.generate(input_ids=x, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                              mm_token_type_ids=(x == ids["<|image_pad|>"]).int(), max_new_tokens=6, do_sample=False,
                              eos_token_id=ids["<|im_end|>"], pad_token_id=0)
    out2 = run_lf("generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, plain)), "--image",
                  tmp_path / "a.png", "--max-new-tokens", "6", "--ids").stdout
    assert json.loads(out2.strip().splitlines()[-1]) == ref2[0, len(first):].tolist()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava"])
def test_vision_recompute_gives_the_same_run(tmp_path, family):
    """model.vision.recompute (each tower layer recomputed in backward) trains as without it: the same losses and
    gradient norms over three steps; likewise with the language model's blocks recomputed too (model.recompute: full;
    Qwen3-VL's deepstack features are added outside the recomputed blocks, so their gradients reach the tower)."""
    model_dir = tmp_path / "m"
    if family == "llava":
        from test_vlm_train import make_model_dir as make_llava
        make_llava(model_dir)
        seq_len = 64
    else:
        make_model_dir(model_dir, family)
        seq_len = 256
    conversations(tmp_path)
    r = recipe(tmp_path, model_dir, tmp_path / "data.json", seq_len, packing=False)

    def run(name, *sets):
        run_lf("train", r, "--set", f"output_dir={tmp_path / name}", "--set", "train.steps=3", *sets)
        return [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    plain = run("plain")
    both = ["--set", "model.vision.recompute=true", "--set", "model.recompute=full"]
    for name, sets in (("vision", ["--set", "model.vision.recompute=true"]), ("both", both)):
        got = run(name, *sets)
        for a, b in zip(got, plain):
            assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (name, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (name, a, b)

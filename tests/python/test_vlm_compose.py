"""A vision-language model composed in the recipe from parts (issue 19): model.vision (a CLIP / SigLIP folder: a
vision model's or a whole CLIP model's), model.projector (mlp2x_gelu) and model.language (a decoder LM folder). The
run's checkpoints are LLaVA folders transformers loads, holding the parts' weights as they were (tower, LM), the
language folder's tokenizer with <image> added and the vision folder's image processor; the first step's loss equals
transformers' loss of that LLaVA on the same data; per-component freeze and learning-rate multipliers hold; bad
compositions are one line."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from conftest import FIXTURES, run_lf
from test_vlm_train import TEMPLATE, draw


def make_parts(d, tower="clip_vision"):
    """A vision folder (CLIPVisionModel, a whole CLIPModel or SiglipVisionModel; 28x28 images, patch 7) and a Qwen2
    LM folder whose byte-level tokenizer has no <image> (its embedding has spare rows)."""
    torch.manual_seed(0)
    vdir, ldir = d / "vision", d / "language"
    if tower == "siglip_vision":
        vc = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=28, patch_size=7)
        transformers.SiglipVisionModel(vc).save_pretrained(vdir)
        transformers.SiglipImageProcessor(size={"height": 28, "width": 28}).save_pretrained(vdir)
    else:
        vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=28, patch_size=7)
        if tower == "clip":
            tc = transformers.CLIPTextConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                             num_attention_heads=2, vocab_size=50)
            transformers.CLIPModel(transformers.CLIPConfig(text_config=tc.to_dict(), vision_config=vc.to_dict(),
                                                           projection_dim=8)).save_pretrained(vdir)
        else:
            transformers.CLIPVisionModel(vc).save_pretrained(vdir)
        transformers.CLIPImageProcessor(size={"shortest_edge": 28},
                                        crop_size={"height": 28, "width": 28}).save_pretrained(vdir)
    tok = Tokenizer.from_file(str(FIXTURES / "tok_bytelevel_gpt2" / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    n = tok.get_vocab_size()
    lc = transformers.Qwen2Config(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=n + 6, max_position_embeddings=256,
                                  eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=None)
    transformers.Qwen2ForCausalLM(lc).save_pretrained(ldir)
    tok.save(str(ldir / "tokenizer.json"))
    (ldir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None,
                                                            "chat_template": TEMPLATE}))
    return vdir, ldir, n


def recipe(tmp_path, vdir, ldir, data, steps=1, extra=""):
    r = tmp_path / "compose.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model:
  vision: {{path: {vdir}}}
  projector: {{kind: mlp2x_gelu}}
  language: {{path: {ldir}}}
{extra}
data: {{format: sft, train: [{{path: {data}}}], seq_len: 48, packing: false, assistant_only_loss: false}}
train: {{steps: {steps}, micro_batch_size: 2, threads: 2}}
optim: {{lr: 0.0, weight_decay: 0.0}}
schedule: {{kind: constant}}
checkpoint: {{every: {steps}}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


def data_file(tmp_path):
    draw(tmp_path / "red.png", (220, 30, 30))
    draw(tmp_path / "blue.png", (30, 40, 210), size=(30, 44))
    data = [{"image": f, "conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": c}]}
            for f, c in (("red.png", "Red."), ("blue.png", "Blue."))]
    (tmp_path / "data.json").write_text(json.dumps(data))
    return tmp_path / "data.json"


def latest(run):
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


@pytest.mark.parametrize("tower", ["clip_vision", "clip", "siglip_vision"])
def test_composed_llava_loads_in_transformers_with_the_parts(tmp_path, tower):
    from PIL import Image
    vdir, ldir, n = make_parts(tmp_path, tower)
    run_lf("train", recipe(tmp_path, vdir, ldir, data_file(tmp_path)))
    ck = latest(tmp_path / "run")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(ck).eval()
    assert model.config.image_token_id == n  # <image> added at the first spare row
    tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
    assert tok.token_to_id("<image>") == n
    # the parts' weights, as they were (lr 0)
    sd = {k: v for k, v in model.state_dict().items()}
    vision = load_file(str(vdir / "model.safetensors"))
    lm = load_file(str(ldir / "model.safetensors"))
    checked = 0
    for k, v in vision.items():
        if k.startswith("vision_model."):
            assert torch.equal(sd["model.vision_tower." + k[len("vision_model."):]], v), k
            checked += 1
    for k, v in lm.items():
        name = "model.language_model." + k[6:] if k.startswith("model.") else k
        assert torch.equal(sd[name], v), k
        checked += 1
    assert checked == sum(1 for k in vision if k.startswith("vision_model.")) + len(lm)
    # the first step's loss is transformers' loss of this LLaVA on the same data (its processor and template)
    ours = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ck / "tokenizer.json"))
    proc = transformers.AutoImageProcessor.from_pretrained(ck)
    # default strategy: CLIP's class token dropped (16 tokens); SigLIP has none and drops the first patch (15)
    per_image = (28 // 7) ** 2 - (1 if "siglip" in tower else 0)
    ids, labels = [], []
    for c in ("Red.", "Blue."):
        m = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nColour?"}]},
             {"role": "assistant", "content": c}]
        text = hf_tok.apply_chat_template(m, chat_template=TEMPLATE, tokenize=False)
        t = hf_tok(text.replace("<image>", "<image>" * per_image), add_special_tokens=False)["input_ids"]
        ids.append(torch.tensor(t + [0] * (48 - len(t))))
        lab = torch.tensor(t + [-100] * (48 - len(t)))
        lab[lab == n] = -100
        labels.append(lab)
    pixels = proc([Image.open(tmp_path / f).convert("RGB") for f in ("red.png", "blue.png")],
                  return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = model(input_ids=torch.stack(ids), pixel_values=pixels, labels=torch.stack(labels)).loss.item()
    assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)


def hf_state(ck):
    return transformers.LlavaForConditionalGeneration.from_pretrained(ck).state_dict()


def test_component_freeze_and_learning_rates(tmp_path):
    """model.vision.freeze and model.language.lr_multiplier 0 keep those parts bitwise as loaded over two steps at
    lr 1e-2 while the projector trains (against a run at lr 0, which keeps everything where it started)."""
    vdir, ldir, _ = make_parts(tmp_path)
    r = recipe(tmp_path, vdir, ldir, data_file(tmp_path), steps=2, extra="  image_token: '<image>'")
    run_lf("train", r, "--set", f"output_dir={tmp_path / 'still'}")
    start = hf_state(latest(tmp_path / "still"))
    run_lf("train", r, "--set", "optim.lr=1e-2", "--set", "model.vision.freeze=true",
           "--set", "model.language.lr_multiplier=0")
    trained = hf_state(latest(tmp_path / "run"))
    moved = {k for k in start if not torch.equal(start[k], trained[k])}
    assert moved and all(k.startswith("model.multi_modal_projector.") for k in moved), sorted(moved)[:5]
    assert len(moved) == 4  # both linears' weights and biases


def test_bad_compositions_are_one_line(tmp_path):
    vdir, ldir, _ = make_parts(tmp_path)
    r = recipe(tmp_path, vdir, ldir, data_file(tmp_path))
    for sets, words in [(["model.projector.kind=qformer"], ["model.projector.kind", "qformer", "mlp2x_gelu"]),
                        (["model.language.path="], ["model.language.path", "missing"]),
                        ([f"model.path={ldir}"], ["model.path", "model.vision"]),
                        ([f"model.vision.path={ldir}"], ["config.json", "model_type", "qwen2"]),
                        (["model.vision.feature_layer=9"], ["vision_feature_layer", "9"])]:
        args = [x for s in sets for x in ("--set", s)]
        err = run_lf("train", r, *args, check=False).stderr
        assert all(w in err for w in words), (sets, err)
        assert len(err.strip().splitlines()) == 1, err

"""A Qwen2.5-VL / Qwen3-VL composed in the recipe from parts (issue 19): model.vision (a whole Qwen VLM folder, whose
vision tower and patch merger are taken), model.projector.kind patch_merger and model.language (a Qwen2 / Qwen3 LM
folder of another width). The run's checkpoints are Qwen VL folders transformers loads: the tower's and the LM's
weights as they were, the merger's output layers new (the LM's width), multimodal rope sections fitted to the LM's
head, Qwen's vision tokens added to the LM's tokenizer; the first step's loss equals transformers' loss of that model
on the same data (its processor and template); the merger is the projector for per-component freezing; a language
model the Qwen VL class cannot hold is one line."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from conftest import FIXTURES, run_lf
from test_qwen_vl_train import TEMPLATE, conversations, hf_encode, hf_loss_sum, make_model_dir


def make_language(d, family, hidden=64):
    """A Qwen2 (Qwen3) LM over a byte-level tokenizer with ChatML's tokens but none of Qwen's vision tokens (its
    embedding has spare rows for them) and the Qwen-VL template."""
    tok = Tokenizer.from_file(str(FIXTURES / "tok_bytelevel_gpt2" / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    n = tok.get_vocab_size()
    torch.manual_seed(1)
    kw = dict(hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=n + 6, max_position_embeddings=512,
              eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=None)
    if family == "qwen3_vl":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **kw))
    elif family in ("qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet + gated attention, 8 of head_dim 16 rotated
        from test_qwen3_next_parity import perturb
        kw.update(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                  linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
        if family == "qwen3_5":
            model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
        else:
            del kw["intermediate_size"]
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)
            model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kw))
        model = perturb(model)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None,
                                                         "chat_template": TEMPLATE}))
    return n


def recipe(tmp_path, vdir, ldir, data, seq_len, steps=1, extra=""):
    r = tmp_path / "compose.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model:
  vision: {{path: {vdir}}}
  projector: {{kind: patch_merger}}
  language: {{path: {ldir}}}
{extra}
data: {{format: sft, train: [{{path: {data}}}], seq_len: {seq_len}, packing: false, assistant_only_loss: false}}
train: {{steps: {steps}, micro_batch_size: 2, threads: 2}}
optim: {{lr: 0.0, weight_decay: 0.0}}
schedule: {{kind: constant}}
checkpoint: {{every: {steps}}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return r


def latest(run):
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


CLASSES = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
           "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
           "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration}
LM_CLASSES = {"qwen3_5": transformers.Qwen3_5ForCausalLM, "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM}


@pytest.mark.parametrize("family,tower", [("qwen2_5_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl"),
                                          ("qwen3_5", "qwen3_5"),
                                          pytest.param("qwen3_5_moe", "qwen3_5", marks=pytest.mark.slow)])
def test_composed_qwen_vl_loads_in_transformers_with_the_parts(tmp_path, family, tower):
    """(Qwen3.5: the tower of a dense Qwen3.5 folder (merger out 64) with a Qwen3.5 or Qwen3.5-MoE text LM.)"""
    vdir, ldir = tmp_path / "vision", tmp_path / "language"
    make_model_dir(vdir, tower)  # a whole tiny Qwen VL (merger out 48; Qwen3.5's 64)
    n = make_language(ldir, family, hidden=96 if tower.startswith("qwen3_5") else 64)
    msgs, images = conversations(tmp_path)
    run_lf("train", recipe(tmp_path, vdir, ldir, tmp_path / "data.json", seq_len=256))
    ck = latest(tmp_path / "run")
    model = CLASSES[family].from_pretrained(ck).eval()
    tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
    added = [tok.token_to_id(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")]
    assert added == [n, n + 1, n + 2, n + 3]
    assert model.config.image_token_id == n and model.config.vision_start_token_id == n + 2
    hidden = model.config.text_config.hidden_size
    assert model.config.vision_config.out_hidden_size == hidden == (96 if family.startswith("qwen3_5") else 64)
    sections = model.config.text_config.rope_parameters["mrope_section"]
    rotary = {"qwen3_vl": 16, "qwen2_5_vl": 64 // 4}.get(family, 16 // 2)  # Qwen3.5: half of head_dim 16 rotated
    assert len(sections) == 3 and sum(sections) == rotary // 2
    # the parts' weights as they were (lr 0); the merger's output layers are new
    sd = model.state_dict()
    new = ("merger.mlp.2.", "merger.linear_fc2.", ".linear_fc2.")
    vision = load_file(str(vdir / "model.safetensors"))
    checked = 0
    for k, v in vision.items():  # saved as visual.* (Qwen2.5-VL) or model.visual.* (Qwen3-VL)
        if not k.startswith(("visual.", "model.visual.")):
            continue
        k = k if k.startswith("model.") else "model." + k
        if any(s in k for s in new) and ("merger" in k):
            assert sd[k].shape[0] == hidden, k
            continue
        assert torch.equal(sd[k], v), k
        checked += 1
    assert checked > 10
    # the language model's tensors by transformers' in-memory names (Qwen3.5-MoE's experts stacked)
    lm = LM_CLASSES[family].from_pretrained(ldir).state_dict() if family in LM_CLASSES else \
        load_file(str(ldir / "model.safetensors"))
    for k, v in lm.items():
        name = "model.language_model." + k[6:] if k.startswith("model.") else k
        assert torch.equal(sd[name], v), k
    # the first step's loss is transformers' on the same data
    sums, counts = [], []
    for m, img in zip(msgs, images):
        seq, px = hf_encode(ck, m, [img])
        s, c = hf_loss_sum(model, seq, px, n)
        sums.append(s)
        counts.append(c)
    ours = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    ref = sum(sums) / sum(counts)
    assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)


def test_patch_merger_is_the_projector_component(tmp_path):
    """model.vision.freeze and model.language.lr_multiplier 0 keep the tower and the LM bitwise over two steps at lr
    1e-2 while the merger trains."""
    vdir, ldir = tmp_path / "vision", tmp_path / "language"
    make_model_dir(vdir, "qwen2_5_vl")
    make_language(ldir, "qwen2_5_vl")
    conversations(tmp_path)
    r = recipe(tmp_path, vdir, ldir, tmp_path / "data.json", seq_len=256, steps=2)
    run_lf("train", r, "--set", f"output_dir={tmp_path / 'still'}")
    start = CLASSES["qwen2_5_vl"].from_pretrained(latest(tmp_path / "still")).state_dict()
    run_lf("train", r, "--set", "optim.lr=1e-2", "--set", "model.vision.freeze=true",
           "--set", "model.language.lr_multiplier=0")
    trained = CLASSES["qwen2_5_vl"].from_pretrained(latest(tmp_path / "run")).state_dict()
    moved = {k for k in start if not torch.equal(start[k], trained[k])}
    assert moved and all(k.startswith("model.visual.merger.") for k in moved), sorted(moved)[:5]
    assert len(moved) == 5  # ln_q and both linears' weights and biases


def test_bad_patch_merger_compositions_are_one_line(tmp_path):
    vdir, ldir = tmp_path / "vision", tmp_path / "language"
    make_model_dir(vdir, "qwen2_5_vl")
    make_language(ldir, "qwen3_vl")  # a Qwen3 LM cannot be Qwen2.5-VL's decoder
    conversations(tmp_path)
    r = recipe(tmp_path, vdir, ldir, tmp_path / "data.json", seq_len=256)
    err = run_lf("train", r, check=False).stderr
    assert all(w in err for w in ["language/config.json", "model_type", "qwen3", "qwen2"]), err
    assert len(err.strip().splitlines()) == 1, err
    err = run_lf("train", r, "--set", f"model.vision.path={ldir}", check=False).stderr
    assert all(w in err for w in ["language/config.json", "model_type", "patch_merger"]), err
    assert len(err.strip().splitlines()) == 1, err


def test_qwen3_5_tower_takes_only_a_qwen3_5_language_model(tmp_path):
    vdir, ldir = tmp_path / "vision", tmp_path / "language"
    make_model_dir(vdir, "qwen3_5")
    make_language(ldir, "qwen3_vl")  # a Qwen3 LM (softmax attention only) cannot be Qwen3.5's decoder
    conversations(tmp_path)
    err = run_lf("train", recipe(tmp_path, vdir, ldir, tmp_path / "data.json", seq_len=256), check=False).stderr
    assert all(w in err for w in ["language/config.json", "model_type", "'qwen3'", "qwen3_5_text"]), err
    assert len(err.strip().splitlines()) == 1, err

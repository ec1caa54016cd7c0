"""Bad training samples (issue 19): every image of SFT data is read and decoded when the data is loaded, so an image
that cannot be decoded (a truncated JPEG, a text file named .png, a missing file) or a sample whose <image> markers
and images disagree is one line naming the data file, the sample (FILE:[i] / FILE:LINE), the field and the image
before step 1. With data.skip_bad_samples the bad samples are left out and counted (stderr once, and the run's first
metrics line) and the run trains on the others as on a file of only those. A batch file whose image tokens do not
match its images is one line naming the file."""
import json
import shutil

import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file

from conftest import FIXTURES, run_lf
from test_vlm_train import draw, make_model_dir, recipe


def good(image, text="Red."):
    return {"image": image, "conversations": [{"from": "human", "value": "<image>\nWhat colour?"},
                                              {"from": "gpt", "value": text}]}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny LLaVA folder and a folder of images: two good ones and the bad kinds."""
    d = tmp_path_factory.mktemp("bad_samples")
    make_model_dir(d / "m")
    draw(d / "red.png", (220, 30, 30))
    draw(d / "blue.png", (30, 40, 210))
    noise = Image.frombytes("RGB", (64, 64), bytes(torch.randint(0, 256, (64 * 64 * 3,), dtype=torch.uint8).tolist()))
    noise.save(d / "full.jpg", quality=95)
    data = (d / "full.jpg").read_bytes()
    (d / "cut.jpg").write_bytes(data[: len(data) * 2 // 3])  # headers intact, the scan ends early
    (d / "text.png").write_text("this is not an image\n")
    return d


BAD = {  # name: (sample, what the error says besides the sample and field)
    "truncated_jpeg": (good("cut.jpg"), "field 'image'", ["cut.jpg", "truncated"]),
    "text_named_png": ({**good("x"), "image": None, "images": ["red.png", "text.png"],
                        "conversations": [{"from": "human", "value": "<image><image> two"},
                                          {"from": "gpt", "value": "ok"}]},
                       "field 'images[1]'", ["text.png", "not a JPEG or PNG"]),
    "missing_file": (good("nowhere.png"), "field 'image'", ["nowhere.png", "cannot open"]),
    "marker_mismatch": ({**good("x"), "image": None, "images": ["red.png", "blue.png"]}, "field 'images'",
                        ["2 images but 1 <image> markers"]),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_sample_is_one_line_before_step_one(llava, tmp_path, kind):
    sample, field, words = BAD[kind]
    (llava / f"{kind}.json").write_text(json.dumps([good("red.png"), sample, good("blue.png", "Blue.")]))
    r = recipe(tmp_path, llava / "m", llava / f"{kind}.json")
    proc = run_lf("train", r, check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err
    assert f"{kind}.json:[1]: {field}" in err, err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # found before the first step


def test_image_part_of_a_message_is_named(llava, tmp_path):
    """OpenAI image parts: the error names the part (jsonl: FILE:LINE)."""
    line = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                                      {"type": "image", "image": "text.png"}]},
                         {"role": "assistant", "content": "Hm."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(good(str(llava / "red.png"))) + "\n\n" + json.dumps(line) + "\n")
    shutil.copy(llava / "text.png", tmp_path / "text.png")
    err = run_lf("train", recipe(tmp_path, llava / "m", tmp_path / "d.jsonl"), check=False).stderr.strip()
    assert len(err.splitlines()) == 1 and "d.jsonl:3: field 'messages[0].content[1].image'" in err, err
    assert "not a JPEG or PNG" in err


def first_metrics(run):
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_skip_bad_samples_trains_on_the_good_ones(llava, tmp_path):
    samples = [good("red.png")] + [BAD[k][0] for k in sorted(BAD)] + [good("blue.png", "Blue.")]
    (llava / "mixed.json").write_text(json.dumps(samples))
    (llava / "clean.json").write_text(json.dumps([samples[0], samples[-1]]))
    r = recipe(tmp_path, llava / "m", llava / "mixed.json", steps=2)
    proc = run_lf("train", r, "--set", "data.skip_bad_samples=true", "--set", f"output_dir={tmp_path / 'skip'}")
    lines = [l for l in proc.stderr.splitlines() if l.startswith("data: skipped")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"data: skipped 4 bad samples of 6 (first: {llava / 'mixed.json'}:[1]: "), lines
    m = first_metrics(tmp_path / "skip")
    assert m["data_skipped_samples"] == 4 and m["data_samples_read"] == 6, m
    run_lf("train", r, "--set", f"data.train=[{{path: {llava / 'clean.json'}}}]", "--set",
           f"output_dir={tmp_path / 'clean'}")
    ours = [json.loads(l)["loss"] for l in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    clean = [json.loads(l)["loss"] for l in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
    # the same two conversations in the same order (to float rounding: MKL's GEMMs may round differently when the two
    # runs' buffers sit at other alignments; other conversations or another order move the loss by far more)
    assert len(ours) == len(clean) and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(ours, clean)), (ours, clean)
    assert "data_skipped_samples" not in first_metrics(tmp_path / "clean")  # not asked to skip: no field


def test_all_bad_is_one_line_even_when_skipping(llava, tmp_path):
    (llava / "allbad.json").write_text(json.dumps([BAD["missing_file"][0]]))
    r = recipe(tmp_path, llava / "m", llava / "allbad.json")
    err = run_lf("train", r, "--set", "data.skip_bad_samples=true", check=False).stderr.strip()
    assert len(err.splitlines()) == 1 and "no conversations" in err and "nowhere.png" in err, err


def text_model(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(FIXTURES / "tok_bytelevel_gpt2", tok)
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))
    model = {"model_type": "llama", "vocab_size": 2000, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "model.json").write_text(json.dumps(model))
    return tok


def test_bad_text_line_is_one_line_or_skipped(tmp_path):
    tok = text_model(tmp_path)
    lines = [json.dumps({"instruction": f"Say {i}", "output": f"{i}"}) for i in range(4)]
    lines[1] = '{"messages": [{"role": "user", "content": "hi"}'  # invalid JSON
    lines[2] = json.dumps({"messages": [{"role": "user", "content": "only a question"}]})  # no assistant turn
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "clean.jsonl").write_text("\n".join([lines[0], lines[3]]) + "\n")
    r = tmp_path / "sft.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{config: {tmp_path / 'model.json'}, tokenizer: {tok}}}
data: {{format: sft, train: [{{path: {tmp_path / 'chat.jsonl'}}}], seq_len: 48, packing: false}}
train: {{steps: 2, micro_batch_size: 2, threads: 2}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    err = run_lf("train", r, check=False).stderr.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'chat.jsonl'}:2: invalid JSON" in err, err
    proc = run_lf("train", r, "--set", "data.skip_bad_samples=true")
    assert (f"data: skipped 2 bad samples of 4 (first: {tmp_path / 'chat.jsonl'}:2: invalid JSON"
            in proc.stderr), proc.stderr
    m = first_metrics(tmp_path / "run")
    assert m["data_skipped_samples"] == 2 and m["data_samples_read"] == 4
    run_lf("train", r, "--set", f"data.train=[{{path: {tmp_path / 'clean.jsonl'}}}]", "--set",
           f"output_dir={tmp_path / 'clean'}")
    assert first_metrics(tmp_path / "clean")["loss"] == m["loss"]
    err = run_lf("train", r, "--set", "data.format=pretrain", "--set", "data.skip_bad_samples=true",
                 check=False).stderr.strip()
    assert len(err.splitlines()) == 1 and "data.skip_bad_samples" in err, err


def qwen_batch_file(tmp_path, drop_token):
    """A Qwen2.5-VL folder and a batch file of two rows with an image each; drop_token: one image token fewer."""
    from test_qwen_vl_parity import IMAGE, make_batch, qwen_config
    torch.manual_seed(4)
    transformers.Qwen2_5_VLForConditionalGeneration(qwen_config()).save_pretrained(tmp_path / "m")
    ids, pixels, grid, labels = make_batch([[(1, 4, 4)], [(1, 4, 4)]], seed=5)
    if drop_token:
        ids[1, (ids[1] == IMAGE).nonzero()[0]] = 5
    per_image = grid.prod(-1)
    f = tmp_path / "b.safetensors"
    save_file({"input_ids": ids, "labels": labels, "pixel_values": pixels.contiguous(),
               "pixel_values.row": torch.arange(2).repeat_interleave(per_image), "image_grid_thw": grid,
               "image_grid_thw.row": torch.arange(2)}, str(f))
    return f, ids.shape[1]


@pytest.mark.parametrize("drop_token", [False, True])
def test_batch_file_image_tokens_not_matching_the_grid(tmp_path, drop_token):
    """data.format: batch (Qwen2.5-VL, patch grids): a row whose image tokens do not match image_grid_thw is one line
    naming the batch file, in `train` as in `dump`."""
    f, seq = qwen_batch_file(tmp_path, drop_token)
    r = tmp_path / "r.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {tmp_path / 'm'}}}
data: {{format: batch, train: [{{path: {f}}}], seq_len: {seq}}}
train: {{steps: 1, micro_batch_size: 2, threads: 2}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    proc = run_lf("train", r, check=False)
    if not drop_token:
        assert proc.returncode == 0, proc.stderr
        return
    err = proc.stderr.strip()
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err
    assert f"error: {f}: step 1: batch: " in err and "image tokens" in err, err
    proc = run_lf("dump", "--model", tmp_path / "m", "--batch", f, "--out", tmp_path / "o", check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and len(err.splitlines()) == 1 and str(f) in err and "image tokens" in err, err

"""Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration, fp32 on the CPU (issue 19): `loongforge dump`
on a batch of images with different grids (window attention with partial windows, full-attention blocks, two images
in one row, a two-frame image) gives transformers' logits (<= 1e-5 rel), loss, every gradient (<= 1e-4 rel, under
transformers' parameter names) and parameters after one AdamW step; multimodal RoPE positions follow get_rope_index;
the checkpoint loads under the saved and the in-memory key layouts; `convert` writes a folder transformers loads;
`info` counts the components as transformers does; a token / grid mismatch is one line."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import run_lf
from test_model_parity import ADAMW
from test_vlm_parity import compare, hf_reference

IMAGE, VIDEO, START, END = 99, 98, 97, 96
MERGE = 2


def qwen_config(tied=False):
    vision = dict(depth=4, hidden_size=32, intermediate_size=40, num_heads=4, in_channels=3, patch_size=2,
                  spatial_merge_size=MERGE, temporal_patch_size=2, window_size=8, out_hidden_size=48,
                  fullatt_block_indexes=[1, 3])
    # head_dim 12: 6 rotary frequencies in uneven temporal / height / width sections
    text = dict(vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
                rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 3], rope_theta=10000.0))
    return transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                                         video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                                         tie_word_embeddings=tied)


def make_batch(grids_per_row, seed=0):
    """Rows of text with each image as <start> image tokens <end>; the rows padded with text to one length."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(3, END, (n,), generator=g).tolist()
    rows = []
    for grids in grids_per_row:
        ids = text(3)
        for t, h, w in grids:
            ids += [START] + [IMAGE] * (t * h * w // MERGE ** 2) + [END] + text(2)
        rows.append(ids)
    length = max(map(len, rows)) + 2
    ids = torch.tensor([r + text(length - len(r)) for r in rows])
    grid = torch.tensor([list(x) for grids in grids_per_row for x in grids])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 2 * 2, generator=g)
    labels = ids.clone()
    labels[ids == IMAGE] = -100
    labels[:, :2] = -100
    return ids, pixels, grid, labels


def run_dump(model_dir, tensors, tmp_path, extra=("--adamw", ADAMW)):
    batch = tmp_path / "batch.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(batch))
    out = tmp_path / "out.safetensors"
    run_lf("dump", "--model", model_dir, "--batch", batch, "--out", out, *extra)
    return load_file(str(out))


CASES = {
    # row 0: two images (2x3 and 3x2 merged tokens: partial 2x2 windows), row 1: one image of 4x6 (six windows)
    "untied": dict(tied=False, grids=[[(1, 4, 6), (1, 6, 4)], [(1, 8, 12)]], mm_token_type_ids=False),
    # a two-frame image (per-frame attention, temporal positions) and tied embeddings
    "tied_two_frames": dict(tied=True, grids=[[(2, 4, 4)], [(1, 4, 8), (1, 8, 4)]], mm_token_type_ids=True),
}


def dump_parity(model, spec, tmp_path):
    """`dump` of model's saved folder on make_batch(spec["grids"]) (with mm_token_type_ids when spec says) against
    transformers (compare()); returns transformers' outputs. (Also for Qwen3-VL.)"""
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    ids, pixels, grid, labels = make_batch(spec["grids"])
    tensors = {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "labels": labels}
    if spec["mm_token_type_ids"]:
        tensors["mm_token_type_ids"] = (ids == IMAGE).int()
    ours = run_dump(model_dir, tensors, tmp_path)
    ref = hf_reference(model, ids, pixels, labels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())
    compare(ours, ref)
    return ref


@pytest.mark.parametrize("case", list(CASES))
def test_qwen_vl_dump_matches_transformers(case, tmp_path):
    spec = CASES[case]
    torch.manual_seed(0)
    dump_parity(transformers.Qwen2_5_VLForConditionalGeneration(qwen_config(tied=spec["tied"])).eval(), spec, tmp_path)


def test_qwen_vl_video_dump_matches_transformers(tmp_path):
    """Videos (pixel_values_videos, video_grid_thw, second_per_grid_ts) beside images: the tower runs over each
    video's frames, the features fill the video tokens, and the frames' temporal positions are spaced by
    tokens_per_second x seconds per temporal patch (truncated, 1.3 s giving 5.2 -> 0, 5, 10, 15) as transformers'
    get_rope_index; logits, loss and every gradient as transformers' with mm_token_type_ids 0 / 1 / 2."""
    torch.manual_seed(2)
    model = transformers.Qwen2_5_VLForConditionalGeneration(qwen_config()).eval()
    model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(2)
    text = lambda n: torch.randint(3, END, (n,), generator=g).tolist()
    image, videos = (1, 4, 4), [(2, 4, 6), (4, 4, 4)]
    merged = lambda t, h, w: t * h * w // MERGE ** 2
    rows = [text(3) + [START] + [IMAGE] * merged(*image) + [END] + text(2) + [START] + [VIDEO] * merged(*videos[0]) +
            [END] + text(3),
            text(2) + [START] + [VIDEO] * merged(*videos[1]) + [END] + text(4)]
    length = max(map(len, rows))
    ids = torch.tensor([r + text(length - len(r)) for r in rows])
    labels = ids.clone()
    labels[(ids == IMAGE) | (ids == VIDEO)] = -100
    tt = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    pixels = torch.randn(4 * 4, 3 * 2 * 2 * 2, generator=g)
    vgrid = torch.tensor(videos)
    vpixels = torch.randn(int(vgrid.prod(-1).sum()), 3 * 2 * 2 * 2, generator=g)
    seconds = torch.tensor([0.5, 1.3])
    inputs = dict(image_grid_thw=torch.tensor([image]), pixel_values_videos=vpixels, video_grid_thw=vgrid,
                  second_per_grid_ts=seconds, mm_token_type_ids=tt)
    pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=tt, image_grid_thw=torch.tensor([image]),
                                        video_grid_thw=vgrid, second_per_grid_ts=seconds)
    first = (ids[1] == VIDEO).nonzero()[0].item()
    assert pos[0, 1, first:first + 16:4].tolist() == [first + k for k in (0, 5, 10, 15)]  # 4 x 1.3 = 5.2 per frame
    ours = run_dump(tmp_path / "model", {"input_ids": ids, "pixel_values": pixels, "labels": labels, **inputs},
                    tmp_path)
    ref = hf_reference(model, ids, pixels, labels, **inputs)
    compare(ours, ref)


def test_qwen_vl_rope_index_matches_transformers(tmp_path):
    """Our positions through the logits: transformers' with its own get_rope_index positions equals transformers
    given them explicitly; with 1D positions instead, the logits differ (so the parity above tests M-RoPE)."""
    torch.manual_seed(4)
    cfg = qwen_config()
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    ids, pixels, grid, _ = make_batch([[(1, 4, 6), (1, 6, 4)], [(1, 8, 12)]], seed=4)
    pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=grid)
    # text after an image continues at the image's start + max(h, w) / merge
    first = (ids[0] == IMAGE).nonzero()[0].item()
    assert pos[:, 0, first].tolist() == [first] * 3
    assert pos[0, 0, first + 6].item() == first + 3  # <end> after the 2x3 image
    model.save_pretrained(tmp_path / "m")
    ours = run_dump(tmp_path / "m", {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid}, tmp_path,
                    extra=())
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, position_ids=pos).logits
        flat = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits  # 1D positions
    assert (flat - want).abs().max() > 1e-3
    assert ((ours["logits"] - want).abs().max() / want.abs().max()).item() <= 1e-5


def check_layout_and_convert(model, base, other, tmp_path):
    """The folder `base` (save_pretrained) and its config with the tensors `other` (another key layout) give equal
    logits; `convert` of `base` writes the saved names, and transformers loads it to model's state dict. (Also for
    Qwen3-VL.)"""
    saved = load_file(str(base / "model.safetensors"))
    ids, pixels, grid, _ = make_batch([[(1, 4, 6)], [(1, 6, 4)]], seed=1)
    tensors = {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid}
    want = run_dump(base, tensors, tmp_path, extra=())
    d = tmp_path / "other_layout"
    d.mkdir()
    (d / "config.json").write_text((base / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in other.items()}, str(d / "model.safetensors"))
    got = run_dump(d, tensors, tmp_path, extra=())
    assert torch.equal(got["logits"], want["logits"])

    run_lf("convert", "--model", base, "--out", tmp_path / "out", "--dtype", "fp32")
    back = type(model).from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert sorted(load_file(str(tmp_path / "out" / "model.safetensors"))) == sorted(saved)
    want_sd, got_sd = model.state_dict(), back.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for k in want_sd:
        assert torch.equal(got_sd[k], want_sd[k]), k


def test_qwen_vl_key_layouts_convert_and_info(tmp_path):
    """save_pretrained's layout (visual.*, model.*, lm_head.weight) and the in-memory names (model.visual.*,
    model.language_model.*) load to the same model; convert writes a folder transformers loads with an equal state
    dict; info counts the components as transformers' modules hold them."""
    torch.manual_seed(1)
    cfg = qwen_config()
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    base = tmp_path / "saved"
    model.save_pretrained(base)
    saved = load_file(str(base / "model.safetensors"))
    assert any(k.startswith("visual.blocks.") for k in saved) and any(k.startswith("model.layers.") for k in saved)
    check_layout_and_convert(model, base, {k: v.detach().clone() for k, v in model.named_parameters()}, tmp_path)

    info = json.loads(run_lf("info", base).stdout)
    comps = info["components"]
    assert set(comps) == {"vision_tower", "merger", "language_model"}
    n = lambda m: sum(p.numel() for p in m.parameters())
    assert comps["merger"]["parameters"] == n(model.model.visual.merger)
    assert comps["vision_tower"]["parameters"] + comps["merger"]["parameters"] == n(model.model.visual)
    assert comps["language_model"]["parameters"] == n(model.model.language_model) + n(model.lm_head)
    assert info["parameters"] == n(model)


def test_qwen_vl_tied_info(tmp_path):
    cfg = qwen_config(tied=True)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    model.save_pretrained(tmp_path / "m")
    assert "lm_head.weight" not in load_file(str(tmp_path / "m" / "model.safetensors"))
    info = json.loads(run_lf("info", tmp_path / "m").stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def check_bad_inputs_one_line(model, tmp_path, field, value):
    """Saves `model`; a token / grid mismatch, too few patches or a missing grid is one line naming the batch; setting
    vision_config.`field` to `value` makes `info` fail in one line naming it. (Also for Qwen3-VL.)"""
    model.save_pretrained(tmp_path / "m")
    ids, pixels, grid, _ = make_batch([[(1, 4, 6)], [(1, 6, 4)]], seed=3)
    batch = tmp_path / "batch.safetensors"

    def err(tensors):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(batch))
        proc = run_lf("dump", "--model", tmp_path / "m", "--batch", batch, "--out", tmp_path / "o", check=False)
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert str(batch) in proc.stderr
        return proc.stderr

    short = ids.clone()
    short[0, (ids[0] == IMAGE).nonzero()[0]] = 5  # one image token fewer than the grids give
    assert "image tokens" in err({"input_ids": short, "pixel_values": pixels, "image_grid_thw": grid})
    assert "pixel_values" in err({"input_ids": ids, "pixel_values": pixels[:-4], "image_grid_thw": grid})
    assert "image_grid_thw" in err({"input_ids": ids, "pixel_values": pixels})
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    conf["vision_config"][field] = value
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    e = run_lf("info", tmp_path / "m", check=False).stderr
    assert f"vision_config.{field}" in e and len(e.strip().splitlines()) == 1


def test_qwen_vl_bad_input_is_one_line(tmp_path):
    torch.manual_seed(3)
    check_bad_inputs_one_line(transformers.Qwen2_5_VLForConditionalGeneration(qwen_config()), tmp_path,
                              "out_hidden_size", 40)

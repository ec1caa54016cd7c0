"""Qwen3-VL against transformers' Qwen3VLForConditionalGeneration, fp32 on the CPU: `loongforge dump` on a batch of
images with different grids (learned positions resampled to each grid, deepstack features from two ViT layers added
after the first decoder layers, two images in one row, a two-frame image) gives transformers' logits (<= 1e-5 rel),
loss, every gradient (<= 1e-4 rel, under transformers' parameter names) and parameters after one AdamW step;
interleaved multimodal RoPE positions follow get_rope_index; the checkpoint loads under the saved and the
Qwen2.5-VL-style key layouts; `convert` writes a folder transformers loads; `info` counts the components as
transformers does; a token / grid mismatch is one line."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import run_lf
from test_qwen_vl_parity import (END, IMAGE, START, VIDEO, check_bad_inputs_one_line, check_layout_and_convert,
                                 dump_parity, make_batch, run_dump)

DEEPSTACK = [0, 2]


def qwen3_config(tied=False, deepstack=DEEPSTACK):
    vision = dict(depth=4, hidden_size=32, intermediate_size=40, num_heads=4, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=16,
                  deepstack_visual_indexes=deepstack)
    # head_dim 12: 6 rotary frequencies, interleaved t/h/w with uneven sections
    text = dict(vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
                rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 3], rope_theta=10000.0))
    return transformers.Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                                      video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                                      tie_word_embeddings=tied)


CASES = {
    # row 0: two images (2x3 and 3x2 merged tokens), row 1: one image of 4x6 (positions upsampled from the 4x4 grid)
    "untied": dict(tied=False, grids=[[(1, 4, 6), (1, 6, 4)], [(1, 8, 12)]], mm_token_type_ids=False),
    # a two-frame image (per-frame attention, temporal positions) and tied embeddings
    "tied_two_frames": dict(tied=True, grids=[[(2, 4, 4)], [(1, 4, 8), (1, 2, 2)]], mm_token_type_ids=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_vl_dump_matches_transformers(case, tmp_path):
    spec = CASES[case]
    torch.manual_seed(0)
    ref = dump_parity(transformers.Qwen3VLForConditionalGeneration(qwen3_config(tied=spec["tied"])).eval(), spec,
                      tmp_path)
    # the deepstack mergers are trained through the language model
    for i in range(len(DEEPSTACK)):
        assert ref[f"grad.model.visual.deepstack_merger_list.{i}.linear_fc2.weight"].abs().max() > 0


def test_qwen3_vl_video_dump_matches_transformers(tmp_path):
    """Videos beside an image: the tower runs over each video, its features fill the video tokens, the deepstack
    features of images and videos join in sequence order, and each frame (between timestamp text, as Qwen3-VL's
    processor writes) takes positions as its own t = 1 grid; logits, loss and every gradient as transformers'."""
    torch.manual_seed(5)
    check_video_dump(transformers.Qwen3VLForConditionalGeneration(qwen3_config()).eval(), tmp_path)


def check_video_dump(model, tmp_path):
    """`dump` of model's saved folder on two rows with two videos (each frame between timestamp text) and an image
    gives transformers' logits, loss and every gradient. (Also for Qwen3.5.)"""
    from test_qwen_vl_parity import MERGE
    from test_vlm_parity import compare, hf_reference
    model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(5)
    text = lambda n: torch.randint(3, END, (n,), generator=g).tolist()
    image, videos = (1, 4, 4), [(2, 4, 6), (3, 4, 4)]

    def video(t, h, w):  # timestamp text, then each frame between the vision markers
        out = []
        for _ in range(t):
            out += text(2) + [START] + [VIDEO] * (h * w // MERGE ** 2) + [END]
        return out
    rows = [text(3) + [START] + [IMAGE] * 4 + [END] + video(*videos[0]) + text(2), text(2) + video(*videos[1]) + text(3)]
    length = max(map(len, rows))
    ids = torch.tensor([r + text(length - len(r)) for r in rows])
    labels = ids.clone()
    labels[(ids == IMAGE) | (ids == VIDEO)] = -100
    tt = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    pixels = torch.randn(16, 3 * 2 * 2 * 2, generator=g)
    vgrid = torch.tensor(videos)
    vpixels = torch.randn(int(vgrid.prod(-1).sum()), 3 * 2 * 2 * 2, generator=g)
    inputs = dict(image_grid_thw=torch.tensor([image]), pixel_values_videos=vpixels, video_grid_thw=vgrid,
                  mm_token_type_ids=tt)
    ours = run_dump(tmp_path / "model", {"input_ids": ids, "pixel_values": pixels, "labels": labels, **inputs},
                    tmp_path)
    ref = hf_reference(model, ids, pixels, labels, **inputs)
    compare(ours, ref)


def check_rope_positions(model, tmp_path):
    """Our logits equal transformers' with its get_rope_index positions given explicitly and 1D positions give other
    logits; returns the batch (ids, pixels, grid, mm_token_type_ids) and transformers' logits. (Also for Qwen3.5.)"""
    ids, pixels, grid, _ = make_batch([[(1, 4, 6), (1, 6, 4)], [(1, 8, 12)]], seed=4)
    tt = (ids == IMAGE).int()
    pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=tt, image_grid_thw=grid)
    model.save_pretrained(tmp_path / "m")
    ours = run_dump(tmp_path / "m", {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid}, tmp_path,
                    extra=())
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, position_ids=pos).logits
        flat = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                     position_ids=torch.arange(ids.shape[1]).expand_as(ids)).logits  # 1D positions
    assert (flat - want).abs().max() > 1e-3
    assert ((ours["logits"] - want).abs().max() / want.abs().max()).item() <= 1e-5
    return (ids, pixels, grid, tt), want


def test_qwen3_vl_rope_and_deepstack_matter(tmp_path):
    """1D positions or no deepstack features give other logits (so the parity above tests interleaved M-RoPE and
    deepstack)."""
    torch.manual_seed(4)
    model = transformers.Qwen3VLForConditionalGeneration(qwen3_config()).eval()
    (ids, pixels, grid, tt), want = check_rope_positions(model, tmp_path)
    # without deepstack (same weights otherwise) the logits differ
    torch.manual_seed(4)
    plain = transformers.Qwen3VLForConditionalGeneration(qwen3_config(deepstack=[])).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "deepstack" not in k})
    with torch.no_grad():
        no_ds = plain(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=tt).logits
    assert (no_ds - want).abs().max() > 1e-3


def test_qwen3_vl_key_layouts_convert_and_info(tmp_path):
    """save_pretrained's layout (model.visual.*, model.language_model.*, lm_head.weight) and the Qwen2.5-VL-style one
    (visual.*, model.*) load to the same model; convert writes a folder transformers loads with an equal state dict;
    info counts the components as transformers' modules hold them."""
    torch.manual_seed(1)
    model = transformers.Qwen3VLForConditionalGeneration(qwen3_config()).eval()
    base = tmp_path / "saved"
    model.save_pretrained(base)
    saved = load_file(str(base / "model.safetensors"))
    assert any(k.startswith("model.visual.blocks.") for k in saved)
    assert any(k.startswith("model.language_model.layers.") for k in saved)
    legacy = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
              for k, v in saved.items()}
    check_layout_and_convert(model, base, legacy, tmp_path)

    info = json.loads(run_lf("info", base).stdout)
    comps = info["components"]
    assert set(comps) == {"vision_tower", "merger", "deepstack_mergers", "language_model"}
    n = lambda m: sum(p.numel() for p in m.parameters())
    v = model.model.visual
    assert comps["merger"]["parameters"] == n(v.merger)
    assert comps["deepstack_mergers"]["parameters"] == n(v.deepstack_merger_list)
    assert comps["vision_tower"]["parameters"] == n(v) - n(v.merger) - n(v.deepstack_merger_list)
    assert comps["language_model"]["parameters"] == n(model.model.language_model) + n(model.lm_head)
    assert info["parameters"] == n(model)


def test_qwen3_vl_tied_info(tmp_path):
    model = transformers.Qwen3VLForConditionalGeneration(qwen3_config(tied=True))
    model.save_pretrained(tmp_path / "m")
    assert "lm_head.weight" not in load_file(str(tmp_path / "m" / "model.safetensors"))
    info = json.loads(run_lf("info", tmp_path / "m").stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def test_qwen3_vl_bad_input_is_one_line(tmp_path):
    torch.manual_seed(3)
    check_bad_inputs_one_line(transformers.Qwen3VLForConditionalGeneration(qwen3_config()), tmp_path,
                              "deepstack_visual_indexes", [0, 4])

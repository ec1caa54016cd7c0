"""Qwen3.5 vision-language models against transformers' Qwen3_5ForConditionalGeneration (model_type qwen3_5) and
Qwen3_5MoeForConditionalGeneration (qwen3_5_moe), fp32 on the CPU: Qwen3-VL's tower without deepstack mergers and
the Qwen3.5 text decoder (Gated DeltaNet + gated full attention, MoE with a shared expert for qwen3_5_moe) whose
partial rotary features take interleaved multimodal RoPE sections. `loongforge dump` on a batch of images with
different grids gives transformers' logits (<= 1e-5 rel), loss, every gradient (<= 1e-4 rel, under transformers'
names) and parameters after one AdamW step, with videos beside images too; positions follow get_rope_index; save_pretrained's and the
Qwen2.5-VL-style key layouts load; `convert` writes a folder transformers loads; `info` counts the components as
transformers does; deepstack indexes in the vision config are one line."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import run_lf
from test_qwen3_next_parity import perturb
from test_qwen3_vl_parity import check_rope_positions, check_video_dump
from test_qwen_vl_parity import (END, IMAGE, START, VIDEO, check_bad_inputs_one_line, check_layout_and_convert,
                                 dump_parity)

LT = ["linear_attention", "full_attention"]


def qwen3_5_config(moe=False, tied=False):
    vision = dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=4, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
    # head_dim 24 x partial_rotary_factor 0.5: 12 rotated features, 6 frequencies interleaved t/h/w in uneven sections
    text = dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, layer_types=LT * 2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
                linear_num_value_heads=4, bos_token_id=1, eos_token_id=2,
                rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 3], mrope_interleaved=True,
                                     rope_theta=10000.0, partial_rotary_factor=0.5))
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                  tie_word_embeddings=tied)
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)
        return transformers.Qwen3_5MoeConfig(vision_config=vision, text_config=text, **tokens)
    text.update(intermediate_size=96)
    return transformers.Qwen3_5Config(vision_config=vision, text_config=text, **tokens)


def make_model(moe=False, tied=False, seed=0):
    torch.manual_seed(seed)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    # every norm, gate and decay parameter made to matter
    return perturb(cls(qwen3_5_config(moe=moe, tied=tied)).eval())


CASES = {
    # row 0: two images (2x3 and 3x2 merged tokens), row 1: one image of 4x6 (positions upsampled from the 4x4 grid)
    "qwen3_5": dict(moe=False, tied=False, grids=[[(1, 4, 6), (1, 6, 4)], [(1, 8, 12)]], mm_token_type_ids=False),
    # the MoE decoder, a two-frame image (per-frame attention, temporal positions), tied embeddings
    "qwen3_5_moe_tied_two_frames": dict(moe=True, tied=True, grids=[[(2, 4, 4)], [(1, 4, 8), (1, 2, 2)]],
                                        mm_token_type_ids=True),
}


@pytest.mark.parametrize("case", [c if c == "qwen3_5" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_qwen3_5_vl_dump_matches_transformers(case, tmp_path):
    spec = CASES[case]
    ref = dump_parity(make_model(moe=spec["moe"], tied=spec["tied"]), spec, tmp_path)
    assert ref["grad.model.visual.merger.linear_fc2.weight"].abs().max() > 0
    assert ref["grad.model.language_model.layers.0.linear_attn.A_log"].abs().max() > 0


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True])
def test_qwen3_5_vl_video_dump_matches_transformers(moe, tmp_path):
    """Videos beside an image (each frame between timestamp text takes positions as its own t = 1 grid)."""
    check_video_dump(make_model(moe=moe, seed=5), tmp_path)


@pytest.mark.slow
def test_qwen3_5_vl_multimodal_rope_matters(tmp_path):
    """Our logits equal transformers' with its get_rope_index positions given explicitly; 1D positions give other
    logits (so the parity above tests the interleaved sections over the partial rotary features)."""
    check_rope_positions(make_model(seed=4), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True])
def test_qwen3_5_vl_key_layouts_convert_and_info(moe, tmp_path):
    """save_pretrained's layout (model.visual.*, model.language_model.*, lm_head.weight) and the Qwen2.5-VL-style one
    (visual.*, model.*) load to the same model; convert writes a folder transformers loads with an equal state dict;
    info counts the components as transformers' modules hold them (no deepstack mergers)."""
    model = make_model(moe=moe, seed=1)
    base = tmp_path / "saved"
    model.save_pretrained(base)
    saved = load_file(str(base / "model.safetensors"))
    assert any(k.startswith("model.visual.blocks.") for k in saved)
    assert any(k.startswith("model.language_model.layers.") for k in saved)
    assert not any("deepstack" in k for k in saved)
    legacy = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
              for k, v in saved.items()}
    check_layout_and_convert(model, base, legacy, tmp_path)

    info = json.loads(run_lf("info", base).stdout)
    assert info["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5")
    comps = info["components"]
    assert set(comps) == {"vision_tower", "merger", "language_model"}
    n = lambda m: sum(p.numel() for p in m.parameters())
    v = model.model.visual
    assert comps["merger"]["parameters"] == n(v.merger)
    assert comps["vision_tower"]["parameters"] == n(v) - n(v.merger)
    assert comps["language_model"]["parameters"] == n(model.model.language_model) + n(model.lm_head)
    assert comps["language_model"]["model_type"] == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert info["parameters"] == n(model)


def test_qwen3_5_vl_bad_input_is_one_line(tmp_path):
    check_bad_inputs_one_line(make_model(seed=3), tmp_path, "deepstack_visual_indexes", [0])

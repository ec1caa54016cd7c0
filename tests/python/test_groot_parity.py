"""GR00T N1.7 (LeRobot 0.6.1's GrootPolicy, config type "groot") in LoongForge = LeRobot's own, built small and offline
in the lerobot oracle environment, fp32 on the CPU: `dump` on GR00T's processed batch (state, action, action_mask,
embodiment_id, input_ids, attention_mask, pixel_values, image_grid_thw) with the flow-matching draws `noise` and `time`
(GR00T's t: 1 is the data) and the sampler's start `sample_noise` passed in gives LeRobot's loss, every parameter's
gradient under LeRobot's names (the Qwen3-VL backbone frozen: zero, as LeRobot's None), one AdamW step, and the
eval-mode action chunk (num_inference_timesteps Euler steps).

How LeRobot's GR00T N1.7 builds small and offline (no hub):
  - GrootPolicy.__init__ calls GR00TN17.from_pretrained(base_model_path), which downloads. The oracle builds
    GR00TN17(GR00TN17Config(...small...), load_backbone_weights=False) itself and patches
    GrootPolicy._create_groot_model to return it (cast to fp32, as model_params_fp32 does). With
    load_backbone_weights=False the Qwen3Backbone builds Qwen3VLForConditionalGeneration from
    AutoConfig.from_pretrained(model_name): model_name is a local folder holding a small Qwen3VLConfig's config.json.
    The GR00T model config is saved (GR00TN17Config.save_pretrained) to a local folder named by the policy config's
    base_model_path; LoongForge reads the architecture from there, as LeRobot does.
  - GR00TN17.prepare_input needs dm-tree (absent here): a dict map_structure shim stands in for it.
  - LeRobot 0.6.1 targets transformers 5.4-5.5; with 5.24 Qwen3VLModel.compute_3d_position_ids takes `cache`, not
    the `past_key_values` GR00T passes: a wrapper renames it.
  - Training-mode randomness is turned off by the config (diffusion_model_cfg / vl_self_attention_cfg dropout 0,
    state_dropout_prob 0); noise comes from torch.randn (patched during forward / get_action), time from
    action_head.sample_time (patched).
  - use_bf16=False (LeRobot autocasts to bf16 by default).
State-dict names (LeRobot's = LoongForge's):
  _groot_model.backbone.model.model.visual.{patch_embed.proj, pos_embed, blocks.N.*, merger.*, deepstack_merger_list.N.*}
  _groot_model.backbone.model.model.language_model.{embed_tokens, layers.N.*, norm}.weight (select_layer layers kept;
    the tied lm_head is saved as _groot_model.backbone.model.lm_head.weight instead of embed_tokens)
  _groot_model.action_head.model.timestep_encoder.timestep_embedder.linear_{1,2}.{weight,bias}
  _groot_model.action_head.model.transformer_blocks.N.{norm1.linear, attn1.to_q, attn1.to_k, attn1.to_v,
    attn1.to_out.0, ff.net.0.proj, ff.net.2}.{weight,bias}
  _groot_model.action_head.model.proj_out_{1,2}.{weight,bias}
  _groot_model.action_head.{state_encoder,action_decoder}.layer{1,2}.{W,b}; action_encoder.W{1,2,3}.{W,b}
  _groot_model.action_head.vlln.{weight,bias}; vl_self_attention.transformer_blocks.N.{norm1, norm3}.{weight,bias}
    and the attention / feed-forward names above; position_embedding.weight

NOTES (what works, what is left):
  - works: the model (backbone through the existing Qwen3-VL, action head, flow-matching loss, Euler sampler),
    `dump` and `info`, LeRobot's folder loads (tied lm_head name), frozen parts per tune_* flags. Tests:
    test_groot_dump_matches_lerobot[groot] (fast: AlternateVLDiT, vlln + vl_self_attention, position embedding,
    frozen backbone), [groot_dit] (slow: plain DiT, top LLM layer trained, projectors frozen),
    test_groot_bad_configs_and_batches_one_line (slow), test_groot_full_size_info (slow: `info` of the real
    3.1B N1.7 = LeRobot's count, built on the meta device).
  - prompts padded on the left (LeRobot's processor's side; transformers 5.24 gives the valid tokens the unpadded
    prompt's positions and attention, and the pads' fully masked query rows SDPA's 0, so a pad's feature is its
    embedding through each layer's residual MLP): [groot_left_pad] (slow: loss, gradients with the top backbone
    layer trained, action chunk, AdamW step). Right padding is refused in one line (pads' queries would see the
    prompt).
  - GR00T's processor (the default path of processor_groot.py): tests/python/test_groot_train.py.
  - left: dropout in parity (implemented, not compared), bf16 autocast, RTC, the engine layouts (DDP/FSDP) over
    this policy, the DiT with positional_embeddings, a raw N1.7 checkpoint's weights as the starting point (LoongForge
    reads a LeRobot policy folder's model.safetensors; base_model_path gives only the architecture).
"""
import json

import numpy as np
import pytest

from conftest import check_policy_dump, run_lf

# In the lerobot environment: what LeRobot's GR00T N1.7 needs to run here (test_groot_train.py starts with it too).
SHIMS = r'''
import json, sys, types, torch
from pathlib import Path
from transformers.models.qwen3_vl import modeling_qwen3_vl as QV
import lerobot.utils.import_utils as IU
import lerobot.policies.groot.groot_n1_7 as G
from lerobot.policies.groot.modeling_groot import GrootPolicy

# dm-tree shim (GR00TN17.prepare_input maps the batch's tensors to the model's device and dtype)
IU._require_package_cache["tree"] = True
G.tree = types.SimpleNamespace(map_structure=lambda f, x: type(x)({k: f(v) for k, v in x.items()}))
# transformers 5.24 renamed compute_3d_position_ids' past_key_values to cache
orig = QV.Qwen3VLModel.compute_3d_position_ids
def compat(self, *a, past_key_values=None, **kw):
    return orig(self, *a, cache=past_key_values, **kw)
QV.Qwen3VLModel.compute_3d_position_ids = compat
'''

ORACLE = SHIMS + r'''
from safetensors.torch import save_file
import transformers
from lerobot.policies.groot.configuration_groot import GrootConfig
from lerobot.configs.types import FeatureType, PolicyFeature

spec = json.loads(sys.argv[1]); out = Path(sys.argv[2])
torch.manual_seed(spec["seed"])
tok = spec["tokens"]
qcfg = transformers.Qwen3VLConfig(vision_config=spec["vision"], text_config=spec["text"], tie_word_embeddings=True, **tok)
qcfg.save_pretrained(out / "backbone")
gcfg = G.GR00TN17Config(model_name=str(out / "backbone"), **spec["groot"])
gcfg.save_pretrained(out / "base")
model = G.GR00TN17(gcfg, load_backbone_weights=False).float()
with torch.no_grad():  # LeRobot starts biases at 0 and LayerNorms at 1: perturb so that gradients say something
    for n, p in model.named_parameters():
        if p.dim() == 1 or n.endswith(".b"): p.add_(torch.randn_like(p) * 0.1)
def create(self):  # as GR00TN17.from_pretrained applies the policy config's tune_* flags
    model.backbone.set_trainable_parameters(tune_llm=self.config.tune_llm, tune_visual=self.config.tune_visual,
                                            tune_top_llm_layers=self.config.tune_top_llm_layers)
    model.action_head.set_trainable_parameters(self.config.tune_projector, self.config.tune_diffusion_model,
                                               self.config.tune_vlln)
    return model
GrootPolicy._create_groot_model = create

feats = {k: PolicyFeature(FeatureType[t], tuple(s)) for k, (t, s) in spec["inputs"].items()}
cfg = GrootConfig(input_features=feats, output_features={"action": PolicyFeature(FeatureType.ACTION, (spec["action_dim"],))},
                  device="cpu", base_model_path=str(out / "base"), use_bf16=False, **spec["policy"])
policy = GrootPolicy(cfg)
policy.save_pretrained(out / "policy")

g = spec["groot"]; B = len(spec["rows"]); H = g["action_horizon"]; A = g["max_action_dim"]
v = spec["vision"]; patch_dim = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
merge = v["spatial_merge_size"] ** 2
ids, grids, masks = [], [], []
for (before, grid, after), (side, pad) in zip(spec["rows"], spec.get("pads", [["right", 0]] * B)):
    n = grid[0] * grid[1] * grid[2] // merge
    row = torch.cat([torch.randint(0, 96, (before,)), torch.tensor([tok["vision_start_token_id"]]),
                     torch.full((n,), tok["image_token_id"]), torch.tensor([tok["vision_end_token_id"]]),
                     torch.randint(0, 96, (after,))])
    valid = torch.ones(len(row) + pad, dtype=torch.long)
    pads = torch.full((pad,), 7)
    if side == "right":
        row = torch.cat([row, pads]); valid[len(row) - pad:] = 0
    else:
        row = torch.cat([pads, row]); valid[:pad] = 0
    ids.append(row); masks.append(valid); grids.append(grid)
batch = {"input_ids": torch.stack(ids), "image_grid_thw": torch.tensor(grids), "attention_mask": torch.stack(masks)}
batch["pixel_values"] = torch.randn(int(sum(t * h * w for t, h, w in grids)), patch_dim)
batch["state"] = torch.randn(B, 1, g["max_state_dim"])
batch["action"] = torch.randn(B, H, A)
mask = torch.ones(B, H, A)
mask[:, :, spec["action_dim"]:] = 0
mask[1, H - 1] = 0
batch["action_mask"] = mask
batch["embodiment_id"] = torch.tensor(spec["embodiments"])
batch["noise"] = torch.randn(B, H, A)
batch["time"] = (1 - torch.distributions.Beta(1.5, 1.0).sample([B])) * 0.999
batch["sample_noise"] = torch.randn(B, H, A)
save_file({k: t.contiguous() for k, t in batch.items()}, str(out / "batch.safetensors"))

class Draw:
    def __init__(self, t): self.t = t
    def __enter__(self):
        self.randn = torch.randn
        torch.randn = lambda *a, **k: self.t.clone()
    def __exit__(self, *e): torch.randn = self.randn

draws = ("noise", "time", "sample_noise")
policy.train()
head = policy._groot_model.action_head
head.sample_time = lambda n, device, dtype: batch["time"].clone()
with Draw(batch["noise"]):
    loss, _ = policy.forward({k: t for k, t in batch.items() if k not in draws})
loss.backward()
res = {"loss": loss.detach().reshape(1)}
for n, p in policy.named_parameters():
    res["grad." + n] = p.grad if p.grad is not None else torch.zeros_like(p)
with Draw(batch["sample_noise"]):
    res["action_chunk"] = policy.predict_action_chunk({k: t for k, t in batch.items() if k not in draws + ("action",)})
policy.train()
opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
opt.step()
for n, p in policy.named_parameters(): res["after_step." + n] = p.detach().clone()
save_file({k: t.contiguous() for k, t in res.items()}, str(out / "ref.safetensors"))
'''

TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, in_channels=3, patch_size=2,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 1])
# head_dim 8: 4 rotary frequencies, interleaved t/h/w
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1], rope_theta=10000.0))
GROOT = dict(backbone_embedding_dim=32, select_layer=2, hidden_size=24, input_embedding_dim=16, max_state_dim=6,
             max_action_dim=5, action_horizon=4, max_seq_len=8, max_num_embodiments=3, state_dropout_prob=0.0,
             attend_text_every_n_blocks=2, num_inference_timesteps=4,
             diffusion_model_cfg=dict(positional_embeddings=None, num_layers=4, num_attention_heads=2,
                                      attention_head_dim=8, norm_type="ada_norm", dropout=0.0, final_dropout=True,
                                      output_dim=24, interleave_self_attention=True),
             vl_self_attention_cfg=dict(positional_embeddings=None, num_layers=1, num_attention_heads=2,
                                        attention_head_dim=16, dropout=0.0, final_dropout=True))

CASES = {
    # two rows: a 4x4-patch image and a 4x8 one (positions resampled from the 4x4 grid), text around them; the
    # second row's last chunk step masked; embodiments 2 and 0; AlternateVLDiT (text, self, image, self blocks)
    "groot": dict(seed=0, tokens=TOKENS, vision=VISION, text=TEXT, groot=GROOT, action_dim=3,
                  inputs={"observation.state": ["STATE", [4]], "observation.images.top": ["VISUAL", [3, 32, 32]]},
                  policy=dict(chunk_size=4, n_action_steps=3),
                  rows=[[5, [1, 4, 4], 3], [2, [1, 4, 8], 2]], embodiments=[2, 0]),
}
# the plain DiT (every block cross-attends, unmasked), no vlln / vl_self_attention / position embedding; the top
# backbone layer trained (its gradient reaches through the deepstack-free last layer), the projectors frozen; one
# embodiment for both rows
CASES["groot_dit"] = dict(CASES["groot"], seed=1, embodiments=[1, 1],
                          policy=dict(chunk_size=4, n_action_steps=4, tune_top_llm_layers=1, tune_projector=False),
                          groot=dict(GROOT, use_alternate_vl_dit=False, use_vlln=False, add_pos_embed=False,
                                     vl_self_attention_cfg=dict(num_layers=0),
                                     diffusion_model_cfg=dict(GROOT["diffusion_model_cfg"], num_layers=3,
                                                              interleave_self_attention=False)))
# prompts padded on the left as LeRobot's processor pads them (8 pads before the first row, none in the second): the
# pads' features (no attention output, each layer's MLP) reach the action head through vl_self_attention; the top
# backbone layer trained, so its gradient goes through the pads' path too
CASES["groot_left_pad"] = dict(CASES["groot"], seed=2, rows=[[2, [1, 4, 4], 1], [5, [1, 4, 8], 2]],
                               pads=[["left", 8], ["left", 0]],
                               policy=dict(chunk_size=4, n_action_steps=3, tune_top_llm_layers=1))


@pytest.mark.parametrize("case", [c if c == "groot" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_groot_dump_matches_lerobot(tmp_path, case):
    spec = CASES[case]
    ref, _ = check_policy_dump(tmp_path, ORACLE, spec)
    # the DiT learns; the frozen backbone does not
    assert np.abs(ref["grad._groot_model.action_head.model.transformer_blocks.0.attn1.to_k.weight"]).max() > 0
    top = "grad._groot_model.backbone.model.model.language_model.layers.1.mlp.down_proj.weight"
    assert (np.abs(ref[top]).max() > 0) == (spec["policy"].get("tune_top_llm_layers", 0) > 0)
    info = json.loads(run_lf("info", tmp_path / "policy").stdout)
    assert info["model_type"] == "groot" and info["parameters"] == sum(v.size for k, v in ref.items() if k.startswith("grad."))


@pytest.mark.slow
def test_groot_bad_configs_and_batches_one_line(tmp_path):
    """Config mistakes (the policy's, the GR00T model config's under base_model_path) and what is not supported yet
    (diffusers' sinusoidal positions, prompts padded on the right) are one line naming the file's field."""
    import shutil
    from safetensors.numpy import load_file, save_file
    from conftest import run_lerobot
    run_lerobot(ORACLE, json.dumps(CASES["groot"]), tmp_path)

    def one_line(proc, what):
        assert proc.returncode != 0 and what in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    def fails(change_policy, change_base, field):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(tmp_path / "policy", bad / "policy")
        shutil.copytree(tmp_path / "base", bad / "base")
        cfg = json.loads((bad / "policy" / "config.json").read_text())
        base = json.loads((bad / "base" / "config.json").read_text())
        cfg["base_model_path"] = str(bad / "base")
        change_policy(cfg)
        change_base(base)
        (bad / "policy" / "config.json").write_text(json.dumps(cfg))
        (bad / "base" / "config.json").write_text(json.dumps(base))
        one_line(run_lf("info", bad / "policy", check=False), f"config.json: field '{field}'")

    keep = lambda c: None  # noqa: E731
    fails(lambda c: c.update(base_model_path="nvidia/GR00T-N1.7-3B"), keep, "base_model_path")
    fails(keep, lambda b: b["diffusion_model_cfg"].update(positional_embeddings="sinusoidal"),
          "diffusion_model_cfg.positional_embeddings")
    fails(keep, lambda b: b["diffusion_model_cfg"].update(output_dim=7), "diffusion_model_cfg.output_dim")
    fails(keep, lambda b: b.update(backbone_embedding_dim=48, vl_self_attention_cfg=dict(
        b["vl_self_attention_cfg"], attention_head_dim=24)), "backbone_embedding_dim")
    fails(keep, lambda b: b.update(backbone_embedding_dim=48), "vl_self_attention_cfg")
    fails(keep, lambda b: b.update(model_name="nobody/unknown"), "model_name")
    batch = load_file(tmp_path / "batch.safetensors")
    batch["attention_mask"][1, -1] = 0
    save_file(batch, str(tmp_path / "padded.safetensors"))
    one_line(run_lf("dump", "--model", tmp_path / "policy", "--batch", tmp_path / "padded.safetensors", "--out",
                    tmp_path / "x.safetensors", check=False), "attention_mask")


META = r'''
import json, sys, torch
from pathlib import Path
import lerobot.policies.groot.groot_n1_7 as G
out = Path(sys.argv[2])
cfg = G.GR00TN17Config()  # GR00T N1.7's defaults: Cosmos-Reason2-2B cut at layer 16, a 32-block AlternateVLDiT
cfg.save_pretrained(out / "base")
with torch.device("meta"):  # shapes only
    model = G.GR00TN17(cfg, load_backbone_weights=False)
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()),
                  "backbone": sum(p.numel() for p in model.backbone.parameters())}))
'''


@pytest.mark.slow
def test_groot_full_size_info(tmp_path):
    """`info` of a full-size GR00T N1.7 (LeRobot's defaults, the known nvidia/Cosmos-Reason2-2B backbone) counts
    LeRobot's parameters (3.1B) without building the model."""
    from conftest import run_lerobot
    ref = json.loads(run_lerobot(META, "{}", tmp_path).strip().splitlines()[-1])
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text(json.dumps({
        "type": "groot", "base_model_path": str(tmp_path / "base"),
        "input_features": {"observation.state": {"type": "STATE", "shape": [8]},
                           "observation.images.top": {"type": "VISUAL", "shape": [3, 256, 256]}},
        "output_features": {"action": {"type": "ACTION", "shape": [7]}}}))
    info = json.loads(run_lf("info", tmp_path / "policy").stdout)
    assert info["parameters"] == ref["parameters"] and info["components"]["backbone"]["parameters"] == ref["backbone"]

"""π0 and π0.5 (LeRobot's PI0Policy / PI05Policy) in LoongForge = LeRobot's own, built small in the lerobot oracle
environment (LeRobot builds them only at full size: the oracle patches its Gemma size table, the config's variant
check, the PaliGemma / expert configs it builds and the reshape that assumes 8 heads). `dump` on a batch as the
policy's forward receives it (after the preprocessor: images in [0, 1], token ids, normalised state and actions, with
the flow-matching draws `noise` and `time` and the sampler's start `sample_noise` passed in) gives its loss, every
parameter's gradient under LeRobot's names and the eval-mode action chunk (10-step Euler with the prefix cached);
one AdamW step equals torch.optim.AdamW's."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import check_policy_dump, run_lerobot, run_lf

# In the lerobot environment, SMALL_PI0 defines small_pi0(kind, sizes, vocab, vision) -> (modeling module, config class, policy class) with those
# patches in place (test_pi0_train.py uses it too).
SMALL_PI0 = r'''
import inspect
def small_pi0(kind, sizes, vocab, vision):
    if kind == "pi0":
        import lerobot.policies.pi0.modeling_pi0 as M
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        Policy = M.PI0Policy
    else:
        import lerobot.policies.pi05.modeling_pi05 as M
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        Policy = M.PI05Policy
    # LeRobot's size table, variant check and PaliGemma / expert configs, patched to the small sizes
    get_config = M.get_gemma_config
    M.get_gemma_config = lambda v: M.GemmaConfig(**sizes[v]) if v in sizes else get_config(v)
    post_init = Config.__post_init__
    def small_post_init(self):
        names = self.paligemma_variant, self.action_expert_variant
        self.paligemma_variant = self.action_expert_variant = "gemma_300m"
        post_init(self)
        self.paligemma_variant, self.action_expert_variant = names
    Config.__post_init__ = small_post_init
    PaliGemma, Expert = M.PaliGemmaForConditionalGenerationWithPiGemma, M.PiGemmaForCausalLM
    def small_paligemma(config):
        for k, v in vision.items():
            setattr(config.vision_config, k, v)
        config.projection_dim = vision["projection_dim"]
        config.vocab_size = config.text_config.vocab_size = vocab
        return PaliGemma(config=config)
    def small_expert(config):
        config.vocab_size = vocab
        return Expert(config=config)
    M.PaliGemmaForConditionalGenerationWithPiGemma, M.PiGemmaForCausalLM = small_paligemma, small_expert
    src = inspect.getsource(M.compute_layer_complete)  # the joint attention's reshape assumes 8 heads
    fixed = "att_output.reshape(batch_size, att_output.shape[1], -1)"
    assert "att_output.reshape(batch_size, -1, 1 * 8 * head_dim)" in src
    exec(src.replace("att_output.reshape(batch_size, -1, 1 * 8 * head_dim)", fixed), M.__dict__)
    # LeRobot 0.6.1 targets transformers 5.4-5.5; this environment has a later one, whose create_causal_mask takes no
    # cache_position. The mask LeRobot passes is a prepared 4D one, which create_causal_mask returns as-is.
    import lerobot.policies.pi_gemma as pi_gemma
    pi_gemma.create_causal_mask = lambda config, inputs_embeds, attention_mask, **kw: attention_mask
    return M, Config, Policy
'''

# In the lerobot environment: build the policy from SPEC (json) at small sizes, save it to OUT/policy (LeRobot's
# folder layout, plus the size fields LoongForge reads for variants LeRobot does not know), draw a batch, run
# policy.forward in train mode with the flow-matching draws fixed to the batch's, backward, predict_action_chunk
# from the batch's sample_noise, one AdamW step; write the batch and the results.
ORACLE = SMALL_PI0 + r'''
import json, sys, torch
from safetensors.torch import save_file
from lerobot.configs.types import FeatureType, PolicyFeature
spec = json.loads(sys.argv[1]); out = sys.argv[2]
sizes = spec.pop("variant_sizes"); vocab = spec.pop("vocab_size"); vision = spec.pop("vision_config")
M, Config, Policy = small_pi0(spec.pop("type"), sizes, vocab, vision)

torch.manual_seed(spec.pop("seed"))
B = spec.pop("batch"); L = spec.pop("lang_len"); lang_pad = spec.pop("lang_pad"); pad = spec.pop("pad")
missing = spec.pop("missing_cameras", [])
image_shapes = spec.pop("image_shapes", {})
feats = {k: PolicyFeature(FeatureType[t], tuple(s)) for k, (t, s) in spec.pop("inputs").items()}
action_dim = spec.pop("action_dim")
spec["image_resolution"] = tuple(spec["image_resolution"])  # as draccus loads it (a list would always resize)
cfg = Config(input_features=feats, output_features={"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
             device="cpu", **spec)
policy = Policy(cfg)
with torch.no_grad():  # LeRobot starts the RMSNorm weights and the adaptive norms' dense layers at 0
    for n, p in policy.named_parameters():
        if p.dim() == 1: p.normal_(0, 0.1)
        elif ".dense." in n: p.normal_(0, 0.05)
policy.save_pretrained(out + "/policy")
saved = json.loads(open(out + "/policy/config.json").read())
saved["variant_sizes"] = sizes; saved["vocab_size"] = vocab
saved["vision_config"] = dict(vision, image_size=cfg.image_resolution[0])
open(out + "/policy/config.json", "w").write(json.dumps(saved, indent=4))
if cfg.dtype == "bfloat16":  # saved with LeRobot's bf16 weights; the reference: those weights in a float32 policy
    import dataclasses     # (built afresh: casting the bf16 one back would keep its bf16-rounded rotary buffers)
    policy32 = Policy(dataclasses.replace(cfg, dtype="float32"))
    missed = policy32.load_state_dict({n: p.detach().float() for n, p in policy.named_parameters()}, strict=False)
    assert not missed.unexpected_keys and all("embed_tokens" in k or "lm_head" in k or "inv_freq" in k
                                              for k in missed.missing_keys), missed
    policy = policy32

batch = {}
for k, f in cfg.input_features.items():
    if k in missing or k not in feats: continue
    shape = image_shapes.get(k, list(f.shape))
    batch[k] = torch.rand(B, *shape) if f.type is FeatureType.VISUAL else torch.randn(B, *shape)
batch["observation.language.tokens"] = torch.randint(0, vocab, (B, L))
mask = torch.ones(B, L, dtype=torch.bool)
for row, n in enumerate(lang_pad):
    if n: mask[row, -n:] = False
batch["observation.language.attention_mask"] = mask
batch["action"] = torch.randn(B, cfg.chunk_size, action_dim)
is_pad = torch.zeros(B, cfg.chunk_size, dtype=torch.bool)
for row, n in enumerate(pad):
    if n: is_pad[row, -n:] = True
batch["action_is_pad"] = is_pad
batch["noise"] = torch.randn(B, cfg.chunk_size, cfg.max_action_dim)
batch["time"] = torch.rand(B) * 0.999 + 0.001
batch["sample_noise"] = torch.randn(B, cfg.chunk_size, cfg.max_action_dim)
save_file({k: v.contiguous() for k, v in batch.items()}, out + "/batch.safetensors")

draws = ("noise", "time", "sample_noise")
policy.train()
policy.model.sample_noise = lambda shape, device: batch["noise"].clone()
policy.model.sample_time = lambda bsize, device: batch["time"].clone()
loss, parts = policy.forward({k: v for k, v in batch.items() if k not in draws})
loss.backward()
res = {"loss": loss.detach().reshape(1)}
for n, p in policy.named_parameters():
    res["grad." + n] = p.grad if p.grad is not None else torch.zeros_like(p)
policy.model.sample_noise = lambda shape, device: batch["sample_noise"].clone()
res["action_chunk"] = policy.predict_action_chunk({k: v for k, v in batch.items() if k not in draws + ("action", "action_is_pad")})
policy.train()
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
opt.step()
for n, p in policy.named_parameters(): res["after_step." + n] = p.detach().clone()
save_file({k: v.contiguous() for k, v in res.items()}, out + "/ref.safetensors")
'''

VLM = dict(width=32, depth=2, mlp_dim=48, num_heads=4, num_kv_heads=1, head_dim=16)
EXPERT = dict(width=24, depth=2, mlp_dim=40, num_heads=4, num_kv_heads=1, head_dim=16)
VISION = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=2, patch_size=14, intermediate_size=40,
              projection_dim=32)


def small(kind, **kw):
    spec = dict(type=kind, variant_sizes={"gemma_tiny": VLM, "gemma_tiny_expert": EXPERT}, vocab_size=96,
                vision_config=VISION, paligemma_variant="gemma_tiny", action_expert_variant="gemma_tiny_expert",
                image_resolution=[28, 28], chunk_size=5, n_action_steps=5, max_state_dim=8, max_action_dim=6,
                action_dim=3, batch=2, lang_len=6, lang_pad=[0, 2], pad=[0, 2], seed=0)
    spec.update(kw)
    return spec


CASES = {
    # one camera at the model's resolution, padded language tokens, GQA (4 heads, 1 key/value head)
    "pi0": small("pi0", inputs={"observation.state": ["STATE", [4]],
                                "observation.images.top": ["VISUAL", [3, 28, 28]]}),
    # two cameras, one resized with padding (24 x 32 -> 28 x 28), one missing (an empty camera: -1 image, masked);
    # 2 key/value heads; 3 Euler steps
    "pi0_two_cameras": small("pi0", inputs={"observation.state": ["STATE", [5]],
                                            "observation.images.left": ["VISUAL", [3, 24, 32]],
                                            "observation.images.right": ["VISUAL", [3, 28, 28]]},
                             image_shapes={"observation.images.left": [3, 24, 32]},
                             missing_cameras=["observation.images.right"], num_inference_steps=3,
                             variant_sizes={"gemma_tiny": dict(VLM, num_kv_heads=2),
                                            "gemma_tiny_expert": dict(EXPERT, num_kv_heads=2, depth=2)},
                             batch=3, lang_pad=[0, 1, 3], pad=[0, 1, 4], seed=1),
    # LeRobot's bf16 weights (dtype: bfloat16: every weight but the vision tower, projector and norms stored in
    # bf16): LoongForge reads them into float32 masters and computes in float32 (bf16 compute is `precision: bf16`)
    "pi0_bf16_weights": small("pi0", inputs={"observation.state": ["STATE", [4]],
                                            "observation.images.top": ["VISUAL", [3, 28, 28]]}, dtype="bfloat16",
                              seed=3),
    # π0.5: no state token, the time through the expert's adaptive RMSNorms
    "pi05": small("pi05", inputs={"observation.state": ["STATE", [4]],
                                  "observation.images.top": ["VISUAL", [3, 28, 28]]}, seed=2),
}


def check_dump(tmp_path, spec):
    ref, _ = check_policy_dump(tmp_path, ORACLE, spec)
    info = json.loads(run_lf("info", tmp_path / "policy").stdout)
    assert info["model_type"] == spec["type"] and info["parameters"] == sum(v.size for k, v in ref.items() if k.startswith("grad."))


@pytest.mark.parametrize("case", [c if c == "pi0" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_pi0_dump_matches_lerobot(tmp_path, case):
    check_dump(tmp_path, CASES[case])
    if CASES[case].get("dtype") == "bfloat16":  # the folder held bf16 weights
        raw = (tmp_path / "policy" / "model.safetensors").read_bytes()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        dtypes = {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
        assert json.loads((tmp_path / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
        gemma_q = {k: v for k, v in dtypes.items() if k.endswith("q_proj.weight") and "vision_tower" not in k}
        assert gemma_q and all(v == "BF16" for v in gemma_q.values()), gemma_q
        assert any(v == "F32" for k, v in dtypes.items() if "vision_tower" in k), dtypes


@pytest.mark.slow
def test_pi0_old_vision_names_and_bad_configs(tmp_path):
    """Checkpoints saved with transformers < 5.24 name the SigLIP tower's weights vision_tower.vision_model.*: they
    load to the same results. Config mistakes are one line naming the field."""
    import shutil
    from safetensors.numpy import save_file
    run_lerobot(ORACLE, json.dumps(CASES["pi0"]), tmp_path)
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "policy", old)
    weights = load_file(old / "model.safetensors")
    save_file({k.replace(".vision_tower.", ".vision_tower.vision_model."): v for k, v in weights.items()},
              str(old / "model.safetensors"))
    outs = []
    for folder in (tmp_path / "policy", old):
        outs.append(tmp_path / (folder.name + ".safetensors"))
        run_lf("dump", "--model", folder, "--batch", tmp_path / "batch.safetensors", "--out", outs[-1])
    a, b = load_file(outs[0]), load_file(outs[1])
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)

    def fails(change, field):
        cfg = json.loads((tmp_path / "policy" / "config.json").read_text())
        change(cfg)
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(tmp_path / "policy", bad)
        (bad / "config.json").write_text(json.dumps(cfg))
        proc = run_lf("info", bad, check=False)
        assert proc.returncode != 0 and f"config.json: field '{field}'" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    fails(lambda c: c.update(paligemma_variant="gemma_huge"), "paligemma_variant")
    fails(lambda c: c["variant_sizes"]["gemma_tiny_expert"].update(num_heads=2), "action_expert_variant")
    fails(lambda c: c["vision_config"].update(projection_dim=16), "vision_config.projection_dim")
    fails(lambda c: c.update(image_resolution=[28, 32]), "image_resolution")
    fails(lambda c: c.update(max_action_dim=2), "max_action_dim")

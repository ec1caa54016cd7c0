"""ACT (LeRobot's ACTPolicy) in LoongForge = LeRobot's own, built from small configs in the lerobot oracle environment:
`dump` on a batch as LeRobot's policy.forward receives it (normalised, with the latent's draw `vae_eps` passed in)
gives its loss, l1_loss, kld_loss, every parameter's gradient under LeRobot's names and the eval-mode action chunk;
one AdamW step equals torch.optim.AdamW's."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import assert_policy_grads_and_step_match, run_gtest_hook, run_lerobot, run_lf

# In the lerobot environment: build ACTPolicy from CONFIG (json), save it to DIR (LeRobot's folder layout), draw a
# batch, run policy.forward in train mode with torch.randn_like fixed to the batch's vae_eps, backward, one AdamW
# step, and predict_action_chunk; write the batch and the results.
ORACLE = r'''
import json, sys, torch
from safetensors.torch import save_file
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.act.modeling_act import ACTPolicy
spec = json.loads(sys.argv[1]); out = sys.argv[2]
if spec.pop("narrow", False):  # a narrow "resnet18": widths / 8, fewer blocks (LoongForge reads them from the weights)
    import torchvision
    from torchvision.models.resnet import BasicBlock, ResNet
    def narrow_resnet18(weights=None, **kw):
        make = ResNet._make_layer
        ResNet._make_layer = lambda self, block, planes, blocks, stride=1, dilate=False: make(self, block, planes // 8, blocks, stride, dilate)
        try:
            m = ResNet(BasicBlock, [2, 1, 1, 1], **kw)
        finally:
            ResNet._make_layer = make
        m.fc = torch.nn.Linear(64, 10)  # ACT sizes its projection by fc.in_features
        return m
    torchvision.models.resnet18 = narrow_resnet18
torch.manual_seed(spec.pop("seed"))
B = spec.pop("batch"); pad = spec.pop("pad")
feats = {k: PolicyFeature(FeatureType[t], tuple(s)) for k, (t, s) in spec.pop("inputs").items()}
cfg = ACTConfig(input_features=feats, output_features={"action": PolicyFeature(FeatureType.ACTION, (spec.pop("action_dim"),))},
                pretrained_backbone_weights=None, device="cpu", **spec)
policy = ACTPolicy(cfg)
with torch.no_grad():  # non-trivial frozen batch-norm statistics and biases (a fresh ResNet has identities)
    for n, b in policy.named_buffers():
        if "running_var" in n: b.uniform_(0.5, 2.0)
        elif "running_mean" in n or n.endswith(".bias"): b.normal_(0, 0.1)
        elif n.endswith(".weight"): b.uniform_(0.5, 1.5)
    for n, p in policy.named_parameters():
        if p.dim() == 1: p.normal_(0, 0.1)
policy.save_pretrained(out + "/policy")
batch = {}
for k, f in feats.items():
    batch[k] = torch.randn(B, *f.shape)
batch["action"] = torch.randn(B, cfg.chunk_size, cfg.action_feature.shape[0])
is_pad = torch.zeros(B, cfg.chunk_size, dtype=torch.bool)
for row, n in enumerate(pad):
    if n: is_pad[row, -n:] = True
batch["action_is_pad"] = is_pad
batch["vae_eps"] = torch.randn(B, cfg.latent_dim)
save_file({k: v.contiguous() for k, v in batch.items()}, out + "/batch.safetensors")
policy.train()
real_randn_like = torch.randn_like
torch.randn_like = lambda t, **kw: batch["vae_eps"].to(t.dtype)
loss, parts = policy.forward({k: v for k, v in batch.items() if k != "vae_eps"})
torch.randn_like = real_randn_like
loss.backward()
res = {"loss": loss.detach().reshape(1)}
for k, v in parts.items(): res[k] = torch.tensor([v])
for n, p in policy.named_parameters():
    res["grad." + n] = p.grad if p.grad is not None else torch.zeros_like(p)
res["action_chunk"] = policy.predict_action_chunk({k: v for k, v in batch.items() if k not in ("action", "action_is_pad", "vae_eps")})
policy.train()
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
opt.step()
for n, p in policy.named_parameters(): res["after_step." + n] = p.detach().clone()
save_file({k: v.contiguous() for k, v in res.items()}, out + "/ref.safetensors")
'''

CASES = {
    # one camera (a narrow ResNet-18 trunk) + state, post-norm, the CVAE; padded chunk ends
    "camera_state": dict(inputs={"observation.state": ["STATE", [4]], "observation.images.top": ["VISUAL", [3, 48, 64]]},
                         action_dim=3, chunk_size=6, n_action_steps=6, dim_model=16, n_heads=2, dim_feedforward=24,
                         n_encoder_layers=2, n_decoder_layers=2, n_vae_encoder_layers=1, latent_dim=4, dropout=0.0,
                         batch=3, pad=[0, 2, 5], seed=0, narrow=True),
    # two cameras + environment state, pre-norm, GELU
    "two_cameras_prenorm": dict(inputs={"observation.state": ["STATE", [5]], "observation.environment_state": ["ENV", [3]],
                                        "observation.images.left": ["VISUAL", [3, 32, 32]],
                                        "observation.images.right": ["VISUAL", [3, 32, 32]]},
                                action_dim=2, chunk_size=4, n_action_steps=1, dim_model=8, n_heads=2, dim_feedforward=12,
                                n_encoder_layers=1, n_decoder_layers=1, n_vae_encoder_layers=2, latent_dim=3, dropout=0.0,
                                pre_norm=True, feedforward_activation="gelu", temporal_ensemble_coeff=0.01,
                                batch=2, pad=[1, 0], seed=1),
    # no camera, no CVAE: the robot and environment states (LeRobot's forward needs observation.state)
    "env_state_no_vae": dict(inputs={"observation.state": ["STATE", [2]], "observation.environment_state": ["ENV", [6]]}, action_dim=4, chunk_size=5,
                             n_action_steps=5, dim_model=12, n_heads=3, dim_feedforward=16, n_encoder_layers=2,
                             n_decoder_layers=1, use_vae=False, latent_dim=2, dropout=0.0, batch=4, pad=[0, 0, 3, 1],
                             seed=2),
}


def close(a, b, rtol, atol):
    return np.allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", [c if c == "camera_state" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_act_dump_matches_lerobot(tmp_path, case):
    run_lerobot(ORACLE, json.dumps(CASES[case]), tmp_path)
    out = tmp_path / "lf.safetensors"
    run_lf("dump", "--model", tmp_path / "policy", "--batch", tmp_path / "batch.safetensors", "--out", out,
           "--adamw", "lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1")
    ref, got = load_file(tmp_path / "ref.safetensors"), load_file(out)
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * max(1.0, abs(ref["loss"][0]))
    for part in ("l1_loss", "kld_loss"):
        assert (part in got) == (part in ref), part
        if part in ref:
            assert abs(got[part][0] - ref[part][0]) <= 1e-5 * max(1.0, abs(ref[part][0])), part
    assert got["action_chunk"].shape == ref["action_chunk"].shape
    assert close(got["action_chunk"], ref["action_chunk"], 1e-5, 1e-5)
    assert_policy_grads_and_step_match(got, ref)


# In the lerobot environment: LeRobot's ACTTemporalEnsembler fed random action chunks (more steps than a chunk, so the
# counts saturate; the episode restarting once, reset()) for each (coeff, chunk) case, its actions written beside the
# chunks (OUT/ensemble_N.safetensors) for the C++ hook ActTemporalEnsemble.LeRobotHook.
ENSEMBLE = r'''
import json, sys, torch
from safetensors.torch import save_file
from lerobot.policies.act.modeling_act import ACTTemporalEnsembler
for n, (coeff, chunk) in enumerate(json.loads(sys.argv[1])):
    torch.manual_seed(n)
    steps, reset_at = 3 * chunk + 2, 2 * chunk + 1
    chunks = torch.randn(steps, 2, chunk, 3)
    e = ACTTemporalEnsembler(coeff, chunk)
    actions = []
    for t in range(steps):
        if t == reset_at: e.reset()
        actions.append(e.update(chunks[t]).clone())
    save_file({"chunks": chunks, "actions": torch.stack(actions), "coeff": torch.tensor([coeff], dtype=torch.float64),
               "reset_at": torch.tensor([reset_at])}, f"{sys.argv[2]}/ensemble_{n}.safetensors")
'''
ENSEMBLE_CASES = [(0.01, 6), (-0.2, 4), (0.0, 1), (0.5, 10)]


def test_act_temporal_ensemble_matches_lerobot(tmp_path):
    """models/policy/temporal_ensemble.h = LeRobot's online average over overlapping chunks, to 1e-6."""
    run_lerobot(ENSEMBLE, json.dumps(ENSEMBLE_CASES), tmp_path)
    for n in range(len(ENSEMBLE_CASES)):
        run_gtest_hook("ActTemporalEnsemble.LeRobotHook", {"LF_TEST_ACT_ENSEMBLE": str(tmp_path / f"ensemble_{n}.safetensors")})


@pytest.mark.slow
def test_act_info_and_bad_config(tmp_path):
    spec = dict(CASES["camera_state"], narrow=False)
    run_lerobot(ORACLE, json.dumps(spec), tmp_path)
    info = json.loads(run_lf("info", tmp_path / "policy").stdout)
    assert info["model_type"] == "act" and info["cameras"] == ["observation.images.top"]
    ref = run_lerobot("import sys, torch; from safetensors.torch import load_file; "
                      "print(sum(v.numel() for k, v in load_file(sys.argv[1]).items() if 'running' not in k and "
                      "'.bn' not in k and 'downsample.1' not in k and 'pos_enc' not in k))",
                      tmp_path / "policy" / "model.safetensors")
    assert info["parameters"] == int(ref)
    cfg = json.loads((tmp_path / "policy" / "config.json").read_text())
    cfg["n_heads"] = 5
    (tmp_path / "policy" / "config.json").write_text(json.dumps(cfg))
    proc = run_lf("info", tmp_path / "policy", check=False)
    assert proc.returncode != 0 and "config.json: field 'n_heads'" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# In the lerobot environment: the policy's pre / post-processors (normaliser stats) saved beside it (SRC), then the
# folder LoongForge wrote (DST) loaded by LeRobot: the same weights, the same processors, the same action chunk.
ROUND_TRIP = r'''
import sys, torch
from lerobot.policies.act.modeling_act import ACTPolicy
from lerobot.policies.factory import make_pre_post_processors
src, dst, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "save":
    p = ACTPolicy.from_pretrained(src)
    stats = {k: {"mean": torch.randn(*f.shape[:1]), "std": torch.rand(*f.shape[:1]) + 0.5}
             for k, f in {**p.config.input_features, **p.config.output_features}.items()}
    pre, post = make_pre_post_processors(p.config, dataset_stats=stats)
    pre.save_pretrained(src)
    post.save_pretrained(src)
    sys.exit(0)
a, b = ACTPolicy.from_pretrained(src), ACTPolicy.from_pretrained(dst)
sa, sb = a.state_dict(), b.state_dict()
assert sorted(sa) == sorted(sb), set(sa) ^ set(sb)
for k in sa: assert torch.equal(sa[k], sb[k]), k
pa, _ = make_pre_post_processors(a.config, pretrained_path=src)
pb, _ = make_pre_post_processors(b.config, pretrained_path=dst)
obs = {k: torch.rand(1, *f.shape) for k, f in a.config.input_features.items()}
xa, xb = pa(dict(obs)), pb(dict(obs))
assert torch.equal(a.predict_action_chunk(xa), b.predict_action_chunk(xb))
print("ok")
'''


@pytest.mark.slow
def test_act_convert_writes_a_folder_lerobot_loads(tmp_path):
    run_lerobot(ORACLE, json.dumps(dict(CASES["camera_state"], narrow=False)), tmp_path)
    run_lerobot(ROUND_TRIP, tmp_path / "policy", "-", "save")
    run_lf("convert", "--model", tmp_path / "policy", "--out", tmp_path / "out", "--dtype", "fp32")
    cfg_in = json.loads((tmp_path / "policy" / "config.json").read_text())
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == cfg_in
    assert "ok" in run_lerobot(ROUND_TRIP, tmp_path / "policy", tmp_path / "out", "check")


@pytest.mark.slow
def test_act_processors_written_by_loongforge_load_in_lerobot(tmp_path):
    """The normaliser files LoongForge writes (io/policy_processor.h, read from those LeRobot saved) make LeRobot's
    pipelines that normalise and unnormalise as the originals do."""
    run_lerobot(ORACLE, json.dumps(dict(CASES["camera_state"], narrow=False)), tmp_path)
    run_lerobot(ROUND_TRIP, tmp_path / "policy", "-", "save")
    out = tmp_path / "out"
    out.mkdir()
    run_gtest_hook("PolicyProcessor.RewriteHook", {"LF_TEST_POLICY_PROC_SRC": str(tmp_path / "policy"),
                                                   "LF_TEST_POLICY_PROC_DST": str(out)})
    check = r"""
import sys, torch
from lerobot.processor import PolicyProcessorPipeline
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
a, b = sys.argv[1], sys.argv[2]
for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
    kw = {} if "pre" in name else dict(to_transition=policy_action_to_transition, to_output=transition_to_policy_action)
    pa = PolicyProcessorPipeline.from_pretrained(a, config_filename=name, **kw)
    pb = PolicyProcessorPipeline.from_pretrained(b, config_filename=name, **kw)
    torch.manual_seed(0)
    if "pre" in name:
        x = {"observation.state": torch.randn(2, 4), "observation.images.top": torch.rand(2, 3, 48, 64), "action": torch.randn(2, 6, 3)}
        ya, yb = pa(dict(x)), pb(dict(x))
        for k in x: assert torch.equal(ya[k], yb[k]), k
    else:
        x = torch.randn(2, 6, 3)
        assert torch.equal(pa(x.clone()), pb(x.clone()))
print("ok")
"""
    assert "ok" in run_lerobot(check, tmp_path / "policy", out)

"""π0 and π0.5 trained by `loongforge train` from a LeRobot dataset (data.format: robot), against LeRobot's own
processors and policies (small, built as test_pi0_parity.py builds them) on a dataset whose episodes have tasks, and
a small Gemma-like tokenizer made here with the `tokenizers` library (LeRobot's processors load it through
transformers' AutoTokenizer in place of google/paligemma-3b-pt-224; LoongForge through data.robot.tokenizer):
  - a batch of the robot source = LeRobot's preprocessor output for the same frames: the prompt's tokens and mask
    (π0: the task with a newline, truncated / padded to tokenizer_max_length; π0.5: "Task: ..., State: <256 bins of
    the normalised state>;\\nAction: "), the normalised state, camera and action chunk; its loss (`dump`) =
    PI0Policy.forward's on LeRobot's batch with the same noise and time; the processor files written beside it load
    in LeRobot and make the same batch;
  - training lowers the loss (with open-loop evaluation on a held-out episode), and the checkpoint folder (weights,
    config, processors, tokenizer) loads in LeRobot and gives an action for a raw observation with its task;
  - the shipped LoRA recipes' targets train only adapters, saved in PEFT's layout, which PeftModel.from_pretrained
    loads over LeRobot's policy to the loss `dump --lora` gives."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import ROOT, run_gtest_hook, run_lerobot, run_lf
from test_pi0_parity import EXPERT, SMALL_PI0, VISION, VLM
from test_policy_train import DATASET, PROCESSED, check_layout
from test_policy_train import recipe as policy_recipe

# The episodes' tasks: underscores, newlines and outer (Unicode) spaces (π0.5 cleans them), one long enough for π0's
# tokenizer_max_length here (16) to cut.
TASKS = ["follow_the ring", "\u3000 pick up the cube\nthen stop \u00a0", "put the block in the box, then pick up the ring, then follow the cube to the box"]

# A Gemma-like tokenizer (scripts/gemma_tokenizer.py: BPE with byte fallback, spaces as '▁', "<bos> $A", pad 0 / eos 1
# / bos 2 / unk 3) trained on a few prompts, at most 384 tokens (the policies' vocab_size).
TOKENIZER = (ROOT / "scripts" / "gemma_tokenizer.py").read_text()
TOKENIZER_ARGS = ["384", "Task: pick up the cube, State: 12 130 255 0;\nAction: ", "follow the ring\n", "put the block in the box"]

# small_pi0 with LeRobot's processor factory loading the tokenizer folder (argv[1] of the scripts below) in place of
# google/paligemma-3b-pt-224.
SETUP = SMALL_PI0 + r'''
import importlib, json, sys, torch
SIZES = json.loads(sys.argv[-2]); VISION = json.loads(sys.argv[-1])
def setup(kind, tok):
    M, Config, Policy = small_pi0(kind, SIZES, 384, VISION)
    P = importlib.import_module(f"lerobot.policies.{kind}.processor_{kind}")
    step = P.TokenizerProcessorStep
    P.TokenizerProcessorStep = lambda **kw: step(**dict(kw, tokenizer_name=tok))
    return M, Config, Policy
'''

# A small policy of KIND (argv[1]) for the dataset, saved to argv[3] with the size fields LoongForge reads.
POLICY = SETUP + r'''
from lerobot.configs.types import FeatureType, PolicyFeature
kind, out = sys.argv[1], sys.argv[3]
M, Config, Policy = setup(kind, sys.argv[2])
torch.manual_seed(0)
cfg = Config(input_features={"observation.state": PolicyFeature(FeatureType.STATE, (4,)),
                             "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 24, 32))},
             output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))}, device="cpu",
             paligemma_variant="gemma_tiny", action_expert_variant="gemma_tiny_expert", image_resolution=(28, 28),
             chunk_size=5, n_action_steps=5, max_state_dim=8, max_action_dim=6,
             tokenizer_max_length=16 if kind == "pi0" else 200)
policy = Policy(cfg)
with torch.no_grad():  # LeRobot starts the RMSNorm weights and the adaptive norms' dense layers at 0
    for n, p in policy.named_parameters():
        if p.dim() == 1: p.normal_(0, 0.1)
        elif ".dense." in n: p.normal_(0, 0.05)
policy.save_pretrained(out)
saved = json.loads(open(out + "/config.json").read())
saved.update(variant_sizes=SIZES, vocab_size=384, vision_config=dict(VISION, image_size=28))
open(out + "/config.json", "w").write(json.dumps(saved, indent=4))
'''

# LeRobot's preprocessed batch for the frames the source read (argv[5]'s "index"), its loss with our noise and time,
# and the processors LoongForge wrote (argv[6]) applied to the same raw batch.
LEROBOT_BATCH = SETUP + PROCESSED + r'''
import shutil, tempfile
from safetensors.torch import load_file, save_file
kind, tok, root, pol, ours, files, out = sys.argv[1:8]
M, Config, Policy = setup(kind, tok)
cfg = json.loads(open(pol + "/config.json").read())
for k in ("variant_sizes", "vocab_size", "vision_config"): cfg.pop(k)
plain = tempfile.mkdtemp()
shutil.copy(pol + "/model.safetensors", plain)
open(plain + "/config.json", "w").write(json.dumps(cfg))
policy = Policy.from_pretrained(plain)
ours = load_file(ours)
keys = ["observation.state", "observation.images.top", "action", "action_is_pad", "observation.language.tokens",
        "observation.language.attention_mask"]
ref, res = processed(action_dataset(root, policy.config), policy.config, ours["index"], files, keys)
policy.train()
policy.model.sample_noise = lambda shape, device: ours["noise"].clone()
policy.model.sample_time = lambda bsize, device: ours["time"].clone()
loss, parts = policy.forward({k: ref[k] for k in keys})
res["loss"] = loss.detach().reshape(1)
save_file(res, out)
'''

# The trained checkpoint (argv[3]) as LeRobot loads it: the policy (its config without the size fields), the
# processors and tokenizer from the folder, an action for a raw observation with a task.
LOAD_CHECKPOINT = SETUP + r'''
import shutil, tempfile
from lerobot.policies.factory import make_pre_post_processors
kind, ckpt = sys.argv[1], sys.argv[3]
M, Config, Policy = setup(kind, sys.argv[2])
folder = tempfile.mkdtemp()
shutil.copytree(ckpt, folder, dirs_exist_ok=True)
cfg = json.loads(open(folder + "/config.json").read())
for k in ("variant_sizes", "vocab_size", "vision_config"): cfg.pop(k)
open(folder + "/config.json", "w").write(json.dumps(cfg))
p = Policy.from_pretrained(folder)
pre, post = make_pre_post_processors(p.config, pretrained_path=folder)
obs = {"observation.state": torch.zeros(1, 4), "observation.images.top": torch.full((1, 3, 24, 32), 0.5),
       "task": ["pick up the cube"]}
a = post(p.select_action(pre(obs)))
assert a.shape == (1, 4) and torch.isfinite(a).all()
print("ok")
'''


def lerobot(script, kind, made, *args):
    return run_lerobot(script, kind, made / "tokenizer", *args,
                       json.dumps({"gemma_tiny": VLM, "gemma_tiny_expert": EXPERT}), json.dumps(VISION))


def recipe(tmp_path, made, kind, steps=40, extra=""):
    return policy_recipe(tmp_path, made / "dataset", made / kind, f"    tokenizer: {made / 'tokenizer'}\n{extra}", steps)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The dataset, the tokenizer and both policies, made by one lerobot process (each start costs seconds)."""
    d = tmp_path_factory.mktemp("made")
    (d / "tokenizer").mkdir()
    sizes, vision = json.dumps({"gemma_tiny": VLM, "gemma_tiny_expert": EXPERT}), json.dumps(VISION)
    runs = [(DATASET, [d / "dataset", json.dumps(TASKS)]), (TOKENIZER, [d / "tokenizer", *TOKENIZER_ARGS])]
    runs += [(POLICY, [kind, d / "tokenizer", d / kind, sizes, vision]) for kind in ("pi0", "pi05")]
    script = "import sys\n" + "".join(f"sys.argv = {['-c', *map(str, args)]!r}\nexec({code!r}, {{}})\n"
                                       for code, args in runs)
    run_lerobot(script)
    return d


def save_dump_batch(batch, path):
    """The source's batch as `dump` takes it: without the frames' index, with the sampler's start (dump also runs
    the eval-mode sampler)."""
    b = {k: v for k, v in batch.items() if k != "index"}
    b["sample_noise"] = np.random.default_rng(0).standard_normal(b["noise"].shape).astype(np.float32)
    save_file(b, str(path))


def check_batch_and_loss(tmp_path, made, kind):
    pol = made / kind
    rec = recipe(tmp_path, made, kind)
    out = tmp_path / "hook"
    out.mkdir()
    run_gtest_hook("RobotSource.BatchHook", {"LF_TEST_ROBOT_RECIPE": str(rec), "LF_TEST_ROBOT_OUT": str(out)})
    lerobot(LEROBOT_BATCH, kind, made, made / "dataset", pol, out / "batch.safetensors", out / "model_files",
            tmp_path / "ref.safetensors")
    ours, ref = load_file(out / "batch.safetensors"), load_file(tmp_path / "ref.safetensors")
    for k in ["observation.state", "observation.images.top", "action"]:
        assert ours[k].shape == ref[k].shape, k
        assert np.abs(ours[k] - ref[k]).max() <= 1e-5, (k, np.abs(ours[k] - ref[k]).max())
    for k in ["action_is_pad", "observation.language.tokens", "observation.language.attention_mask"]:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, (k, ours[k].dtype, ref[k].dtype)
        assert (ours[k] == ref[k]).all(), (k, ours[k], ref[k])
    for k in ref:
        if k.startswith("files."):  # our processor files make LeRobot's batch
            assert np.abs(ref[k].astype(np.float64) - ref[k[6:]].astype(np.float64)).max() <= 1e-6, k
    mask = ours["observation.language.attention_mask"]
    L = 16 if kind == "pi0" else 200
    assert mask.shape == (6, L) and mask[:, 0].all() and (ours["observation.language.tokens"][:, 0] == 2).all()
    # the loss of our batch (dump: the model as LeRobot's forward) = LeRobot's on its batch with our noise and time
    save_dump_batch(ours, tmp_path / "ours.safetensors")
    run_lf("dump", "--model", pol, "--batch", tmp_path / "ours.safetensors", "--out", tmp_path / "dump.safetensors")
    got = load_file(tmp_path / "dump.safetensors")
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * max(1.0, abs(ref["loss"][0])), (got["loss"], ref["loss"])
    return ours


def test_pi0_batch_and_loss_match_lerobot(tmp_path, made):
    ours = check_batch_and_loss(tmp_path, made, "pi0")
    # rows of the long tasks were cut at 16 tokens, the short task's padded
    lengths = ours["observation.language.attention_mask"].sum(axis=1)
    assert (lengths == 16).any() and (lengths < 16).any(), lengths


@pytest.mark.slow
def test_pi05_batch_and_loss_match_lerobot(tmp_path, made):
    check_batch_and_loss(tmp_path, made, "pi05")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_pi0_trains_and_its_checkpoint_loads_in_lerobot(tmp_path, made, kind):
    pol = made / kind
    rec = recipe(tmp_path, made, kind, steps=30)
    run_lf("train", rec, "--set", "data.robot.valid_episodes=1", "--set", "eval.every=30")
    m = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in m if "loss" in x]
    assert len(losses) == 30
    # open-loop evaluation on the held-out episode (its rows' prompts made as the training rows')
    assert [x["step"] for x in m if "open_loop_mse" in x] == [30] and np.isfinite(m[-1]["open_loop_mse"])
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    ckpts = tmp_path / "run" / "checkpoints"
    ckpt = ckpts / (ckpts / "latest").read_text().strip()
    assert (ckpt / "tokenizer.json").exists()
    assert "ok" in lerobot(LOAD_CHECKPOINT, kind, made, ckpt)


@pytest.mark.parametrize("kind,layout", [("pi0", "dp2"), pytest.param("pi0", "fsdp2", marks=pytest.mark.slow),
                                         pytest.param("pi05", "fsdp2", marks=pytest.mark.slow),
                                         pytest.param("pi0", "hsdp2x2", marks=pytest.mark.slow)])
def test_pi0_layout_matches_one_process(tmp_path, made, kind, layout):
    """π0 and π0.5 (the vision tower frozen, a lower learning rate for the language model, the flow-matching draws
    `noise` / `time` of each row from its own seeded stream) under DDP / FSDP / HSDP = one process. Adam's eps at
    1e-6: at 1e-8 an element whose gradient is at rounding level (~1e-9) takes a step of up to lr in whichever
    direction the rounding of a reduction order gives (π0 hsdp2x2: one element of action_time_mlp_out at 1.5e-5)."""
    check_layout(tmp_path, lambda d, steps: recipe(d, made, kind, steps=steps), layout, made / kind / "model.safetensors",
                 ["optim.eps=1e-6", "model.freeze=[model.paligemma_with_expert.paligemma.model.vision_tower]",
                  "optim.lr_multipliers=[{pattern: model.paligemma_with_expert.paligemma.model.language_model, "
                  "multiplier: 0.5}]"], frozen="vision_tower")


# LeRobot's policy (argv[3]) with the PEFT adapter (argv[4]) as PeftModel.from_pretrained loads it: its loss on our
# batch (argv[5]) with our noise and time (into argv[6]).
PEFT_LOSS = SETUP + r'''
import shutil, tempfile
from peft import PeftModel
from safetensors.torch import load_file, save_file
kind, pol, adapter, batch, out = sys.argv[1], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
M, Config, Policy = setup(kind, sys.argv[2])
folder = tempfile.mkdtemp()
shutil.copy(pol + "/model.safetensors", folder)
cfg = json.loads(open(pol + "/config.json").read())
for k in ("variant_sizes", "vocab_size", "vision_config"): cfg.pop(k)
open(folder + "/config.json", "w").write(json.dumps(cfg))
policy = PeftModel.from_pretrained(Policy.from_pretrained(folder), adapter)
inner = policy.base_model.model
b = load_file(batch)
inner.train()
inner.model.sample_noise = lambda shape, device: b["noise"].clone()
inner.model.sample_time = lambda bsize, device: b["time"].clone()
loss, _ = inner.forward({k: v for k, v in b.items() if k not in ("noise", "time", "sample_noise")})
save_file({"loss": loss.detach().reshape(1)}, out)
'''


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_lora_recipe_trains_only_the_adapter(tmp_path, made, kind):
    """The shipped LoRA recipe's lora.* (its target patterns over LeRobot's module names) on the small policy: only
    adapter weights train and are saved, in PEFT's layout, covering the language model, the action expert and the
    policy's projections; PeftModel.from_pretrained over LeRobot's policy gives the loss `dump --lora` gives."""
    import yaml
    from conftest import ROOT
    lora = yaml.safe_load((ROOT / "configs" / kind / f"lora-{kind}-libero.yaml").read_text())["lora"]
    pol = made / kind
    extra = "lora:\n  enabled: true\n  r: 4\n  alpha: 8.0\n  target_modules:\n" + "".join(
        f"    - {json.dumps(t)}\n" for t in lora["target_modules"])
    rec = recipe(tmp_path, made, kind, steps=8)
    rec.write_text(rec.read_text().replace("optim:\n  lr: 0.001", "optim:\n  lr: 0.01") + extra)
    run_lf("train", rec)
    ckpts = tmp_path / "run" / "checkpoints"
    ckpt = ckpts / (ckpts / "latest").read_text().strip()
    assert (ckpt / "adapter_config.json").exists() and not (ckpt / "model.safetensors").exists()
    names = list(load_file(ckpt / "adapter_model.safetensors"))
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    for part in ["paligemma.model.language_model.layers.0.self_attn.q_proj", "gemma_expert.model.layers.1.mlp.down_proj",
                 "model.action_out_proj"]:
        assert any(part in n for n in names), part
    assert not any("vision_tower" in n for n in names)
    # our batch's loss with the adapter: ours (`dump --lora`) = LeRobot's policy with PEFT's adapter
    out = tmp_path / "hook"
    out.mkdir()
    run_gtest_hook("RobotSource.BatchHook", {"LF_TEST_ROBOT_RECIPE": str(recipe(tmp_path, made, kind)),
                                             "LF_TEST_ROBOT_OUT": str(out)})
    save_dump_batch(load_file(out / "batch.safetensors"), tmp_path / "ours.safetensors")
    run_lf("dump", "--model", pol, "--lora", ckpt, "--batch", tmp_path / "ours.safetensors", "--out", tmp_path / "d.safetensors")
    run_lf("dump", "--model", pol, "--batch", tmp_path / "ours.safetensors", "--out", tmp_path / "base.safetensors")
    lerobot(PEFT_LOSS, kind, made, pol, ckpt, tmp_path / "ours.safetensors", tmp_path / "ref.safetensors")
    got, ref = load_file(tmp_path / "d.safetensors")["loss"][0], load_file(tmp_path / "ref.safetensors")["loss"][0]
    base = load_file(tmp_path / "base.safetensors")["loss"][0]
    assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), (got, ref)
    assert abs(got - base) > 1e-4, (got, base)  # the adapter did train


def test_language_policy_needs_a_tokenizer(tmp_path, made):
    """Without data.robot.tokenizer and none in the policy's folder: one line naming the key; with one there, it is
    the default."""
    pol = made / "pi0"
    rec = recipe(tmp_path, made, "pi0").read_text().replace(f"    tokenizer: {made / 'tokenizer'}\n", "")
    (tmp_path / "no_tok.yaml").write_text(rec)
    proc = run_lf("train", tmp_path / "no_tok.yaml", check=False)
    assert proc.returncode != 0 and "data.robot.tokenizer" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # the tokenizer in the policy's folder is the default
    folder = tmp_path / "with_tok"
    shutil.copytree(pol, folder)
    for f in (made / "tokenizer").iterdir():
        shutil.copy(f, folder)
    (tmp_path / "in_folder.yaml").write_text(rec.replace(str(pol), str(folder)).replace("steps: 40", "steps: 1"))
    run_lf("train", tmp_path / "in_folder.yaml")

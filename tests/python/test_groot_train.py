"""GR00T N1.7 trained by `loongforge train` from a LeRobot dataset (data.format: robot), against LeRobot's own GR00T
processor (processor_groot.py's make_groot_pre_post_processors, the default path: no raw N1.7 checkpoint sidecars,
absolute actions) and GrootPolicy, built small and offline as test_groot_parity.py builds them, on test_policy_train.py's
dataset (one 24 x 32 camera, 4-dim state and action) with a small Qwen3-VL processor folder made here (the byte-level
fixture tokenizer with Qwen's special tokens, a Qwen-VL ChatML template, Qwen2VLImageProcessor with 16-pixel patches
merged 2 x 2): LeRobot's processors load it in place of nvidia/Cosmos-Reason2-2B (GROOT_N1_7_BACKBONE_MODEL patched),
LoongForge through data.robot.tokenizer.
  - a batch of the robot source = LeRobot's preprocessor output for the same frames: state / action min-max
    normalised (clipped) and zero-padded to max_state_dim / max_action_dim, action_mask, embodiment_id
    (new_embodiment: 10), the camera squashed to 256 x 256, centre-cropped to 230 and resized back (torchvision's
    antialiased bicubic), the chat prompt (the image, then the formalised task) tokenised with the image's 64 tokens,
    pixel_values and image_grid_thw of the Qwen image processor; its loss (`dump`) = GrootPolicy.forward's on
    LeRobot's batch with the same noise and time; the processor files written beside it load in LeRobot
    (make_pre_post_processors(pretrained_path=...)) and make the same batch;
  - prompts of different lengths (a dataset with three tasks) are padded on the left to the batch's longest, as
    LeRobot's processor pads them: the batch and its loss = LeRobot's (test_groot_padded_prompts_match_lerobot);
  - training lowers the loss (on a fixed batch: see the test), open-loop evaluation on a held-out episode (during
    training and `eval --open-loop`) = LeRobot's numbers for the checkpoint (its processors, predict_action_chunk
    with the sampler drawing from the recipe's seed), and the checkpoint folder (weights, config, GR00T's
    processor files, the processor folder's files) loads in LeRobot (GrootPolicy.from_pretrained,
    make_pre_post_processors(pretrained_path=...)), whose chunk for a processed raw observation = LoongForge's on
    the same processed batch with the same sampler start; `loongforge predict` on a raw observation and its task (the
    policy runner: GR00T's processor side through the contract) = LeRobot's preprocessor -> predict_action_chunk ->
    postprocessor with the sampler seeded alike.
  - a raw N1.7 checkpoint (base_model_path) starts from its weights; its processor_config.json's image geometry,
    letterbox, albumentations path (OpenCV's INTER_AREA, training rows' crop windows drawn per row), language
    formalising, outlier clipping and state dropout (a draw per training row), statistics for the embodiment
    (statistics.json, percentiles), modality config (group order, valid action steps, camera order) and
    embodiment_id.json make LeRobot's batch, LeRobot's steps in training mode given the same draws
    (test_groot_checkpoint_*).

NOTES (what is left):
  - open-loop evaluation compares with the batch's packed actions unpacked (= the recorded ones within the
    statistics' range: the dataset's statistics cover every episode; a given stats.json narrower than a held-out
    episode would clip them).
  - formalize_language keeps ASCII letters and digits only (Python's str.isalnum / lower are Unicode-aware).
  - a data-parallel share pads its prompts to its own longest row, as each LeRobot process pads its own batch; as
    the pads' features enter vl_self_attention unmasked (LeRobot's model), a multi-task batch's loss depends on
    how it is split over processes (a single-task dataset's does not).
  - the rest of a raw N1.7 checkpoint's sidecars (relative action groups, max_action_horizon, video horizons above
    one frame) is not followed (named on stderr). clip_outliers false is followed but the test's statistics (the
    dataset's own) leave nothing to clip.
"""
import json
import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES, LF_BIN, ROOT, launch_ranks, run_gtest_hook, run_lerobot, run_lf
from test_groot_parity import GROOT, SHIMS, TEXT
from test_policy_train import DATASET, PROCESSED
from test_policy_train import recipe as policy_recipe

sys.path.insert(0, str(ROOT / "scripts"))
from qwen_tokenizer import SPECIAL, TEMPLATE  # noqa: E402  Qwen's special tokens (first) and a Qwen-VL ChatML template

VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, in_channels=3, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 1])
SMALL = dict(GROOT, max_state_dim=6, max_action_dim=5, action_horizon=4, max_num_embodiments=12)

# In the lerobot environment, with MADE = argv[1]: LeRobot's GR00T small and offline (test_groot_parity.py's
# patches), the processor folder MADE/processor in place of nvidia/Cosmos-Reason2-2B, and GR00TN17 built from
# base_model_path's config without weights (LeRobot downloads them).
SETUP = SHIMS + r'''
import lerobot.policies.groot.processor_groot as PG
MADE = Path(sys.argv[1])
PG.GROOT_N1_7_BACKBONE_MODEL = str(MADE / "processor")
def create(self):
    model = G.GR00TN17(G.GR00TN17Config.from_pretrained(self.config.base_model_path), load_backbone_weights=False).float()
    model.backbone.set_trainable_parameters(tune_llm=self.config.tune_llm, tune_visual=self.config.tune_visual,
                                            tune_top_llm_layers=self.config.tune_top_llm_layers)
    model.action_head.set_trainable_parameters(self.config.tune_projector, self.config.tune_diffusion_model,
                                               self.config.tune_vlln)
    return model
GrootPolicy._create_groot_model = create
class Draw:  # torch.randn -> a given tensor (GR00T's noise draws)
    def __init__(self, t): self.t = t
    def __enter__(self):
        self.randn = torch.randn
        torch.randn = lambda *a, **k: self.t.clone()
    def __exit__(self, *e): torch.randn = self.randn
'''

# The processor folder, the Qwen3-VL config, GR00T's model config and a small policy (argv[2]: the specs).
MAKE = SETUP + r'''
import transformers
from tokenizers import Tokenizer
from lerobot.policies.groot.configuration_groot import GrootConfig
from lerobot.configs.types import FeatureType, PolicyFeature
spec = json.loads(sys.argv[2])
proc = MADE / "processor"; proc.mkdir(parents=True, exist_ok=True)
tok = Tokenizer.from_file(spec["fixture"])
tok.add_special_tokens(spec["special"])
tok.save(str(proc / "tokenizer.json"))
(proc / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                        "chat_template": spec["template"]}))
(proc / "preprocessor_config.json").write_text(json.dumps({
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"longest_edge": 16777216, "shortest_edge": 65536}}))
ids = {t: tok.token_to_id(t) for t in spec["special"]}
tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
text = dict(spec["text"], vocab_size=tok.get_vocab_size() + 1)
transformers.Qwen3VLConfig(vision_config=spec["vision"], text_config=text, tie_word_embeddings=True,
                           **tokens).save_pretrained(MADE / "backbone")
G.GR00TN17Config(model_name=str(MADE / "backbone"), **spec["groot"]).save_pretrained(MADE / "base")
torch.manual_seed(0)
cfg = GrootConfig(input_features={"observation.state": PolicyFeature(FeatureType.STATE, (4,)),
                                  "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 24, 32))},
                  output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))}, device="cpu",
                  base_model_path=str(MADE / "base"), use_bf16=False, chunk_size=4, n_action_steps=4,
                  max_state_dim=spec["groot"]["max_state_dim"], max_action_dim=spec["groot"]["max_action_dim"])
policy = GrootPolicy(cfg)
with torch.no_grad():  # LeRobot starts biases at 0 and LayerNorms at 1: perturb so that gradients say something;
    # its per-embodiment linears start at std 0.02, through which a model this small hardly learns in tens of steps:
    # std 1 / sqrt(fan_in) here
    for n, p in policy.named_parameters():
        if p.dim() == 1 or n.endswith(".b"): p.add_(torch.randn_like(p) * 0.1)
        if n.endswith(".W"): p.copy_(torch.randn_like(p) / p.shape[-2] ** 0.5)
policy.save_pretrained(MADE / "policy")
'''

# LeRobot's preprocessed batch of the frames the source read (argv[3]'s "index") on the dataset argv[2], its loss
# with our noise and time, and the processors LoongForge wrote (argv[4]) on the same raw batch; into argv[5].
LEROBOT_BATCH = SETUP + PROCESSED + r'''
from safetensors.torch import load_file, save_file
root, ours, files, out = sys.argv[2:6]
policy = GrootPolicy.from_pretrained(MADE / "policy")
ours = load_file(ours)
keys = ["state", "action", "action_mask", "embodiment_id", "input_ids", "attention_mask", "pixel_values", "image_grid_thw"]
if "vlm_crop_position" in ours or "state_dropout" in ours:
    # our training rows' draws: LeRobot's pack / encode steps in training mode (as lerobot-train builds them) drawing
    # from Python's random, in their order (the pack step's state dropout, a value per row below the probability to
    # drop; then the encode step's crop window, (y, x) per row), replayed for each pipeline built
    import itertools, random
    import lerobot.policies.groot.processor_groot as pg
    def training(step_class):
        call = step_class.__call__
        def train_call(self, transition):
            self.training = True
            return call(self, transition)
        step_class.__call__ = train_call
    seq = []
    if "state_dropout" in ours:
        training(pg.GrootN17PackInputsStep)
        seq += [0.0 if d else 1.0 for d in ours["state_dropout"].tolist()]
    if "vlm_crop_position" in ours:
        training(pg.GrootN17VLMEncodeStep)
        seq += ours["vlm_crop_position"].reshape(-1).tolist()
    draws = itertools.cycle(seq)
    random.random = lambda: next(draws)
ref, res = processed(action_dataset(root, policy.config), policy.config, ours["index"], files, keys)
if "noise" in ours:
    policy.train()
    policy._groot_model.action_head.sample_time = lambda n, device, dtype: ours["time"].clone()
    with Draw(ours["noise"]):
        loss, _ = policy.forward({k: ref[k] for k in keys})
    res["loss"] = loss.detach().reshape(1)
save_file({k: v.contiguous() for k, v in res.items()}, out)
'''

# The trained checkpoint (argv[2]) as LeRobot loads it: the policy and its processors from the folder; a raw
# observation through the preprocessor, the chunk from the batch's sampler start (argv[3]), the postprocessor; and
# the processed observation for LoongForge (into argv[4]).
LOAD_CHECKPOINT = SETUP + r'''
from safetensors.torch import load_file, save_file
from lerobot.policies.factory import make_pre_post_processors
ckpt, start, out = sys.argv[2:5]
p = GrootPolicy.from_pretrained(ckpt)
p.eval()
pre, post = make_pre_post_processors(p.config, pretrained_path=ckpt)
g = torch.Generator().manual_seed(3)
obs = {"observation.state": torch.randn(2, 4, generator=g), "observation.images.top": torch.rand(2, 3, 24, 32, generator=g),
       "task": ["follow", "follow"]}
b = pre(obs)
keys = ["state", "embodiment_id", "input_ids", "attention_mask", "pixel_values", "image_grid_thw"]
noise = load_file(start)["sample_noise"]
with torch.no_grad(), Draw(noise):
    chunk = p.predict_action_chunk({k: b[k] for k in keys})
a = post(chunk)
assert a.shape == (2, 4, 4) and torch.isfinite(a).all()
res = {k: b[k].contiguous() for k in keys}
res["embodiment_id"] = res["embodiment_id"].long()
res.update(action=torch.zeros(2, 4, 5), action_mask=torch.ones(2, 4, 5), noise=noise, time=torch.full((2,), 0.5),
           sample_noise=noise.clone(), chunk=chunk.contiguous(), unpacked=a.contiguous())
save_file(res, out)
'''

# The checkpoint (argv[2]) at deployment, as LeRobot runs it: one raw observation (argv[3]: state [4], the camera as
# uint8 [H, W, C]) and its task (argv[4]) through the preprocessor, predict_action_chunk with the sampler drawing from
# torch's generator seeded with argv[5] (as `loongforge predict --seed` seeds its own), the postprocessor; the chunk to
# argv[6].
RUNNER = SETUP + r'''
from safetensors.torch import load_file, save_file
from lerobot.policies.factory import make_pre_post_processors
ckpt, raw, task, seed, out = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
p = GrootPolicy.from_pretrained(ckpt)
p.eval()
pre, post = make_pre_post_processors(p.config, pretrained_path=ckpt)
o = load_file(raw)
obs = {"observation.state": o["observation.state"][None].float(),
       "observation.images.top": o["observation.images.top"].permute(2, 0, 1)[None].float() / 255, "task": [task]}
b = pre(obs)
keys = ["state", "embodiment_id", "input_ids", "attention_mask", "pixel_values", "image_grid_thw"]
torch.manual_seed(seed)
with torch.no_grad():
    chunk = post(p.predict_action_chunk({k: b[k] for k in keys}))
save_file({"action": chunk[0].contiguous()}, out)
'''

# LeRobot's own open-loop numbers for the checkpoint (argv[2]) on the held-out episode (argv[4]) of the dataset
# (argv[3]): one batch of the frames every n_action_steps through its preprocessor, predict_action_chunk with the
# sampler drawing from torch's generator seeded with argv[5] (as LoongForge's evaluation seeds its own), the
# postprocessor, against the recorded actions inside the episode.
OPEN_LOOP = SETUP + r'''
from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.policies.factory import make_pre_post_processors
ckpt, root, ep, seed = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
p = GrootPolicy.from_pretrained(ckpt)
p.eval()
ds = LeRobotDataset("test/robot", root=root)
pre, post = make_pre_post_processors(p.config, pretrained_path=ckpt)
lo, hi = int(ds.meta.episodes["dataset_from_index"][ep]), int(ds.meta.episodes["dataset_to_index"][ep])
actions = torch.stack([ds[i]["action"] for i in range(lo, hi)])
frames = list(range(0, hi - lo, p.config.n_action_steps))
items = [ds[lo + f] for f in frames]
obs = {k: torch.stack([it[k] for it in items]) for k in ("observation.state", "observation.images.top")}
obs["task"] = [it["task"] for it in items]
torch.manual_seed(seed)
with torch.no_grad():
    chunk = post(p.predict_action_chunk(pre(obs)))
sq, n = 0.0, 0
for i, f in enumerate(frames):
    k = min(chunk.shape[1], hi - lo - f)
    sq += ((chunk[i, :k] - actions[f:f + k]) ** 2).sum().item(); n += k * chunk.shape[2]
print(json.dumps({"mse": sq / n}))
'''

SPEC = dict(fixture=str(FIXTURES / "tok_bytelevel_gpt2" / "tokenizer.json"), special=SPECIAL, template=TEMPLATE,
            vision=VISION, text=TEXT, groot=SMALL)
TASKS = ["follow the ring", "Pick up the cube, then stop!", "put_the block"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The datasets (one task; three tasks of different lengths), the processor folder and the policy, made by one
    lerobot process."""
    d = tmp_path_factory.mktemp("groot")
    runs = [(DATASET, [d / "dataset"]), (DATASET, [d / "tasks", json.dumps(TASKS)]), (MAKE, [d, json.dumps(SPEC)])]
    script = "import sys\n" + "".join(f"sys.argv = {['-c', *map(str, args)]!r}\nexec({code!r}, {{}})\n"
                                       for code, args in runs)
    run_lerobot(script)
    return d


def recipe(tmp_path, made, dataset="dataset", steps=40, extra=""):
    return policy_recipe(tmp_path, made / dataset, made / "policy", f"    tokenizer: {made / 'processor'}\n{extra}", steps)


def compare_batches(ours, ref, files=True):
    for k in ["state", "action", "action_mask", "pixel_values"]:
        assert ours[k].shape == ref[k].shape, (k, ours[k].shape, ref[k].shape)
        assert np.abs(ours[k] - ref[k]).max() <= 1e-6, (k, np.abs(ours[k] - ref[k]).max())
    for k in ["embodiment_id", "input_ids", "attention_mask", "image_grid_thw"]:
        assert ours[k].shape == ref[k].shape and (ours[k] == ref[k].astype(np.int64)).all(), (k, ours[k], ref[k])
    if files:  # our processor files make LeRobot's batch
        for k in ["state", "action", "action_mask", "embodiment_id", "input_ids", "attention_mask", "pixel_values",
                  "image_grid_thw"]:
            assert np.abs(ref["files." + k].astype(np.float64) - ref[k].astype(np.float64)).max() == 0, k


def dump_batch(batch, path):
    """The source's batch as `dump` takes it: without the frames' index and the item fields' row indices, with the
    sampler's start."""
    b = {k: v for k, v in batch.items() if k not in ("index", "vlm_crop_position", "state_dropout") and not k.endswith(".row")}
    b["sample_noise"] = np.random.default_rng(0).standard_normal(b["noise"].shape).astype(np.float32)
    save_file(b, str(path))


def check_batch_and_loss(tmp_path, made, dataset, env=None):
    out = tmp_path / "hook"
    out.mkdir()
    run_gtest_hook("RobotSource.BatchHook", {"LF_TEST_ROBOT_RECIPE": str(recipe(tmp_path, made, dataset)),
                                             "LF_TEST_ROBOT_OUT": str(out), **(env or {})})
    run_lerobot(LEROBOT_BATCH, made, made / dataset, out / "batch.safetensors", out / "model_files",
                tmp_path / "ref.safetensors")
    ours, ref = load_file(out / "batch.safetensors"), load_file(tmp_path / "ref.safetensors")
    compare_batches(ours, ref)
    # the loss of our batch (dump: the model as LeRobot's forward) = LeRobot's on its batch with our noise and time
    dump_batch(ours, tmp_path / "ours.safetensors")
    run_lf("dump", "--model", made / "policy", "--batch", tmp_path / "ours.safetensors", "--out", tmp_path / "dump.safetensors")
    got = load_file(tmp_path / "dump.safetensors")
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * max(1.0, abs(ref["loss"][0])), (got["loss"], ref["loss"])
    return ours


def test_groot_batch_and_loss_match_lerobot(tmp_path, made):
    ours = check_batch_and_loss(tmp_path, made, "dataset")
    assert ours["input_ids"].shape[0] == 6 and (ours["image_grid_thw"] == [1, 16, 16]).all()
    assert (ours["embodiment_id"] == 10).all() and ours["attention_mask"].all()



def raw_checkpoint(tmp_path, made, dataset):
    """A copy of the made policy whose base_model_path is a copy of its base folder (a raw N1.7 checkpoint the test
    gives sidecars), beside the made DATASET, processor and backbone folders."""
    m = tmp_path / "made"
    m.mkdir()
    for d in (dataset, "processor", "backbone"):
        (m / d).symlink_to(made / d)
    shutil.copytree(made / "base", m / "base")
    shutil.copytree(made / "policy", m / "policy")
    cfg = json.loads((m / "policy" / "config.json").read_text())
    cfg["base_model_path"] = str(m / "base")
    (m / "policy" / "config.json").write_text(json.dumps(cfg))
    return m


def test_groot_checkpoint_image_geometry_matches_lerobot(tmp_path, made):
    """A raw N1.7 checkpoint's processor_config.json (base_model_path) sets the image geometry of GR00T's processor in
    LeRobot (image_target_size, shortest_image_edge, crop_fraction, letter_box_transform): the same batch here (each
    24 x 32 camera zero-padded to a square, resized to a 240 x 240 square, 0.9 of it centre-cropped, resized to
    256 x 288: 8 x 9 merged patches), the processor files
    written carry it (LeRobot's pipelines from them make the same batch), the loss = LeRobot's. Sidecar settings
    LoongForge does not follow are named on stderr."""
    m = raw_checkpoint(tmp_path, made, "dataset")
    kwargs = {"image_target_size": [256, 288], "image_crop_size": [230, 230], "shortest_image_edge": 240,
              "crop_fraction": 0.9, "use_albumentations": False, "letter_box_transform": True}
    (m / "base" / "processor_config.json").write_text(json.dumps({"processor_class": "Gr00tN1d7Processor",
                                                                  "processor_kwargs": kwargs}))
    (m / "base" / "statistics.json").write_text("{}")
    ours = check_batch_and_loss(tmp_path, m, "dataset")
    assert (ours["image_grid_thw"] == [1, 16, 18]).all()
    pre = json.loads((tmp_path / "hook" / "model_files" / "policy_preprocessor.json").read_text())
    step = [st for st in pre["steps"] if st["registry_name"] == "groot_n1_7_vlm_encode_v1"][0]["config"]
    assert step["image_target_size"] == [256, 288] and step["shortest_image_edge"] == 240 and step["crop_fraction"] == 0.9
    assert step["letter_box_transform"] is True and step["use_albumentations"] is False and "vlm_crop_position" not in ours
    # settings not followed: said on stderr, the batch made without them
    kwargs.update(use_relative_action=True)
    (m / "base" / "processor_config.json").write_text(json.dumps({"processor_kwargs": kwargs}))
    proc = run_lf("info", m / "policy" / "config.json")
    assert "use_relative_action true" in proc.stderr, proc.stderr


def test_groot_checkpoint_albumentations_images_match_lerobot(tmp_path, made):
    """A raw N1.7 checkpoint whose processor_config.json asks for use_albumentations and letter_box_transform: each
    camera (24 x 32) zero-padded to a square, its shortest edge resized to 200 with OpenCV's INTER_AREA, 0.9 of each
    side cropped at the training row's drawn position (one for all its cameras), resized to 200 again: the batch =
    LeRobot's encode step in training mode with the same windows (OpenCV's resize bit for bit), the processor files
    written carry the switches, the loss = LeRobot's."""
    m = raw_checkpoint(tmp_path, made, "dataset")
    kwargs = {"image_target_size": [256, 256], "image_crop_size": None, "shortest_image_edge": 200,
              "crop_fraction": 0.9, "use_albumentations": True, "letter_box_transform": True}
    (m / "base" / "processor_config.json").write_text(json.dumps({"processor_class": "Gr00tN1d7Processor",
                                                                  "processor_kwargs": kwargs}))
    ours = check_batch_and_loss(tmp_path, m, "dataset")
    pos = ours["vlm_crop_position"]
    assert pos.shape == (ours["input_ids"].shape[0], 2) and len(np.unique(pos)) == pos.size  # a window per row
    pre = json.loads((tmp_path / "hook" / "model_files" / "policy_preprocessor.json").read_text())
    step = [st for st in pre["steps"] if st["registry_name"] == "groot_n1_7_vlm_encode_v1"][0]["config"]
    assert step["use_albumentations"] is True and step["letter_box_transform"] is True

def test_groot_checkpoint_processor_switches_match_lerobot(tmp_path, made):
    """A raw N1.7 checkpoint's processor switches formalize_language false (tasks with capitals and punctuation kept
    as written), clip_outliers false and state_dropout_prob 0.5 (training rows' states zeroed by a draw per row): the
    batch (three tasks) = LeRobot's pack step in training mode with the same draws, the processor files carry the
    switches, the loss = LeRobot's."""
    m = raw_checkpoint(tmp_path, made, "tasks")
    kwargs = {"formalize_language": False, "clip_outliers": False, "state_dropout_prob": 0.5}
    (m / "base" / "processor_config.json").write_text(json.dumps({"processor_kwargs": kwargs}))
    ours = check_batch_and_loss(tmp_path, m, "tasks", {"LF_TEST_ROBOT_SHARES": "0"})
    drop = ours["state_dropout"]
    assert drop.any() and not drop.all()
    assert (ours["state"][drop] == 0).all() and (ours["state"][~drop] != 0).any()
    pre = json.loads((tmp_path / "hook" / "model_files" / "policy_preprocessor.json").read_text())
    step = [st for st in pre["steps"] if st["registry_name"] == "groot_n1_7_pack_inputs_v1"][0]["config"]
    assert step["formalize_language"] is False and step["clip_outliers"] is False and step["state_dropout_prob"] == 0.5


def test_groot_checkpoint_statistics_match_lerobot(tmp_path, made):
    """A raw N1.7 checkpoint with statistics for the policy's embodiment (statistics.json: state and action each as
    two modality groups, q01 / q99 taken as min / max under use_percentiles, narrower than the data so some values
    clip), its modality config (the groups' order, 3 valid action steps of 4, the camera order) and its own
    embodiment_id.json: the batch = LeRobot's (its processor takes all of these from the checkpoint), the processor
    files written carry the checkpoint's statistics, the loss = LeRobot's."""
    m = raw_checkpoint(tmp_path, made, "dataset")
    ds = json.loads((made / "dataset" / "meta" / "stats.json").read_text())

    def groups(feature):  # [arm (3 dims), grip (1)]: min / max / q01 / q99 / mean / std per group
        st = {k: np.asarray(ds[feature][k], dtype=np.float64) for k in ("min", "max", "mean", "std")}
        mid, half = (st["max"] + st["min"]) / 2, (st["max"] - st["min"]) / 2
        full = dict(st, q01=mid - 0.6 * half, q99=mid + 0.7 * half)
        return {name: {k: v[sl].tolist() for k, v in full.items()} for name, sl in (("arm", slice(0, 3)), ("grip", slice(3, 4)))}

    stats = {"new_embodiment": {"state": groups("observation.state"), "action": groups("action")}}
    (m / "base" / "statistics.json").write_text(json.dumps(stats))
    (m / "base" / "embodiment_id.json").write_text(json.dumps({"new_embodiment": 5, "libero_sim": 2}))
    mc = {"state": {"modality_keys": ["arm", "grip"]}, "video": {"modality_keys": ["top"]},
          "action": {"modality_keys": ["arm", "grip"], "delta_indices": [0, 1, 2]}}
    (m / "base" / "processor_config.json").write_text(json.dumps({"processor_kwargs": {
        "use_percentiles": True, "modality_configs": {"new_embodiment": mc}}}))
    ours = check_batch_and_loss(tmp_path, m, "dataset")
    assert (ours["embodiment_id"] == 5).all()
    assert (ours["action_mask"][:, 3:] == 0).all() and (ours["action_mask"][:, :3, :4] == 1).all()
    assert (np.abs(ours["state"]) == 1).any()  # clipped to the checkpoint's narrower range
    state = load_file(str(next((tmp_path / "hook" / "model_files").glob("policy_preprocessor_step_*groot_n1_7_pack*"))))
    ref_min = np.array(stats["new_embodiment"]["state"]["arm"]["q01"] + stats["new_embodiment"]["state"]["grip"]["q01"])
    assert np.allclose(state["observation.state.min"], ref_min, atol=1e-6)


@pytest.mark.slow
def test_groot_padded_prompts_match_lerobot(tmp_path, made):
    """Tasks of different lengths: the prompts padded on the left to the batch's longest, as LeRobot's processor pads
    them (one process's batch: the hook's share check is off, a share pads to its own longest row), and the loss of
    the padded batch = LeRobot's (pad tokens: no attention, their features mixed in by vl_self_attention)."""
    ours = check_batch_and_loss(tmp_path, made, "tasks", {"LF_TEST_ROBOT_SHARES": "0"})
    assert not ours["attention_mask"].all() and ours["attention_mask"][:, -1].all()  # left padding


@pytest.mark.slow
def test_groot_trains_and_its_checkpoint_loads_in_lerobot(tmp_path, made):
    """Training lowers the loss: the flow-matching loss of a step is dominated by its noise and time draws (a small
    GR00T's per-step loss hardly moves in tens of steps, LeRobot's own likewise), so the loss compared is `dump`'s on
    one fixed batch of 24 rows with its draws, before and after 40 steps."""
    rec = recipe(tmp_path, made, steps=40)
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    run_gtest_hook("RobotSource.BatchHook", {"LF_TEST_ROBOT_RECIPE": str(rec), "LF_TEST_ROBOT_OUT": str(fixed),
                                             "LF_TEST_ROBOT_ROWS": "24", "LF_TEST_ROBOT_SHARES": "0"})
    dump_batch(load_file(fixed / "batch.safetensors"), fixed / "dump_batch.safetensors")

    def loss(model):
        run_lf("dump", "--model", model, "--batch", fixed / "dump_batch.safetensors", "--out", fixed / "d.safetensors")
        return load_file(fixed / "d.safetensors")["loss"][0]

    run_lf("train", rec, "--set", "data.robot.valid_episodes=1", "--set", "eval.every=40", "--set", "optim.lr=0.003")
    m = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([x for x in m if "loss" in x]) == 40
    # open-loop evaluation on the held-out episode during training
    assert [x["step"] for x in m if "open_loop_mse" in x] == [40] and np.isfinite(m[-1]["open_loop_mse"])
    ckpts = tmp_path / "run" / "checkpoints"
    ckpt = ckpts / (ckpts / "latest").read_text().strip()
    before, after = loss(made / "policy"), loss(ckpt)
    assert after < 0.8 * before, (before, after)
    assert (ckpt / "policy_preprocessor.json").exists() and (ckpt / "preprocessor_config.json").exists()
    # LeRobot loads the folder (policy, processors from their files); its chunk of a processed raw observation =
    # LoongForge's on the same processed batch with the same sampler start
    start = tmp_path / "start.safetensors"
    save_file({"sample_noise": np.random.default_rng(1).standard_normal((2, 4, 5)).astype(np.float32)}, str(start))
    run_lerobot(LOAD_CHECKPOINT, made, ckpt, start, tmp_path / "obs.safetensors")
    obs = load_file(tmp_path / "obs.safetensors")
    save_file({k: v for k, v in obs.items() if k not in ("chunk", "unpacked")}, str(tmp_path / "obs_batch.safetensors"))
    run_lf("dump", "--model", ckpt, "--batch", tmp_path / "obs_batch.safetensors", "--out", tmp_path / "d.safetensors")
    got = load_file(tmp_path / "d.safetensors")
    assert np.abs(got["action_chunk"] - obs["chunk"]).max() <= 1e-5, np.abs(got["action_chunk"] - obs["chunk"]).max()
    # at deployment (train/policy_runner.h through `loongforge predict`): a raw observation and its task give LeRobot's
    # chunk (its processors and sampler seeded alike)
    rng = np.random.default_rng(4)
    save_file({"observation.state": rng.standard_normal(4).astype(np.float32),
               "observation.images.top": rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)}, str(tmp_path / "raw.safetensors"))
    run_lerobot(RUNNER, made, ckpt, tmp_path / "raw.safetensors", "follow", 5, tmp_path / "ref.safetensors")
    want = load_file(tmp_path / "ref.safetensors")["action"]
    run_lf("predict", "--policy", ckpt, "--observation", tmp_path / "raw.safetensors", "--prompt", "follow", "--seed",
           "5", "--out", tmp_path / "ours.safetensors")
    mine = load_file(tmp_path / "ours.safetensors")["action"]
    assert mine.shape == want.shape == (4, 4), (mine.shape, want.shape)
    assert np.abs(mine - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), np.abs(mine - want).max()
    # `eval --open-loop` on the held-out episode: 18 frames, a chunk every 4 (n_action_steps)
    proc = run_lf("eval", rec, "--model", ckpt, "--set", "data.robot.valid_episodes=1", "--open-loop", tmp_path / "ol")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["episodes"] == 1 and report["chunks"] == 5 and len(report["mse_per_dim"]) == 4
    assert abs(report["mse"] - m[-1]["open_loop_mse"]) <= 1e-6 * max(report["mse"], 1e-3)
    ref = json.loads(run_lerobot(OPEN_LOOP, made, ckpt, made / "dataset", 1, 7).strip().splitlines()[-1])
    assert abs(report["mse"] - ref["mse"]) <= 1e-5 * max(ref["mse"], 1e-3), (report["mse"], ref["mse"])


# A GR00T N1.7 checkpoint as GR00TN17.save_pretrained writes one (argv[2]/base: config.json + its weights in bf16,
# sharded with model.safetensors.index.json, as nvidia/GR00T-N1.7-3B is stored) from the small model config of
# MADE/base with every weight perturbed, a policy config.json alone naming it (argv[2]/policy_config), and the policy
# LeRobot builds from that config (GrootPolicy(config): GR00TN17.from_pretrained(base_model_path), the tune_* flags,
# its parameters cast to fp32): its state_dict into argv[2]/ref.safetensors.
BASE_CHECKPOINT = SHIMS + r"""
from safetensors.torch import save_file
from lerobot.policies.groot.configuration_groot import GrootConfig
from lerobot.configs.types import FeatureType, PolicyFeature
MADE, out = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(11)
model = G.GR00TN17(G.GR00TN17Config.from_pretrained(MADE / "base"), load_backbone_weights=False).float()
with torch.no_grad():
    for p in model.parameters(): p.add_(torch.randn_like(p) * 0.1)
model.to(torch.bfloat16).save_pretrained(out / "base", max_shard_size="300KB")
assert (out / "base" / "model.safetensors.index.json").exists()
old = json.loads((MADE / "policy" / "config.json").read_text())
cfg = GrootConfig(input_features={"observation.state": PolicyFeature(FeatureType.STATE, (4,)),
                                  "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 24, 32))},
                  output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))}, device="cpu",
                  base_model_path=str(out / "base"), use_bf16=False, chunk_size=4, n_action_steps=4,
                  max_state_dim=old["max_state_dim"], max_action_dim=old["max_action_dim"], tune_visual=True)
(out / "policy_config").mkdir()
cfg._save_pretrained(out / "policy_config")
policy = GrootPolicy(cfg)
save_file({k: v.detach().float().clone().contiguous() for k, v in policy.state_dict().items()}, out / "ref.safetensors")
print(json.dumps(sorted(n for n, p in policy.named_parameters() if p.requires_grad)))
"""


def test_groot_starts_from_base_checkpoint_weights(tmp_path, made):
    """A policy config.json alone (no weights) whose base_model_path is a GR00T N1.7 checkpoint (bf16, sharded) starts
    from that checkpoint's weights, as LeRobot's GrootPolicy(config) does: after a step at learning rate 0, the
    checkpoint LoongForge saves holds every tensor of LeRobot's policy exactly (float32), and only the parameters
    LeRobot trains (tune_visual here; the language model frozen) are trained. A processor sidecar in the base folder
    asking for what LoongForge's processor does not follow (relative actions) is said once on stderr."""
    trainable = json.loads(run_lerobot(BASE_CHECKPOINT, made, tmp_path).strip().splitlines()[-1])
    rec = policy_recipe(tmp_path, made / "dataset", "unused", f"    tokenizer: {made / 'processor'}\n", 1)
    text = rec.read_text().replace("  path: unused", f"  config: {tmp_path / 'policy_config' / 'config.json'}")
    rec.write_text(text)
    # a raw checkpoint's processor sidecar asking for what LoongForge's processor does not follow: said once on stderr
    (tmp_path / "base" / "processor_config.json").write_text(
        '{"processor_class": "Gr00tN1d7Processor", "processor_kwargs": {"use_relative_action": true}}')
    proc = run_lf("train", rec, "--set", "optim.lr=0.0")
    assert "weights from" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("use_relative_action true") == 1, proc.stderr[-2000:]
    ckpts = tmp_path / "run" / "checkpoints"
    got = load_file(ckpts / (ckpts / "latest").read_text().strip() / "model.safetensors")
    ref = load_file(tmp_path / "ref.safetensors")
    embed = "_groot_model.backbone.model.model.language_model.embed_tokens.weight"
    ref.pop("_groot_model.backbone.model.lm_head.weight", None)  # the tied copy: one of the two is stored
    got.pop("_groot_model.backbone.model.lm_head.weight", None)
    assert embed in ref and embed in got
    assert sorted(got) == sorted(ref), sorted(set(got) ^ set(ref))
    for k in ref:
        assert np.array_equal(got[k], ref[k]), k
    assert any("visual" in n for n in trainable) and not any("language_model" in n for n in trainable)
    m = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert len(m) == 1 and np.isfinite(m[0]["loss"])


@pytest.mark.slow
def test_groot_recipe_mistakes_one_line(tmp_path, made):
    """Without data.robot.tokenizer (and no processor files in the policy folder), with a chunk_size the model's
    action_horizon does not take, or with a processor folder whose image processor gives no patches: one line naming
    the key or the config's field."""
    def one_line(rec, what):
        proc = run_lf("train", rec, check=False)
        assert proc.returncode != 0 and what in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    text = recipe(tmp_path, made, steps=1).read_text()
    (tmp_path / "no_proc.yaml").write_text(text.replace(f"    tokenizer: {made / 'processor'}\n", ""))
    one_line(tmp_path / "no_proc.yaml", "data.robot.tokenizer")
    pol = tmp_path / "policy"
    shutil.copytree(made / "policy", pol)
    cfg = json.loads((pol / "config.json").read_text())
    (pol / "config.json").write_text(json.dumps(dict(cfg, chunk_size=8, n_action_steps=8)))
    (tmp_path / "chunk.yaml").write_text(text.replace(str(made / "policy"), str(pol)))
    one_line(tmp_path / "chunk.yaml", "'chunk_size'")
    proc_dir = tmp_path / "clip"
    shutil.copytree(made / "processor", proc_dir)
    (proc_dir / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    (tmp_path / "clip.yaml").write_text(text.replace(str(made / "processor"), str(proc_dir)))
    one_line(tmp_path / "clip.yaml", "Qwen2VLImageProcessor")


def layout_run(out, made, n, sets):
    """4 steps of the one-task dataset in `n` processes with `sets`: (per-step metrics, final weights)."""
    from safetensors.torch import load_file as load_torch
    out.mkdir()
    rec = recipe(out, made, steps=4)
    args = [LF_BIN, "train", rec, "--set", "train.micro_batch_size=4", *sum((["--set", s] for s in sets), [])]
    if n == 1:
        run_lf(*args[1:], "--set", "parallel.zero=1")
    else:
        for r, p in enumerate(launch_ranks(n, args, timeout=600)):
            assert p.returncode == 0, f"rank {r}: {p.stderr[-3000:]}"
    m = [json.loads(l) for l in (out / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    ck = out / "run" / "checkpoints"
    ck = ck / (ck / "latest").read_text().strip()
    return m, {k: v for f in sorted(ck.glob("model*.safetensors")) for k, v in load_torch(str(f)).items()}


@pytest.mark.parametrize("layout", [pytest.param("dp2", marks=pytest.mark.slow), "fsdp2"])
def test_groot_layout_matches_one_process(tmp_path, made, layout):
    """GR00T on the FSDP-style engine: DDP (dp2) and FSDP (dp2, zero 3) over the small GR00T (its Qwen3-VL backbone
    frozen, tune_* as LeRobot's defaults) trained 4 steps on the one-task dataset give one process's per-step losses,
    gradient norms and final weights (fp32, CPU, <= 1e-5 relative). (A multi-task dataset's pads depend on the
    split: see NOTES.)"""
    from safetensors.torch import load_file as load_torch
    ref, ref_w = layout_run(tmp_path / "one", made, 1, [])
    sets = ["parallel.dp=2", "train.micro_batch_size=2"] + (["parallel.zero=3"] if layout == "fsdp2" else [])
    got, w = layout_run(tmp_path / layout, made, 2, sets)
    assert len(got) == len(ref) == 4
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (layout, a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (layout, a["step"])
    assert sorted(w) == sorted(ref_w)
    for k, v in ref_w.items():
        diff, scale = (w[k] - v).abs().max().item(), max(v.abs().max().item(), 1e-3)
        assert diff <= 1e-5 * scale + 1e-6, (layout, k, diff, scale)
    start = load_torch(str(made / "policy" / "model.safetensors"))
    moved = sum(not bool((ref_w[k] == start[k]).all()) for k in start if k in ref_w)
    frozen = [k for k in start if ".backbone." in k and k in ref_w]
    assert moved > 0 and frozen and all(bool((w[k] == start[k]).all()) for k in frozen)


@pytest.mark.slow
def test_groot_bf16_fsdp_follows_one_process_bf16(tmp_path, made):
    """`precision: bf16` over GR00T: bf16 compute over fp32 masters trains as fp32 does (losses within 1 %); as for
    ACT (test_policy_dist.py), DDP and FSDP (dp2, zero 3) at bf16 follow the one-process bf16 run, FSDP within 3x
    DDP's rounding (both run under autocast; FSDP's bf16 copies are only of linear layers' weights, so GR00T's
    per-embodiment biases `b` [E, out] keep fp32, and GR00T reads its compute dtype from a bias, not from a weight
    FSDP replaces by its bf16 copy: before either, FSDP's losses were 1e-4 to 4e-4 off). The checkpoint is fp32."""
    fp32, _ = layout_run(tmp_path / "fp32", made, 1, [])
    one, _ = layout_run(tmp_path / "one", made, 1, ["precision=bf16"])
    dp = ["precision=bf16", "parallel.dp=2", "train.micro_batch_size=2"]
    ddp, _ = layout_run(tmp_path / "ddp", made, 2, dp)
    fsdp, w = layout_run(tmp_path / "fsdp", made, 2, dp + ["parallel.zero=3"])

    def rel(a, b):
        return abs(a - b) / max(abs(a), abs(b), 1e-12)

    assert len(fp32) == len(one) == len(ddp) == len(fsdp) == 4
    assert any(rel(a["loss"], b["loss"]) > 1e-6 for a, b in zip(one, fp32))  # bf16 compute happened
    assert all(rel(a["loss"], b["loss"]) <= 0.01 for a, b in zip(one, fp32))
    worst_ddp = max(rel(a["loss"], b["loss"]) for a, b in zip(one, ddp))
    assert worst_ddp <= 3e-4
    for a, b in zip(one, fsdp):
        assert rel(a["loss"], b["loss"]) <= max(3 * worst_ddp, 1e-5), (a["step"], a["loss"], b["loss"], worst_ddp)
    assert all(v.dtype == torch.float32 for v in w.values() if v.is_floating_point())

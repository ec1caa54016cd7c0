"""DeepSeek-V3.2 (deepseek_v32) and GLM-5-style DSA (glm_moe_dsa): DeepSeek sparse attention (the lightning indexer
keeping the index_topk best keys of each query, DeepSeek-V3's latent attention over them) against transformers 5.24's
own classes, fp32 on the CPU, built from small configs: `loongforge dump` logits, loss, every gradient (the indexers
get none: their top-k selection is not differentiable, transformers runs them under no_grad) and one AdamW step
(torch.optim.AdamW leaves the indexers untouched, not even weight decay; so does ours); `convert` writes
save_pretrained's names and transformers loads them; greedy `generate` (the index keys cached with the latents) =
transformers' ids; a bad config is one line naming the field; `loongforge train` leaves the indexers as loaded.

index_topk is small (4-6) beside the 24-token batches, so most queries attend to a subset of what they see; each
test checks that the selection matters (dense attention gives other logits) and that it is well conditioned (the
float64 model selects the same keys, so no near-tie decides a key)."""
import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import LF_BIN, launch_ranks, run_lf
from test_model_parity import (ADAMW, check_bad_field_one_line, check_export, check_greedy_generate, compare,
                               hf_reference, make_batch, rel_err, run_dump)
from test_moe_parity import write_periodic_shard

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, kv_lora_rank=16,
              q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=6, index_head_dim=16, index_n_heads=16,
              bos_token_id=1, eos_token_id=2)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=0.8,
            mscale_all_dim=0.7, beta_fast=32.0, beta_slow=1.0)

CASES = {
    # one dense layer, one MoE layer; the indexer rotates halves of its first qk_rope_head_dim features
    "v32": dict(COMMON, model_type="deepseek_v32", rms_norm_eps=1e-6),
    # yarn (cos / sin scaled, softmax scale with mscale), attention biases, index_head_dim = qk_rope_head_dim
    "v32_yarn_bias": dict(COMMON, model_type="deepseek_v32", rope_parameters=YARN, attention_bias=True,
                          index_head_dim=8, index_topk=4, num_hidden_layers=3, first_k_dense_replace=0),
    # GLM-5: interleaved rope in the indexer, layers 1-2 reuse layer 0's selection, layer 3 selects again
    "glm_shared": dict(COMMON, model_type="glm_moe_dsa", num_hidden_layers=4, n_group=1, topk_group=1,
                       indexer_types=["full", "shared", "shared", "full"], rms_norm_eps=1e-5),
    # GLM-5's default schedule: every layer full (index_topk_freq 1)
    "glm_all_full": dict(COMMON, model_type="glm_moe_dsa", n_group=1, topk_group=1, index_topk=5),
}
SLOW = {"v32_yarn_bias", "glm_all_full"}


def make_model(cfg, seed=0):
    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):  # non-trivial norms (the indexer's LayerNorm too)
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("mlp.gate.weight"):  # spread router scores
                p.copy_(torch.randn_like(p) * 0.3)
            if ".indexer." in n and not n.endswith("norm.weight") and not n.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.2)  # scores spread wider than the 0.02 init gives
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def indexers(model):
    return [l.self_attn.indexer for l in model.model.layers if getattr(l.self_attn, "indexer", None) is not None]


def selections(model, ids):
    """The keys each full layer keeps: bool [B,S,T] per indexer (top-k among the visible keys)."""
    got = []
    hooks = [ix.register_forward_hook(lambda m, i, o: got.append(o)) for ix in indexers(model)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    t = ids.shape[1]
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    return [torch.zeros(ids.shape[0], t, t, dtype=torch.bool).scatter(-1, o.long(), True) & visible for o in got]


def check_well_posed(model, ids):
    """The selection matters (attending to every visible key changes the logits) and has a margin (the float64 model
    keeps the same keys)."""
    keep = selections(model, ids)
    assert any((~k & torch.ones_like(k).tril()).any() for k in keep)  # some visible keys are dropped
    wide = copy.deepcopy(model).double()
    wide.set_experts_implementation("eager")  # the grouped-GEMM path takes no float64
    assert all(torch.equal(a, b) for a, b in zip(keep, selections(wide, ids))), "a near-tie decides a key"
    for ix in indexers(wide):
        ix.index_topk = 10 ** 6
    with torch.no_grad():
        dense = wide(input_ids=ids).logits
        sparse = model(input_ids=ids).logits
    assert rel_err(sparse, dense.float()) > 1e-3


def dump_case(case, tmp_path, extra):
    """CASES[case] saved, a well-posed 24-token batch and `dump --adamw` with `extra` flags: (model, ids, labels,
    the parameters before, our outputs)."""
    model = make_model(CASES[case])
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    ids, labels = make_batch(model.config.vocab_size, t=24)
    check_well_posed(model, ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, ids, labels, before, run_dump(model_dir, ids, labels, tmp_path, ["--adamw", ADAMW, *extra])


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in sorted(CASES)])
def test_dump_parity(case, tmp_path):
    model, ids, labels, before, ours = dump_case(case, tmp_path, [])
    ref = hf_reference(model, ids, labels)
    compare(ours, ref)
    names = [n for n in before if ".indexer." in n]
    assert names and len(names) == 5 * len(indexers(model))  # wq_b, wk, k_norm.{weight,bias}, weights_proj
    for n in names:
        assert dict(model.named_parameters())[n].grad is None  # transformers: no gradient reaches the indexer
        assert not ours["grad." + n].any(), n
        assert torch.equal(ref["after_adamw." + n], before[n])  # torch.optim.AdamW skipped it
        assert torch.equal(ours["after_step." + n], before[n]), n  # and so did ours (no weight decay either)
    info = json.loads(run_lf("info", tmp_path / "model").stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", ["v32", "glm_shared"])
def test_export_loads_in_transformers(case, tmp_path):
    """convert writes save_pretrained's names (self_attn.indexer.wq_b / wk / k_norm / weights_proj, per-expert
    weights) bit for bit, and transformers loads the folder with equal outputs."""
    model = make_model(CASES[case])
    src = tmp_path / "src"
    model.save_pretrained(src)
    check_export(model, src, tmp_path / "out")


@pytest.mark.parametrize("case", ["v32", pytest.param("glm_shared", marks=pytest.mark.slow)])
def test_generate_greedy_matches_transformers(case, tmp_path):
    """Greedy ids with our cache (latents, rotated shared keys and index keys): the prompt alone is longer than
    index_topk, so every step selects. The checkpoint also carries a multi-token-prediction layer
    (model.layers.{num_hidden_layers}.*), which both skip on load."""
    model = make_model(dict(CASES[case], index_topk=4))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    st = load_file(str(model_dir / "model.safetensors"))
    st[f"model.layers.{model.config.num_hidden_layers}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(st, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    check_greedy_generate(model, model_dir, [1, 17, 42, 99, 5, 250, 31])


@pytest.mark.parametrize("case,field,value,needle", [
    ("v32", "q_lora_rank", None, "field 'q_lora_rank'"),
    ("v32", "index_head_dim", 4, "field 'index_head_dim'"),
    ("glm_shared", "indexer_types", ["shared", "full", "shared", "full"], "field 'indexer_types'"),
    ("glm_shared", "mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "field 'mlp_layer_types'"),
])
def test_bad_config_one_line(case, field, value, needle, tmp_path):
    src = tmp_path / "src"
    make_model(CASES[case]).save_pretrained(src)
    check_bad_field_one_line(src, field, value, needle)


def test_defaults_when_the_file_has_none(tmp_path):
    """A config.json holding only the required fields gets DeepseekV32Config's / GlmMoeDsaConfig's defaults: `info`
    counts the parameters of the model transformers builds from the same file (on the meta device: no memory)."""
    for model_type, extra in (("deepseek_v32", {}), ("glm_moe_dsa", dict(index_topk_freq=2))):
        cfg = dict(model_type=model_type, vocab_size=1024, hidden_size=256, intermediate_size=512,
                   num_hidden_layers=5, num_attention_heads=4, **extra)
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        config = transformers.AutoConfig.from_pretrained(d)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        info = json.loads(run_lf("info", d).stdout)
        assert info["parameters"] == sum(p.numel() for p in model.parameters()), model_type


def train_recipe(tmp_path, model_dir, seq, mb):
    """2 steps on tmp_path/train at a constant lr 1e-2 with weight decay 0.1; writes tmp_path/run."""
    r = tmp_path / "r.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {model_dir}}}
data: {{train: [{{path: {tmp_path / 'train'}}}], seq_len: {seq}, valid_fraction: 0.0}}
train: {{steps: 2, micro_batch_size: {mb}, threads: 2}}
optim: {{lr: 1.0e-2, weight_decay: 0.1}}
schedule: {{kind: constant, warmup_steps: 0}}
log: {{progress: lines, plot: false}}
""")
    return r


def check_first_loss_and_read_checkpoint(tmp_path, model, pattern, seq, mb, check_batch=None):
    """After train_recipe's run on write_periodic_shard(pattern): its first step's loss is transformers' loss of
    `model` on that batch (check_batch(model, ids) first when given); returns the latest checkpoint's tensors."""
    losses = [json.loads(l)["loss"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(l) and "step" in json.loads(l)]
    ids, tgt = first_batch(pattern, seq, mb)
    if check_batch:
        check_batch(model, ids)
    with torch.no_grad():
        lg = model(input_ids=ids).logits
    want = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.size(-1)), tgt.reshape(-1)).item()
    assert abs(losses[0] - want) <= 1e-5 * want
    return latest_checkpoint(tmp_path / "run")


def train_setup(tmp_path, repeats):
    """A v32 model (vocab 64) saved in tmp_path/model, a periodic token shard of `repeats` periods in tmp_path/train
    and train_recipe's recipe (seq 32, micro-batch 2). Returns (model, model_dir, pattern, recipe)."""
    model = make_model(dict(CASES["v32"], vocab_size=64))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(0, 64, (16,), generator=g).tolist()
    write_periodic_shard(tmp_path / "train", pattern, repeats)
    return model, model_dir, pattern, train_recipe(tmp_path, model_dir, 32, 2)


def first_batch(pattern, seq, mb):
    """The first training micro-batch of the periodic shard: input ids and targets [mb, seq]."""
    window = torch.tensor((pattern * 3)[: seq + 1])
    return window[:seq].unsqueeze(0).repeat(mb, 1), window[1:].unsqueeze(0).repeat(mb, 1)


def latest_checkpoint(run):
    """Every tensor of the run's latest checkpoint."""
    runs = run / "checkpoints"
    saved = {}
    for f in (runs / (runs / "latest").read_text().strip()).glob("*.safetensors"):
        saved.update(load_file(str(f)))
    return saved


@pytest.mark.parametrize("layout", ["one", "dp2", pytest.param("dp2_zero3", marks=pytest.mark.slow)])
def test_train_leaves_the_indexers_as_loaded(layout, tmp_path):
    """`loongforge train` with weight decay: the first step's loss is transformers' loss on the same batch, the
    checkpoint's indexer tensors are the loaded ones bit for bit (they get no gradient, so no optimizer touches
    them: one process with the row split over threads, DDP over two ranks, FSDP) while every other weight moved."""
    model, model_dir, pattern, recipe = train_setup(tmp_path, 40)
    seq, mb = 32, 2
    if layout == "one":
        run_lf("train", recipe)
    else:
        res = launch_ranks(2, [LF_BIN, "train", recipe, "--set", "train.micro_batch_size=1", "--set", "parallel.dp=2",
                               "--set", f"parallel.zero={3 if layout.endswith('zero3') else 0}"])
        for r in res:
            assert r.returncode == 0, r.stderr[-3000:]
    saved = check_first_loss_and_read_checkpoint(tmp_path, model, pattern, seq, mb, check_well_posed)
    loaded = load_file(str(model_dir / "model.safetensors"))
    for k, v in loaded.items():
        if ".indexer." in k:
            assert torch.equal(saved[k], v), k
        elif k.endswith("weight") and "norm" not in k and "experts" not in k:
            assert not torch.equal(saved[k], v), k


def train_metrics(tmp_path, recipe, out, sets=(), ranks=1):
    """`train` on one process or `ranks` ranks into tmp_path/out (with --set `sets`): its metrics lines per step."""
    args = ["--set", f"output_dir={tmp_path / out}", *[x for s in sets for x in ("--set", s)]]
    if ranks == 1:
        run_lf("train", recipe, *args)
    else:
        for r in launch_ranks(ranks, [LF_BIN, "train", recipe, *args]):
            assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(l) for l in (tmp_path / out / "metrics.jsonl").read_text().splitlines() if '"step"' in l and '"loss"' in l]


def check_layout_follows_one_process(tmp_path, case, layout, sets=(), keys=("loss",)):
    """Three steps of `train` on `case` (seq 32, micro-batch 2) under `layout` on two ranks = one process: every
    step's `keys` within 1e-5, the first gradient norm within 1e-5 (AdamW's normalised steps amplify the last bits
    after it: 1e-3); the checkpoints' tensors alike (median difference 1e-6, none over 0.1)."""
    model = make_model(dict(CASES[case], vocab_size=64))
    model.save_pretrained(tmp_path / "model")
    write_periodic_shard(tmp_path / "train", torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(3)).tolist(), 40)
    recipe = train_recipe(tmp_path, tmp_path / "model", 32, 2)
    sets = ["train.steps=3", *sets]
    one = train_metrics(tmp_path, recipe, "one", sets)
    two = train_metrics(tmp_path, recipe, "two", [*sets, *layout], ranks=2)
    assert len(one) == len(two) == 3
    for i, (a, b) in enumerate(zip(one, two)):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= (1e-5 if i == 0 else 1e-3) * a["grad_norm"], (a, b)
    x, y = latest_checkpoint(tmp_path / "one"), latest_checkpoint(tmp_path / "two")
    assert sorted(x) == sorted(y)
    for k in x:
        d = (x[k].double() - y[k].double()).abs()
        assert d.median() <= 1e-6 and d.max() <= 0.1, (k, d.median(), d.max())
    return one, two


@pytest.mark.parametrize("case,layout", [
    ("v32", ["parallel.tp=2"]),
    ("glm_shared", ["parallel.tp=2", "parallel.sp=true"]),
    pytest.param("v32", ["parallel.tp=2", "parallel.sp=true"], marks=pytest.mark.slow),
    pytest.param("glm_shared", ["parallel.tp=2"], marks=pytest.mark.slow),
])
def test_tp2_follows_one_process(case, layout, tmp_path):
    """Tensor parallelism (+ sequence parallelism): the latent attention splits by heads, the indexers stay whole on
    every rank (the sequence gathered for them under sp) and select the same keys as one process; GLM-5's shared
    layers reuse that selection. The frozen indexers stay as loaded."""
    check_layout_follows_one_process(tmp_path, case, layout)
    loaded = load_file(str(tmp_path / "model" / "model.safetensors"))
    saved = latest_checkpoint(tmp_path / "two")
    for k, v in loaded.items():
        if ".indexer." in k:
            assert torch.equal(saved[k], v), k


@pytest.mark.parametrize("case,mode", [
    ("glm_shared", "ring"),
    pytest.param("v32", "a2a", marks=pytest.mark.slow),
])
def test_cp2_follows_one_process(case, mode, tmp_path):
    """Context parallelism (either mode): each rank holds two of the four load-balanced chunks of the sequence; a
    sparse-attention layer gathers the whole sequence's latents, shared rotary keys and index keys, its indexer
    scores the local queries against every visible key (the same top-k as one process) and the local queries attend
    to the kept keys; GLM-5's shared layers reuse the selection."""
    check_layout_follows_one_process(tmp_path, case, ["parallel.cp=2", f"parallel.cp_mode={mode}"])


@pytest.mark.parametrize("case,key,needle", [
    ("glm_shared", "pp", "shared sparse-attention layers"),
])
def test_unsupported_layout_is_one_line(case, key, needle, tmp_path):
    """GLM-5's shared layers read a selection made earlier on the same micro-batch, which pipeline schedules do not
    keep: two ranks each end with one line naming parallel.<key>."""
    model_dir = tmp_path / "model"
    make_model(dict(CASES[case], vocab_size=64)).save_pretrained(model_dir)
    write_periodic_shard(tmp_path / "train", list(range(3, 19)), 40)
    res = launch_ranks(2, [LF_BIN, "train", train_recipe(tmp_path, model_dir, 16, 1), "--set", f"parallel.{key}=2"])
    for r in res:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and f"parallel.{key}" in lines[0] and needle in lines[0], r.stderr

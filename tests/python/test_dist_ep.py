"""Expert parallelism (parallel/expert_parallel.h) at ep2 and ep4: every rank runs its own rows of a tiny qwen3_moe
model with its share of the experts; the loss sums over ranks and every gradient (non-expert ones summed over ranks,
expert ones as local slices) equal the one-process reference each rank computes itself on the global batch
(tests/cpp/test_ep.cpp, EPHook.*), dropless and with per-rank capacity dropping.
`loongforge train` with parallel.ep (ep2, ep4, ep2 x dp2, ep2 x tp2; the ep ranks are data-parallel ranks) and
tensor parallelism of the MoE blocks (tp2, tp2 + sp, with router losses) and pipeline parallelism (pp2 with
per-layer router losses, ep2 x pp2) and hot-expert replication (moe.guest_slots: ep2, ep4 over 2 nodes, ep2 x tp2;
the replicas compute tokens and lower the ranks' overload) give the losses,
grad norms and validation losses of one process, and its checkpoints hold every expert under the per-expert HF names a one-process run writes (resume in one process,
load in transformers); bad ep layouts fail with one line naming the field."""
import json
import pathlib
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

from conftest import LF_BIN, launch_ranks, run_gtest_hook_ranks, run_lf


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_matches_one_process(ep):
    run_gtest_hook_ranks(ep, "EPHook.LossAndGradientsMatchOneProcess", {"LF_EP_HOOK": "1"})


# ---- `loongforge train` with parallel.ep (train/dist_engine.cpp): ep ranks are data-parallel ranks -------------------
MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
           num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=64,
           router_aux_loss_coef=0.0, rms_norm_eps=1e-6)


def write_moe(d, model_seed=0, data_seed=7, **overrides):
    """d/model: a tiny Qwen3-MoE (MOE with overrides) whose routers have spread-out logits, so tokens go to
    different experts on different ranks; d/train: a token shard."""
    cfg = transformers.AutoConfig.for_model(**dict(MOE, **overrides))
    torch.manual_seed(model_seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(d / "model")
    g = torch.Generator().manual_seed(data_seed)
    write_shard(d / "train", torch.randint(0, 64, (4000,), generator=g).numpy(), docs=40)
    return d


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_moe(tmp_path_factory.mktemp("ep_train"))


def write_shard(prefix, toks, docs):
    """A uint16 token shard (docs/data_format.md) of `docs` equal-length documents of random tokens."""
    import numpy as np
    toks = toks.astype(np.uint16)
    toks.tofile(str(prefix) + ".bin")
    offsets = np.linspace(0, len(toks), docs + 1).astype("<u8")
    idx = b"LFIDX\0\0\0" + np.array([1, 2], dtype="<u4").tobytes() + np.array([docs, len(toks)], dtype="<u8").tobytes()
    (pathlib.Path(str(prefix) + ".idx")).write_bytes(idx + offsets.tobytes())


def ep_recipe(tmp, d, out, steps):
    r = tmp / f"{out}.yaml"
    r.write_text(f"""
output_dir: {tmp / out}
seed: 3
model:
  path: {d / 'model'}
data:
  train:
    - path: {d / 'train'}
  seq_len: 16
  valid_fraction: 0.05
train:
  steps: {steps}
  micro_batch_size: 1
  grad_accum: 2
  threads: 1
checkpoint:
  every: 4
eval:
  every: 2
  batches: 2
optim:
  lr: 1.0e-2
  clip: 0.5
schedule:
  kind: constant
log:
  progress: off
  plot: false
  tensorboard: false
""")
    return r


def ep_metrics(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]


def whole_tensors(ckpt, prefix):
    out = {}
    for f in sorted(ckpt.glob(f"{prefix}*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


# Router losses (load balancing pooled over layers as transformers, DeepSeek's sequence-level loss, z-loss): every
# layout adds its share of the losses of the whole global micro-batch (CausalLM::aux_stats / aux_share), so they match
# one process. Under pp the pooled load-balancing loss sums the expert counts over the stages first (Pipeline's carry).
ROUTER_LOSSES = ["moe.aux_loss_coef=0.02", "moe.seq_aux_loss_coef=0.01", "moe.z_loss_coef=0.001"]
PER_LAYER_LOSSES = ["moe.seq_aux_loss_coef=0.02", "moe.z_loss_coef=0.001"]
R = ROUTER_LOSSES


@pytest.mark.parametrize("dp,ep,tp,extra", [
    (2, 2, 1, R), (4, 4, 1, R), pytest.param(4, 2, 1, R, marks=pytest.mark.slow),  # (ep2 x dp2: with ZeRO-1 below)
    pytest.param(2, 1, 1, R, marks=pytest.mark.slow),  # plain data parallel: the same router losses as one process
    (4, 2, 1, R + ["parallel.zero=1"]),     # ep2 x dp2 with ZeRO-1 (optimizer state split over the dp / ep ranks)
    (2, 1, 1, R + ["parallel.zero=3"]),     # FSDP: router losses backpropagated in each layer's recomputation
    (2, 2, 2, R),                           # ep2 x tp2: each ep rank's experts split along their ffn over tp
    pytest.param(1, 1, 2, R, marks=pytest.mark.slow),  # tp2 of an MoE model (with sp below)
    (1, 1, 2, R + ["parallel.sp=true"]),    # ... with sequence parallelism (parallel.* sets: tp run only)
    (1, 1, 1, R + ["parallel.pp=2"]),                 # pp2: router losses added per pipeline chunk
    (2, 2, 1, R + ["parallel.pp=2"]),                 # ep2 x pp2: each stage's experts over its ep group
    pytest.param(1, 1, 1, PER_LAYER_LOSSES + ["parallel.pp=2"], marks=pytest.mark.slow),  # pp2 without the pooled load-balancing loss (no carry)
    # recomputed layers under pp2 backpropagate their shares (with every stage's counts) in their recomputation
    pytest.param(1, 1, 1, R + ["model.recompute=full", "parallel.pp=2"], marks=pytest.mark.slow),
    (2, 2, 1, R + ["model.recompute=per_layer", "parallel.pp=2"]),  # layer 0 recomputed, layer 1 not
    (1, 1, 1, R + ["parallel.cp=2"]),         # cp2 (ring attention): tokens of sequence chunks; sequence counts summed
    (2, 2, 1, R + ["parallel.cp=2", "parallel.cp_mode=a2a"]),  # ep2 x cp2
    # hot-expert replication (guest slots): routing unchanged, so the same losses as one process (and as no guests)
    (2, 2, 1, R + ["moe.guest_slots=2"]),
    (4, 4, 1, R + ["moe.guest_slots=1", "moe.ranks_per_node=2"]),  # 2 "nodes" of 2 ranks
    pytest.param(2, 2, 2, R + ["moe.guest_slots=1"], marks=pytest.mark.slow),  # ep2 x tp2: the copies are tp shards
])
def test_train_ep_matches_one_process(tmp_path, moe_dir, dp, ep, tp, extra):
    """ep2, ep4, ep2 x dp2 (4 data ranks, 2 per expert group), dp2, ep2 x tp2, tp2 (+sp), pp2, ep2 x pp2 and
    replication, cp2 (ring), ep2 x cp2 (a2a), all with router losses: per-step losses and grad norms of one process (fp32, 1e-5, 4 steps of 2 micro-batches, clipping on) and the validation
    losses; the checkpoint holds the one-process run's tensors (per-expert names), with the optimizer moments,
    resumes in one process with the same next-step loss (1e-6) and loads in transformers."""
    steps = 4
    dist_only = ("parallel.", "moe.guest_slots", "moe.ranks_per_node")  # the one-process run has no such layout
    sets = sum((["--set", x] for x in extra if not x.startswith(dist_only)), [])
    layout = sum((["--set", x] for x in extra if x.startswith(dist_only)), [])
    run_lf("train", ep_recipe(tmp_path, moe_dir, "one", steps + 1), "--set", f"train.micro_batch_size={dp}", *sets)
    pp = int(next((x.split("=")[1] for x in extra if x.startswith("parallel.pp=")), 1))
    cp = int(next((x.split("=")[1] for x in extra if x.startswith("parallel.cp=")), 1))
    res = launch_ranks(dp * tp * pp * cp, [LF_BIN, "train", ep_recipe(tmp_path, moe_dir, "ep", steps), "--set", f"parallel.dp={dp}",
                                 "--set", f"parallel.ep={ep}", "--set", f"parallel.tp={tp}", *sets, *layout], threads=1)
    for r in res:
        assert r.returncode == 0, r.stderr[-3000:]
    one, got = ep_metrics(tmp_path / "one"), ep_metrics(tmp_path / "ep")
    assert len(got) == steps
    for a, b in zip(one, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a, b)
        assert ("valid_loss" in a) == ("valid_loss" in b) == (a["step"] % 2 == 0)
        if "valid_loss" in a:  # evaluation (forward only, eval mode) through the ep exchange as well
            assert abs(a["valid_loss"] - b["valid_loss"]) <= 1e-5 * abs(a["valid_loss"]), (a, b)
    if any(x.startswith("moe.guest_slots") for x in extra):  # the replicas did compute tokens, balancing the ranks
        assert all(m["moe_overload"] <= m["moe_home_overload"] + 1e-12 for m in got), got
        assert sum(m["moe_replica_tokens"] for m in got) > 0, got
        assert min(m["moe_overload"] - m["moe_home_overload"] for m in got) < -0.01, got
    elif ep > 1:  # without guests every token is computed at home
        assert all(m["moe_replica_tokens"] == 0 and m["moe_overload"] == m["moe_home_overload"] for m in got), got
    ckpt = tmp_path / "ep" / "checkpoints" / f"step_{steps:08d}"
    weights = whole_tensors(ckpt, "model")
    one_weights = whole_tensors(tmp_path / "one" / "checkpoints" / f"step_{steps:08d}", "model")
    # the same tensor names as the one-process run's checkpoint (per-expert HF names: experts.E.gate_proj.weight ...)
    assert sorted(weights) == sorted(one_weights)
    experts = [k for k in weights if ".mlp.experts." in k]
    assert len(experts) == 2 * MOE["num_experts"] * 3, experts
    # the same weights as the one-process run's checkpoint of that step, also as transformers loads them
    a = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "checkpoints" / f"step_{steps:08d}",
                                                          dtype=torch.float32).state_dict()
    assert sorted(a) == sorted(b)
    for k in a:  # AdamW (lr 1e-2) amplifies fp32 rounding where a gradient is tiny: 1e-4 = 1/400 of 4 steps' move
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-4), k
    for k in weights:
        assert torch.allclose(weights[k], one_weights[k], rtol=1e-4, atol=1e-4), k
    ref_opt = whole_tensors(tmp_path / "one" / "checkpoints" / f"step_{steps:08d}", "optimizer")
    opt = whole_tensors(ckpt, "optimizer")
    assert any(".experts." in k for k in ref_opt) and sorted(k for k in ref_opt if k.startswith("exp_avg")) == sorted(k for k in opt if k.startswith("exp_avg"))
    for k in ref_opt:
        if k.startswith("exp_avg"):
            assert torch.allclose(opt[k], ref_opt[k], rtol=1e-3, atol=1e-7), k
    # resume in one process: step 5 equals the uninterrupted one-process run's step 5
    shutil.copytree(tmp_path / "ep", tmp_path / "resumed")
    rec = ep_recipe(tmp_path, moe_dir, "resumed", steps + 1)
    run_lf("train", rec, "--resume", "--set", f"train.micro_batch_size={dp}", *sets)
    last = ep_metrics(tmp_path / "resumed")[-1]
    assert last["step"] == steps + 1
    assert abs(last["loss"] - one[steps]["loss"]) <= 1e-6 * abs(one[steps]["loss"]), (last, one[steps])
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[3, 4, 5, 6]])).logits).all()


def test_pooled_lb_loss_under_interleaved_pp(tmp_path):
    """pp2 x vpp2 (4 virtual stages of one layer; layer 0 dense, mlp_only_layers): the pooled load-balancing loss
    sums the expert counts along the virtual stages (the dense stage adds zeros) and every stage adds its share in
    its backward, as one process computes it: same losses and grad norms (fp32, 1e-5)."""
    write_moe(tmp_path, model_seed=1, data_seed=8, num_hidden_layers=4, mlp_only_layers=[0])
    sets = sum((["--set", x] for x in R), [])
    run_lf("train", ep_recipe(tmp_path, tmp_path, "one", 3), *sets)
    res = launch_ranks(2, [LF_BIN, "train", ep_recipe(tmp_path, tmp_path, "pp", 3), *sets, "--set", "parallel.pp=2",
                           "--set", "parallel.vpp=2"], threads=1)
    for r in res:
        assert r.returncode == 0, r.stderr[-3000:]
    one, got = ep_metrics(tmp_path / "one"), ep_metrics(tmp_path / "pp")
    assert len(one) == len(got) == 3
    for a, b in zip(one, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a, b)


@pytest.mark.parametrize("sets,needle", [
    (["parallel.dp=2", "parallel.ep=3"], "'parallel.ep': 3 does not divide parallel.dp 2"),
    (["parallel.dp=2", "parallel.ep=2", "parallel.zero=3"], "'parallel.ep': 2: expert parallelism runs with parallel.zero 0"),
    (["parallel.dp=2", "parallel.ep=2", "parallel.tp=3"], "'parallel.tp': 3 does not divide num_attention_heads"),
    (["moe.guest_slots=1"], "'moe.guest_slots': 1: hot-expert replication"),
    (["parallel.dp=4", "parallel.ep=4", "moe.guest_slots=1", "moe.ranks_per_node=3"], "'moe.ranks_per_node': 3"),
])
def test_bad_ep_layouts_one_line(tmp_path, moe_dir, sets, needle):
    p = run_lf("train", ep_recipe(tmp_path, moe_dir, "bad", 1), *sum((["--set", s] for s in sets), []), check=False)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_lora_with_expert_parallelism(tmp_path, moe_dir):
    """LoRA adapters on the attention projections of an MoE model whose (frozen) experts are split over ep2 x dp2:
    the per-step losses and grad norms of the one-process LoRA run (fp32, 1e-5, router losses on) and the same PEFT
    adapter."""
    from safetensors.torch import load_file
    steps = 4
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
            "optim.eps=1.0e-5"] + R
    sets = sum((["--set", x] for x in lora), [])
    run_lf("train", ep_recipe(tmp_path, moe_dir, "one", steps), "--set", "train.micro_batch_size=4", *sets)
    res = launch_ranks(4, [LF_BIN, "train", ep_recipe(tmp_path, moe_dir, "ep", steps), "--set", "parallel.dp=4",
                           "--set", "parallel.ep=2", *sets], threads=1)
    for r in res:
        assert r.returncode == 0, r.stderr[-3000:]
    one, got = ep_metrics(tmp_path / "one"), ep_metrics(tmp_path / "ep")
    assert len(got) == steps and one[-1]["loss"] != one[0]["loss"]
    for a, b in zip(one, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a, b)
    ck = f"checkpoints/step_{steps:08d}/adapter_model.safetensors"
    want, have = load_file(tmp_path / "one" / ck), load_file(tmp_path / "ep" / ck)
    assert sorted(have) == sorted(want) and want
    for k, w in want.items():
        assert torch.allclose(have[k], w, rtol=1e-4, atol=1e-6), k

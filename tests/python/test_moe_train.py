"""Training mixture-of-experts models through `loongforge train`: the recipe's `moe.*` router options reach the
blocks, aux-loss-free bias updates use the loads of the whole step (all data-parallel ranks), so dp2 (DDP and FSDP)
follows one process; `moe.*` keys on a dense model are errors naming the key."""
import json
import pathlib

import pytest
import torch
import transformers
from safetensors import safe_open

from conftest import LF_BIN, launch_ranks, run_lf
from test_moe_parity import write_periodic_shard

CFG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
           topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
           qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64)


def write_recipe(tmp, model_dir, out, extra=""):
    r = tmp / f"{out}.yaml"
    r.write_text(f"""
output_dir: {tmp / out}
seed: 3
model:
  path: {model_dir}
data:
  train:
    - path: {tmp / 'train'}
  seq_len: 16
train:
  steps: 3
  micro_batch_size: 2
  grad_accum: 2
optim:
  lr: 1.0e-2
  weight_decay: 0.0
schedule:
  kind: constant
log:
  progress: lines
  plot: false
  tensorboard: false
moe:
  bias_update_rate: 0.01
{extra}
""")
    return r


def biases(ckpt):
    out = {}
    for f in sorted(pathlib.Path(ckpt).glob("*.safetensors")):
        if f.name.startswith("optimizer"):
            continue
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if k.endswith("e_score_correction_bias"):
                    out[k] = h.get_tensor(k)
    return out


def losses(run):
    return [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()]


def write_model_and_data(tmp_path, **overrides):
    """A tiny DeepSeek-V3 (routers with spread-out logits) in tmp_path/model and a token shard in tmp_path/train."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**dict(CFG, **overrides)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(5)
    write_periodic_shard(tmp_path / "train", torch.randint(0, 128, (37,), generator=g).tolist(), 60)


@pytest.mark.parametrize("zero", [0, 3])  # DDP; FSDP (layers run without a graph, recomputed in backward)
def test_bias_updates_follow_global_loads_under_dp(tmp_path, zero):
    write_model_and_data(tmp_path)

    run_lf("train", write_recipe(tmp_path, tmp_path / "model", "one"))
    res = launch_ranks(2, [LF_BIN, "train", write_recipe(tmp_path, tmp_path / "model", "dp2", "parallel:\n  dp: 2"),
                           "--set", "train.micro_batch_size=1", "--set", f"parallel.zero={zero}"], threads=1)
    for r in res:
        assert r.returncode == 0, r.stderr
    one = biases(tmp_path / "one" / "checkpoints" / "step_00000003")
    two = biases(tmp_path / "dp2" / "checkpoints" / "step_00000003")
    assert list(one) == ["model.layers.1.mlp.gate.e_score_correction_bias"] and list(two) == list(one)
    b = next(iter(one.values()))
    # three sign updates of 0.01 from zero: multiples of 0.01 in [-0.03, 0.03], and the loads were not balanced
    assert b.abs().max() > 0 and torch.allclose(b / 0.01, torch.round(b / 0.01), atol=1e-4)
    assert b.abs().max() <= 0.03 + 1e-6
    assert torch.equal(next(iter(two.values())), b)
    for a, c in zip(losses(tmp_path / "one"), losses(tmp_path / "dp2")):
        assert abs(a - c) <= 1e-5 * abs(a)


def test_moe_keys_on_a_dense_model_are_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2)))
    r = tmp_path / "r.yaml"
    r.write_text(f"model:\n  config: {tmp_path / 'config.json'}\ndata:\n  format: batch\n")
    p = run_lf("train", r, "--set", "moe.capacity_factor=1.0", "--set", f"output_dir={tmp_path / 'o'}", check=False)
    assert p.returncode != 0
    assert "moe.capacity_factor" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("recompute", ["full", "per_layer"])
def test_router_losses_with_recompute(tmp_path, recompute):
    """Activation recomputation of MoE layers with every router loss (load balancing, sequence-level, z-loss) and
    aux-loss-free bias updates: the recomputed layers make their statistics in the graph-free forward and their loss
    shares go back in their recomputation, so losses, grad norms and the learned biases equal the run without
    recomputation (fp32, 1e-5); in one process and at dp2 (router losses of the global micro-batch)."""
    write_model_and_data(tmp_path, first_k_dense_replace=0)
    sets = ["--set", "moe.aux_loss_coef=0.02", "--set", "moe.seq_aux_loss_coef=0.01", "--set", "moe.z_loss_coef=0.001"]

    def metrics(run):
        return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]

    run_lf("train", write_recipe(tmp_path, tmp_path / "model", "plain"), *sets)
    run_lf("train", write_recipe(tmp_path, tmp_path / "model", "rc"), *sets, "--set", f"model.recompute={recompute}")
    res = launch_ranks(2, [LF_BIN, "train", write_recipe(tmp_path, tmp_path / "model", "rc_dp2", "parallel:\n  dp: 2"),
                           "--set", "train.micro_batch_size=1", "--set", f"model.recompute={recompute}", *sets],
                       threads=1)
    for r in res:
        assert r.returncode == 0, r.stderr[-3000:]
    plain = metrics(tmp_path / "plain")
    assert len(plain) == 3
    for run in ("rc", "rc_dp2"):
        got = metrics(tmp_path / run)
        for a, b in zip(plain, got):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (run, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (run, a, b)
        want = biases(tmp_path / "plain" / "checkpoints" / "step_00000003")
        have = biases(tmp_path / run / "checkpoints" / "step_00000003")
        assert list(want) == list(have) and len(want) == 2
        for k in want:
            assert torch.equal(want[k], have[k]), (run, k)

"""DeepSeek-V4 under `loongforge train` layouts: expert parallelism (dp2 ep2: each rank its rows and half of every
layer's routed experts, the hash-routed layer routing its rows by their token ids), pipeline parallelism (pp2: the
hyper-connection streams [B, T, hc_mult, hidden] travel between the stages), both (dp2 ep2 pp2), and tensor
parallelism (tp2, and tp2 + sp: query heads, sinks and output-projection groups split, the compressors and indexers
whole on the gathered sequence; with dp2 ep2 in the slow set), context parallelism (cp2: the shared key head and the
compressor / indexer projections gathered over the sequence, the sliding window at global positions; dp2 ep2 cp2 and
tp2 sp cp2 in the slow set; packed documents under sp or cp are one-line errors), with the router losses on (the load-balancing loss pooled over the top-k layers as transformers, the sequence-level and z-losses):
per-step losses, grad norms and validation losses of one process; the checkpoint holds every expert under
save_pretrained's names and loads in transformers with the one-process run's weights."""
import pytest
import torch
import transformers

from conftest import LF_BIN, launch_ranks, run_lf
from test_deepseek_v4_parity import make_model
from test_dist_ep import ROUTER_LOSSES, ep_metrics, ep_recipe, whole_tensors, write_shard


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4_dist")
    make_model(dict(vocab_size=64)).save_pretrained(d / "model")
    g = torch.Generator().manual_seed(7)
    write_shard(d / "train", torch.randint(0, 64, (4000,), generator=g).numpy(), docs=40)
    return d


@pytest.mark.parametrize("dp,ep,pp,tp,sp,cp", [(2, 2, 1, 1, False, 1), (1, 1, 2, 1, False, 1), (2, 2, 2, 1, False, 1),
                                               (1, 1, 1, 2, False, 1), (1, 1, 1, 2, True, 1), (1, 1, 1, 1, False, 2),
                                               pytest.param(2, 2, 1, 2, False, 1, marks=pytest.mark.slow),
                                               pytest.param(2, 2, 1, 2, True, 1, marks=pytest.mark.slow),
                                               pytest.param(2, 2, 1, 1, False, 2, marks=pytest.mark.slow),
                                               pytest.param(1, 1, 1, 2, True, 2, marks=pytest.mark.slow)])
def test_deepseek_v4_train_layout_matches_one_process(tmp_path, v4_dir, dp, ep, pp, tp, sp, cp):
    steps = 4
    # lr 1e-3: at test_dist_ep's 1e-2 fp32 rounding flips a near-tie of a top-k (routing or the load-balancing
    # statistics' softmax top-k) by the 4th step, in plain dp2 as well
    sets = sum((["--set", x] for x in ROUTER_LOSSES + ["optim.lr=1.0e-3"]), [])
    run_lf("train", ep_recipe(tmp_path, v4_dir, "one", steps), "--set", f"train.micro_batch_size={dp}", *sets)
    res = launch_ranks(dp * pp * tp * cp, [LF_BIN, "train", ep_recipe(tmp_path, v4_dir, "dist", steps), "--set",
                                           f"parallel.dp={dp}", "--set", f"parallel.ep={ep}", "--set", f"parallel.pp={pp}",
                                           "--set", f"parallel.tp={tp}", "--set", f"parallel.sp={str(sp).lower()}",
                                           "--set", f"parallel.cp={cp}", *sets], threads=1)
    for r in res:
        assert r.returncode == 0, r.stderr[-3000:]
    one, got = ep_metrics(tmp_path / "one"), ep_metrics(tmp_path / "dist")
    assert len(one) == len(got) == steps and one[-1]["loss"] != one[0]["loss"]
    for a, b in zip(one, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a, b)
        assert ("valid_loss" in a) == ("valid_loss" in b)
        if "valid_loss" in a:
            assert abs(a["valid_loss"] - b["valid_loss"]) <= 1e-5 * abs(a["valid_loss"]), (a, b)
    ckpt = f"checkpoints/step_{steps:08d}"
    weights, one_weights = whole_tensors(tmp_path / "dist" / ckpt, "model"), whole_tensors(tmp_path / "one" / ckpt, "model")
    assert sorted(weights) == sorted(one_weights)
    assert len([k for k in weights if ".ffn.experts." in k]) == 4 * 4 * 3  # layers x experts x (w1, w2, w3)
    for k in weights:  # AdamW amplifies fp32 rounding where a gradient is tiny
        assert weights[k].dtype == one_weights[k].dtype, k
        if weights[k].is_floating_point():
            assert torch.allclose(weights[k], one_weights[k], rtol=1e-4, atol=1e-4), k
        else:
            assert torch.equal(weights[k], one_weights[k]), k  # tid2eid
    a = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "dist" / ckpt, dtype=torch.float32)
    b = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "one" / ckpt, dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        assert torch.allclose(a(input_ids=ids).logits, b(input_ids=ids).logits, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("sets, field, needle", [(["parallel.tp=2", "parallel.sp=true"], "parallel.sp", "sequence parallelism"),
                                                (["parallel.cp=2"], "parallel.cp", "context parallelism")])
def test_deepseek_v4_packed_documents_under_sp_cp_are_one_line(tmp_path, v4_dir, sets, field, needle):
    res = launch_ranks(2, [LF_BIN, "train", ep_recipe(tmp_path, v4_dir, "packed", 2), *sum((["--set", x] for x in sets), []),
                           "--set", "data.per_document_attention=true"], threads=1)
    for r in res:
        lines = [l for l in r.stderr.strip().splitlines() if "error" in l]
        assert r.returncode != 0 and len(lines) == 1, r.stderr[-2000:]
        assert field in lines[0] and "packed documents under " + needle in lines[0], lines[0]

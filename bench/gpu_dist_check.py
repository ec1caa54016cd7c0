"""Distributed training on the GPU (issue 5, with a GPU lent): the distributed engine with the model, batches and
optimizer state on the GPU trains as one process does, for every layout. The GPU machine has one GPU, so the
multi-rank runs put both ranks on it and communicate through Gloo (parallel.backend: gloo, which stages GPU tensors
through the host; NCCL refuses two ranks on one device); NCCL itself runs at world size 1 (ZeRO-1), as in the gtest
CudaKernels.DataParallelZero1OnGpuMatchesSingle. fp32, 6 steps of a tiny Llama (a tiny Qwen3-MoE for ep), clipping
on, ~20 % of the labels ignored; per-step losses within 1e-5 and grad norms within 1e-4 (relative) of the
single-process GPU run.

    python3 bench/gpu_dist_check.py --lf build-gpu/loongforge [--out DIR] [--layouts dp|all]
    .venv/bin/python bench/gpu_dist_check.py --lf build/loongforge --device cpu   # the same logic on the CPU

--layouts dp: dp2, dp2 + ZeRO-1, ZeRO-1 on NCCL; all (default): also tp2, tp2 + sp, pp2 (1F1B), pp2 x vpp2, cp2 ring,
cp2 a2a, FSDP (dp2, ZeRO-3) and ep2 (MoE), and two checkpoint round trips on the GPU (FSDP saved at step 3 and
resumed; tp2 saved at step 3 and resumed at pp2): the resumed runs' six steps = the one-process run's.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file

CONFIG = dict(model_type="llama", vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
              tie_word_embeddings=False)
MOE_CONFIG = dict(model_type="qwen3_moe", vocab_size=8192, hidden_size=128, intermediate_size=256,
                  moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  router_aux_loss_coef=0.01, output_router_logits=True)


def write_inputs(work):
    (work / "config.json").write_text(json.dumps(CONFIG))
    (work / "moe_config.json").write_text(json.dumps(MOE_CONFIG))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 8192, (8, 64), generator=g)
    labels = ids.clone()
    labels[torch.rand(8, 64, generator=g) < 0.2] = -100
    save_file({"input_ids": ids, "labels": labels}, str(work / "batch.safetensors"))
    (work / "r.yaml").write_text("")


def run(a, work, tag, ranks, sets, port, resume=False):
    out = work / tag
    base = [a.lf, "train", str(work / "r.yaml"), "--set", f"output_dir={out}", "--set", f"device={a.device}",
            "--set", "seed=3", "--set", f"model.config={work / 'config.json'}", "--set", "data.format=batch",
            "--set", f"data.train=[{{path: {work / 'batch.safetensors'}}}]", "--set", "data.seq_len=64",
            "--set", "train.steps=6", "--set", "train.grad_accum=2", "--set", "optim.lr=1e-3",
            "--set", "schedule.kind=constant", "--set", "checkpoint.every=0", "--set", "log.progress=off",
            "--set", "log.tensorboard=false", "--set", "log.plot=false"]
    for s in sets:
        base += ["--set", s]
    if resume:
        base.append("--resume")
    procs = []
    for r in range(ranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if ranks > 1:
            env.update(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen(base, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        bad = next(i for i, p in enumerate(procs) if p.returncode != 0)
        raise RuntimeError(f"rank {bad} exited with {procs[bad].returncode}: " + logs[bad][-400:].replace("\n", " / "))
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    return [(l["loss"], l["grad_norm"]) for l in lines], logs[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lf", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--layouts", default="all", choices=["dp", "all"])
    a = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="lf-gpu-dist-"))
    write_inputs(work)
    gloo = ["parallel.backend=gloo", "train.micro_batch_size=2"]
    fsdp = ["parallel.dp=2", "parallel.zero=3", "parallel.backend=gloo", "train.micro_batch_size=1"]
    cases = [("dp2 (gloo, both ranks on one device)", 2, ["parallel.dp=2", "parallel.backend=gloo",
                                                           "train.micro_batch_size=1"]),
             ("dp2 + ZeRO-1 (gloo)", 2, ["parallel.dp=2", "parallel.zero=1", "parallel.backend=gloo",
                                          "train.micro_batch_size=1"]),
             ("ZeRO-1, one rank (auto: nccl on cuda)", 1, ["parallel.zero=1", "train.micro_batch_size=2"])]
    if a.layouts == "all":
        cases += [("tp2", 2, ["parallel.tp=2"] + gloo),
                  ("tp2 + sp", 2, ["parallel.tp=2", "parallel.sp=true"] + gloo),
                  ("pp2 (1F1B)", 2, ["parallel.pp=2"] + gloo),
                  ("pp2 x vpp2 (interleaved)", 2, ["parallel.pp=2", "parallel.vpp=2"] + gloo),
                  ("cp2 ring", 2, ["parallel.cp=2", "parallel.cp_mode=ring"] + gloo),
                  ("cp2 a2a", 2, ["parallel.cp=2", "parallel.cp_mode=a2a"] + gloo),
                  ("FSDP (dp2, ZeRO-3)", 2, ["parallel.dp=2", "parallel.zero=3", "parallel.backend=gloo",
                                              "train.micro_batch_size=1"]),
                  ("ep2 (MoE, vs its own one-process run)", 2, ["parallel.ep=2", "parallel.dp=2",
                                                               "parallel.backend=gloo", "train.micro_batch_size=1"]),
                  ("FSDP, saved at step 3, resumed", 2, (fsdp, fsdp)),
                  ("tp2 saved at step 3, resumed at pp2", 2, (["parallel.tp=2"] + gloo, ["parallel.pp=2"] + gloo))]
    moe_sets = [f"model.config={work / 'moe_config.json'}"]
    results, ok = [], True
    refs = {}
    try:
        refs["dense"], log = run(a, work, "single", 1, ["train.micro_batch_size=2"], 29671)
        if a.layouts == "all":
            refs["moe"], log = run(a, work, "single-moe", 1, ["train.micro_batch_size=2"] + moe_sets, 29670)
    except Exception as e:  # noqa: BLE001
        print(f"single-process reference failed: {e}")
        return 1
    for i, (name, ranks, sets) in enumerate(cases):
        row = {"case": name}
        moe = name.startswith("ep")
        ref = refs["moe" if moe else "dense"]
        try:
            if isinstance(sets, tuple):  # (first layout, resumed layout): 3 steps, a checkpoint, 3 more after --resume
                first, then = sets
                run(a, work, f"case{i}", ranks, first + ["train.steps=3", "checkpoint.every=3"], 29672 + i)
                got, log = run(a, work, f"case{i}", ranks, then + ["checkpoint.every=3"], 29700 + i, resume=True)
            else:
                got, log = run(a, work, f"case{i}", ranks, sets + (moe_sets if moe else []), 29672 + i)
            dl = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(got, ref))
            dg = max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(got, ref))
            fallback = [l for l in log.splitlines() if l.startswith("loongforge: device")]
            row.update(steps=len(got), max_rel_loss=dl, max_rel_grad_norm=dg, device_note=fallback[0] if fallback else "")
            row["status"] = "ok" if len(got) == len(ref) and dl <= 1e-5 and dg <= 1e-4 and not fallback else "FAIL"
        except Exception as e:  # noqa: BLE001 - a failed case is a row
            row["status"] = "FAIL: " + str(e)[:300]
        ok = ok and row["status"] == "ok"
        results.append(row)
    print(f"{'case':42s} {'status':6s} {'loss (rel)':>11s} {'grad norm (rel)':>16s}")
    for r in results:
        st = r["status"] if r["status"] in ("ok", "FAIL") else "FAIL"
        print(f"{r['case']:42s} {st:6s} {r.get('max_rel_loss', float('nan')):11.2e} "
              f"{r.get('max_rel_grad_norm', float('nan')):16.2e}  {'' if st == 'ok' else r['status'][:200]}"
              f"{(' ' + r['device_note']) if r.get('device_note') else ''}")
    if a.out:
        pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(a.out) / "gpu_dist.json").write_text(json.dumps({"device": a.device, "results": results},
                                                                      indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""`loongforge train` on several processes (CPU, Gloo): every layout of issue 5 gives the per-step losses and gradient
norms of one process (fp32, 1e-5), launched with torchrun-style variables or mpirun; checkpoints written by one
layout resume in another with the same next-step loss; bad layouts fail with one line."""
import json
import os
import shutil
import subprocess

import pytest

from conftest import LF_BIN, free_port, launch_ranks, lf_backends, run_lf

MODEL = {
    "model_type": "llama", "vocab_size": 24, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
STEPS = 10


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_data")
    run_lf("data", "synth", "--task", "addition", "--docs", 2000, "--digits", 2, "--out", d)
    run_lf("data", "tokenize", "--tokenizer", d, "--input", d / "train.jsonl", "--out", d / "train")
    (d / "model.json").write_text(json.dumps(MODEL))
    return d


def recipe(tmp_path, data_dir, model=None):
    text = f"""
output_dir: {tmp_path / 'run'}
seed: 11
model:
  config: {model or data_dir / 'model.json'}
  tokenizer: {data_dir}
data:
  train:
    - path: {data_dir / 'train'}
  seq_len: 32
train:
  steps: {STEPS}
  micro_batch_size: 2
  grad_accum: 2
  threads: 1
optim:
  lr: 3.0e-3
  clip: 0.5
schedule:
  warmup_steps: 2
log:
  progress: off
  plot: false
  tensorboard: false
"""
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_ranks(n, rec, sets, timeout=600, resume=False):
    args = sum((["--set", s] for s in sets), []) + (["--resume"] if resume else [])
    res = launch_ranks(n, [LF_BIN, "train", rec, *args], timeout=timeout)
    for r, p in enumerate(res):
        assert p.returncode == 0, f"rank {r}: {p.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """One process; the global batch of every layout below (dp x micro_batch_size = 4 rows, 2 micro-batches)."""
    tmp = tmp_path_factory.mktemp("ref")
    rec = recipe(tmp, data_dir)
    run_lf("train", rec, "--set", "train.micro_batch_size=4")
    return metrics(tmp / "run")


def close(a, b, rel=1e-5):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def assert_matches(name, got, reference):
    """Every step's loss, grad norm and token count equal the one-process run's (losses and norms to 1e-5)."""
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for m, ref in zip(got, reference):
        assert close(m["loss"], ref["loss"]), (name, m["step"], m["loss"], ref["loss"])
        assert close(m["grad_norm"], ref["grad_norm"]), (name, m["step"], m["grad_norm"], ref["grad_norm"])
        assert m["tokens"] == ref["tokens"]


LAYOUTS = {
    "dp2": (2, ["parallel.dp=2", "train.micro_batch_size=2"]),
    "dp4_zero1": (4, ["parallel.dp=4", "parallel.zero=1", "train.micro_batch_size=1"]),
    "dp4_zero3": (4, ["parallel.dp=4", "parallel.zero=3", "train.micro_batch_size=1"]),
    "hsdp_2x2": (4, ["parallel.dp=4", "parallel.zero=3", "parallel.hsdp_shard=2", "train.micro_batch_size=1"]),
    "tp2": (2, ["parallel.tp=2", "train.micro_batch_size=4"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true", "train.micro_batch_size=4"]),
    "pp2": (2, ["parallel.pp=2", "train.micro_batch_size=4"]),
    "pp2_interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=4"]),
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring", "train.micro_batch_size=4"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_mode=a2a", "train.micro_batch_size=4"]),
    "dp2_tp2_pp2": (8, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(tmp_path, data_dir, reference, name):
    n, sets = LAYOUTS[name]
    rec = recipe(tmp_path, data_dir)
    train_ranks(n, rec, sets)
    assert_matches(name, metrics(tmp_path / "run"), reference)


# DeepSeek-V3's multi-head latent attention (and its MoE layer) under tensor, sequence and context parallelism: the
# latent projections stay whole (their outputs feed every head), the per-head up-projections split; ring attention
# carries values narrower than the keys (v_head_dim 12 < 16) zero-padded.
DEEPSEEK = {
    "model_type": "deepseek_v3", "vocab_size": 24, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "kv_lora_rank": 16, "q_lora_rank": 24,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
MLA_LAYOUTS = {
    "tp2": (2, ["parallel.tp=2", "train.micro_batch_size=4"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true", "train.micro_batch_size=4"]),
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring", "train.micro_batch_size=4"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_mode=a2a", "train.micro_batch_size=4"]),
}


@pytest.fixture(scope="module", params=["q_lora", "q_proj"])
def deepseek(request, tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("ds_ref")
    cfg = dict(DEEPSEEK, q_lora_rank=None) if request.param == "q_proj" else DEEPSEEK
    (tmp / "model.json").write_text(json.dumps(cfg))
    rec = recipe(tmp, data_dir, model=tmp / "model.json")
    run_lf("train", rec, "--set", "train.micro_batch_size=4")
    return tmp / "model.json", metrics(tmp / "run")


@pytest.mark.parametrize("name", list(MLA_LAYOUTS))
def test_mla_layout_matches_one_process(tmp_path, data_dir, deepseek, name):
    model, reference = deepseek
    n, sets = MLA_LAYOUTS[name]
    rec = recipe(tmp_path, data_dir, model=model)
    train_ranks(n, rec, sets)
    assert_matches(name, metrics(tmp_path / "run"), reference)


# A vocabulary tp does not divide (the quickstart's 17 tokens): tensor parallelism pads the output and embedding rows
# (to a multiple of tp x parallel.vocab_granule); the padding never reaches the loss or the checkpoint.
@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("v17_ref")
    (tmp / "model.json").write_text(json.dumps(dict(MODEL, vocab_size=17, pad_token_id=None)))
    rec = recipe(tmp, data_dir, model=tmp / "model.json")
    run_lf("train", rec, "--set", "train.micro_batch_size=4")
    return tmp / "model.json", metrics(tmp / "run")


@pytest.mark.parametrize("sets", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true", "parallel.vocab_granule=8"]])
def test_tp_pads_a_vocabulary_it_does_not_divide(tmp_path, data_dir, odd_vocab, sets):
    model, reference = odd_vocab
    rec = recipe(tmp_path, data_dir, model=model)
    train_ranks(2, rec, sets + ["train.micro_batch_size=4"])
    assert_matches(sets, metrics(tmp_path / "run"), reference)
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{STEPS:08d}"
    from safetensors import safe_open
    shapes = {}
    for f in ckpt.glob("model-rank-*.safetensors"):
        with safe_open(str(f), "pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    assert shapes["model.embed_tokens.weight"] == (17, MODEL["hidden_size"])
    assert shapes["lm_head.weight"] == (17, MODEL["hidden_size"])


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_mpirun_launch(tmp_path, data_dir, reference, backend):
    """mpirun -np 2: ranks from OMPI_COMM_WORLD_*; auto takes Open MPI's collectives when the build has them."""
    if not shutil.which("mpirun"):
        pytest.skip("no mpirun")
    rec = recipe(tmp_path, data_dir)
    proc = subprocess.run(["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1",
                           "-x", f"MASTER_PORT={free_port()}", str(LF_BIN), "train", str(rec), "--set", "parallel.dp=2",
                           "--set", "train.micro_batch_size=2", "--set", f"parallel.backend={backend}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metrics(tmp_path / "run")
    for m, ref in zip(got, reference):
        assert close(m["loss"], ref["loss"]) and close(m["grad_norm"], ref["grad_norm"])


@pytest.mark.parametrize("name", ["dp4_zero3", "cp2_ring", "cp2_a2a", "dp2_tp2_pp2"])
def test_layout_over_mpi_matches_one_process(tmp_path, data_dir, reference, name):
    """parallel.backend: mpi (Open MPI's collectives and point-to-point instead of Gloo), started by mpirun without
    MASTER_ADDR / MASTER_PORT: same per-step losses and grad norms as one process."""
    if not shutil.which("mpirun"):
        pytest.skip("no mpirun")
    if "mpi" not in lf_backends():
        pytest.skip("this build has no MPI backend")
    n, sets = LAYOUTS[name]
    rec = recipe(tmp_path, data_dir)
    args = sum((["--set", s] for s in sets + ["parallel.backend=mpi"]), [])
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(["mpirun", "-np", str(n), "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1",
                           str(LF_BIN), "train", str(rec), *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metrics(tmp_path / "run")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for m, ref in zip(got, reference):
        assert close(m["loss"], ref["loss"]), (name, m["step"], m["loss"], ref["loss"])
        assert close(m["grad_norm"], ref["grad_norm"]), (name, m["step"], m["grad_norm"], ref["grad_norm"])


def test_mpi_backend_needs_mpirun(tmp_path, data_dir):
    """parallel.backend: mpi in a job started with torchrun-style variables: MPI's world (this process alone) is not
    the job's, and one line says so instead of a hang."""
    if "mpi" not in lf_backends():
        pytest.skip("this build has no MPI backend")
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(LF_BIN), "train", str(recipe(tmp_path, data_dir)), "--set", "parallel.dp=2", "--set",
                           "parallel.backend=mpi"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'parallel.backend': mpi, but MPI sees rank 0 of 1 where the launcher says rank 1 of 2" \
        in lines[0], proc.stderr


def test_checkpoint_reshards(tmp_path, data_dir):
    """Saved at tp2 x pp2 after 5 steps; resumed at dp4 and at one rank: step 6's loss equals the uninterrupted
    tp2 x pp2 run's (1e-6), and the checkpoint loads in transformers."""
    full = tmp_path / "full"
    full.mkdir()
    train_ranks(4, recipe(full, data_dir), ["parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=4",
                                            "train.steps=6"])
    want = metrics(full / "run")[5]["loss"]
    src = tmp_path / "src"
    src.mkdir()
    train_ranks(4, recipe(src, data_dir), ["parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=4",
                                           "train.steps=6", "train.stop_at_step=5"])
    ckpt = src / "run" / "checkpoints" / "step_00000005"
    assert (ckpt / "model.safetensors.index.json").exists()
    for target, n, sets in [("dp4", 4, ["parallel.dp=4", "train.micro_batch_size=1"]),
                            ("one", 1, ["train.micro_batch_size=4"])]:
        d = tmp_path / target
        shutil.copytree(src / "run", d / "run")
        rec = recipe(d, data_dir)
        args = sets + ["train.steps=6"]
        if n == 1:
            run_lf("train", rec, "--resume", *sum((["--set", s] for s in args), []))
        else:
            res = launch_ranks(n, [LF_BIN, "train", rec, "--resume", *sum((["--set", s] for s in args), [])])
            for p in res:
                assert p.returncode == 0, p.stderr[-3000:]
        got = metrics(d / "run")[-1]
        assert got["step"] == 6
        assert close(got["loss"], want, 1e-6), (target, got["loss"], want)
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("n,sets,needle", [
    (1, ["parallel.tp=3"], "'parallel.tp': 3 does not divide num_attention_heads 4"),
    (1, ["parallel.pp=3"], "'parallel.pp'"),
    (1, ["parallel.pp=2", "parallel.pp_layout=[1,2]"], "'parallel.pp_layout': sums to 3 layers"),
    (1, ["parallel.dp=2"], "needs 2 processes; the job has 1"),
    (1, ["parallel.hsdp_shard=2", "parallel.dp=4"], "'parallel.hsdp_shard'"),
    (1, ["parallel.ep=2"], "'parallel.ep'"),
])
def test_bad_layouts_one_line(tmp_path, data_dir, n, sets, needle):
    rec = recipe(tmp_path, data_dir)
    proc = run_lf("train", rec, *sum((["--set", s] for s in sets), []), check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_killed_rank_ends_the_job(tmp_path, data_dir):
    """kill -9 of one rank mid-training: the other exits within the timeout with one line naming it."""
    import os
    import signal
    import time
    from conftest import free_port
    rec = recipe(tmp_path, data_dir)
    port = free_port()
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([str(LF_BIN), "train", str(rec), "--set", "parallel.dp=2", "--set",
                                       "train.steps=100000", "--set", "parallel.timeout_s=20"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
    m = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not m.exists() or len(m.read_text().splitlines()) < 3):
        time.sleep(0.2)
    assert m.exists(), procs[0].stderr.read() if procs[0].poll() is not None else "no metrics"
    t0 = time.time()
    procs[1].send_signal(signal.SIGKILL)
    err = procs[0].communicate(timeout=60)[1]
    assert procs[0].returncode == 1
    assert time.time() - t0 < 25
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "rank(s) 1 stopped answering" in lines[0], err


def start_ranks(n, argv, env=None):
    """Starts argv as n ranks (torchrun-style variables) without waiting; returns the processes in rank order."""
    port = free_port()
    return [subprocess.Popen([str(a) for a in argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(n),
                                  "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                  "OMP_NUM_THREADS": "1"})
            for r in range(n)]


def checkpoint_tensors(run_dir):
    """Every tensor of the latest checkpoint's safetensors files (model shards, optimizer shards), by file and name."""
    from safetensors.torch import load_file
    root = run_dir / "checkpoints"
    ckpt = root / (root / "latest").read_text().strip()
    return {(f.name, k): v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def assert_same_checkpoint(a, b):
    import torch
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


RESUME_LAYOUTS = {  # name: ranks, settings; the CI set covers sharded optimizer, tensor+sequence, pipeline, context
    "dp2_zero1": (2, ["parallel.dp=2", "parallel.zero=1", "train.micro_batch_size=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true", "train.micro_batch_size=4"]),
    "pp2_interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=4"]),
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring", "train.micro_batch_size=4"]),
    "dp2_zero3": (2, ["parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=2"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_mode=a2a", "train.micro_batch_size=4"]),
    "hsdp_2x2": (4, ["parallel.dp=4", "parallel.zero=3", "parallel.hsdp_shard=2", "train.micro_batch_size=1"]),
    "dp2_tp2_pp2": (8, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=2"]),
}
RESUME_CI = {"dp2_zero1", "tp2_sp", "pp2_interleaved", "cp2_ring"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in RESUME_CI else pytest.mark.slow)
                                  for n in RESUME_LAYOUTS])
def test_layout_resume_is_bitwise(tmp_path, data_dir, name):
    """Stopped at step 4 of 8 and resumed in the same layout: every later loss and grad norm, and the final model and
    optimizer shards, equal the uninterrupted run's bitwise."""
    n, sets = RESUME_LAYOUTS[name]
    sets = sets + ["train.steps=8", "checkpoint.every=3", "eval.every=0"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    train_ranks(n, recipe(a, data_dir), sets)
    train_ranks(n, recipe(b, data_dir), sets + ["train.stop_at_step=4"])
    train_ranks(n, recipe(b, data_dir), sets, resume=True)
    ma, mb = metrics(a / "run"), metrics(b / "run")
    assert [m["step"] for m in mb] == list(range(1, 9))
    for x, y in zip(ma, mb):
        assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"]), (name, x["step"])
    assert_same_checkpoint(a / "run", b / "run")


def dist_kill_at_random_instants(tmp_path, data_dir, kills, seed):
    """Two ranks with a sharded optimizer (ZeRO-1), a checkpoint every step; at KILLS random instants (start-up,
    steps, sharded saves) both ranks are killed with SIGKILL, as a machine failure would, and the job is resumed;
    the result equals the uninterrupted job's bitwise (losses, model and optimizer shards)."""
    import random
    import signal
    import time
    steps = 4 * kills
    sets = ["parallel.dp=2", "parallel.zero=1", "train.micro_batch_size=2", f"train.steps={steps}",
            "checkpoint.every=1", "eval.every=0"]
    ref, run = tmp_path / "ref", tmp_path / "killed"
    ref.mkdir(), run.mkdir()
    train_ranks(2, recipe(ref, data_dir), sets)
    rec = recipe(run, data_dir)
    rng = random.Random(seed)
    root = run / "run" / "checkpoints"
    m = run / "run" / "metrics.jsonl"
    lines = lambda: len(m.read_text().splitlines()) if m.exists() else 0  # noqa: E731
    args = sum((["--set", s] for s in sets), [])
    killed = 0
    for _ in range(kills + 20):
        resume = ["--resume"] if (root / "latest").exists() else []
        procs = start_ranks(2, [LF_BIN, "train", rec, *args, *resume], {"LOONGFORGE_TEST_SAVE_DELAY_MS": "150"})
        if killed < kills:
            if rng.random() < 0.3:
                time.sleep(rng.uniform(0.0, 1.0))
            else:
                target, deadline = lines() + 1, time.time() + 120
                while all(p.poll() is None for p in procs) and lines() < target and time.time() < deadline:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 0.25))
            if all(p.poll() is None for p in procs):
                for p in procs:
                    p.send_signal(signal.SIGKILL)
                for p in procs:
                    p.wait()
                killed += 1
                continue
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"rank {r}: {err[-3000:]}"
        break
    assert killed == kills
    got, want = metrics(run / "run"), metrics(ref / "run")
    assert [x["step"] for x in got] == list(range(1, steps + 1))
    assert [x["loss"] for x in got] == [x["loss"] for x in want]
    assert_same_checkpoint(ref / "run", run / "run")


def test_dist_kill_at_random_instants_resumes_bitwise(tmp_path, data_dir):
    dist_kill_at_random_instants(tmp_path, data_dir, kills=4, seed=3)


@pytest.mark.slow
def test_dist_kill_at_random_instants_resumes_bitwise_long(tmp_path, data_dir):
    dist_kill_at_random_instants(tmp_path, data_dir, kills=20, seed=4)

"""`loongforge train`: resume is bitwise, saves are atomic, accumulation equals a larger batch, loss falls, and bad
recipes fail with one clear line."""
import json
import os
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import LF_BIN, ROOT, run_lf

MODEL = {
    "model_type": "llama", "vocab_size": 17, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    run_lf("data", "synth", "--task", "addition", "--docs", 3000, "--digits", 2, "--out", d)
    run_lf("data", "tokenize", "--tokenizer", d, "--input", d / "train.jsonl", "--out", d / "train")
    (d / "model.json").write_text(json.dumps(MODEL))
    return d


def recipe(tmp_path, data_dir, name="r.yaml", **extra):
    text = f"""
output_dir: {tmp_path / 'run'}
seed: 7
model:
  config: {data_dir / 'model.json'}
  tokenizer: {data_dir}
data:
  train:
    - path: {data_dir / 'train'}
  seq_len: 32
  valid_fraction: 0.05
train:
  steps: 6
  micro_batch_size: 4
  threads: 2
optim:
  lr: 3.0e-3
schedule:
  warmup_steps: 2
eval:
  every: 3
  batches: 2
log:
  progress: lines
  plot: false
"""
    p = tmp_path / name
    p.write_text(text)
    return p


def metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def latest(run_dir):
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def test_resume_is_bitwise(tmp_path, data_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ra, rb = recipe(a, data_dir), recipe(b, data_dir)
    run_lf("train", ra)
    run_lf("train", rb, "--set", "train.stop_at_step=3")
    assert [m["step"] for m in metrics(b / "run")] == [1, 2, 3]
    run_lf("train", rb, "--resume")
    ma, mb = metrics(a / "run"), metrics(b / "run")
    assert [m["step"] for m in mb] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(ma, mb):
        assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"] and x["lr"] == y["lr"]
        assert x.get("valid_loss") == y.get("valid_loss")
    wa, wb = load_file(str(latest(a / "run") / "model.safetensors")), load_file(str(latest(b / "run") / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa = load_file(str(latest(a / "run") / "optimizer.safetensors"))
    ob = load_file(str(latest(b / "run") / "optimizer.safetensors"))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)


def test_nonfinite_steps_stop_or_skip(tmp_path, data_dir):
    """A diverging run (lr 1e12, no clipping: step 1 blows the weights up, step 2's loss is NaN) never checkpoints
    NaN and never writes null: `stop` ends at step 2 with one line, the step-1 checkpoint the newest; `skip` drops
    steps 2.. (no weight, moment or optimizer-step change: every later checkpoint equals step 1's), counting them."""
    import math
    diverge = ["--set", "optim.lr=1e12", "--set", "optim.clip=0", "--set", "schedule.warmup_steps=0",
               "--set", "checkpoint.every=1", "--set", "eval.every=0", "--set", "train.steps=4"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    p = run_lf("train", recipe(a, data_dir), *diverge, check=False)
    assert p.returncode == 1, p.stderr
    err = p.stderr.strip().splitlines()[-1]
    assert "step 2: the loss is" in err and "train.on_nonfinite" in err and "step_00000001" in err, err
    assert latest(a / "run").name.endswith("1"), latest(a / "run")
    w = load_file(str(latest(a / "run") / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in w.values())
    assert [m["step"] for m in metrics(a / "run")] == [1]

    run_lf("train", recipe(b, data_dir), *diverge, "--set", "train.on_nonfinite=skip", "--set", "checkpoint.keep=10")
    m = metrics(b / "run")
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert math.isfinite(m[0]["loss"]) and "skipped_nonfinite" not in m[0]
    for x in m[1:]:
        assert x["skipped_nonfinite"] is True and isinstance(x["loss"], str), x
    assert m[-1]["nonfinite_steps"] == 3
    ck = b / "run" / "checkpoints"
    first = sorted(d for d in ck.iterdir() if d.name.startswith("step_"))
    assert [d.name for d in first] == [f"step_0000000{k}" for k in range(1, 5)]
    w1 = load_file(str(first[0] / "model.safetensors"))
    o1 = load_file(str(first[0] / "optimizer.safetensors"))
    w4, o4 = load_file(str(latest(b / "run") / "model.safetensors")), load_file(str(latest(b / "run") / "optimizer.safetensors"))
    assert all(torch.equal(w1[k], w4[k]) for k in w1)
    assert all(torch.equal(o1[k], o4[k]) for k in o1 if not k.startswith("rng"))
    from safetensors import safe_open
    with safe_open(str(first[0] / "optimizer.safetensors"), "pt") as f1, \
            safe_open(str(latest(b / "run") / "optimizer.safetensors"), "pt") as f4:
        assert f1.metadata()["optimizer_steps"] == f4.metadata()["optimizer_steps"] == "1"
    assert json.loads((latest(b / "run") / "trainer_state.json").read_text())["nonfinite_steps"] == 3


def test_checkpoint_pointers_stay_inside_their_folder(tmp_path, data_dir):
    """`latest` and the index files name files of their own folder only: a pointer outside it (../, an absolute
    path) is refused with one line naming the file, before anything is read from there."""
    import shutil
    r = recipe(tmp_path, data_dir)
    run_lf("train", r, "--set", "train.stop_at_step=3", "--set", "eval.every=0")
    root = tmp_path / "run" / "checkpoints"
    good = (root / "latest").read_text()
    outside = tmp_path / "elsewhere"
    shutil.copytree(root / good.strip(), outside)
    for bad in ["../../elsewhere", str(outside), "..", "step_00000003/../../../elsewhere"]:
        (root / "latest").write_text(bad + "\n")
        p = run_lf("train", r, "--resume", check=False)
        err = p.stderr.strip()
        assert p.returncode == 1 and "\n" not in err, (bad, err)
        assert str(root / "latest") in err and "not a folder of" in err, (bad, err)
    (root / "latest").write_text(good)
    # a model folder's index naming a shard outside the folder
    ck = root / good.strip()
    (outside / "model.safetensors").rename(outside / "stolen.safetensors")
    from safetensors import safe_open
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (ck / "model.safetensors").rename(ck / "model-00001.safetensors")
    index = {"metadata": {}, "weight_map": {n: "../../../elsewhere/stolen.safetensors" for n in names}}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    p = run_lf("train", r, "--resume", check=False)
    err = p.stderr.strip()
    assert p.returncode == 1 and "model.safetensors.index.json" in err and "not a file of this folder" in err, err


@pytest.mark.parametrize("victim,cut", [("model.safetensors", 100), ("optimizer.safetensors", 8),
                                        ("model.safetensors", 10**9)])
def test_truncated_checkpoint_is_refused(tmp_path, data_dir, victim, cut):
    """A checkpoint file cut short (a full disk, a copy interrupted) is refused with one line naming it."""
    import os
    r = recipe(tmp_path, data_dir)
    run_lf("train", r, "--set", "train.stop_at_step=3", "--set", "eval.every=0")
    f = latest(tmp_path / "run") / victim
    os.truncate(f, max(0, os.path.getsize(f) - cut))
    p = run_lf("train", r, "--resume", check=False)
    err = p.stderr.strip()
    assert p.returncode == 1 and "\n" not in err and str(f) in err, err


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, data_dir):
    """A save that cannot be written (here: files capped below the weights' size with RLIMIT_FSIZE, as a full disk
    refuses the write) ends with one line naming the path; the previous checkpoint stays complete and `latest`;
    resuming without the cap ends exactly where an uninterrupted run does."""
    import os
    import resource
    import signal
    import subprocess
    from conftest import LF_BIN
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    sets = ["--set", "checkpoint.every=1", "--set", "eval.every=0"]
    run_lf("train", recipe(a, data_dir), *sets)
    rb = recipe(b, data_dir)
    run_lf("train", rb, *sets, "--set", "train.stop_at_step=2")
    weights = os.path.getsize(latest(b / "run") / "model.safetensors")

    def capped():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the cap fail with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (weights // 2, weights // 2))
    p = subprocess.run([str(LF_BIN), "train", str(rb), *sets, "--resume"], capture_output=True, text=True,
                       preexec_fn=capped, env={**os.environ, "OMP_NUM_THREADS": "2"})
    err = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert str(b / "run" / "checkpoints") in err, err
    assert latest(b / "run").name == "step_00000002"
    run_lf("train", rb, *sets, "--resume")
    wa = load_file(str(latest(a / "run") / "model.safetensors"))
    wb = load_file(str(latest(b / "run") / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m["loss"] for m in metrics(a / "run")] == [m["loss"] for m in metrics(b / "run")]


def test_loss_falls_and_outputs_exist(tmp_path, data_dir):
    r = recipe(tmp_path, data_dir)
    run_lf("train", r, "--set", "train.steps=40", "--set", "eval.every=20", "--set", "log.plot=true",
           "--set", "optim.lr=1e-2")
    m = metrics(tmp_path / "run")
    assert len(m) == 40
    for k in ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu"):
        assert k in m[0]
    assert sum(x["loss"] for x in m[-5:]) / 5 < m[0]["loss"] - 0.5
    assert m[19]["valid_loss"] < m[0]["loss"]
    run_dir = tmp_path / "run"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ck = latest(run_dir)
    # a checkpoint is a Hugging Face folder: transformers loads it, and eval reproduces the last validation loss
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(ck)
    assert hf.config.vocab_size == 17
    out = json.loads(run_lf("eval", r, "--model", ck, "--set", "eval.batches=2").stdout)
    assert out["valid_loss"] == pytest.approx(m[-1]["valid_loss"], rel=1e-5)


def test_grad_accumulation_equals_larger_batch(tmp_path, data_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    common = ["--set", "train.steps=1", "--set", "data.valid_fraction=0", "--set", "eval.every=0"]
    run_lf("train", recipe(a, data_dir), *common, "--set", "train.micro_batch_size=8")
    run_lf("train", recipe(b, data_dir), *common, "--set", "train.micro_batch_size=2", "--set", "train.grad_accum=4")
    wa = load_file(str(latest(a / "run") / "model.safetensors"))
    wb = load_file(str(latest(b / "run") / "model.safetensors"))
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst <= 1e-6
    assert metrics(a / "run")[0]["loss"] == pytest.approx(metrics(b / "run")[0]["loss"], rel=1e-6)


def test_cpu_split_follows_one_piece(tmp_path, data_dir):
    """The micro-batch's rows split over 2 and 3 threads (train.cpu_split) give the losses and gradient norms of the
    unsplit run; a split run is deterministic; a negative value is a one-line error naming the field."""
    runs = {}
    for split in (1, 2, 3):
        d = tmp_path / f"s{split}"
        d.mkdir()
        run_lf("train", recipe(d, data_dir), "--set", "eval.every=0", "--set", f"train.cpu_split={split}")
        runs[split] = metrics(d / "run")
    again = tmp_path / "again"
    again.mkdir()
    run_lf("train", recipe(again, data_dir), "--set", "eval.every=0", "--set", "train.cpu_split=3")
    assert [m["loss"] for m in metrics(again / "run")] == [m["loss"] for m in runs[3]]
    for split in (2, 3):
        for x, y in zip(runs[split], runs[1]):
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), (split, x["step"])
            assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (split, x["step"])
    bad = run_lf("train", recipe(tmp_path, data_dir), "--set", "train.cpu_split=-1", check=False)
    assert bad.returncode != 0
    lines = [l for l in bad.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "train.cpu_split" in lines[0], bad.stderr


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, data_dir):
    r = recipe(tmp_path, data_dir)
    env = {**os.environ, "LOONGFORGE_TEST_SAVE_DELAY_MS": "1500"}
    proc = subprocess.Popen([str(LF_BIN), "train", str(r), "--set", "checkpoint.every=2", "--set", "eval.every=0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 120
    # wait until step 2 is complete and the save of step 4 has started, then kill hard
    while time.time() < deadline:
        if (root / "latest").exists() and (root / "latest").read_text().strip() == "step_00000002" and \
                any(p.name.startswith(".tmp-step_00000004") for p in root.iterdir()):
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the save of step 4 never started")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not (root / "step_00000004").exists()
    run_lf("train", r, "--set", "checkpoint.every=2", "--set", "eval.every=0", "--resume")
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


def kill_at_random_instants(tmp_path, data_dir, kills, seed, steps=None):
    """Trains STEPS steps (a checkpoint each step) while killing the process with SIGKILL at KILLS random instants
    (start-up, steps, saves), resuming each time; the result must equal the uninterrupted run bitwise. The instants
    are drawn relative to the run's progress (metrics lines written since the attempt started, then a random delay
    shorter than a step and its save), not as absolute times, so a fast machine cannot finish the run before the
    kills are spent."""
    import random
    steps = steps or 4 * kills
    ref, run = tmp_path / "ref", tmp_path / "killed"
    ref.mkdir(), run.mkdir()
    sets = ["--set", "checkpoint.every=1", "--set", "eval.every=0", "--set", f"train.steps={steps}"]
    run_lf("train", recipe(ref, data_dir), *sets)
    r = recipe(run, data_dir)
    rng = random.Random(seed)
    env = {**os.environ, "LOONGFORGE_TEST_SAVE_DELAY_MS": "150", "OMP_NUM_THREADS": "2"}
    root = run / "run" / "checkpoints"

    def lines():
        try:
            return len((run / "run" / "metrics.jsonl").read_text().splitlines())
        except FileNotFoundError:
            return 0

    done, killed = False, 0
    for _ in range(kills + 20):
        args = [str(LF_BIN), "train", str(r), *sets] + (["--resume"] if (root / "latest").exists() else [])
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if killed < kills:
            if rng.random() < 0.3:  # during start-up (or the first step on a fast machine)
                time.sleep(rng.uniform(0.0, 0.5))
            else:  # once a new step's metrics are written: during its save or the next step
                target = lines() + 1
                deadline = time.time() + 120
                while proc.poll() is None and lines() < target and time.time() < deadline:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 0.25))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed += 1
                continue
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        done = True
        break
    assert done and killed == kills, (done, killed)
    assert [m["step"] for m in metrics(run / "run")] == list(range(1, steps + 1))
    assert [m["loss"] for m in metrics(run / "run")] == [m["loss"] for m in metrics(ref / "run")]
    wa = load_file(str(latest(ref / "run") / "model.safetensors"))
    wb = load_file(str(latest(run / "run") / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    oa = load_file(str(latest(ref / "run") / "optimizer.safetensors"))
    ob = load_file(str(latest(run / "run") / "optimizer.safetensors"))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)


QWEN3_MOE = dict(MODEL, model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                 router_aux_loss_coef=0.01, output_router_logits=True)


@pytest.mark.parametrize("name,sets", [
    ("split+documents", ["data.per_document_attention=true"]),
    ("no split", ["train.cpu_split=1", "data.per_document_attention=true"]),
    ("accumulation", ["train.grad_accum=2", "data.per_document_attention=true"]),
    ("lora", ["lora.enabled=true", "lora.target_modules=[q_proj,v_proj]", "lora.dropout=0.1"]),
    ("bf16", ["precision=bf16"]),
    ("moe", ["moe.aux_loss_coef=0.01"]),
])
def test_resume_is_bitwise_for_every_step_feature(tmp_path, data_dir, name, sets):
    """Stop at step 4 of 8 and resume: every later loss, grad norm, validation loss and the final weights equal the
    uninterrupted run's bitwise, for each recipe feature that changes how a step is computed (the thread split with
    per-document attention, accumulation, the validation split, LoRA with dropout, bf16, MoE routing losses)."""
    sets = sum((["--set", x] for x in sets + ["train.steps=8", "eval.every=2", "checkpoint.every=3"]), [])
    if name == "moe":
        (tmp_path / "moe.json").write_text(json.dumps(QWEN3_MOE))
        sets += ["--set", f"model.config={tmp_path / 'moe.json'}"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    run_lf("train", recipe(a, data_dir), *sets)
    run_lf("train", recipe(b, data_dir), *sets, "--set", "train.stop_at_step=4")
    run_lf("train", recipe(b, data_dir), *sets, "--resume")
    ma, mb = metrics(a / "run"), metrics(b / "run")
    assert [m["step"] for m in mb] == list(range(1, 9))
    for x, y in zip(ma, mb):
        for k in ("loss", "grad_norm", "lr", "valid_loss"):
            assert x.get(k) == y.get(k), (name, x["step"], k, x.get(k), y.get(k))
    stem = "adapter_model" if name == "lora" else "model"
    wa = load_file(str(latest(a / "run") / f"{stem}.safetensors"))
    wb = load_file(str(latest(b / "run") / f"{stem}.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_kill_at_random_instants_resumes_bitwise(tmp_path, data_dir):
    kill_at_random_instants(tmp_path, data_dir, kills=6, seed=1)


@pytest.mark.slow
def test_kill_at_random_instants_resumes_bitwise_long(tmp_path, data_dir):
    kill_at_random_instants(tmp_path, data_dir, kills=24, seed=2)


@pytest.mark.parametrize("sets, needle", [
    (["train.stpes=5"], "did you mean 'train.steps'"),
    (["optim.lrr=1"], "did you mean 'optim.lr'"),
    (["train.steps=many"], "'train.steps': expected an integer"),
    (["precision=fp8"], "'precision': fp8 needs a CUDA GPU"),
    (["parallel.tp=2"], "parallel.tp"),
    (["model.family=no_such_family"], "recipe: field 'model.family': unknown family 'no_such_family' (known: decoder_lm, diffusion, policy, text_encoder, vlm)"),
    (["moe.z_loss_coef=0.1"], "recipe: field 'moe.z_loss_coef': the model has no mixture-of-experts layers"),
    (["data.train=[{path: /nonexistent/shard}]"], "/nonexistent/shard"),
])
def test_bad_recipe_one_line(tmp_path, data_dir, sets, needle):
    r = recipe(tmp_path, data_dir)
    args = sum((["--set", s] for s in sets), [])
    proc = run_lf("train", r, *args, check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_bad_recipe_file(tmp_path, data_dir):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  steps: 5\n  micro_batch: 4\n")
    proc = run_lf("train", p, check=False)
    assert proc.returncode == 1 and "bad.yaml" in proc.stderr and "train.micro_batch_size" in proc.stderr
    p.write_text("train: [1, 2\n")
    proc = run_lf("train", p, check=False)
    assert proc.returncode == 1 and "bad.yaml" in proc.stderr and "line" in proc.stderr


def test_recompute_gives_the_same_training(tmp_path, data_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    common = ["--set", "train.steps=2", "--set", "eval.every=0"]
    run_lf("train", recipe(a, data_dir), *common)
    run_lf("train", recipe(b, data_dir), *common, "--set", "model.recompute=full")
    wa = load_file(str(latest(a / "run") / "model.safetensors"))
    wb = load_file(str(latest(b / "run") / "model.safetensors"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6
    assert [m["loss"] for m in metrics(a / "run")] == pytest.approx([m["loss"] for m in metrics(b / "run")], rel=1e-6)


def test_bf16_trains(tmp_path, data_dir):
    r = recipe(tmp_path, data_dir)
    run_lf("train", r, "--set", "precision=bf16", "--set", "train.steps=20", "--set", "optim.lr=1e-2",
           "--set", "eval.every=0")
    m = metrics(tmp_path / "run")
    assert m[-1]["loss"] < m[0]["loss"] - 0.3


def test_lora_run_resumes_and_loads_in_peft(tmp_path, data_dir):
    import peft
    import transformers
    torch.manual_seed(0)
    base = tmp_path / "base"
    cfg = transformers.AutoConfig.for_model(**MODEL)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(base)
    lora = ["--set", f"model.path={base}", "--set", "model.config=", "--set", "lora.enabled=true",
            "--set", "lora.r=4", "--set", "lora.target_modules=[q_proj,v_proj,down_proj]", "--set", "eval.every=0",
            "--set", "optim.lr=1e-2"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    run_lf("train", recipe(a, data_dir), *lora)
    run_lf("train", recipe(b, data_dir), *lora, "--set", "train.stop_at_step=3")
    run_lf("train", recipe(b, data_dir), *lora, "--resume")
    assert [m["loss"] for m in metrics(a / "run")] == [m["loss"] for m in metrics(b / "run")]
    ck = latest(a / "run")
    assert (ck / "adapter_config.json").exists() and not (ck / "model.safetensors").exists()
    assert metrics(a / "run")[-1]["loss"] < metrics(a / "run")[0]["loss"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    ids = torch.randint(3, 17, (2, 12))
    with torch.no_grad():
        before = hf(input_ids=ids).logits
        model = peft.PeftModel.from_pretrained(hf, ck)
        after = model(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-4  # the adapter learned something
    from safetensors.torch import save_file
    save_file({"input_ids": ids}, str(tmp_path / "batch.safetensors"))
    run_lf("dump", "--model", base, "--lora", ck, "--batch", tmp_path / "batch.safetensors", "--out", tmp_path / "o.st")
    ours = load_file(str(tmp_path / "o.st"))["logits"]
    assert ((ours - after).abs().max() / after.abs().max()).item() <= 1e-5


def test_train_matches_dump_steps_on_fixture(tmp_path):
    """`dump --steps 10` on tests/fixtures/hf_llama equals a 10-step `train` on the same batch and settings. Both take
    the batch in one piece (train.cpu_split: 1): with eps 1e-8, AdamW turns the rounding of another summation order
    into ~1e-6 weight differences in elements whose gradients nearly cancel; the split itself is checked against one
    piece in tests/cpp/test_thread_split.cpp and test_cpu_split_follows_one_piece below."""
    from safetensors.torch import save_file
    from conftest import FIXTURES
    ref = load_file(str(FIXTURES / "hf_llama" / "reference.safetensors"))
    batch = tmp_path / "batch.safetensors"
    save_file({"input_ids": ref["input_ids"], "labels": ref["labels"]}, str(batch))
    run_lf("dump", "--model", FIXTURES / "hf_llama", "--batch", batch, "--out", tmp_path / "dump.st",
           "--adamw", "lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1", "--steps", 10, "--clip", 1.0)
    dump = load_file(str(tmp_path / "dump.st"))
    r = tmp_path / "r.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {FIXTURES / 'hf_llama'}}}
data: {{format: batch, train: [{{path: {batch}}}], seq_len: 24}}
train: {{steps: 10, micro_batch_size: 2, cpu_split: 1}}
optim: {{lr: 1.0e-3, beta1: 0.9, beta2: 0.95, eps: 1.0e-8, weight_decay: 0.1, no_decay: [], clip: 1.0}}
schedule: {{kind: constant}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    run_lf("train", r)
    m = metrics(tmp_path / "run")
    assert torch.allclose(torch.tensor([x["loss"] for x in m], dtype=torch.float64), dump["losses"].double(), rtol=1e-6, atol=0)
    assert torch.allclose(torch.tensor([x["grad_norm"] for x in m], dtype=torch.float64), dump["grad_norms"].double(), rtol=1e-5, atol=0)
    w = load_file(str(latest(tmp_path / "run") / "model.safetensors"))
    for k, v in w.items():
        assert (v - dump["after_step." + k]).abs().max().item() <= 1e-6, k


@pytest.mark.parametrize("template,what", [
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed deeper than"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "bytes (the limit is"),
])
def test_sft_hostile_chat_template(tmp_path, template, what):
    """A chat template is an untrusted program: a recursive macro (once a segmentation fault) or a loop doubling a
    string (once memory exhaustion) as a recipe's data.chat_template ends the run with one line naming the file."""
    import shutil
    from conftest import FIXTURES
    tok = tmp_path / "tok"
    shutil.copytree(FIXTURES / "tok_bytelevel_gpt2", tok)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "hello"}]}) + "\n")
    (tmp_path / "evil.jinja").write_text(template)
    (tmp_path / "model.json").write_text(json.dumps(dict(MODEL, vocab_size=2000)))
    r = tmp_path / "sft.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{config: {tmp_path / 'model.json'}, tokenizer: {tok}}}
data: {{format: sft, train: [{{path: {tmp_path / 'chat.jsonl'}}}], seq_len: 64, chat_template: {tmp_path / 'evil.jinja'}}}
train: {{steps: 2, micro_batch_size: 1, threads: 1}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    p = run_lf("train", r, check=False)
    assert p.returncode == 1, (p.returncode, p.stderr)
    err = p.stderr.strip().splitlines()[-1]
    assert "evil.jinja:1:" in err and what in err, p.stderr


def test_sft_tokenizer_past_the_model_vocabulary_is_one_line(tmp_path):
    """A tokenizer whose ids go past the model's vocab_size (another model's): one line naming the tokenizer folder and
    the id (it was an internal error from the embedding)."""
    import shutil
    from conftest import FIXTURES
    tok = tmp_path / "tok"
    shutil.copytree(FIXTURES / "tok_bytelevel_gpt2", tok)
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"}))
    line = {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]}
    (tmp_path / "chat.jsonl").write_text((json.dumps(line) + "\n") * 8)
    (tmp_path / "model.json").write_text(json.dumps(dict(MODEL, vocab_size=100, hidden_size=32, intermediate_size=64)))
    r = tmp_path / "sft.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{config: {tmp_path / 'model.json'}, tokenizer: {tok}}}
data: {{format: sft, train: [{{path: {tmp_path / 'chat.jsonl'}}}], seq_len: 64}}
train: {{steps: 2, micro_batch_size: 2, threads: 1}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    res = run_lf("train", r, check=False)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr[-2000:]
    assert str(tok) in lines[0] and "token id" in lines[0] and "vocabulary of 100" in lines[0], lines[0]


def test_sft_trains_on_chat_data(tmp_path):
    """SFT from alpaca / sharegpt / OpenAI-messages lines with a ChatML template, loss on assistant tokens only."""
    import shutil
    from conftest import FIXTURES
    tok = tmp_path / "tok"
    shutil.copytree(FIXTURES / "tok_bytelevel_gpt2", tok)
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))
    lines = []
    for i in range(40):
        a, b = i % 7, (i * 3) % 5
        lines.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                   {"role": "assistant", "content": f"It is {a + b}."}]})
        lines.append({"instruction": f"Repeat the word number {i % 4}", "input": "", "output": f"word {i % 4}"})
        lines.append({"conversations": [{"from": "human", "value": "Say hello"}, {"from": "gpt", "value": "Hello!"}]})
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    model = dict(MODEL, vocab_size=2000, hidden_size=64, intermediate_size=128, max_position_embeddings=256)
    (tmp_path / "model.json").write_text(json.dumps(model))
    r = tmp_path / "sft.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{config: {tmp_path / 'model.json'}, tokenizer: {tok}}}
data: {{format: sft, train: [{{path: {tmp_path / 'chat.jsonl'}}}], seq_len: 96, packing: true}}
train: {{steps: 30, micro_batch_size: 4, threads: 2}}
optim: {{lr: 3.0e-3}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    run_lf("train", r)
    m = metrics(tmp_path / "run")
    assert m[-1]["loss"] < m[0]["loss"] - 1.0
    # the checkpoint answers like its training data
    ck = latest(tmp_path / "run")
    assert (ck / "tokenizer_config.json").exists()

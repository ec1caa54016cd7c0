"""DeepSeek-V3 multi-token prediction (MTP) layers (GLM-4-MoE's are the same) (models/llama/mtp.h) against transformers 5.24's MtpModel, fp32 on
the CPU: a folder whose safetensors hold the MTP layers under the checkpoint's names (model.layers.{L+k}.*) loads
them, `dump`'s teacher-forced mtp_logits.k equal MtpModel.forward_layer + the shared head, `convert` writes them back
under the same names, a folder without them loads the main model alone; `loongforge train` with
model.mtp_loss_weight trains them (the MTP loss goes down, reported in the metrics line; dp2 = one process) and
`generate --mtp` (speculative decoding: MTP drafts, the main model verifies) gives plain greedy's ids."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

from conftest import LF_BIN, launch_ranks, run_lf
from test_deepseek_parity import make_model
from test_model_parity import make_batch, rel_err, run_dump
from test_moe_parity import write_periodic_shard
from test_moe_train import write_recipe

L = 2  # main layers of the tiny models (test_deepseek_parity's BASE); layer 0 dense, the rest and the MTP blocks MoE


def glm4_moe_model(overrides, seed=0):
    """A tiny GLM-4-MoE (test_new_moe_parity's, L layers, the first dense): the same MTP layers as DeepSeek-V3."""
    from test_new_moe_parity import CASES as MOE_CASES, make_model as make_moe_model
    return make_moe_model({**MOE_CASES["glm4_moe_qk_norm_bias"], "num_hidden_layers": L, **overrides}, seed)


def write_mtp_folder(path, overrides, depths, copies=False, make_model=make_model):
    """A tiny DeepSeek-V3 folder with `depths` MTP layers in the checkpoint's layout. The MTP blocks are the MoE
    layers L.. of a deeper model saved by transformers (so they carry its checkpoint names), plus enorm / hnorm /
    eh_proj / shared_head.norm; with `copies` also DeepSeek's embed_tokens / shared_head.head copies beside them."""
    main = make_model(dict(overrides, num_mtp_layers=depths))
    main.save_pretrained(path)
    deep = make_model(dict(overrides, num_hidden_layers=L + depths, num_mtp_layers=depths), seed=1)
    deep.save_pretrained(path / "deep")
    sd = load_file(str(path / "model.safetensors"))
    deep_sd = load_file(str(path / "deep" / "model.safetensors"))
    h = main.config.hidden_size
    g = torch.Generator().manual_seed(3)
    for k in range(depths):
        p = f"model.layers.{L + k}."
        sd.update({n: t for n, t in deep_sd.items() if n.startswith(p)})
        for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            sd[p + n] = 1 + 0.2 * torch.randn(h, generator=g)
        sd[p + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
        if copies:
            sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
            sd[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    for f in (path / "deep").iterdir():
        f.unlink()
    (path / "deep").rmdir()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == depths and cfg["num_hidden_layers"] == L
    return sd


def load_reference(path, depths):
    """transformers' main model and its MtpModel from the folder (deepseek_v3 names only layer 61 as MTP weights:
    the instance is told about layers L.. of this small model)."""
    main = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L + k}\..*" for k in range(depths)]
    return main.eval(), MtpModel.from_pretrained(main).eval()


def reference_mtp_logits(main, mtp, ids):
    """Depth k's logits at positions 0..T-k-2 with the sequence's own tokens (teacher forcing), as
    MtpCandidateGenerator drives forward_layer: the input ids and position ids one token ahead per depth, the main
    model's last hidden state (after its final norm) for depth 0, depth k-1's output after."""
    b, t = ids.shape
    pos = torch.arange(t)[None].expand(b, t)
    out = []
    with torch.no_grad():
        prev = main(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        for k in range(len(mtp.layers)):
            n = t - k - 1
            prev = mtp.forward_layer(k, prev[:, :n], pos[:, k + 1:], None, input_ids=ids[:, k + 1:])
            out.append(mtp._project_to_logits(prev))
        # the drafting entry point: its depth-0 logits at the last position are the same quantity
        _, drafted, _ = mtp(input_ids=ids[:, 1:], last_hidden_states=main.model(input_ids=ids).last_hidden_state[:, :-1],
                            attention_mask=None, position_ids=pos[:, 1:], mtp_cache=None)
    assert rel_err(drafted[:, 0], out[0][:, -1]) <= 1e-6
    return out


CASES = {
    "q_lora_2_depths": (dict(), 2),
    "glm4_moe_1_depth": (dict(), 1),
    "q_proj_yarn_1_depth": (dict(q_lora_rank=None, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                                                        factor=4.0, original_max_position_embeddings=32,
                                                                        mscale=0.8, mscale_all_dim=0.7)), 1),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("q_proj") else c
                                  for c in sorted(CASES)])
def test_mtp_logits_match_transformers(case, tmp_path):
    overrides, depths = CASES[case]
    write_mtp_folder(tmp_path / "model", overrides, depths, copies=case.startswith("q_lora"),
                     make_model=glm4_moe_model if case.startswith("glm4_moe") else make_model)
    main, mtp = load_reference(tmp_path / "model", depths)
    ids, labels = make_batch(main.config.vocab_size, t=20)
    ref = reference_mtp_logits(main, mtp, ids)
    ours = run_dump(tmp_path / "model", ids, labels, tmp_path)
    with torch.no_grad():
        assert rel_err(ours["logits"], main(input_ids=ids).logits) <= 1e-5
    assert sorted(k for k in ours if k.startswith("mtp_logits.")) == [f"mtp_logits.{k}" for k in range(depths)]
    for k in range(depths):
        assert ours[f"mtp_logits.{k}"].shape == ref[k].shape
        assert rel_err(ours[f"mtp_logits.{k}"], ref[k]) <= 1e-5, k
    # the dump loss is transformers' causal-LM loss (MTP layers not in it: their gradients are zero)
    assert all(ours[n].abs().max() == 0 for n in ours if n.startswith(f"grad.model.layers.{L}."))


def test_mtp_export_keeps_checkpoint_names(tmp_path):
    sd = write_mtp_folder(tmp_path / "model", {}, 2, copies=True)
    run_lf("convert", "--model", tmp_path / "model", "--out", tmp_path / "out", "--dtype", "fp32")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    mtp_keys = {n for n in sd if n.startswith((f"model.layers.{L}.", f"model.layers.{L + 1}."))}
    copies = {n for n in mtp_keys if n.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    assert copies and {n for n in out if n.startswith("model.layers.") and int(n.split(".")[2]) >= L} == mtp_keys - copies
    for n in mtp_keys - copies:
        assert torch.equal(out[n], sd[n]), n
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    _, mtp = load_reference(tmp_path / "out", 2)  # transformers loads the exported MTP layers
    assert torch.equal(mtp.layers[1].post_norm.weight, sd[f"model.layers.{L + 1}.shared_head.norm.weight"])


def test_folder_without_mtp_weights_loads_the_main_model(tmp_path):
    model = make_model(dict(num_mtp_layers=1))
    model.save_pretrained(tmp_path / "model")
    ids, labels = make_batch(model.config.vocab_size, t=12)
    ours = run_dump(tmp_path / "model", ids, labels, tmp_path)
    assert not any(k.startswith("mtp_logits") for k in ours)
    with torch.no_grad():
        assert rel_err(ours["logits"], model(input_ids=ids).logits) <= 1e-5
    r = tmp_path / "r.yaml"
    r.write_text(f"model:\n  path: {tmp_path / 'model'}\n  mtp_loss_weight: 0.3\ndata:\n  format: batch\n")
    p = run_lf("train", r, "--set", f"output_dir={tmp_path / 'o'}", check=False)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "loongforge: error: recipe: field 'model.mtp_loss_weight': the checkpoint lacks the model's 1 multi-token prediction "
        f"layer(s) (model.layers.{L}.* absent)")
    p = run_lf("generate", "--model", tmp_path / "model", "--prompt-ids", "1,2", "--mtp", "--ids", check=False)
    assert p.returncode == 1 and "generate --mtp: the model has no multi-token prediction layers" in p.stderr


# test_moe_train's recipe (tiny DeepSeek-V3, periodic token shard) with the MTP loss on, 12 steps, a checkpoint at 6
MTP = ["--set", "model.mtp_loss_weight=0.5", "--set", "train.steps=12", "--set", "train.grad_accum=1",
       "--set", "moe.bias_update_rate=0", "--set", "checkpoint.every=6"]


def metrics(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def write_model_and_data(tmp_path):
    sd = write_mtp_folder(tmp_path / "model", {}, 2)
    pattern = torch.randint(3, 256, (8,), generator=torch.Generator().manual_seed(5)).tolist()
    write_periodic_shard(tmp_path / "train", pattern, 60)
    return sd, pattern


def test_train_mtp_loss_goes_down_and_drafts_get_accepted(tmp_path):
    sd, pattern = write_model_and_data(tmp_path)
    run_lf("train", write_recipe(tmp_path, tmp_path / "model", "one"), *MTP)
    one = metrics(tmp_path / "one")
    mtp = [m["mtp_loss"] for m in one]
    assert mtp[-1] < 0.5 * mtp[0], mtp
    ck = load_file(str(tmp_path / "one" / "checkpoints" / "step_00000012" / "model.safetensors"))
    assert not torch.equal(ck[f"model.layers.{L}.eh_proj.weight"], sd[f"model.layers.{L}.eh_proj.weight"])
    # trained MTP layers draft what the main model says: speculative decoding accepts drafts (all of them after 12
    # steps on the pattern; some after 6, on another prompt: rejected drafts mid-way), plain greedy's ids each time
    for step, prompt, accept in ((12, pattern * 2, lambda a, d: a == d), (6, [17, 42, 99, 5, 250], lambda a, d: 0 < a < d)):
        ckpt = tmp_path / "one" / "checkpoints" / f"step_{step:08d}"
        args = ("generate", "--model", ckpt, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", 20, "--ids")
        plain = json.loads(run_lf(*args).stdout)
        spec = run_lf(*args, "--mtp")
        assert json.loads(spec.stdout) == plain and len(plain) == 20
        words = spec.stderr.strip().splitlines()[-1].split()
        assert accept(int(words[4]), int(words[6])), (step, spec.stderr)


@pytest.mark.slow
def test_train_dp2_equals_one_process(tmp_path):
    write_model_and_data(tmp_path)
    run_lf("train", write_recipe(tmp_path, tmp_path / "model", "one"), *MTP, "--set", "train.steps=3")
    res = launch_ranks(2, [LF_BIN, "train", write_recipe(tmp_path, tmp_path / "model", "dp2", "parallel:\n  dp: 2"),
                           *MTP, "--set", "train.micro_batch_size=1", "--set", "train.steps=3"], threads=1)
    for r in res:
        assert r.returncode == 0, r.stderr
    one = metrics(tmp_path / "one")
    for a, b in zip(one, metrics(tmp_path / "dp2"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["mtp_loss"] - b["mtp_loss"]) <= 1e-5 * abs(a["mtp_loss"])
    # the distributed checkpoint writer keeps the checkpoint's names: the MTP layers as one process writes them
    ck = [{n: t for f in sorted((tmp_path / r / "checkpoints" / "step_00000003").glob("model*.safetensors"))
           for n, t in load_file(str(f)).items()} for r in ("one", "dp2")]
    assert sorted(ck[0]) == sorted(ck[1]) and f"model.layers.{L + 1}.shared_head.norm.weight" in ck[1]
    for n in ck[0]:  # (AdamW's g / sqrt(v) magnifies last-bit gradient differences where gradients are tiny)
        assert rel_err(ck[1][n], ck[0][n]) <= 1e-3, n


def test_mtp_layout_errors(tmp_path):
    write_mtp_folder(tmp_path / "model", {}, 1)
    r = write_recipe(tmp_path, tmp_path / "model", "o")
    p = run_lf("train", r, *MTP, "--set", "parallel.tp=2", check=False)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith(
        "loongforge: error: recipe: field 'parallel.tp': the multi-token prediction loss")


@pytest.mark.slow  # (the training test checks speculative decoding with all and some drafts accepted)
def test_speculative_generate_equals_greedy(tmp_path):
    write_mtp_folder(tmp_path / "model", dict(bos_token_id=1, eos_token_id=2), 2)
    prompt = "1,17,42,99,5,250,31"
    plain = run_lf("generate", "--model", tmp_path / "model", "--prompt-ids", prompt, "--max-new-tokens", 24, "--ids")
    spec = run_lf("generate", "--model", tmp_path / "model", "--prompt-ids", prompt, "--max-new-tokens", 24, "--ids",
                  "--mtp")
    got, want = json.loads(spec.stdout), json.loads(plain.stdout)
    assert got == want and len(want) >= 8
    line = spec.stderr.strip().splitlines()[-1]
    assert line.startswith("generate: mtp drafts accepted ") and f"for {len(got)} tokens" in line


@pytest.mark.slow
def test_train_resume_is_bitwise(tmp_path):
    """A run stopped at step 3 and resumed (its checkpoint holds the MTP layers under the checkpoint's names) gives
    the uninterrupted run's losses, MTP losses and weights."""
    write_model_and_data(tmp_path)
    run_lf("train", write_recipe(tmp_path, tmp_path / "model", "a"), *MTP, "--set", "train.steps=5")
    rb = write_recipe(tmp_path, tmp_path / "model", "b")
    run_lf("train", rb, *MTP, "--set", "train.steps=5", "--set", "train.stop_at_step=3")
    run_lf("train", rb, *MTP, "--set", "train.steps=5", "--resume")
    ma, mb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [m["step"] for m in mb] == [1, 2, 3, 4, 5]
    assert [(m["loss"], m["mtp_loss"]) for m in ma] == [(m["loss"], m["mtp_loss"]) for m in mb]
    wa, wb = (load_file(str(tmp_path / r / "checkpoints" / "step_00000005" / "model.safetensors")) for r in "ab")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

"""A DiT trains through the same trainer as the LLMs (issue 20): `loongforge train` on a batch file of the model's
own tensors (hidden_states, timestep, class_labels, target; `data.format: batch`) gives the losses of diffusers'
model under torch's AdamW on the same batch, step by step, and its checkpoint is a diffusers folder holding the
parameters torch ends with."""
import json

import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import save_file

from conftest import run_lf
from test_dit_parity import make_batch, make_dit


def test_train_on_a_batch_matches_torch_adamw(tmp_path):
    model = make_dit(tmp_path / "m").train()
    batch = make_batch(model, n=3)
    save_file(batch, str(tmp_path / "b.safetensors"))
    steps, lr, wd = 3, 1e-3, 0.1
    (tmp_path / "r.yaml").write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {tmp_path / 'm'}}}
data: {{format: batch, train: [{{path: {tmp_path / 'b.safetensors'}}}], seq_len: 16}}
train: {{steps: {steps}, micro_batch_size: 3, threads: 2}}
optim: {{lr: {lr}, weight_decay: {wd}, no_decay: [], clip: 0.0}}
schedule: {{kind: constant}}
checkpoint: {{every: {steps}}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    run_lf("train", tmp_path / "r.yaml")
    ours = [json.loads(l)["loss"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    model.eval()  # no label dropout: the conditions are the batch's
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    c = model.config.in_channels
    ref = []
    for _ in range(steps):
        out = model(batch["hidden_states"], timestep=batch["timestep"], class_labels=batch["class_labels"]).sample
        loss = ((out[:, :c] - batch["target"]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)
    ck = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    back = DiTTransformer2DModel.from_pretrained(ck)
    want = dict(model.named_parameters())
    for n, p in back.named_parameters():
        if n.endswith("to_k.bias"):  # its gradient is rounding noise (test_dit_parity.check_grad)
            continue
        assert (p - want[n]).abs().max() <= 1e-5, n

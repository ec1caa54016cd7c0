"""Class-conditional image folders for diffusion training (issue 20): `data.format: images` reads ROOT/<class>/<image>
(classes numbered in sorted order, as torchvision's ImageFolder), makes each image square as DiT's center_crop_arr
does with Pillow (BOX halvings, BICUBIC resize, centre crop; or a crop at offsets the row draws, `data.random_crop`),
flips it left-right when `data.random_flip` draws so,
scales it to [-1, 1] and feeds it as clean `latents` to the diffusion objective: the first step's loss equals
diffusers' DiT on the images as Pillow and torch prepare them, in the documented stream order. Bad images and
folders are one line."""
import json

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image
from safetensors.torch import save_file

from conftest import run_lf
from test_diffusion_objective import SEED, row_seed
from test_dit_parity import make_dit

M64 = 2 ** 64 - 1


def mix(a, b):
    return (a * 6364136223846793005 + b * 1442695040888963407 + 1) & M64


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def stream_order(n, seed, epoch):
    order, state = list(range(n)), mix(seed, epoch)
    for i in range(n - 1, 0, -1):
        state, r = splitmix64(state)
        j = r % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def flipped(seed, k):
    return splitmix64(mix(seed ^ 0x5f1f5f1f5f1f5f1f, k))[1] & 1


def center_crop_arr(pil_image, image_size, offsets=None):
    """DiT's (ADM's) preprocessing; with `offsets` (room -> offset) the square is cut at the offsets it gives."""
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.array(pil_image)
    crop_y = (arr.shape[0] - image_size) // 2
    crop_x = (arr.shape[1] - image_size) // 2
    if offsets:
        crop_y = offsets(arr.shape[0] - image_size)
        crop_x = offsets(arr.shape[1] - image_size)
    return Image.fromarray(arr[crop_y: crop_y + image_size, crop_x: crop_x + image_size])


def crop_offsets(seed, k):
    """The row's crop offsets: SplitMix64 from mix(seed ^ 0x3c3c3c3c3c3c3c3c, k), next() mod (room + 1)."""
    state = [mix(seed ^ 0x3c3c3c3c3c3c3c3c, k)]

    def offset(room):
        state[0], r = splitmix64(state[0])
        return r % (room + 1)
    return offset


def make_folders(root):
    g = np.random.default_rng(0)
    files = []
    for c, name in enumerate(["cat", "dog", "emu"]):
        (root / name).mkdir(parents=True)
        for i, (w, h) in enumerate([(50, 70), (33, 20), (40, 40)][: 2 + (c == 1)]):
            f = root / name / f"{i}.{'jpg' if i == 1 else 'png'}"
            Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(f)
            files.append((f, c))
    return sorted(files, key=lambda x: (x[1], str(x[0])))


@pytest.mark.parametrize("flip,crop", [(False, False), (True, False), (True, True)])
def test_first_loss_matches_pillow_and_diffusers(tmp_path, flip, crop):
    model = make_dit(tmp_path / "m", num_embeds_ada_norm=3, in_channels=3, out_channels=6, sample_size=8)
    files = make_folders(tmp_path / "imgs")
    n, res = len(files), 8
    (tmp_path / "r.yaml").write_text(f"""
output_dir: {tmp_path / 'run'}
seed: {SEED}
model: {{path: {tmp_path / 'm'}}}
data: {{format: images, train: [{{path: {tmp_path / 'imgs'}}}], resolution: {res}, random_flip: {str(flip).lower()},
       random_crop: {str(crop).lower()}}}
train: {{steps: 1, micro_batch_size: {n}, threads: 1}}
optim: {{lr: 0.0}}
diffusion: {{objective: flow_matching, shift: 2.0}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    run_lf("train", tmp_path / "r.yaml")
    ours = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    order = stream_order(n, SEED, 0)
    sched = FlowMatchEulerDiscreteScheduler(shift=2.0)
    losses = []
    with torch.no_grad():
        for k in range(n):
            f, label = files[order[k]]
            img = np.array(center_crop_arr(Image.open(f).convert("RGB"), res, crop_offsets(SEED, k) if crop else None))
            if flip and flipped(SEED, k):
                img = img[:, ::-1]
            x = torch.from_numpy(img.copy()).permute(2, 0, 1).float() / 255.0
            x = ((x - 0.5) / 0.5)[None]
            g = torch.Generator().manual_seed(row_seed(SEED, k))
            u = torch.rand(1, generator=g)
            noise = torch.randn(x.shape, generator=g)
            i = int((u * 1000).long())
            sigma, t = sched.sigmas[i], sched.timesteps[i:i + 1]
            pred = model((1 - sigma) * x + sigma * noise, timestep=t, class_labels=torch.tensor([label])).sample[:, :3]
            losses.append(((pred - (noise - x)) ** 2).mean().item())
    ref = sum(losses) / n
    assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)


def test_bad_image_folders_are_one_line(tmp_path):
    make_dit(tmp_path / "m", num_embeds_ada_norm=3, in_channels=3, out_channels=6, sample_size=8)
    make_folders(tmp_path / "imgs")
    (tmp_path / "imgs" / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    r = tmp_path / "r.yaml"
    r.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{path: {tmp_path / 'm'}}}
data: {{format: images, train: [{{path: {tmp_path / 'imgs'}}}], resolution: 8}}
train: {{steps: 1, micro_batch_size: 2}}
diffusion: {{objective: flow_matching}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    err = run_lf("train", r, check=False).stderr
    assert "broken.png" in err and len(err.strip().splitlines()) == 1, err
    err = run_lf("train", r, "--set", f"data.train=[{{path: {tmp_path / 'nowhere'}}}]", check=False).stderr
    assert "nowhere" in err and len(err.strip().splitlines()) == 1, err

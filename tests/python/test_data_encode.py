"""`loongforge data encode` (issue 20): an image folder becomes latent shards — each row the VAE's posterior mean of
DiT's preprocessing of the image (Pillow), normalized as the pipelines feed the denoiser ((z - shift) * scale), equal
to diffusers' AutoencoderKL; mirrored copies with --flip; a rerun continues an interrupted encoding and refuses other
arguments or a folder it did not make; `data.format: latents` trains on the shards in the documented stream order
(first loss = diffusers' DiT on those latents), with data.random_flip taking the mirrored rows; latents of another
VAE (channel count) are one line naming the shard and field."""
import json
import struct
import zlib

import numpy as np
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
from PIL import Image
from safetensors.torch import load_file

from conftest import run_lf
from test_diffusion_objective import SEED, row_seed
from test_dit_parity import make_dit
from test_image_folder import center_crop_arr, crop_offsets, flipped, make_folders, stream_order
from test_vae_parity import make_vae

RES = 16


def make_parts(tmp_path, latent_channels=4):
    vae = make_vae(block_out_channels=(8, 8), latent_channels=latent_channels, norm_num_groups=4,
                   layers_per_block=1, scaling_factor=0.7, shift_factor=0.05).eval()
    vae.save_pretrained(tmp_path / "vae")
    return vae, make_folders(tmp_path / "imgs")


def encode(tmp_path, *extra, check=True, out="lat", res=RES):
    return run_lf("data", "encode", "--images", tmp_path / "imgs", "--vae", tmp_path / "vae", "--out", tmp_path / out,
                  "--resolution", res, "--shard-size", 3, "--batch", 2, *extra, check=check)


def reference_latents(vae, files, flip=False):
    xs = []
    for f, _ in files:
        img = np.array(center_crop_arr(Image.open(f).convert("RGB"), RES))
        if flip:
            img = img[:, ::-1]
        xs.append(torch.from_numpy(img.copy()).permute(2, 0, 1).float() / 127.5 - 1)
    with torch.no_grad():
        z = vae.encode(torch.stack(xs)).latent_dist.mean
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


def read_all(folder):
    idx = json.loads((folder / "encode.json").read_text())
    parts = [load_file(str(folder / s)) for s in idx["shards"]]
    return idx, {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def test_encode_matches_diffusers_and_resumes(tmp_path):
    vae, files = make_parts(tmp_path)
    out = encode(tmp_path, "--flip").stdout
    assert "7 latents" in out and "3 shards" in out, out
    idx, t = read_all(tmp_path / "lat")
    assert idx["complete"] and idx["latent_channels"] == 4 and len(idx["shards"]) == 3
    want = reference_latents(vae, files)
    assert (t["latents"] - want).abs().max() <= 1e-5 * want.abs().max()
    want_flip = reference_latents(vae, files, flip=True)
    assert (t["latents_flip"] - want_flip).abs().max() <= 1e-5 * want_flip.abs().max()
    assert t["class_labels"].tolist() == [c for _, c in files]

    # an interrupted run (its last shard never finished) continues where it stopped, leaving the others as they were
    first = (tmp_path / "lat" / idx["shards"][0]).stat().st_mtime_ns
    idx["shards"].pop()
    idx["complete"] = False
    (tmp_path / "lat" / "encode.json").write_text(json.dumps(idx))
    (tmp_path / "lat" / "shard_00002.safetensors").unlink()
    encode(tmp_path, "--flip")
    idx2, t2 = read_all(tmp_path / "lat")
    assert idx2["complete"] and len(idx2["shards"]) == 3
    assert (tmp_path / "lat" / idx["shards"][0]).stat().st_mtime_ns == first
    assert torch.equal(t2["latents"], t["latents"])

    # other arguments, or a folder encode did not make: one line, nothing touched
    err = encode(tmp_path, "--flip", res=8, check=False).stderr
    assert "encode.json" in err and "resolution" in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    err = encode(tmp_path, out="other", check=False).stderr
    assert "not empty" in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"


def write_recipe(tmp_path, flip=False, crop=False):
    (tmp_path / "r.yaml").write_text(f"""
output_dir: {tmp_path / 'run'}
seed: {SEED}
model: {{path: {tmp_path / 'm'}}}
data: {{format: latents, train: [{{path: {tmp_path / 'lat'}}}], random_flip: {str(flip).lower()},
       random_crop: {str(crop).lower()}, resolution: 8}}
train: {{steps: 1, micro_batch_size: 7, threads: 1}}
optim: {{lr: 0.0}}
diffusion: {{objective: flow_matching, shift: 2.0}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    return tmp_path / "r.yaml"


def test_training_on_shards_matches_diffusers(tmp_path):
    vae, files = make_parts(tmp_path)
    encode(tmp_path, "--flip")
    model = make_dit(tmp_path / "m", num_embeds_ada_norm=3, sample_size=8)
    for flip, crop in ((False, False), (True, False), (True, True)):
        run_lf("train", write_recipe(tmp_path, flip, crop), "--set", f"output_dir={tmp_path / f'run{flip}{crop}'}")
        ours = json.loads((tmp_path / f"run{flip}{crop}" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
        _, t = read_all(tmp_path / "lat")
        order = stream_order(7, SEED, 0)
        sched = FlowMatchEulerDiscreteScheduler(shift=2.0)
        losses = []
        with torch.no_grad():
            for k in range(7):
                r = order[k]
                x = (t["latents_flip"] if flip and flipped(SEED, k) else t["latents"])[r:r + 1]
                if crop:  # 8-pixel windows of the 16-pixel encoding: 4 x 4 of the 8 x 8 latents
                    off = crop_offsets(SEED, k)
                    y0 = off(4)
                    x0 = off(4)
                    x = x[:, :, y0:y0 + 4, x0:x0 + 4]
                g = torch.Generator().manual_seed(row_seed(SEED, k))
                u = torch.rand(1, generator=g)
                noise = torch.randn(x.shape, generator=g)
                i = int((u * 1000).long())
                sigma, ts = sched.sigmas[i], sched.timesteps[i:i + 1]
                pred = model((1 - sigma) * x + sigma * noise, timestep=ts, class_labels=t["class_labels"][r:r + 1]).sample
                losses.append(((pred[:, :4] - (noise - x)) ** 2).mean().item())
        ref = sum(losses) / 7
        assert abs(ours - ref) <= 1e-5 * abs(ref), (flip, crop, ours, ref)


def test_latents_of_another_vae_are_one_line(tmp_path):
    make_parts(tmp_path, latent_channels=8)
    encode(tmp_path)
    make_dit(tmp_path / "m", num_embeds_ada_norm=3, sample_size=8)
    err = run_lf("train", write_recipe(tmp_path), check=False).stderr
    assert "shard_0000" in err and "hidden_states" in err and "in_channels" in err, err
    assert len(err.strip().splitlines()) == 1, err
    # shards without mirrored rows, asked to flip
    err = run_lf("train", write_recipe(tmp_path, flip=True), check=False).stderr
    assert "encode.json" in err and "flip" in err and len(err.strip().splitlines()) == 1, err


def corrupt_pixels(png):
    """The PNG with its compressed pixels garbled but every chunk well formed (lengths, CRCs)."""
    out, i = bytearray(png[:8]), 8
    while i < len(png):
        n = struct.unpack(">I", png[i:i + 4])[0]
        kind, data = png[i + 4:i + 8], bytearray(png[i + 8:i + 8 + n])
        if kind == b"IDAT":
            data[2:] = bytes(255 - b for b in data[2:])
        out += struct.pack(">I", n) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)
        i += 12 + n
    return bytes(out)


def test_unreadable_images_are_one_line_before_any_work(tmp_path):
    """Every image is checked (decoded) before the first shard: a file that is no image, or one whose pixels do not
    decode, is one line naming it, and the output folder is not made."""
    make_parts(tmp_path)
    bad = tmp_path / "imgs" / "emu" / "9.png"
    for content in (b"\x89PNG\r\n\x1a\n not really", corrupt_pixels((tmp_path / "imgs" / "emu" / "0.png").read_bytes())):
        bad.write_bytes(content)
        err = encode(tmp_path, check=False).stderr
        assert "9.png" in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "lat").exists()

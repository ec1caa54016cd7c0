"""`loongforge data encode` for text-to-video data (issue 20): a captioned video folder (metadata.jsonl) becomes
shards of Wan-VAE latents — diffusers' AutoencoderKLWan posterior mean of the PyAV-decoded, Pillow-cropped frames,
normalized as WanPipeline does ((z - mean) / std) — and text states — transformers' UMT5 encoder on its tokenizer's
ids, padded to max_length with the positions past each caption zeroed (WanPipeline._get_t5_prompt_embeds) — plus the
empty prompt's states as the null condition; a captioned image folder encodes its images as 1-frame clips; a
folder without captions, or captions without a text encoder, are one line."""
import json

import numpy as np
import torch
import transformers
from diffusers import AutoencoderKLWan
from PIL import Image
from safetensors.torch import load_file

from conftest import run_lf
from test_t5_parity import TINY, perturbed, t5_tokenizer_folder
from test_video import make_clip, pyav_frames, to_pixels
from test_wan_vae_parity import CASES

L = 24  # text positions


def make_parts(tmp_path):
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**CASES["wan21"])
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.1 * torch.randn_like(p))
    vae.eval().save_pretrained(tmp_path / "vae")
    tok_dir, tok, _ = t5_tokenizer_folder(tmp_path)
    te = perturbed(transformers.UMT5EncoderModel(transformers.UMT5Config(**{**TINY, "vocab_size": 70},
                                                                         feed_forward_proj="gated-gelu")))
    te.save_pretrained(tmp_path / "te")
    for f in tok_dir.iterdir():
        (tmp_path / "te" / f.name).write_bytes(f.read_bytes())
    return vae, te, tok


def ref_states(te, tok, captions):
    t = tok([" ".join(c.split()) for c in captions], padding="max_length", max_length=L, truncation=True,
            add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    with torch.no_grad():
        h = te(t.input_ids, attention_mask=t.attention_mask).last_hidden_state
    lens = t.attention_mask.sum(1)
    return torch.stack([torch.cat([u[:v], u.new_zeros(L - v, u.shape[1])]) for u, v in zip(h, lens)])


def normalized(vae, x):
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - mean) * inv_std


def test_captioned_videos_match_diffusers_and_transformers(tmp_path):
    vae, te, tok = make_parts(tmp_path)
    root = tmp_path / "clips"
    root.mkdir()
    make_clip(root / "a.mp4", 32, 32, 7)
    make_clip(root / "b.mp4", 48, 40, 9)
    caps = {"a.mp4": "a  big red dog on the tree", "b.mp4": "The cat " + "sky " * 40}  # b's caption is cut to L
    (root / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f, "text": t}) + "\n" for f, t in caps.items()))
    run_lf("data", "encode", "--videos", root, "--frames", 5, "--resolution", 16, "--vae", tmp_path / "vae",
           "--text-encoder", tmp_path / "te", "--max-text-len", L, "--out", tmp_path / "lat")
    idx = json.loads((tmp_path / "lat" / "encode.json").read_text())
    assert idx["complete"] and idx["conditions"] == "encoder_hidden_states"
    t = load_file(str(tmp_path / "lat" / idx["shards"][0]))
    x = torch.stack([torch.from_numpy(to_pixels(pyav_frames(root / f)[0][:5], 16, 16)) for f in ("a.mp4", "b.mp4")])
    want = normalized(vae, x)
    assert t["latents"].shape == want.shape == (2, 4, 2, 2, 2)
    assert (t["latents"] - want).abs().max() <= 1e-4 * want.abs().max()
    ws = ref_states(te, tok, list(caps.values()))
    assert (t["encoder_hidden_states"] - ws).abs().max() <= 1e-5 * ws.abs().max()
    n0 = len(tok(" ".join(caps["a.mp4"].split())).input_ids)
    assert n0 < L and (ws[0, n0:] == 0).all() and (ws[1] != 0).any(dim=1).all()  # padding zeroed; b's fills L
    null = load_file(str(tmp_path / "lat" / "null_conditions.safetensors"))["encoder_hidden_states"]
    wn = ref_states(te, tok, [""])
    assert (null - wn).abs().max() <= 1e-5 * wn.abs().max()


def test_captioned_images_as_one_frame_clips(tmp_path):
    vae, te, tok = make_parts(tmp_path)
    root = tmp_path / "imgs"
    root.mkdir()
    g = np.random.default_rng(0)
    caps = {"x.png": "blue sky", "y.png": "a small house"}
    for f in caps:
        Image.fromarray(g.integers(0, 256, (24, 20, 3), dtype=np.uint8)).save(root / f)
    (root / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f, "text": t}) + "\n" for f, t in caps.items()))
    run_lf("data", "encode", "--images", root, "--resolution", 16, "--vae", tmp_path / "vae",
           "--text-encoder", tmp_path / "te", "--max-text-len", L, "--out", tmp_path / "lat")
    idx = json.loads((tmp_path / "lat" / "encode.json").read_text())
    t = load_file(str(tmp_path / "lat" / idx["shards"][0]))
    from test_image_folder import center_crop_arr
    x = torch.stack([torch.from_numpy(np.array(center_crop_arr(Image.open(root / f).convert("RGB"), 16)))
                     .permute(2, 0, 1).float() / 127.5 - 1 for f in caps])[:, :, None]
    want = normalized(vae, x)
    assert (t["latents"] - want).abs().max() <= 1e-4 * want.abs().max()
    ws = ref_states(te, tok, list(caps.values()))
    assert (t["encoder_hidden_states"] - ws).abs().max() <= 1e-5 * ws.abs().max()
    # captions need a text encoder; an image VAE cannot take clips
    err = run_lf("data", "encode", "--images", root, "--resolution", 16, "--vae", tmp_path / "vae",
                 "--out", tmp_path / "lat2", check=False).stderr
    assert "--text-encoder" in err and len(err.strip().splitlines()) == 1, err


def test_wan_trains_on_encoded_clips_and_its_sample_grid_matches_diffusers(tmp_path):
    """The shards train a Wan model (condition dropout to the empty prompt's states); the run's sample grid is
    diffusers' loop — Euler flow matching guided by the null condition, the Wan VAE's decode of the denormalized
    latents — frame for frame, with an mp4 per clip."""
    import av
    from diffusers import FlowMatchEulerDiscreteScheduler
    from test_diffusion_objective import SEED
    from test_image_folder import stream_order
    from test_wan_parity import wan_model

    vae, te, tok = make_parts(tmp_path)
    root = tmp_path / "clips"
    root.mkdir()
    make_clip(root / "a.mp4", 32, 32, 7)
    make_clip(root / "b.mp4", 48, 40, 9)
    (root / "metadata.jsonl").write_text(json.dumps({"file_name": "a.mp4", "text": "red dog"}) + "\n" +
                                         json.dumps({"file_name": "b.mp4", "text": "a cat"}) + "\n")
    run_lf("data", "encode", "--videos", root, "--frames", 5, "--resolution", 16, "--vae", tmp_path / "vae",
           "--text-encoder", tmp_path / "te", "--max-text-len", L, "--out", tmp_path / "lat")
    model = wan_model(text_dim=32)
    model.save_pretrained(tmp_path / "m")
    model.eval()
    (tmp_path / "r.yaml").write_text(f"""
output_dir: {tmp_path / 'run'}
seed: {SEED}
model: {{path: {tmp_path / 'm'}, vae: {tmp_path / 'vae'}}}
data: {{format: latents, train: [{{path: {tmp_path / 'lat'}}}]}}
train: {{steps: 1, micro_batch_size: 2, threads: 1}}
optim: {{lr: 0.0}}
diffusion: {{objective: flow_matching, shift: 3.0, condition_dropout: 0.5}}
eval: {{every: 1, samples: 2, sample_steps: 3, sample_guidance: 4.0}}
log: {{progress: off, plot: false, tensorboard: false}}
""")
    run_lf("train", tmp_path / "r.yaml")
    _, t = None, load_file(str(tmp_path / "lat" / "shard_00000.safetensors"))
    null = load_file(str(tmp_path / "lat" / "null_conditions.safetensors"))["encoder_hidden_states"]
    order = stream_order(2, SEED, 0)
    text = t["encoder_hidden_states"][order]
    noise = torch.randn(2, 4, 2, 2, 2, generator=torch.Generator().manual_seed(SEED))
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(3)
    x = noise.clone()
    with torch.no_grad():
        for ts in sched.timesteps:
            tt = ts.reshape(1).expand(2)
            c = model(x, timestep=tt, encoder_hidden_states=text).sample
            u = model(x, timestep=tt, encoder_hidden_states=null.expand(2, -1, -1)).sample
            x = sched.step(u + 4.0 * (c - u), ts, x).prev_sample
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        img = vae.decode(x * std + mean).sample.clamp(-1, 1)
    want = ((img + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).numpy()  # [B, F, H, W, 3]
    folder = tmp_path / "run" / "samples" / "step_00000001"
    for i in range(2):
        for f in range(5):
            got = np.asarray(Image.open(folder / f"sample_{i:02d}" / f"frame_{f:03d}.png").convert("RGB"))
            assert np.abs(got.astype(int) - want[i, f].astype(int)).max() <= 1, (i, f)
        with av.open(str(folder / f"sample_{i:02d}.mp4")) as c:
            assert sum(1 for _ in c.decode(video=0)) == 5
    assert (folder / "grid.png").exists()

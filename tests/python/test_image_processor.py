"""`loongforge data preprocess` against transformers' image processors (AutoImageProcessor, built from configs the
tests write) on JPEG / PNG files the tests write with Pillow: decoding (grey, palette, alpha, 16-bit, CMYK, EXIF),
CLIP / SigLIP / Qwen2-VL / Qwen2.5-VL / Qwen3-VL preprocessing, and one-line errors for bad files."""
import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoImageProcessor, CLIPImageProcessor, Qwen2VLImageProcessor, SiglipImageProcessor

from conftest import run_lf

# The tolerance: 1/255 of the [0, 1] range, i.e. 1 / (255 * std) in normalised units.
TOL_LEVELS = 1.0 / 255


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png16(path, arr, color_type):
    """A 16-bit PNG (Pillow writes none in colour): ARR uint16 [H, W, C], colour type 2 (RGB) or 6 (RGBA)."""
    h, w, _ = arr.shape
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(raw)) +
                     png_chunk(b"IEND", b""))


def scene(h, w, seed):
    """A photo-like image: smooth gradients, sharp edges and noise (so every resize filter tap matters)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 3) % 256], -1).astype(float)
    img[(x // 17 + y // 13) % 2 == 0] = 255 - img[(x // 17 + y // 13) % 2 == 0]  # sharp checkerboard edges
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    out = {}

    def save(name, im, **kw):
        out[name] = d / name
        im.save(out[name], **kw)

    save("photo.jpg", Image.fromarray(scene(480, 640, 0)), quality=90)
    save("tall444.jpg", Image.fromarray(scene(500, 333, 1)), quality=95, subsampling=0)
    save("progressive.jpg", Image.fromarray(scene(231, 317, 2)), quality=85, progressive=True)
    save("grey.jpg", Image.fromarray(scene(150, 201, 3)[..., 0]), quality=90)
    save("cmyk.jpg", Image.fromarray(scene(64, 96, 4)).convert("CMYK"), quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90; Pillow's plain open (and so transformers) does not apply it
    save("exif.jpg", Image.fromarray(scene(120, 200, 5)), quality=90, exif=exif.tobytes())
    save("large.jpg", Image.fromarray(scene(1200, 1600, 6)), quality=85)
    save("wide.png", Image.fromarray(scene(200, 900, 7)))
    save("small.png", Image.fromarray(scene(20, 30, 8)))  # below Qwen's min_pixels
    save("grey.png", Image.fromarray(scene(123, 77, 9)[..., 1]))
    rgba = np.concatenate([scene(100, 150, 10), scene(100, 150, 11)[..., :1]], -1)
    rgba[:10, :, 3] = 0
    rgba[10:20, :, 3] = 255
    save("rgba.png", Image.fromarray(rgba, "RGBA"))
    save("la.png", Image.fromarray(np.stack([scene(90, 60, 12)[..., 0], scene(90, 60, 13)[..., 1]], -1), "LA"))
    pal = Image.fromarray(scene(90, 120, 14)).quantize(64)
    save("palette_trns.png", pal, transparency=3)
    save("palette.png", Image.fromarray(scene(91, 119, 15)).quantize(200))
    save("grey16.png", Image.fromarray((scene(60, 80, 16)[..., 0].astype(np.uint16) * 4)))  # Pillow clips at 255
    save("grey_trns.png", Image.fromarray(scene(70, 50, 17)[..., 2]), transparency=128)
    save("bits1.png", Image.fromarray(scene(33, 47, 18)[..., 0]).convert("1"))
    out["rgb16.png"] = d / "rgb16.png"
    write_png16(out["rgb16.png"], np.random.default_rng(19).integers(0, 65536, (40, 50, 3)), 2)
    out["rgba16.png"] = d / "rgba16.png"
    write_png16(out["rgba16.png"], np.random.default_rng(20).integers(0, 65536, (41, 30, 4)), 6)
    return out


def processor_dir(tmp_path, name, processor, config=None, edit=None):
    """A model folder: the processor saved as transformers saves it, optionally a config.json and edits."""
    d = tmp_path / name
    processor.save_pretrained(d)
    if edit:
        p = d / "preprocessor_config.json"
        p.write_text(json.dumps(edit(json.loads(p.read_text()))))
    if config:
        (d / "config.json").write_text(json.dumps(config))
    return d


def preprocess(d, paths, tmp_path, backend=None):
    out = tmp_path / "out.safetensors"
    args = ["data", "preprocess", "--model", d, "--out", out] + [a for p in paths for a in ("--image", p)]
    run_lf(*args, *(["--backend", backend] if backend else []))
    return load_file(str(out))


def reference(d, paths):
    proc = AutoImageProcessor.from_pretrained(d)
    return proc, proc([Image.open(p) for p in paths], return_tensors="pt")


def assert_close(ours, ref, std):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (ours.dtype, ours.shape, ref.dtype, ref.shape)
    if ours.dtype == torch.uint8:
        assert torch.equal(ours, ref)
        return 0.0
    # per channel: 1/255 of the [0, 1] range in normalised units (+ float32 rounding)
    std = torch.tensor(std, dtype=torch.float64)
    diff = (ours.double() - ref.double()).abs()
    levels = (diff * std.view(-1, 1, 1)).max().item() if ours.dim() == 4 else None
    if ours.dim() == 2:  # patches: columns are C, T, P, P
        levels = (diff.view(diff.shape[0], 3, -1) * std.view(1, 3, 1)).max().item()
    assert levels <= TOL_LEVELS + 1e-6, f"max difference {levels * 255:.3f} grey levels"
    return levels


ALL = ["photo.jpg", "tall444.jpg", "progressive.jpg", "grey.jpg", "cmyk.jpg", "exif.jpg", "large.jpg", "wide.png",
       "small.png", "grey.png", "rgba.png", "la.png", "palette_trns.png", "palette.png", "grey16.png",
       "grey_trns.png", "bits1.png", "rgb16.png", "rgba16.png"]


def test_decoding_matches_pillow(images, tmp_path):
    """No resize, rescale or normalisation: pixel_values are the decoded pixels, as transformers' convert_to_rgb
    gives them (Pillow's decoding, transparency composited onto white), byte for byte; do_pad pads them to the
    largest with zeros so that one run checks every file."""
    d = processor_dir(tmp_path, "raw", SiglipImageProcessor(do_resize=False, do_rescale=False, do_normalize=False,
                                                            do_pad=True))
    paths = [images[name] for name in ALL if name != "large.jpg"]
    ours = preprocess(d, paths, tmp_path)["pixel_values"]
    _, ref = reference(d, paths)
    assert ours.dtype == torch.uint8
    for i, p in enumerate(paths):
        assert torch.equal(ours[i], ref["pixel_values"][i]), p.name


PROCESSORS = {
    "clip": (lambda: CLIPImageProcessor(), None),
    "clip_pad": (lambda: CLIPImageProcessor(size={"shortest_edge": 200}, crop_size={"height": 224, "width": 230}),
                     None),
    "siglip": (lambda: SiglipImageProcessor(), None),
    "siglip_384_bilinear": (lambda: SiglipImageProcessor(size={"height": 384, "width": 384}, resample=2), None),
    "siglip_from_model_type": (lambda: SiglipImageProcessor(size={"height": 160, "width": 192}, resample=1),
                               {"model_type": "siglip"}),
}


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_clip_siglip(name, images, tmp_path):
    make, config = PROCESSORS[name]
    edit = (lambda j: {k: v for k, v in j.items() if k != "image_processor_type"}) if config else None
    d = processor_dir(tmp_path, name, make(), config, edit)
    paths = [images[n] for n in ["photo.jpg", "tall444.jpg", "wide.png", "small.png", "rgba.png", "grey16.png"]]
    proc, ref = reference(d, paths)
    ours = preprocess(d, paths, tmp_path)
    assert list(ours) == ["pixel_values"]
    levels = assert_close(ours["pixel_values"], ref["pixel_values"], proc.image_std)
    print(f"{name}: max difference {levels * 255:.4f} grey levels")


QWEN = {
    # Qwen2-VL: the class defaults (patch 14, min 56*56, max 28*28*1280 pixels)
    "qwen2_vl": (lambda: Qwen2VLImageProcessor(), {"model_type": "qwen2_vl"}, None),
    # Qwen2.5-VL's folders give min_pixels / max_pixels at the top level (here a small maximum)
    "qwen2_5_vl": (lambda: Qwen2VLImageProcessor(), {"model_type": "qwen2_5_vl"},
                   lambda j: {**{k: v for k, v in j.items() if k != "size"}, "min_pixels": 3136,
                              "max_pixels": 200704, "image_processor_type": "Qwen2VLImageProcessorFast"}),
    # Qwen3-VL's folder: the Qwen2-VL class with patch 16, mean / std 0.5 and its pixel bounds
    "qwen3_vl": (lambda: Qwen2VLImageProcessor(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                               size={"shortest_edge": 65536, "longest_edge": 16777216}),
                 {"model_type": "qwen3_vl"}, lambda j: {**j, "image_processor_type": "Qwen2VLImageProcessorFast"}),
    # class from config.json's model_type, temporal patch 3, merge 1
    "qwen_from_model_type": (lambda: Qwen2VLImageProcessor(temporal_patch_size=3, merge_size=1, resample=2),
                             {"model_type": "qwen2_vl"},
                             lambda j: {k: v for k, v in j.items() if k != "image_processor_type"}),
}


@pytest.mark.parametrize("name", list(QWEN))
def test_qwen_vl(name, images, tmp_path):
    make, config, edit = QWEN[name]
    d = processor_dir(tmp_path, name, make(), config, edit)
    paths = [images[n] for n in ["photo.jpg", "small.png", "large.jpg", "wide.png", "grey.jpg", "palette_trns.png"]]
    proc, ref = reference(d, paths)
    assert type(proc).__name__ in ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil")
    ours = preprocess(d, paths, tmp_path)
    assert sorted(ours) == ["image_grid_thw", "pixel_values"]
    assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"])
    levels = assert_close(ours["pixel_values"], ref["pixel_values"], proc.image_std)
    print(f"{name}: max difference {levels * 255:.4f} grey levels")


def torchvision_reference(proc, paths):
    """What transformers' torchvision-backed processor computes on the CPU, written with the torch ops torchvision
    calls (torchvision is not installed here): uint8 antialiased interpolation, center crop, mean and std folded
    with the rescale factor."""
    from transformers.image_transforms import convert_to_rgb
    mean = torch.tensor(proc.image_mean) * (1.0 / proc.rescale_factor)
    std = torch.tensor(proc.image_std) * (1.0 / proc.rescale_factor)
    out = []
    for p in paths:
        x = torch.from_numpy(convert_to_rgb(Image.open(p), return_numpy=True)).permute(2, 0, 1).contiguous()
        if "height" in proc.size:
            size = (proc.size["height"], proc.size["width"])
        else:
            h, w = x.shape[1:]
            s = proc.size["shortest_edge"]
            size = (int(s * h / w), s) if w <= h else (s, int(s * w / h))
        x = F.interpolate(x[None], size=size, mode="bicubic", antialias=True, align_corners=False)[0]
        if proc.do_center_crop:
            ch, cw = proc.crop_size["height"], proc.crop_size["width"]
            top, left = int((x.shape[1] - ch) / 2.0), int((x.shape[2] - cw) / 2.0)
            x = x[:, top:top + ch, left:left + cw]
        out.append(x.float().sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1)))
    return torch.stack(out)


@pytest.mark.parametrize("make", [CLIPImageProcessor, SiglipImageProcessor])
def test_torchvision_backend(make, images, tmp_path):
    d = processor_dir(tmp_path, "tv", make())
    paths = [images[n] for n in ["photo.jpg", "tall444.jpg", "rgba.png"]]
    proc = AutoImageProcessor.from_pretrained(d)
    ours = preprocess(d, paths, tmp_path, backend="torchvision")["pixel_values"]
    assert torch.equal(ours, torchvision_reference(proc, paths))


def test_torchvision_backend_qwen(images, tmp_path):
    """The Qwen2-VL class on the torchvision backend: smart_resize, uint8 bicubic interpolation, folded
    normalisation, transformers' own patch order."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    from transformers.image_transforms import convert_to_rgb
    d = processor_dir(tmp_path, "tvq", Qwen2VLImageProcessor(max_pixels=100352))
    paths = [images[n] for n in ["photo.jpg", "small.png", "rgba.png"]]
    proc = AutoImageProcessor.from_pretrained(d)
    ps, ms, tps = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    mean = (torch.tensor(proc.image_mean) * (1.0 / proc.rescale_factor)).view(-1, 1, 1)
    std = (torch.tensor(proc.image_std) * (1.0 / proc.rescale_factor)).view(-1, 1, 1)
    rows, grids = [], []
    for p in paths:
        x = torch.from_numpy(convert_to_rgb(Image.open(p), return_numpy=True)).permute(2, 0, 1).contiguous()
        size = smart_resize(*x.shape[1:], factor=ps * ms, min_pixels=proc.size["shortest_edge"],
                            max_pixels=proc.size["longest_edge"])
        x = F.interpolate(x[None], size=size, mode="bicubic", antialias=True, align_corners=False)[0]
        patches, gh, gw = proc.patchify(x.float().sub_(mean).div_(std).numpy(), ps, ms, tps)
        rows.append(torch.from_numpy(patches))
        grids.append([1, gh, gw])
    ours = preprocess(d, paths, tmp_path, backend="torchvision")
    assert torch.equal(ours["image_grid_thw"], torch.tensor(grids))
    assert torch.equal(ours["pixel_values"], torch.cat(rows))


def test_bad_files(images, tmp_path):
    d = processor_dir(tmp_path, "clip", CLIPImageProcessor())
    jpeg = images["photo.jpg"].read_bytes()
    png = images["wide.png"].read_bytes()
    bad = {
        "corrupt.jpg": jpeg[:600] + bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8)),
        "truncated.jpg": jpeg[:len(jpeg) // 2],
        "truncated.png": png[:len(png) * 3 // 5],
        "garbage.png": png[:8] + b"\x00\x00\x00\x0dIHDR" + b"\xff" * 100,
        "text.jpg": b"hello, not an image\n",
    }
    for name, data in bad.items():
        p = tmp_path / name
        p.write_bytes(data)
        out = tmp_path / "bad.safetensors"
        proc = run_lf("data", "preprocess", "--model", d, "--image", images["small.png"], "--image", p, "--out",
                      out, check=False)
        assert proc.returncode == 1, (name, proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(p) in lines[0], (name, proc.stderr)
        assert not out.exists()


def test_bad_model_folders(images, tmp_path):
    empty = tmp_path / "no_processor"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    out = tmp_path / "o.safetensors"
    proc = run_lf("data", "preprocess", "--model", empty, "--image", images["small.png"], "--out", out, check=False)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert str(empty) in proc.stderr and "preprocessor_config.json" in proc.stderr

    d = processor_dir(tmp_path, "llava", CLIPImageProcessor(),
                      edit=lambda j: {**j, "image_processor_type": "LlavaNextImageProcessor"})
    proc = run_lf("data", "preprocess", "--model", d, "--image", images["small.png"], "--out", out, check=False)
    assert proc.returncode == 1 and "image_processor_type" in proc.stderr and "LlavaNext" in proc.stderr

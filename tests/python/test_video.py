"""Video input/output through FFmpeg's libraries (data/video.h) and captioned video folders (data/video_folder.h),
checked against PyAV (its own FFmpeg build) and Pillow through `loongforge data frames / write-video / clips`.
Clips are made here with PyAV: a few frames of coloured squares moving over a gradient."""
import json

import av
import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from conftest import run_lf
from test_image_folder import mix, splitmix64, stream_order


def make_clip(path, width, height, frames, fps=8, codec="libx264", pix_fmt="yuv420p", colorspace=None,
              color_range=None):
    """A clip (the container from PATH's extension) of FRAMES frames: squares of three colours moving over a smooth
    background. COLORSPACE / COLOR_RANGE (FFmpeg's AVCOL_SPC / AVCOL_RANGE numbers): the YUV conversion the frames are
    made with, tagged on the stream."""
    yy, xx = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = width, height, pix_fmt
        if colorspace is not None:
            s.codec_context.colorspace, s.codec_context.color_range = colorspace, color_range
        for i in range(frames):
            img = np.stack([(xx * 255 // max(width - 1, 1)), (yy * 255 // max(height - 1, 1)),
                            np.full_like(xx, 40 + 10 * i)], -1).astype(np.uint8)
            for k, colour in enumerate([(255, 0, 0), (0, 255, 0), (30, 30, 255)]):
                y0, x0 = (3 * i + 7 * k) % (height - 8), (5 * i + 11 * k) % (width - 8)
                img[y0:y0 + 8, x0:x0 + 8] = colour
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            if colorspace is not None:
                frame = frame.reformat(format=pix_fmt, dst_colorspace=colorspace, dst_color_range=color_range)
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def pyav_frames(path):
    """PyAV's frames as RGB uint8 [F, H, W, 3] and the stream's average rate."""
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        rate = s.average_rate
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(s)]), rate


def our_frames(tmp_path, video, *args):
    out = tmp_path / "frames.safetensors"
    run_lf("data", "frames", "--video", video, "--out", out, *args)
    t = load_file(str(out))
    return t["frames"], float(t["fps"][0]), int(t["num_frames"][0])


def one_line_error(*args):
    err = run_lf(*args, check=False).stderr.strip()
    assert err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("name,width,height,codec,pix_fmt,colour", [
    ("c.mp4", 32, 32, "libx264", "yuv420p", None),
    ("c.mp4", 64, 48, "libx264", "yuv420p", None),
    ("c.mp4", 50, 30, "libx264", "yuv420p", None),    # odd chroma edge
    ("c.mp4", 48, 32, "libx264", "yuv420p", (1, 1)),  # BT.709, limited range
    ("c.mp4", 48, 32, "libx264", "yuv420p", (1, 2)),  # BT.709, full range
    ("c.mp4", 48, 32, "libx264", "yuv420p", (9, 1)),  # BT.2020
    ("c.mkv", 48, 32, "libx264", "yuv420p", None),    # Matroska: no frame count, we count
    ("c.webm", 48, 32, "libvpx", "yuv420p", None),    # VP8
    ("c.avi", 48, 32, "mjpeg", "yuvj420p", None),     # full-range JPEG YUV
    ("c.mp4", 48, 32, "mpeg4", "yuv420p", None),
])
def test_decode_matches_pyav(tmp_path, name, width, height, codec, pix_fmt, colour):
    clip = make_clip(tmp_path / name, width, height, 10, fps=12, codec=codec, pix_fmt=pix_fmt,
                     colorspace=colour and colour[0], color_range=colour and colour[1])
    ref, rate = pyav_frames(clip)
    ours, fps, n = our_frames(tmp_path, clip)
    # Both convert to RGB with swscale's SWS_BILINEAR (PyAV's default interpolation) and the stream's colour space
    # and range (BT.601 limited when untagged); PyAV has FFmpeg 8 and we the system's (5.1), whose swscale gives the
    # same bytes. H.264, VP8 and FFmpeg's JPEG decoding agree bit for bit between the two versions, so the frames are
    # equal. MPEG-4 part 2 allows IDCTs within IEEE 1180's accuracy, and the two versions' decoders differ at a few
    # pixels: at most 2 levels there, at under 1 % of the pixels.
    assert ours.shape == (10, height, width, 3) and ours.dtype == np.uint8
    if codec != "mpeg4":
        np.testing.assert_array_equal(ours, ref)
    else:
        d = np.abs(ours.astype(np.int32) - ref)
        assert d.max() <= 2 and (d > 0).mean() < 0.01, (d.max(), (d > 0).mean())
    assert fps == float(rate) and n == 10


def test_frame_selection(tmp_path):
    clip = make_clip(tmp_path / "c.mp4", 32, 32, 12)
    ref, _ = pyav_frames(clip)
    for num, stride, start in [(4, 1, 0), (3, 3, 2), (1, 1, 11), (6, 2, 1)]:
        ours, _, n = our_frames(tmp_path, clip, "--num-frames", num, "--stride", stride, "--start", start)
        np.testing.assert_array_equal(ours, ref[start:start + (num - 1) * stride + 1:stride])
        assert n == 12
    err = one_line_error("data", "frames", "--video", clip, "--num-frames", 5, "--stride", 3, "--start", 0,
                         "--out", tmp_path / "x.safetensors")
    assert "c.mp4" in err and "asked for 5 frames" in err and "has 12 frames" in err, err


def test_bad_videos_are_one_line(tmp_path):
    (tmp_path / "notes.mp4").write_text("not a video at all\n" * 10)
    for bad in [tmp_path / "notes.mp4", tmp_path / "missing.mp4"]:
        err = one_line_error("data", "frames", "--video", bad, "--out", tmp_path / "x.safetensors")
        assert bad.name in err, err
    clip = make_clip(tmp_path / "c.mp4", 32, 32, 12)
    (tmp_path / "cut.mp4").write_bytes(clip.read_bytes()[:400])  # the header is there, the frames are not
    err = one_line_error("data", "frames", "--video", tmp_path / "cut.mp4", "--out", tmp_path / "x.safetensors")
    assert "cut.mp4" in err, err


@pytest.mark.parametrize("width,height,fps", [(32, 32, 8), (64, 48, 24)])
def test_encode_reads_back_in_pyav(tmp_path, width, height, fps):
    g = np.random.default_rng(0)
    yy, xx = np.mgrid[0:height, 0:width]
    frames = []
    for i in range(9):  # smooth content (lossy codecs keep it well) with a moving square
        img = np.stack([xx * 4 + i, yy * 5, (xx + yy) * 2 + 20 * i], -1) % 256
        img[(i * 3) % (height - 6):(i * 3) % (height - 6) + 6, 4:10] = g.integers(0, 256, 3)
        frames.append(img.astype(np.uint8))
    frames = np.stack(frames)
    save_file({"frames": frames}, str(tmp_path / "f.safetensors"))
    out = tmp_path / "out.mp4"
    run_lf("data", "write-video", "--frames", tmp_path / "f.safetensors", "--fps", fps, "--out", out)
    back, rate = pyav_frames(out)
    with av.open(str(out)) as c:
        s = c.streams.video[0]
        assert s.codec_context.name in ("h264", "mpeg4") and s.codec_context.pix_fmt == "yuv420p"
        assert (s.width, s.height) == (width, height)
    assert back.shape == frames.shape and rate == fps
    err = np.abs(back.astype(np.int32) - frames.astype(np.int32)).mean()
    assert err < 4.0, err  # lossy (CRF 18 / qscale 2) plus yuv420p chroma subsampling
    assert not list(tmp_path.glob(".out.mp4.tmp*")), "the temporary file was left behind"
    # and our own decoder reads it back as PyAV does
    ours, ours_fps, n = our_frames(tmp_path, out)
    np.testing.assert_array_equal(ours, back)
    assert ours_fps == fps and n == 9


def test_env_names_ffmpeg():
    lines = dict(l.split(": ", 1) for l in run_lf("env").stdout.splitlines() if l.startswith("video: "))
    assert lines["video"].startswith("FFmpeg ") and "libavformat" in lines["video"], lines


def test_encode_bad_frames_are_one_line(tmp_path):
    save_file({"frames": np.zeros((2, 31, 32, 3), np.uint8)}, str(tmp_path / "odd.safetensors"))
    save_file({"frames": np.zeros((2, 32, 32, 3), np.float32)}, str(tmp_path / "float.safetensors"))
    for f, what in [("odd", "even"), ("float", "uint8")]:
        err = one_line_error("data", "write-video", "--frames", tmp_path / f"{f}.safetensors", "--out",
                             tmp_path / "o.mp4")
        assert "o.mp4" in err and what in err, err
        assert not (tmp_path / "o.mp4").exists()


# ---- captioned video folders -----------------------------------------------------------------------------------


def center_crop_to(img, height, width):
    """The image folder's center_crop_arr generalised (data/image_folder.h center_crop_to), with Pillow."""
    while img.size[1] >= 2 * height and img.size[0] >= 2 * width:
        img = img.resize((img.size[0] // 2, img.size[1] // 2), resample=Image.BOX)
    scale = max(height / img.size[1], width / img.size[0])
    img = img.resize((max(round(img.size[0] * scale), width), max(round(img.size[1] * scale), height)),
                     resample=Image.BICUBIC)
    a = np.array(img)
    y, x = (a.shape[0] - height) // 2, (a.shape[1] - width) // 2
    return a[y:y + height, x:x + width]


def to_pixels(frames, height, width):
    """uint8 [F, H, W, 3] -> float32 [3, F, height, width] in [-1, 1], frame by frame as the folder does."""
    out = np.stack([center_crop_to(Image.fromarray(f), height, width) for f in frames])
    x = out.transpose(3, 0, 1, 2).astype(np.float32) / 255.0
    return (x - 0.5) / 0.5


def make_folder(root):
    root.mkdir()
    (root / "sub").mkdir()
    make_clip(root / "a.mp4", 32, 32, 7)
    make_clip(root / "sub" / "b.mp4", 64, 48, 9, fps=24)
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(root / "c.png")
    lines = [{"file_name": "a.mp4", "text": "red squares"}, {"file": "./sub/b.mp4", "caption": "green squares"},
             {"file_name": "c.png", "text": "noise", "other": 1}]
    (root / "metadata.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    return {"a.mp4": "red squares", "sub/b.mp4": "green squares", "c.png": "noise"}


def read_clips(path):
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
        return ({k: f.get_tensor(k) for k in f.keys()}, json.loads(meta["captions"]), json.loads(meta["items"]))


@pytest.mark.parametrize("random", [False, True])
def test_video_folder_matches_pyav_and_pillow(tmp_path, random):
    captions = make_folder(tmp_path / "v")
    files = sorted(captions)  # the listing order: sorted relative paths
    seed, num, stride, h, w = 5, 3, 2, 16, 24
    extra = ["--random-start", "--random-flip"] if random else []
    run_lf("data", "clips", "--folder", tmp_path / "v", "--num-frames", num, "--stride", stride, "--height", h,
           "--width", w, "--seed", seed, "--count", 5, "--out", tmp_path / "c.safetensors", *extra)
    pixels, caps, items = read_clips(tmp_path / "c.safetensors")
    for k in range(5):
        n = len(files)
        f = files[stream_order(n, seed, k // n)[k % n]]
        assert caps[k] == captions[f] and items[k] == str(tmp_path / "v" / f)
        if f.endswith(".png"):
            frames = np.array(Image.open(tmp_path / "v" / f).convert("RGB"))[None]
        else:
            ref, _ = pyav_frames(tmp_path / "v" / f)
            start = 0
            if random:
                room = len(ref) - ((num - 1) * stride + 1)
                start = splitmix64(mix(seed ^ 0x7a7a7a7a7a7a7a7a, k))[1] % (room + 1)
            frames = ref[start:start + (num - 1) * stride + 1:stride]
        x = to_pixels(frames, h, w)
        if random and splitmix64(mix(seed ^ 0x5f1f5f1f5f1f5f1f, k))[1] & 1:
            x = x[..., ::-1]
        np.testing.assert_allclose(pixels[f"pixels.{k}"], x, atol=1e-6, rtol=0)


def test_bad_video_folders_are_one_line(tmp_path):
    root = tmp_path / "v"
    make_folder(root)
    meta = (root / "metadata.jsonl").read_text()

    def err(*extra):
        return one_line_error("data", "clips", "--folder", root, "--num-frames", 2, "--resolution", 16, "--out",
                              tmp_path / "c.safetensors", *extra)

    jsonl = str(root / "metadata.jsonl")
    (root / "metadata.jsonl").write_text(meta + "{not json\n")
    e = err()
    assert f"{jsonl}:5" in e and "invalid JSON" in e, e
    (root / "metadata.jsonl").write_text(meta.replace('"text": "noise"', '"words": "noise"'))
    e = err()
    assert f"{jsonl}:3" in e and "'text' or 'caption'" in e and "missing" in e, e
    (root / "metadata.jsonl").write_text(meta + json.dumps({"file_name": "gone.mp4", "text": "x"}) + "\n")
    e = err()
    assert f"{jsonl}:5" in e and "file_name" in e and "gone.mp4" in e, e
    (root / "metadata.jsonl").write_text(meta + json.dumps({"file_name": "a.mp4", "text": "again"}) + "\n")
    e = err()
    assert f"{jsonl}:5" in e and "twice" in e, e
    (root / "metadata.jsonl").write_text(meta)
    make_clip(root / "d.mp4", 32, 32, 3)
    e = err()
    assert jsonl in e and "no caption for d.mp4" in e, e
    (root / "metadata.jsonl").write_text(meta + json.dumps({"file_name": "d.mp4", "text": "short"}) + "\n")
    e = err("--stride", 3)
    assert "d.mp4" in e and "has 3 frames" in e, e
    (root / "metadata.jsonl").unlink()
    e = err()
    assert str(root) in e and "metadata.jsonl" in e, e

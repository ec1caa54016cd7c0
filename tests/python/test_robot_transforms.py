"""Normalisation (data/robot/normalize.h) against LeRobot's NormalizerProcessorStep / UnnormalizerProcessorStep, and
image transforms (data/robot/transforms.h) against torchvision.transforms.v2.functional and LeRobot's / openpi's
resize_with_pad, through the gtest hooks RobotNormalize.Oracle and RobotTransforms.Oracle. Normalisation: every
mode (IDENTITY, MEAN_STD, MIN_MAX, QUANTILES, QUANTILE10) both ways, for a state vector, an action and a camera
([C, 1, 1] stats), with zero ranges and a zero std (LeRobot's eps handling). Transforms: brightness, contrast,
saturation, hue, sharpness at several factors, affine (rotation, shift, scale, shear; nearest and bilinear; with and
without a fill), centre / plain crops (inside and past the edges), resize with padding (centred and top-left), on
uint8 and float images; and seeded plans (random crop + jitters in random order) replayed with torchvision's
functions, lerobot's SharpnessJitter and torchvision's RandomAffine from the offsets and factors the plan drew; the
jitter defaults are lerobot's ImageTransformsConfig's. Bitwise equal throughout."""
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import run_gtest_hook, run_lerobot

NORM_ORACLE = r"""
import sys, torch
from safetensors.torch import load_file, save_file
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.processor import (NormalizerProcessorStep, TransitionKey, UnnormalizerProcessorStep,
                               create_transition)
inp = load_file(sys.argv[1])
xs = {k[2:]: v for k, v in inp.items() if k.startswith("x.")}
stats = {}
for k, v in inp.items():
    if k.startswith("stats."):
        feat, stat = k[6:].rsplit(".", 1)
        stats.setdefault(feat, {})[stat] = v.numpy()
types = {"observation.state": FeatureType.STATE, "observation.images.top": FeatureType.VISUAL,
         "action": FeatureType.ACTION}
features = {k: PolicyFeature(type=types[k], shape=tuple(xs[k].shape[1:])) for k in xs}
out = {}
for mode in ["IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"]:
    norm_map = {t: NormalizationMode(mode) for t in types.values()}
    for name, cls in [("norm", NormalizerProcessorStep), ("unnorm", UnnormalizerProcessorStep)]:
        step = cls(features=features, norm_map=norm_map, stats=stats)
        obs = {k: v.clone() for k, v in xs.items() if k != "action"}
        tr = step(create_transition(observation=obs, action=xs["action"].clone()))
        for k in xs:
            v = tr[TransitionKey.ACTION] if k == "action" else tr[TransitionKey.OBSERVATION][k]
            out[f"{name}.{mode}.{k}"] = v.contiguous()
save_file(out, sys.argv[2])
"""


def test_normalize_every_mode_as_lerobot(tmp_path):
    rng = np.random.default_rng(0)
    stats = {}
    for feat, shape in [("observation.state", (5,)), ("action", (4,)), ("observation.images.top", (3, 1, 1))]:
        lo = rng.standard_normal(shape) - 2
        hi = lo + rng.random(shape) * 4
        q = np.sort(rng.uniform(lo, hi, (4,) + shape), axis=0)
        st = {"min": lo, "max": hi, "mean": (lo + hi) / 2, "std": rng.random(shape) + 0.1,
              "q01": q[0], "q10": q[1], "q90": q[2], "q99": q[3], "count": np.array([50])}
        flat = st["min"].reshape(-1)
        st["max"].reshape(-1)[0] = flat[0]  # zero range -> eps
        st["q99"].reshape(-1)[0] = st["q01"].reshape(-1)[0]
        st["q90"].reshape(-1)[-1] = st["q10"].reshape(-1)[-1]
        st["std"].reshape(-1)[1] = 0.0
        stats[feat] = st
    xs = {"observation.state": rng.standard_normal((6, 5)).astype(np.float32),
          "action": rng.standard_normal((6, 4)).astype(np.float32) * 3,
          "observation.images.top": rng.random((2, 3, 4, 5)).astype(np.float32)}
    inp = {f"x.{k}": v for k, v in xs.items()}
    inp.update({f"stats.{f}.{s}": np.asarray(v, np.float64) for f, st in stats.items() for s, v in st.items()})
    save_file(inp, str(tmp_path / "in.safetensors"))
    run_gtest_hook("RobotNormalize.Oracle", {"LF_NORM_IN": str(tmp_path / "in.safetensors"),
                                             "LF_NORM_OUT": str(tmp_path / "ours.safetensors")})
    run_lerobot(NORM_ORACLE, tmp_path / "in.safetensors", tmp_path / "ref.safetensors")
    ours, ref = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
        assert np.array_equal(ours[k], ref[k]), (k, np.abs(ours[k] - ref[k]).max())


TF_ORACLE = r"""
import sys, torch
from safetensors.torch import load_file, save_file
import importlib.util
import torchvision.transforms.v2.functional as F
import lerobot
# lerobot.policies' __init__ imports every policy (and cv2, absent here): load the pure helpers' module alone.
spec = importlib.util.spec_from_file_location("vla_utils", lerobot.__path__[0] + "/policies/common/vla_utils.py")
vla = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vla)
resize_with_pad, resize_with_pad_torch = vla.resize_with_pad, vla.resize_with_pad_torch
inp, ours = load_file(sys.argv[1]), load_file(sys.argv[2])
out = {}
from torchvision.transforms import v2, InterpolationMode
from lerobot.transforms.transforms import ImageTransformsConfig, SharpnessJitter
ops = [F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue,
       lambda y, f: SharpnessJitter((0.0, 3.0)).transform(y, {"sharpness_factor": f})]
AFFINES = [(3.7, 1, -2, 1, 0, 0, 0, 0), (-5, 0, 0, 1, 0, 0, 0, None), (90, 0, 0, 1, 0, 0, 0, 0),
           (30, 2, 1, 0.8, 0, 0, 1, None), (-12.5, -1, 3, 1.3, 10, -5, 1, 0.4), (7, 0, 0, 1, 0, 0, 0, 1)]
for k in ["u8", "f32"]:
    x = inp[k]
    for f in [0.0, 0.5, 0.8, 1.2, 1.7]:
        fs = f"{f:.1f}"
        out[f"{k}.brightness.{fs}"] = F.adjust_brightness(x, f)
        out[f"{k}.contrast.{fs}"] = F.adjust_contrast(x, f)
        out[f"{k}.saturation.{fs}"] = F.adjust_saturation(x, f)
    for f in [-0.5, -0.25, -0.05, 0.0, 0.05, 0.3, 0.5]:
        out[f"{k}.hue.{f:.2f}" if f < 0 else f"{k}.hue.{f:.2f}"] = F.adjust_hue(x, f)
    for f in [0.0, 0.5, 1.0, 1.5, 2.7]:
        out[f"{k}.sharpness.{f:.1f}"] = F.adjust_sharpness(x, f)
    out[f"{k}.sharpness.tiny"] = F.adjust_sharpness(x[..., :2, :], 0.3)
    out[f"{k}.sharpness.5d"] = F.adjust_sharpness(x.unsqueeze(0), 0.3)
    for i, (a, tx, ty, sc, shx, shy, bil, fill) in enumerate(AFFINES):
        if fill is not None and k == "u8":
            fill = fill * 255
        out[f"{k}.affine.{i}"] = F.affine(x, a, [tx, ty], sc, [shx, shy], fill=fill, interpolation=(
            InterpolationMode.BILINEAR if bil else InterpolationMode.NEAREST))
    out[f"{k}.center_crop.5x7"] = F.center_crop(x, [5, 7])
    out[f"{k}.center_crop.20x9"] = F.center_crop(x, [20, 9])
    out[f"{k}.crop.2.3.6x5"] = F.crop(x, 2, 3, 6, 5)
    out[f"{k}.crop.-2.9.8x6"] = F.crop(x, -2, 9, 8, 6)
    out[f"{k}.pad_center.24x24"] = resize_with_pad_torch(x, 24, 24)
    out[f"{k}.pad_center.10x31"] = resize_with_pad_torch(x, 10, 31)
    out[f"{k}.pad_left.24x24"] = resize_with_pad(x.float(), 24, 24, pad_value=-1)
    out[f"{k}.pad_left.7x20"] = resize_with_pad(x.float(), 7, 20, pad_value=-1)
    for seed in [1, 2, 3]:
        pre = f"{k}.plan{seed}"
        top, left = ours[pre + ".crop"].tolist()
        y = F.crop(x, top, left, 9, 10)
        codes = ours[pre + ".jitters"].tolist()
        tx, ty = ours[pre + ".shift"].tolist()
        for i in range(0, len(codes), 2):
            if int(codes[i]) == 5:  # RandomAffine as lerobot's config builds it, with the drawn parameters
                affine = v2.RandomAffine(degrees=(-20.0, 25.0), translate=(0.3, 0.2))
                y = affine.transform(y, {"angle": codes[i + 1], "translate": (tx, ty), "scale": 1.0,
                                         "shear": (0.0, 0.0)})
            else:
                y = ops[int(codes[i])](y, codes[i + 1])
        out[pre + ".out"] = y
        for part in ["crop", "jitters", "shift"]:
            out[f"{pre}.{part}"] = ours[f"{pre}.{part}"]
cfg = ImageTransformsConfig()
tfs = cfg.tfs
defaults = [cfg.max_num_transforms, float(cfg.random_order)]
for name, key in [("brightness", "brightness"), ("contrast", "contrast"), ("saturation", "saturation"),
                  ("hue", "hue"), ("sharpness", "sharpness"), ("affine", "degrees"), ("affine", "translate")]:
    defaults += list(tfs[name].kwargs[key])
defaults += [tfs[n].weight for n in ["brightness", "contrast", "saturation", "hue", "sharpness", "affine"]]
assert [tfs[n].type for n in ["sharpness", "affine"]] == ["SharpnessJitter", "RandomAffine"], tfs
assert set(tfs) == {"brightness", "contrast", "saturation", "hue", "sharpness", "affine"}, set(tfs)
out["defaults"] = torch.tensor(defaults, dtype=torch.float64)
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[3])
"""


def test_transforms_as_torchvision(tmp_path):
    rng = np.random.default_rng(1)
    u8 = rng.integers(0, 256, (2, 3, 12, 17), dtype=np.uint8)
    u8[0, :, :3, :3] = 77  # grey pixels (hue undefined: the H channel's special case)
    u8[1, 0, 5:, :] = 255
    f32 = rng.random((2, 3, 12, 17)).astype(np.float32)
    f32[0, :, :2, :2] = 0.5
    save_file({"u8": u8, "f32": f32}, str(tmp_path / "in.safetensors"))
    run_gtest_hook("RobotTransforms.Oracle", {"LF_TF_IN": str(tmp_path / "in.safetensors"),
                                              "LF_TF_OUT": str(tmp_path / "ours.safetensors")})
    run_lerobot(TF_ORACLE, tmp_path / "in.safetensors", tmp_path / "ours.safetensors", tmp_path / "ref.safetensors")
    ours, ref = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    assert sorted(ours) == sorted(ref)
    kinds = set()
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, (k, ours[k].shape, ref[k].shape)
        assert np.array_equal(ours[k], ref[k]), (k, np.abs(ours[k].astype(np.float64) - ref[k]).max())
        if k.endswith(".jitters"):
            kinds.update(int(c) for c in ref[k][0::2])
    assert kinds == {0, 1, 2, 3, 4, 5}  # the seeded plans drew every jitter
    assert any(ref[k].any() for k in ref if k.endswith(".shift"))  # and an affine shift

"""OpenCV's INTER_AREA resize (data/image/resize.h resize_opencv_area, GR00T N1.7's albumentations image path) = the
cv2.resize of the lerobot environment (opencv-python), bit for bit: shrinking by non-integer factors (the area
tables), by integer ones (2 x 2 rounds half up, 3 x 3 by the float reciprocal), enlarging (the linear resize with
INTER_AREA's coefficients), one axis each way; random and smooth images."""
import numpy as np
from safetensors.numpy import load_file, save_file

from conftest import run_gtest_hook, run_lerobot

SIZES = [(480, 640, 256, 341), (243, 323, 256, 340), (256, 256, 128, 128), (300, 300, 100, 100), (300, 200, 100, 67),
         (100, 100, 256, 256), (24, 32, 200, 267), (200, 300, 256, 150), (120, 90, 60, 300), (3, 5, 7, 2),
         (257, 300, 256, 299), (63, 80, 21, 40)]

CV2 = r'''
import sys, cv2
from safetensors.numpy import load_file, save_file
b = load_file(sys.argv[1])
out = {}
for k, v in b.items():
    if k.startswith("image."):
        h, w = (int(x) for x in b["size." + k[6:]])
        out["out." + k[6:]] = cv2.resize(v, (w, h), interpolation=cv2.INTER_AREA)
save_file(out, sys.argv[2])
'''


def test_opencv_area_resize_matches_cv2(tmp_path):
    rng = np.random.default_rng(0)
    batch = {}
    for i, (h, w, oh, ow) in enumerate(SIZES):
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) * 3 % 256], -1)
        for kind, img in (("random", rng.integers(0, 256, (h, w, 3))), ("smooth", smooth)):
            batch[f"image.{i}_{kind}"] = np.ascontiguousarray(img.astype(np.uint8))
            batch[f"size.{i}_{kind}"] = np.array([oh, ow], dtype=np.int64)
    save_file(batch, str(tmp_path / "in.safetensors"))
    run_gtest_hook("ImageResize.OpenCvAreaHook", {"LF_TEST_AREA_IN": str(tmp_path / "in.safetensors"),
                                                  "LF_TEST_AREA_OUT": str(tmp_path / "ours.safetensors")})
    run_lerobot(CV2, tmp_path / "in.safetensors", tmp_path / "ref.safetensors")
    ours, ref = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    assert sorted(ours) == sorted(ref) and len(ref) == 2 * len(SIZES)
    for k in ref:
        assert ours[k].shape == ref[k].shape, k
        assert (ours[k] == ref[k]).all(), (k, int((ours[k] != ref[k]).sum()))

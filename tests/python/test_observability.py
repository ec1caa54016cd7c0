"""Oracle tests of the TensorBoard event writer (src/loongforge/io/tensorboard.*) and the PNG line plots
(src/loongforge/io/plot.*), read back with the tensorboard package and Pillow.

They drive the ObservabilityOracle.Write gtest of tests/cpp/test_observability.cpp (skipped unless LF_OBS_OUT is set)
in the gtest binary: $LOONGFORGE_TESTS_BIN if set, else loongforge_tests beside the loongforge binary (conftest.py).
"""
import math
import os
import pathlib
import struct
import subprocess
import time

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from conftest import TESTS_BIN, ROOT




TEST = "ObservabilityOracle.Write"
TRAIN_RGB, VALID_RGB = (0xD6, 0x27, 0x28), (0x1F, 0x77, 0xB4)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """Runs the gtest hook once; returns (output dir, wall-clock window of the run)."""
    assert TESTS_BIN.exists(), f"{TESTS_BIN} not found: build it first (bash scripts/build.sh)"
    d = tmp_path_factory.mktemp("obs")
    t0 = time.time()
    proc = subprocess.run([str(TESTS_BIN), f"--gtest_filter={TEST}"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "2", "LF_OBS_OUT": str(d)})
    t1 = time.time()
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{TEST} failed ({proc.returncode}):\n{log}"
    assert f"[       OK ] {TEST}" in log, f"{TEST} did not run:\n{log}"
    return d, (t0, t1)


def f32(v):
    return float(np.float32(v))


def expected():
    """{tag: [(step, wall_time or None for 'now', value)]}, the values of ObservabilityOracle.Write."""
    exp = {"train/loss": [], "valid/loss": [], "lr": [], "edge": []}
    for s in range(200):
        exp["train/loss"].append((s, 1700000000.0 + s * 0.25, 3.0 - 0.01 * s + 0.1 * (s % 7)))
        if s % 20 == 0:
            exp["valid/loss"].append((s, 1700000000.0 + s * 0.25 + 0.125, 2.5 - 0.005 * s))
        if s % 50 == 0:
            exp["lr"].append((s, None, 1e-4 * (s + 1)))
    edge = [0.1, -1e30, 1e-30, 1e-45, 123456789.0, 1e39, math.inf, -math.inf, math.nan]
    exp["edge"] = [(1000 + i, 1.0 + i, v) for i, v in enumerate(edge)]
    exp["edge"] += [(1 << 40, 2e9, 7.0), (2**63 - 1, 2e9 + 0.5, 8.0)]
    return exp


def same_f32(got, want):
    want = f32(want) if math.isfinite(want) and abs(want) < 3.5e38 else want
    if math.isnan(want):
        return math.isnan(got)
    if abs(want) > 3.5e38:  # beyond float32: rounds to inf
        return got == math.copysign(math.inf, want)
    return got == want


def event_file(d):
    files = list((d / "tb").iterdir())
    assert len(files) == 1, files
    assert files[0].name.startswith("events.out.tfevents."), files[0].name
    assert str(files[0]) == (d / "event_file").read_text()
    return files[0]


def test_event_file_name(out):
    d, (t0, t1) = out
    parts = event_file(d).name.split(".")
    secs, host, pid = int(parts[3]), parts[4], int(parts[5])
    assert int(t0) - 1 <= secs <= t1 + 1 and host and pid > 0


def test_tfrecord_framing_and_crcs(out):
    """Every record's length and masked CRC32Cs, checked with tensorboard's own CRC implementation."""
    data = event_file(out[0]).read_bytes()
    n, at = 0, 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        (len_crc,) = struct.unpack_from("<I", data, at + 8)
        assert len_crc == masked_crc32c(data[at:at + 8])
        payload = data[at + 12:at + 12 + length]
        assert len(payload) == length
        (crc,) = struct.unpack_from("<I", data, at + 12 + length)
        assert crc == masked_crc32c(payload)
        event_pb2.Event.FromString(payload)  # parses as an Event proto
        at += 12 + length + 4
        n += 1
    assert at == len(data)
    assert n == 1 + sum(len(v) for v in expected().values())


def test_raw_events_with_protobuf(out):
    d, (t0, t1) = out
    events = [event_pb2.Event.FromString(r) for r in event_file_loader.RawEventFileLoader(str(event_file(d))).Load()]
    assert events[0].file_version == "brain.Event:2"
    assert t0 - 1 <= events[0].wall_time <= t1 + 1
    scalars = events[1:]
    assert all(len(e.summary.value) == 1 and e.summary.value[0].WhichOneof("value") == "simple_value" for e in scalars)
    got = [(e.summary.value[0].tag, e.step) for e in scalars]
    # Written step by step (train/loss, then valid/loss, then lr at each step), then the edge values.
    order = {"train/loss": 0, "valid/loss": 1, "lr": 2, "edge": 3}
    want = sorted(((tag, s) for tag, rows in expected().items() for s, _, _ in rows),
                  key=lambda r: (r[0] == "edge", r[1], order[r[0]]))
    assert got == want


def test_event_accumulator_reads_scalars_exactly(out):
    d, (t0, t1) = out
    acc = event_accumulator.EventAccumulator(str(d / "tb"), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert acc.file_version == 2.0
    exp = expected()
    assert sorted(acc.Tags()["scalars"]) == sorted(exp)
    for tag, rows in exp.items():
        got = acc.Scalars(tag)
        assert [e.step for e in got] == [s for s, _, _ in rows], tag
        for e, (step, wall, value) in zip(got, rows):
            if wall is None:  # written with the default wall time: now
                assert t0 - 1 <= e.wall_time <= t1 + 1, (tag, step, e.wall_time)
            else:
                assert e.wall_time == wall, (tag, step, e.wall_time, wall)
            assert same_f32(e.value, value), (tag, step, e.value, value)
    # float32 rounding actually happened
    assert acc.Scalars("edge")[0].value == f32(0.1) != 0.1
    assert acc.Scalars("edge")[4].value == 123456792.0
    assert acc.Scalars("edge")[3].value == f32(1e-45) > 0


def load_png(path):
    img = Image.open(path)
    img.load()
    return img, np.asarray(img.convert("RGB"))


def colour_mask(px, rgb):
    return np.all(px == np.array(rgb, dtype=np.uint8), axis=-1)


@pytest.mark.parametrize("name,size", [("curves.png", (900, 500)), ("curves_log.png", (700, 400))])
def test_png_plot(out, name, size):
    img, px = load_png(out[0] / name)
    assert img.format == "PNG" and img.size == size and img.mode == "RGB"
    h, w = px.shape[:2]
    white = colour_mask(px, (255, 255, 255)).mean()
    assert white > 0.75, f"background only {white:.0%} white"
    dark = np.all(px < 64, axis=-1)
    assert dark[:30].sum() > 100, "no title text at the top"
    assert dark.sum() > 2000, "no axes / ticks / labels"
    for rgb in (TRAIN_RGB, VALID_RGB):
        assert colour_mask(px, rgb).sum() > 300, f"no line pixels of colour {rgb}"
    # Tick labels left of the plot and below it (dark pixels outside the frame).
    cols = np.where(dark.sum(axis=0) > h * 0.5)[0]  # vertical frame lines
    rows = np.where(dark.sum(axis=1) > w * 0.5)[0]  # horizontal frame lines
    assert len(cols) >= 2 and len(rows) >= 2
    left, right, top, bottom = cols.min(), cols.max(), rows.min(), rows.max()
    assert dark[top:bottom, :left - 6].sum() > 20, "no y tick labels"
    assert dark[bottom + 6:, left:right].sum() > 20, "no x tick labels"
    # The train loss falls: its pixels sit lower (larger row) on the right than on the left (legend excluded: it is
    # drawn in the emptiest corner, here top right).
    red = colour_mask(px, TRAIN_RGB)
    pw = right - left
    y_left = np.nonzero(red[:, left + int(0.05 * pw):left + int(0.3 * pw)])[0].mean()
    y_right = np.nonzero(red[:, left + int(0.5 * pw):left + int(0.75 * pw)])[0].mean()
    assert y_right > y_left + 20
    # Everything of the series lies inside the frame.
    ys, xs = np.nonzero(red | colour_mask(px, VALID_RGB))
    assert xs.min() > left and xs.max() < right and ys.min() > top and ys.max() < bottom


def test_png_atomic_no_leftovers(out):
    names = sorted(p.name for p in out[0].iterdir())
    assert names == ["curves.png", "curves_log.png", "event_file", "tb"]

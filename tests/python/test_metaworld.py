"""Closed loop on Meta-World (the `metaworld` package's task, its scripted expert, its own success signal), the way
robot-learning people judge a policy: demonstrations of button-press-topdown-v3 recorded with the scripted expert
(scripts/metaworld/record.py) and written as a LeRobot dataset by lerobot itself (to_lerobot.py); a small state-based
ACT trained from scratch on them by `loongforge train` (configs/metaworld/act-state.yaml); the checkpoint served by
`loongforge serve` and driven through openpi-client by scripts/metaworld/evaluate.py on placements the recording
never saw: it succeeds on most of them (the scripted expert, run on the same placements, on all), with the report's
Wilson interval around the rate."""
import json
import math
import os
import subprocess

import pytest

from conftest import LF_BIN, ROOT, free_port, run_lerobot, run_lf

SIM_PY = ROOT / ".venv-openpi" / "bin" / "python"
TASK = "button-press-topdown-v3"


def sim(*args):
    if not SIM_PY.exists():
        pytest.fail(f"{SIM_PY} does not exist (scripts/setup.sh makes it)")
    proc = subprocess.run([str(SIM_PY), "-W", "ignore", *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MUJOCO_GL": "osmesa", "PYOPENGL_PLATFORM": "osmesa"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("metaworld")
    sim(ROOT / "scripts/metaworld/record.py", "--task", TASK, "--episodes", 40, "--out", d / "demos.npz")
    run_lerobot((ROOT / "scripts/metaworld/to_lerobot.py").read_text(), d / "demos.npz", d / "data")
    run_lf("train", ROOT / "configs/metaworld/act-state.yaml", "--set", f"output_dir={d / 'run'}",
           "--set", f"data.train=[{{path: {d / 'data'}}}]", "--set", "train.steps=1200", "--set", "checkpoint.every=1200",
           "--set", "eval.every=0", "--set", "log.progress=lines")
    ckpts = d / "run" / "checkpoints"
    return d, ckpts / (ckpts / "latest").read_text().strip()


def test_act_trained_on_expert_demos_succeeds_in_closed_loop(tmp_path, trained):
    d, ckpt = trained
    port = free_port()
    server = subprocess.Popen([str(LF_BIN), "serve", "--policy", str(ckpt), "--port", str(port)],
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        sim(ROOT / "scripts/metaworld/evaluate.py", "--task", TASK, "--episodes", 12, "--port", port,
            "--out", tmp_path / "policy.json")
    finally:
        server.terminate()
        server.wait(timeout=30)
    sim(ROOT / "scripts/metaworld/evaluate.py", "--task", TASK, "--episodes", 12, "--expert",
        "--out", tmp_path / "expert.json")
    p = json.loads((tmp_path / "policy.json").read_text())
    e = json.loads((tmp_path / "expert.json").read_text())
    assert p["policy"] == "act" and p["episodes"] == 12 and p["latency_ms"]["queries"] > 12
    assert e["success_rate"] == 1.0, e
    assert p["success_rate"] >= 0.5, p
    lo, hi = p["wilson95"]
    assert lo <= p["success_rate"] <= hi and 0 < hi - lo < 0.6
    # the interval is Wilson's score interval
    n, k, z = 12, p["successes"], 1.959964
    c = (k / n + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(k / n * (1 - k / n) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert abs(lo - max(0, c - h)) < 1e-9 and abs(hi - min(1, c + h)) < 1e-9
    # episodes end at success, so the policy's successful episodes are shorter than the cap
    assert p["mean_length"] < 200 or p["success_rate"] < 1

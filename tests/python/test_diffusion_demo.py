"""The Diffusion Policy demo end to end (scripts/diffusion_demo.sh: the reach dataset with the target as the
environment state, written with lerobot; LeRobot's Diffusion Policy trained from scratch; open-loop evaluation with
the DDIM sampler on held-out episodes): the script's own check passes (open-loop error under a quarter of the mean
action's) and the checkpoint is a LeRobot policy folder with plots beside it."""
import json
import os
import subprocess

import pytest

from conftest import ROOT


@pytest.mark.slow  # about 80 s on 2 quiet cores plus the dataset written by lerobot: LF_SLOW=1 runs it
def test_diffusion_demo_learns_to_reach(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "diffusion_demo.sh")], capture_output=True, text=True,
                          env={**os.environ, "DIFFUSION_DEMO_DIR": str(tmp_path)}, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "learned: yes" in proc.stdout
    ckpts = tmp_path / "diffusion-reach" / "checkpoints"
    ck = ckpts / (ckpts / "latest").read_text().strip()
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["type"] == "diffusion" and "observation.environment_state" in cfg["input_features"]
    assert list((tmp_path / "diffusion-reach" / "open_loop" / "final").glob("*.png"))

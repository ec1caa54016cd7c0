"""The language-conditioned robot demos end to end (scripts/pi0_demo.sh: a small Gemma-like tokenizer and a small π0;
scripts/groot_demo.sh: a small Qwen-VL-like processor folder and a small GR00T N1.7; each on the two-dot reach dataset
written with lerobot, trained from scratch, evaluated open loop on held-out episodes, `predict` for both tasks on
held-out frames): the script's own check passes (open-loop error under a quarter of the mean action's, each task's
first action heading for its own dot rather than the other on 7 of 8 held-out frames and tasks) and the checkpoint is
a LeRobot policy folder (GR00T's with its processor files)."""
import json
import os
import subprocess

import pytest

from conftest import ROOT

# script, its output-folder variable, the run's folder, the policy type, checkpoint files beyond the weights and
# config. π0: about two minutes on 2 quiet cores; GR00T: about 7 (with the dataset written by lerobot).
DEMOS = {"pi0": ("pi0_demo.sh", "PI0_DEMO_DIR", "pi0-reach", ["tokenizer.json"]),
         "groot": ("groot_demo.sh", "GROOT_DEMO_DIR", "groot-reach", ["tokenizer.json", "policy_preprocessor.json"])}


@pytest.mark.slow  # LF_SLOW=1 runs them
@pytest.mark.parametrize("kind", sorted(DEMOS))
def test_language_demo_learns_to_follow_the_prompt(tmp_path, kind):
    script, var, run, files = DEMOS[kind]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script)], capture_output=True, text=True,
                          env={**os.environ, var: str(tmp_path)}, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "learned: yes" in proc.stdout
    follows = [l for l in proc.stdout.splitlines() if l.startswith("follows the prompt in")]
    assert len(follows) == 1 and int(follows[0].split()[4]) >= 7, follows
    ckpts = tmp_path / run / "checkpoints"
    ck = ckpts / (ckpts / "latest").read_text().strip()
    assert json.loads((ck / "config.json").read_text())["type"] == kind
    assert (ck / "model.safetensors").exists() and all((ck / f).exists() for f in files), files
    assert list((tmp_path / run / "open_loop" / "final").glob("*.png"))

"""`loongforge env` reports what PyTorch itself sees on this machine: LibTorch's version, the intra-op threads, and
the usable GPUs (names, or the reason there is none)."""
import os
import subprocess
import sys

import torch

from conftest import LF_BIN


def torch_threads(env):
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)


def test_env_matches_pytorch():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([str(LF_BIN), "env"], env=env, capture_output=True, text=True, check=True)
    lines = dict(l.split(" ", 1) if l.startswith(("libtorch", "loongforge")) else l.split(": ", 1)
                 for l in out.stdout.splitlines())
    assert lines["libtorch"] == torch.__version__.split("+")[0]
    assert lines["cpu"].startswith(f"{torch_threads(env)} threads")
    gpus = [v for k, v in lines.items() if k.startswith("gpu ")]
    if torch.cuda.is_available() and lines["cuda kernels"].startswith("compiled"):
        assert len(gpus) == torch.cuda.device_count()
        for i, g in enumerate(gpus):
            assert g.startswith(torch.cuda.get_device_name(i) + ", ")
    else:
        assert gpus == [] and lines["gpus"].startswith("none usable (")
    assert lines["collectives"].split(", ")[0] == "gloo"
    assert ("nccl" in lines["collectives"]) == lines["cuda kernels"].startswith("compiled")

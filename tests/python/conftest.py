"""Shared helpers for the oracle tests: they run the `loongforge` binary and compare with the Python libraries."""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
LF_BIN = pathlib.Path(os.environ.get("LOONGFORGE_BIN", ROOT / "build" / "loongforge"))
# The gtest binary; some oracle tests drive C++ hooks in it (gtests that skip unless their env vars are set).
TESTS_BIN = pathlib.Path(os.environ.get("LOONGFORGE_TESTS_BIN", LF_BIN.parent / "loongforge_tests"))


def run_lf(*args, input=None, check=True):
    """Runs loongforge with the arguments; returns the CompletedProcess (text mode)."""
    proc = subprocess.run([str(LF_BIN), *map(str, args)], input=input, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    if check and proc.returncode != 0:
        raise AssertionError(f"loongforge {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def fixtures_dir():
    return FIXTURES

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


def run_gtest_hook(test, env):
    """Runs one C++ oracle hook of the gtest binary (a gtest that skips unless its env vars are set) and fails unless
    it really ran and passed. Returns the CompletedProcess."""
    if not TESTS_BIN.exists():
        pytest.fail(f"{TESTS_BIN} does not exist (build it with scripts/build.sh)")
    proc = subprocess.run([str(TESTS_BIN), f"--gtest_filter={test}"], capture_output=True, text=True,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "[  PASSED  ] 1 test" not in proc.stdout:
        pytest.fail(f"{TESTS_BIN} did not run {test} (stale binary? rebuild it):\n{proc.stdout}")
    return proc


@pytest.fixture(scope="session")
def fixtures_dir():
    return FIXTURES

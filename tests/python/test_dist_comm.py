"""The communication layer across processes: every collective against the values each rank computes alone, the
differentiable collectives' gradients, and a rank that dies: the others stop with an error naming it, within the
timeout (tests/cpp/test_comm.cpp holds the C++ side)."""
import os
import re
import shutil
import subprocess
import time

import pytest

from conftest import TESTS_BIN, launch_ranks, lf_backends, run_gtest_hook_ranks



def test_collectives_four_ranks():
    run_gtest_hook_ranks(4, "DistHook.Collectives", {"LF_DIST_HOOK": "1"})


def mpirun_hook(n, test, hook_env, timeout=300):
    """Runs one C++ hook as n ranks under mpirun with parallel backend mpi, without MASTER_ADDR / MASTER_PORT (MPI
    tells the ranks where the store is)."""
    if not shutil.which("mpirun"):
        pytest.skip("no mpirun")
    if "mpi" not in lf_backends():
        pytest.skip("this build has no MPI backend")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    xs = sum((["-x", f"{k}={v}"] for k, v in {**hook_env, "LF_DIST_HOOK_BACKEND": "mpi",
                                                "OMP_NUM_THREADS": "1"}.items()), [])
    return subprocess.run(["mpirun", "-np", str(n), "--allow-run-as-root", "--oversubscribe", *xs, str(TESTS_BIN),
                           f"--gtest_filter={test}", "--gtest_color=no"], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_collectives_four_ranks_over_mpi():
    """The same hook with parallel backend mpi: Open MPI's non-blocking collectives and its own communicators for
    the mesh groups."""
    p = mpirun_hook(4, "DistHook.Collectives", {"LF_DIST_HOOK": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("[  PASSED  ] 1 test") == 4, p.stdout[-3000:]


def test_hung_rank_is_named_after_the_timeout_over_mpi():
    """Under MPI a wait polls its request up to the timeout; then the same diagnosis names the hung rank."""
    t0 = time.time()
    p = mpirun_hook(3, "DistHook.HungPeerIsNamedAfterTheTimeout", {"LF_DIST_HOOK_HANG": "3000"}, timeout=120)
    out = p.stdout + p.stderr
    assert out.count("rank(s) 1 never reached collective #2") == 2, out[-3000:]
    assert out.count("[  PASSED  ] 1 test") == 2, out[-3000:]  # ranks 0 and 2 (rank 1 leaves without MPI's goodbye)
    assert time.time() - t0 < 60


def test_dead_rank_ends_the_mpi_job():
    """A rank that dies under mpirun: mpirun ends the others at once and names the process (Open MPI's report)."""
    t0 = time.time()
    p = mpirun_hook(3, "DistHook.PeerExitIsAnErrorNamingTheRank", {"LF_DIST_HOOK_EXIT": "30000"}, timeout=120)
    assert p.returncode != 0
    assert time.time() - t0 < 30, "the others waited for the timeout"
    out = p.stdout + p.stderr
    assert re.search(r"Process name: \[\[\d+,\d+\],1\]\s+Exit code:\s+3", out), out[-2000:]


def test_dead_rank_is_named_and_the_others_exit():
    t0 = time.time()
    res = launch_ranks(3, [TESTS_BIN, "--gtest_filter=DistHook.PeerExitIsAnErrorNamingTheRank"],
                       {"LF_DIST_HOOK_EXIT": "30000"}, timeout=120)
    elapsed = time.time() - t0
    assert res[1].returncode == 3  # the rank that died
    for r in (0, 2):
        assert res[r].returncode == 0, res[r].stdout + res[r].stderr
        assert "[  PASSED  ] 1 test" in res[r].stdout
        assert "rank(s) 1 stopped answering" in res[r].stderr
    assert elapsed < 30  # well within the 30 s collective timeout: a dead peer is noticed at once


def test_hung_rank_is_named_after_the_timeout():
    res = launch_ranks(3, [TESTS_BIN, "--gtest_filter=DistHook.HungPeerIsNamedAfterTheTimeout"],
                       {"LF_DIST_HOOK_HANG": "3000"}, timeout=120)
    for r in (0, 2):
        assert res[r].returncode == 0, res[r].stdout + res[r].stderr
        assert "[  PASSED  ] 1 test" in res[r].stdout
        assert "rank(s) 1 never reached" in res[r].stderr

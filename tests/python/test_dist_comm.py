"""The communication layer across processes: every collective against the values each rank computes alone, the
differentiable collectives' gradients, and a rank that dies: the others stop with an error naming it, within the
timeout (tests/cpp/test_comm.cpp holds the C++ side)."""
import time

from conftest import TESTS_BIN, launch_ranks, run_gtest_hook_ranks


def test_collectives_four_ranks():
    run_gtest_hook_ranks(4, "DistHook.Collectives", {"LF_DIST_HOOK": "1"})


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

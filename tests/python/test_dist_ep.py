"""Expert parallelism (parallel/expert_parallel.h) at ep2 and ep4: every rank runs its own rows of a tiny qwen3_moe
model with its share of the experts; the loss sums over ranks and every gradient (non-expert ones summed over ranks,
expert ones as local slices) equal the one-process reference each rank computes itself on the global batch
(tests/cpp/test_ep.cpp, EPHook.*), dropless and with per-rank capacity dropping."""
import pytest

from conftest import run_gtest_hook_ranks


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_matches_one_process(ep):
    run_gtest_hook_ranks(ep, "EPHook.LossAndGradientsMatchOneProcess", {"LF_EP_HOOK": "1"})

"""Data parallelism across processes: DDP, ZeRO-1, FSDP (ZeRO-3), HSDP and gradient accumulation each train a tiny
Llama for 10 AdamW steps with clipping, every rank taking its slice of the global batch, and must give the same
per-step losses and gradient norms as one process (1e-5 relative) and the same final parameters (1e-5 relative to
each tensor's largest value). Every rank computes the single-process reference itself (tests/cpp/test_dp.cpp,
DistHook.DataParallel); LF_DP_HOOK is "zero,shard,replicate,micro_batches[,tied]"."""
import pytest

from conftest import run_gtest_hook_ranks

LAYOUTS = {
    "dp2": "0,1,2,1",
    "dp2_accumulate2": "0,1,2,2",
    "dp4_zero1": "1,4,1,1",
    "dp4_zero3": "3,4,1,1",
    "hsdp_shard2_replicate2": "3,2,2,1",
    "hsdp_zero1_2x2_tied_accumulate2": "1,2,2,2,1",
    "dp2_zero3_tied_accumulate2": "3,2,1,2,1",
    "dp3_zero1_padded_shards": "1,3,1,1",
    "dp3_zero3_padded_shards": "3,3,1,1",
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_data_parallel_matches_one_process(name):
    spec = LAYOUTS[name]
    zero, shard, replicate = (int(x) for x in spec.split(",")[:3])
    run_gtest_hook_ranks(shard * replicate, "DistHook.DataParallel", {"LF_DP_HOOK": spec})

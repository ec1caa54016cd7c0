"""Pipeline parallelism across processes: every layout and schedule gives the single-process summed loss, gradients
(each owned parameter), and 10 AdamW steps with clipping (per-step losses and gradient norms) within 1e-5. Each rank
computes the single-process reference itself (tests/cpp/test_pp.cpp, PipelineHook.MatchesOneProcess)."""
import pytest

from conftest import run_gtest_hook_ranks

CASES = {
    # name: (ranks, env)
    "pp2_1f1b": (2, {}),
    "pp2_uneven_1_3": (2, {"LF_PP_LAYOUT": "1,3"}),
    "pp2_interleaved_vpp2": (2, {"LF_PP_VPP": "2"}),
    "pp4_1f1b": (4, {}),
    "pp2_tied_embeddings": (2, {"LF_PP_TIED": "1"}),
    "pp4_interleaved_vpp2_tied_uneven": (4, {"LF_PP_VPP": "2", "LF_PP_LAYERS": "10", "LF_PP_TIED": "1",
                                             "LF_PP_LAYOUT": "1,2,1,1,1,1,2,1"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_one_process(name):
    n, env = CASES[name]
    run_gtest_hook_ranks(n, "PipelineHook.MatchesOneProcess", {"LF_PP_HOOK": "1", **env})


def test_pp4_vpp2_eight_micro_batches_run_to_the_end():
    # the communication of the interleaved schedule with 8 micro-batches over 4 ranks (2 chunks each) completes
    # (the hook's collectives have a timeout: a deadlock fails) and still matches one process
    run_gtest_hook_ranks(4, "PipelineHook.MatchesOneProcess",
                         {"LF_PP_HOOK": "1", "LF_PP_VPP": "2", "LF_PP_LAYERS": "8", "LF_PP_MICROS": "8",
                          "LF_PP_STEPS": "2"}, timeout=240)

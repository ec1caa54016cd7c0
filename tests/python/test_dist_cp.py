"""Context parallelism across processes (tests/cpp/test_cp.cpp holds the C++ side): ring and all-to-all attention
alone against nn::causal_attention on the full sequence (float64, values and gradients), and a tiny Llama whose
summed loss, gradients (all-reduced over cp) and 10 AdamW steps (losses, gradient norms) match one process within
1e-5 — plain and with packed documents (segment ids); a tiny Qwen3.5 text decoder's linear-attention layers (the
recurrent state passed between ranks) in float64: loss and every gradient = one process; the same for a tiny Kimi
Linear's KDA layers (per-channel decay)."""
import pytest

from conftest import run_gtest_hook_ranks


@pytest.mark.parametrize("n", [2, 4])
def test_ring_and_a2a_attention_match_full_attention(n):
    run_gtest_hook_ranks(n, "CPHook.Attention", {"LF_CP_HOOK": "1"})


@pytest.mark.parametrize("n,mode", [(2, "ring"), (2, "a2a"), (4, "ring")])
def test_llama_context_parallel_matches_one_process(n, mode):
    run_gtest_hook_ranks(n, "CPHook.LlamaLossGradsAndTraining", {"LF_CP_HOOK": "1", "LF_CP_MODE": mode})


@pytest.mark.parametrize("n,mode", [(2, "ring"), pytest.param(2, "a2a", marks=pytest.mark.slow),
                                    pytest.param(4, "ring", marks=pytest.mark.slow)])
def test_linear_attention_context_parallel_float64(n, mode):
    """Gated DeltaNet layers under cp: loss and every gradient = one process in float64 (tests/cpp/test_cp.cpp)."""
    run_gtest_hook_ranks(n, "CPHook.LinearAttentionFloat64", {"LF_CP_HOOK": "1", "LF_CP_MODE": mode})


@pytest.mark.parametrize("n,mode", [(2, "ring"), pytest.param(2, "a2a", marks=pytest.mark.slow)])
def test_kda_context_parallel_float64(n, mode):
    """Kimi Linear's KDA layers under cp: loss and every gradient = one process in float64 (tests/cpp/test_cp.cpp)."""
    run_gtest_hook_ranks(n, "CPHook.KdaFloat64", {"LF_CP_HOOK": "1", "LF_CP_MODE": mode})

"""Tensor + sequence parallelism at tp=2 against the same tiny model run whole in one process (each rank computes
the single-process reference itself; tests/cpp/test_tp.cpp holds the C++ side): loss and gathered gradients
(Llama with every bias and a pad token, Qwen3 q/k norms, tied embeddings, Qwen2), 10 AdamW steps with global-norm
clipping, and the sequence-length error under sp."""
from conftest import run_gtest_hook_ranks

ENV = {"LF_TP_HOOK": "1"}


def test_tp2_gradients_match_one_process():
    run_gtest_hook_ranks(2, "TpHook.GradientParity", ENV)


def test_tp2_training_matches_one_process():
    run_gtest_hook_ranks(2, "TpHook.TrainingParity", ENV)


def test_tp2_sp_rejects_indivisible_sequence():
    run_gtest_hook_ranks(2, "TpHook.SequenceParallelNeedsDivisibleLength", ENV)

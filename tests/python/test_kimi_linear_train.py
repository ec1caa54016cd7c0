"""`loongforge train` on a tiny Kimi Linear (KDA + latent attention without rotary, routed experts with a shared
expert): the loss falls; dp2 with ZeRO-1 and with expert parallelism (slow set), cp2 (the KDA layers pass their
recurrent state and convolution past between the ranks' parts; slow set) and tp2 (KDA split by heads; with
sequence parallelism too) follow one process."""
import pytest

from test_kimi_linear_parity import CASES, make_model, save
from test_qwen3_next_train import (ALIGNED_DOCS, RANDOM_DOCS, check_cp2_follows_one_process, check_cp2_packed_documents, check_dp2_follows_one_process,
                                   check_loss_falls, check_tp2_follows_one_process, write_tiny_data)


@pytest.fixture()
def tiny(tmp_path):
    overrides = dict(CASES["lists_lora_groups"][0], vocab_size=128)
    save(make_model(overrides), tmp_path / "model", overrides)
    write_tiny_data(tmp_path, 128)
    return tmp_path


def test_loss_falls(tiny):
    check_loss_falls(tiny)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero: 1", "ep: 2"])
def test_dp2_follows_one_process(tiny, layout):
    # Step 1's gradient norms agree to 1e-6; by step 3 (lr 1e-2) the float32 rounding of the two batch splittings has
    # grown to 1.4e-5 (zero) / 1.5e-5 (ep) while the losses still agree to 3e-7.
    check_dp2_follows_one_process(tiny, layout, grad_norm_tol=3e-5)


@pytest.mark.parametrize("layout", ["tp: 2", "tp: 2\n  sp: true"])
def test_tp2_follows_one_process(tiny, layout):
    """Tensor parallelism: KDA's heads split (q/k/v, b, the gates' up-projections, the convolutions, dt_bias, A_log,
    o_proj; the gates' low-rank entries and o_norm whole), the latent attention and the experts as DeepSeek's. The
    checkpoints after three AdamW steps (lr 1e-2) to a median difference of 1e-5 per tensor: measured 1.1e-6 at most
    (a norm weight; the step-1 gradient norms agree to 1.5e-6), where a wrong split would differ by O(lr)."""
    check_tp2_follows_one_process(tiny, layout)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ring", "a2a"])
def test_cp2_follows_one_process(tiny, mode):
    """Context parallelism: measured 1.6e-7 (losses) and 6.8e-7 (gradient norms) from one process over three steps
    (slow set: ~20 s; the CI set has test_dist_cp.py's float64 KDA case)."""
    check_cp2_follows_one_process(tiny, mode)


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [ALIGNED_DOCS, RANDOM_DOCS])
def test_cp2_packed_documents_follow_one_process(tiny, lengths):
    """Packed documents under context parallelism (ring): the KDA layers restart their state and convolutions at
    every document start, within a part or at its first token (test_qwen3_next_train.py's check)."""
    check_cp2_packed_documents(tiny, "ring", lengths)

"""Validation (`eval.every`) in distributed runs with pipeline parallelism: the forward-only pipeline schedule
(parallel/pipeline.h: Pipeline::forward_only) gives the valid_loss of one process (fp32, 1e-5), alone and combined
with data and tensor(+sequence) parallelism; the training losses still match too."""
import pytest

from conftest import run_lf
from test_dist_train import close, data_dir, metrics, recipe, train_ranks  # noqa: F401 (data_dir is a fixture)

COMMON = ["train.steps=4", "eval.every=2", "eval.batches=2", "data.valid_fraction=0.05"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):  # noqa: F811
    tmp = tmp_path_factory.mktemp("eval_ref")
    run_lf("train", recipe(tmp, data_dir), *sum((["--set", s] for s in COMMON + ["train.micro_batch_size=4"]), []))
    return metrics(tmp / "run")


LAYOUTS = {
    "pp2": (2, ["parallel.pp=2", "train.micro_batch_size=4"]),
    "pp2_interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=4"]),
    "dp2_pp2": (4, ["parallel.dp=2", "parallel.pp=2", "train.micro_batch_size=2"]),
    "tp2_sp_pp2": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "train.micro_batch_size=4"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_validation_matches_one_process(tmp_path, data_dir, reference, name):  # noqa: F811
    n, sets = LAYOUTS[name]
    train_ranks(n, recipe(tmp_path, data_dir), COMMON + sets)
    got = metrics(tmp_path / "run")
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert [("valid_loss" in m) for m in got] == [False, True, False, True]
    for m, ref in zip(got, reference):
        assert close(m["loss"], ref["loss"]), (name, m["step"], m["loss"], ref["loss"])
        if "valid_loss" in ref:
            assert close(m["valid_loss"], ref["valid_loss"]), (name, m["step"], m["valid_loss"], ref["valid_loss"])

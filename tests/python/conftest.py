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


# The lerobot oracle environment (scripts/setup.sh makes it; requirements-lerobot.txt says why it is separate).
LEROBOT_PY = pathlib.Path(os.environ.get("LOONGFORGE_LEROBOT_PYTHON", ROOT / ".venv-lerobot" / "bin" / "python"))


def run_lerobot(script, *args, timeout=600):
    """Runs SCRIPT (Python source text) in the lerobot oracle environment with ARGS as sys.argv[1:]; fails the test
    with its stderr when it fails. Returns stdout."""
    if not LEROBOT_PY.exists():
        pytest.fail(f"{LEROBOT_PY} does not exist (scripts/setup.sh makes it)")
    proc = subprocess.run([str(LEROBOT_PY), "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1",
                                                "HF_DATASETS_OFFLINE": "1"})
    if proc.returncode != 0:
        raise AssertionError(f"lerobot oracle script failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def assert_policy_grads_and_step_match(got, ref):
    """A policy `dump` against its LeRobot reference: every grad.<name> (1e-4 of the tensor's largest) and the AdamW
    step's after_step.<name>. Adam turns a gradient of rounding noise (an attention key bias, which softmax ignores)
    into a step of about lr with that noise's sign, so such elements are held to lr, the others to float rounding.
    Noise: an element below 1e-5 of its tensor's largest, or below 1e-6 of the largest gradient of all (a tensor whose
    true gradient is 0, as the bias before a softmax, is all noise), or below Adam's eps (1e-8)."""
    import numpy as np
    grads = [k for k in ref if k.startswith("grad.")]
    assert grads and sorted(grads) == sorted(k for k in got if k.startswith("grad."))
    for k in grads:
        scale = max(np.abs(ref[k]).max(), 1e-6)
        assert np.abs(got[k] - ref[k]).max() <= 1e-4 * scale + 1e-7, (k, np.abs(got[k] - ref[k]).max(), scale)
    overall = max(np.abs(ref[k]).max() for k in grads)
    for k in (k for k in ref if k.startswith("after_step.")):
        g = ref["grad." + k[len("after_step."):]]
        noise = np.abs(g) <= max(1e-5 * np.abs(g).max(), 1e-6 * overall, 1e-8)
        diff = np.abs(got[k] - ref[k])
        assert (diff <= 1e-5 * np.abs(ref[k]) + 1e-6)[~noise].all(), k
        assert (diff <= 1.1e-3)[noise].all(), k


def check_policy_dump(tmp_path, oracle, spec):
    """Runs ORACLE (a lerobot script taking SPEC as json and a folder; it writes policy/, batch.safetensors with the
    draws and ref.safetensors) and `loongforge dump` with one AdamW step on its folder and batch: the loss (1e-5 rel),
    the eval-mode action_chunk (1e-4) and assert_policy_grads_and_step_match. Returns (ref, got)."""
    import json
    import numpy as np
    from safetensors.numpy import load_file
    run_lerobot(oracle, json.dumps(spec), tmp_path)
    out = tmp_path / "lf.safetensors"
    run_lf("dump", "--model", tmp_path / "policy", "--batch", tmp_path / "batch.safetensors", "--out", out,
           "--adamw", "lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1")
    ref, got = load_file(tmp_path / "ref.safetensors"), load_file(out)
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * max(1.0, abs(ref["loss"][0])), (got["loss"], ref["loss"])
    assert got["action_chunk"].shape == ref["action_chunk"].shape, (got["action_chunk"].shape, ref["action_chunk"].shape)
    chunk_diff = np.abs(got["action_chunk"] - ref["action_chunk"]).max()
    assert chunk_diff <= 1e-4, chunk_diff
    assert_policy_grads_and_step_match(got, ref)
    return ref, got


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a longer test (more layouts of the same kind); runs with LF_SLOW=1")


# The test files that take longest (their module fixtures train or record): collected first, so that with several
# workers (scripts/test.sh: pytest-xdist, one file per worker at a time) none of them is left running alone at the end.
LONG_FILES = ["test_metaworld.py", "test_policy_train.py", "test_diffusion_policy_train.py", "test_groot_train.py",
              "test_lerobot_dataset.py", "test_policy_dist.py", "test_pi0_train.py", "test_dist_train.py",
              "test_dist_comm.py", "test_robot_loader.py", "test_act_parity.py", "test_robot_stats.py"]


def pytest_collection_modifyitems(config, items):
    """Longest files first (see LONG_FILES); tests marked slow are skipped unless LF_SLOW=1 (the CI set stays small)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order
    if os.environ.get("LF_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow (set LF_SLOW=1 to run)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixtures_dir():
    return FIXTURES


def free_port():
    """A TCP port nobody listens on now (for MASTER_PORT)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(n, argv, env=None, timeout=300, threads=1):
    """Starts `argv` as n ranks with torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT) and waits for all. Returns the list of CompletedProcess-like results (returncode, stdout, stderr) in
    rank order."""
    port = free_port()
    procs = []
    for r in range(n):
        e = {**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)}
        procs.append(subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=e))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {len(results)} of {argv} did not finish within {timeout} s")
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def run_gtest_hook_ranks(n, test, env, timeout=300):
    """Runs one C++ hook of the gtest binary as n ranks; fails unless every rank ran it and passed."""
    if not TESTS_BIN.exists():
        pytest.fail(f"{TESTS_BIN} does not exist (build it with scripts/build.sh)")
    res = launch_ranks(n, [TESTS_BIN, f"--gtest_filter={test}"], env, timeout)
    for r, p in enumerate(res):
        assert p.returncode == 0, f"rank {r}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
        if "[  PASSED  ] 1 test" not in p.stdout:
            pytest.fail(f"rank {r} did not run {test} (stale binary? rebuild it):\n{p.stdout}")
    return res


def lf_backends():
    """The collective backends `loongforge env` lists (gloo; nccl in CUDA builds; mpi in builds with Open MPI)."""
    out = subprocess.run([str(LF_BIN), "env"], capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("collectives:"))
    return [b.strip() for b in line.split(":", 1)[1].split(",")]

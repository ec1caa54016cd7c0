"""`loongforge serve`: a policy behind openpi's websocket + msgpack protocol, driven by the PyPI openpi-client
(0.1.2, in its own environment .venv-openpi: requirements-openpi.txt) unchanged, against LeRobot on a small ACT policy
written here with the lerobot package (its weights, config and processor files):
  - on connect the client gets the policy's metadata; `infer` on a raw observation (a uint8 HWC camera frame, a float
    state; flat by feature name or nested by its dots, arrays or lists) answers the unnormalised action chunk = LeRobot's own prepare_observation_for_inference -> preprocessor ->
    predict_action_chunk -> postprocessor on the same observation, with the server's timings;
  - malformed requests (not msgpack, not a map, a missing feature, a wrong shape or dtype) are answered with one line
    of text (openpi-client raises with it) and the server serves the next client; a message over --max-message-mb
    closes its connection (1009) and the server goes on; two clients at once get their own answers;
  - it listens on 127.0.0.1 unless --host says otherwise; GET /healthz answers 200; at exit (SIGINT) and every
    --report-every requests it prints the request latency's p50 / p99."""
import json
import os
import pathlib
import select
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import LF_BIN, ROOT, run_lerobot, run_lf
from test_policy_train import POLICY

OPENPI_PY = pathlib.Path(os.environ.get("LOONGFORGE_OPENPI_PYTHON", ROOT / ".venv-openpi" / "bin" / "python"))


def run_openpi(script, *args, timeout=120):
    """Runs SCRIPT (Python source) in the openpi-client environment with ARGS as sys.argv[1:]; fails the test with
    its stderr when it fails. Returns stdout."""
    if not OPENPI_PY.exists():
        pytest.fail(f"{OPENPI_PY} does not exist (scripts/setup.sh makes it)")
    proc = subprocess.run([str(OPENPI_PY), "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"openpi-client script failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


class Server:
    """`loongforge serve` in the background: its address from the "listening on ws://HOST:PORT" line, its stderr in
    a file; stop() sends SIGINT and returns the stderr."""

    def __init__(self, log, *args, env=None):
        self.log = pathlib.Path(log)
        self.err = open(self.log, "w")
        self.proc = subprocess.Popen([str(LF_BIN), "serve", *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=self.err, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})})
        deadline = time.time() + 60
        line = ""
        while time.time() < deadline and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                line = self.proc.stdout.readline()
                break
        if "listening on ws://" not in line:
            self.stop()
            raise AssertionError(f"loongforge serve did not start: {line!r}\n{self.log.read_text(errors='replace')}")
        self.host, self.port = line.split("ws://")[1].strip().rsplit(":", 1)
        self.port = int(self.port)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()
        return self.log.read_text(errors="replace")


# In the lerobot environment: test_policy_train.py's small ACT policy (state 4, a 24 x 32 camera, chunk 5) saved to
# argv[1] with processor files (LeRobot's normaliser with the statistics below), two raw observations as a robot
# sends them (uint8 HWC frame, float32 state) to argv[2] (obs.npz: "a.<feature>", "b.<feature>") and LeRobot's answer
# for each to argv[3] (ref.npz): prepare_observation_for_inference -> preprocessor -> predict_action_chunk ->
# postprocessor, as LeRobot's record / eval loops run a policy.
MAKE = POLICY + r'''
import numpy as np
from lerobot.policies.factory import make_pre_post_processors
from lerobot.policies.utils import prepare_observation_for_inference
g = torch.Generator().manual_seed(3)
stats = {"observation.state": {"mean": torch.randn(4, generator=g), "std": torch.rand(4, generator=g) + 0.5},
         "observation.images.top": {"mean": torch.rand(3, 1, 1, generator=g) * 0.5 + 0.25,
                                    "std": torch.rand(3, 1, 1, generator=g) * 0.2 + 0.1},
         "action": {"mean": torch.randn(4, generator=g) * 3, "std": torch.rand(4, generator=g) + 0.5}}
pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
pre.save_pretrained(sys.argv[1]); post.save_pretrained(sys.argv[1])
policy = ACTPolicy.from_pretrained(sys.argv[1]); policy.eval()
pre, post = make_pre_post_processors(policy.config, pretrained_path=sys.argv[1])
rng = np.random.default_rng(5)
obs, ref = {}, {}
for name in ("a", "b"):
    raw = {"observation.state": rng.standard_normal(4).astype(np.float32),
           "observation.images.top": rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)}
    obs.update({f"{name}.{k}": v for k, v in raw.items()})
    batch = prepare_observation_for_inference({k: v.copy() for k, v in raw.items()}, torch.device("cpu"))
    with torch.no_grad():
        ref[name] = post(policy.predict_action_chunk(pre(batch)))[0].numpy()
np.savez(sys.argv[2], **obs)
np.savez(sys.argv[3], **ref)
'''

# In the openpi-client environment: the observation NAME ("a" / "b") of obs.npz as a dict.
CLIENT_COMMON = r'''
import json, sys, threading
import numpy as np
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
port, data = int(sys.argv[1]), np.load(sys.argv[2])
def observation(name):
    return {k[len(name) + 1:]: data[k] for k in data.files if k.startswith(name + ".")}
def listify(x):
    if isinstance(x, np.ndarray): return x.tolist()
    if isinstance(x, dict): return {k: listify(v) for k, v in x.items()}
    return x
'''

# One client: the metadata, then two requests on the same connection ("a", then "b").
ONE_CLIENT = CLIENT_COMMON + r'''
client = WebsocketClientPolicy(host="127.0.0.1", port=port)
out = {"metadata": listify(client.get_server_metadata())}
for name in ("a", "b"):
    r = client.infer(observation(name))
    out[name] = {"actions": r["actions"].tolist(), "dtype": str(r["actions"].dtype),
                 "keys": sorted(r), "server_timing": r["server_timing"], "policy_timing": r["policy_timing"]}
# the same observation nested ({"observation": {"images": {"top": ..}}}), the state as a list of Python floats, and
# a prompt (which ACT does not read)
a = observation("a")
nested = {"observation": {"state": a["observation.state"].tolist(), "images": {"top": a["observation.images.top"]}},
          "prompt": "pick up the cube"}
out["nested"] = client.infer(nested)["actions"].tolist()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    run_lerobot(MAKE, d / "policy", d / "obs.npz", d / "ref.npz")
    return d


@pytest.fixture(scope="module")
def server(made, tmp_path_factory):
    """One server for the module: the default host, any free port, a 64 KiB message bound."""
    s = Server(tmp_path_factory.mktemp("serve_log") / "serve.log", "--policy", made / "policy", "--port", 0,
               "--max-message-mb", 0.0625)
    yield s
    s.stop()


def test_openpi_client_gets_lerobots_actions(made, server):
    out = json.loads(run_openpi(ONE_CLIENT, server.port, made / "obs.npz"))
    ref = np.load(made / "ref.npz")
    meta = out["metadata"]
    assert meta["policy_type"] == "act", meta
    assert list(meta["action_shape"]) == [5, 4], meta
    assert set(meta["input_features"]) == {"observation.state", "observation.images.top"}, meta
    for name in ("a", "b"):
        got = np.array(out[name]["actions"])
        assert out[name]["dtype"] == "float32" and got.shape == ref[name].shape == (5, 4)
        assert np.abs(got - ref[name]).max() <= 1e-5 * max(1.0, np.abs(ref[name]).max()), (got, ref[name])
        assert out[name]["keys"] == ["actions", "policy_timing", "server_timing"]
        assert out[name]["server_timing"]["infer_ms"] >= out[name]["policy_timing"]["infer_ms"] > 0
    got = np.array(out["nested"])
    assert np.abs(got - ref["a"]).max() <= 1e-5 * max(1.0, np.abs(ref["a"]).max())
    assert "prev_total_ms" in out["b"]["server_timing"]  # openpi's server: the previous request's round on the server
    assert np.abs(ref["a"] - ref["b"]).max() > 1e-3  # the two observations do differ


# Malformed requests, each on a connection of its own: the answer (a text frame) and the close code, or the error
# openpi-client raises; then a well-formed request on a new connection.
MALFORMED = CLIENT_COMMON + r'''
import websockets.sync.client as ws
def raw(payload):
    with ws.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as c:
        c.recv()  # the metadata
        c.send(payload)
        text = c.recv()
        try:
            c.recv(timeout=5)
            code = None
        except Exception as e:
            code = getattr(getattr(e, "rcvd", None), "code", None)
        return {"text": text if isinstance(text, str) else None, "close": code}
def via_client(obs):
    client = WebsocketClientPolicy(host="127.0.0.1", port=port)
    try:
        client.infer(obs)
        return "no error"
    except RuntimeError as e:
        return str(e)
a = observation("a")
out = {"garbage": raw(b"\xc1 not msgpack"), "list": raw(msgpack_numpy.packb([1, 2, 3]))}
out["missing"] = via_client({"observation.state": a["observation.state"]})
out["shape"] = via_client({**a, "observation.state": np.zeros(5, np.float32)})
out["dtype"] = via_client({**a, "observation.state": np.array(["a", "b", "c", "d"])})
out["after"] = WebsocketClientPolicy(host="127.0.0.1", port=port).infer(a)["actions"].tolist()
print(json.dumps(out))
'''


def test_malformed_requests_answered_and_the_server_goes_on(made, server):
    out = json.loads(run_openpi(MALFORMED, server.port, made / "obs.npz"))
    for case in ("garbage", "list"):
        assert out[case]["text"] and out[case]["text"].startswith("request: "), out[case]
        assert "\n" not in out[case]["text"] and out[case]["close"] == 1011, out[case]
    assert "not a msgpack message" in out["garbage"]["text"] and "not a map" in out["list"]["text"]
    # openpi-client raises "Error in inference server:\n<the line>"
    for case, words in [("missing", ["observation.images.top"]), ("shape", ["observation.state"]),
                        ("dtype", ["observation.state", "<U1"])]:
        assert out[case].startswith("Error in inference server:\n"), out[case]
        line = out[case].split("\n", 1)[1]
        assert "\n" not in line.strip() and all(w in line for w in words), (case, line)
    ref = np.load(made / "ref.npz")
    assert np.abs(np.array(out["after"]) - ref["a"]).max() <= 1e-5 * max(1.0, np.abs(ref["a"]).max())


# Two clients at once, each sending its own observation N times; then a message over the bound.
TWO_CLIENTS = CLIENT_COMMON + r'''
results, errors = {}, []
barrier = threading.Barrier(2)
def run(name):
    try:
        client = WebsocketClientPolicy(host="127.0.0.1", port=port)
        barrier.wait()
        results[name] = [client.infer(observation(name))["actions"].tolist() for _ in range(4)]
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
for t in threads: t.start()
for t in threads: t.join()
big = {**observation("a"), "observation.extra": np.zeros(1 << 17, np.uint8)}
client = WebsocketClientPolicy(host="127.0.0.1", port=port)
try:
    client.infer(big)
    oversize = "no error"
except Exception as e:
    oversize = f"{type(e).__name__}: {e}"
after = WebsocketClientPolicy(host="127.0.0.1", port=port).infer(observation("b"))["actions"].tolist()
print(json.dumps({"results": results, "errors": errors, "oversize": oversize, "after": after}))
'''


def test_two_clients_at_once_and_an_oversize_message(made, server):
    out = json.loads(run_openpi(TWO_CLIENTS, server.port, made / "obs.npz"))
    ref = np.load(made / "ref.npz")
    assert not out["errors"], out["errors"]
    for name in ("a", "b"):
        assert len(out["results"][name]) == 4
        for got in out["results"][name]:
            assert np.abs(np.array(got) - ref[name]).max() <= 1e-5 * max(1.0, np.abs(ref[name]).max())
    # 128 KiB over the 64 KiB bound: the connection closes with 1009 (message too big); the server goes on
    assert "ConnectionClosed" in out["oversize"] and "1009" in out["oversize"], out["oversize"]
    assert np.abs(np.array(out["after"]) - ref["b"]).max() <= 1e-5 * max(1.0, np.abs(ref["b"]).max())


# Mutated requests, each on a connection of its own: a valid request's msgpack bytes with bits flipped, bytes
# replaced by msgpack's type markers, cut, repeated; and structural changes (dtype strings, shapes, data sizes, nesting,
# key types). Each answer must be a reply (bytes) or one line of text naming the request or an observation; a text
# frame of anything else (an internal error) is a finding. Prints the counts and the findings.
FUZZ = CLIENT_COMMON + r"""
import random
import websockets.sync.client as ws
rng = random.Random(7)
a = observation("a")
base = msgpack_numpy.packb(a)
def arr(x, **kw):
    d = msgpack_numpy.pack_array(x); d.update({k.encode(): v for k, v in kw.items()}); return d
structural = [
    {"observation.state": arr(a["observation.state"], dtype=">f4"), "observation.images.top": a["observation.images.top"]},
    {"observation.state": arr(a["observation.state"], dtype="<f16"), "observation.images.top": a["observation.images.top"]},
    {"observation.state": arr(a["observation.state"], dtype="<x4"), "observation.images.top": a["observation.images.top"]},
    {"observation.state": arr(a["observation.state"], shape=(2, 3)), "observation.images.top": a["observation.images.top"]},
    {"observation.state": arr(a["observation.state"], shape=(-1,)), "observation.images.top": a["observation.images.top"]},
    {"observation.state": arr(a["observation.state"], shape=(1 << 62, 1 << 62)), "observation.images.top": a["observation.images.top"]},
    {"observation.state": arr(a["observation.state"], data=b"123"), "observation.images.top": a["observation.images.top"]},
    {"observation.state": {b"__ndarray__": True}, "observation.images.top": a["observation.images.top"]},
    {"observation.state": {b"__npgeneric__": True, b"data": "x", b"dtype": "<f8"}, "observation.images.top": a["observation.images.top"]},
    {"observation.state": {b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}, "observation.images.top": a["observation.images.top"]},
    {"observation.state": {b"__npgeneric__": True, b"data": 3, b"dtype": "<u4"}, "observation.images.top": a["observation.images.top"]},
    {"observation.state": [[1.0, 2.0], [3.0]], "observation.images.top": a["observation.images.top"]},
    {"observation.state": [1.0, [2.0]], "observation.images.top": a["observation.images.top"]},
    {"observation.state": [[1, 2], [3, [4]]], "observation.images.top": a["observation.images.top"]},
    {"observation.state": [True, False, True, True], "observation.images.top": a["observation.images.top"]},
    {"observation.state": np.array([1, 2, 3, 4], np.uint32), "observation.images.top": a["observation.images.top"]},
    {"observation.state": np.array([1, 2, 3, 4], np.uint16), "observation.images.top": a["observation.images.top"]},
    {"observation.state": np.array([True, False, True, True]), "observation.images.top": a["observation.images.top"]},
    {"observation.state": np.array([np.nan, 0, 0, 0], np.float32), "observation.images.top": a["observation.images.top"]},
    {"observation.state": a["observation.state"], "observation.images.top": a["observation.images.top"].astype(np.float64)},
    {"observation.state": a["observation.state"], "observation.images.top": a["observation.images.top"][:, :, :2]},
    {"observation.state": a["observation.state"], "observation.images.top": a["observation.images.top"].astype(bool)},
    {"observation.state": a["observation.state"], "observation.images.top": np.zeros((0, 32, 3), np.uint8)},
    {"observation.state": a["observation.state"], "observation.images.top": a["observation.images.top"], "prompt": 5},
    {"observation.state": None, "observation.images.top": a["observation.images.top"]},
    {"observation": {"state": {"x": {"y": {"z": 1}}}}},
]
cases = [msgpack_numpy.packb(c) for c in structural]
# a feature name that is not UTF-8 with a value the decoder refuses (the error line quoting it must still be a valid
# text frame)
not_utf8 = msgpack_numpy.packb({**a, "observation.stQte": np.array(["x"])}).replace(b"stQte", b"st\xffte")
cases.append(not_utf8)
cases += [msgpack_numpy.packb({1: 2}), msgpack_numpy.packb({"a": 1} | {"a" + str(i): i for i in range(3000)}), b"",
          b"\x91" * 5000, b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc7\x01\x05x", b"\x81\xa1a\xc1"]
markers = [0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xca, 0xcb, 0xcc, 0xcf, 0xd0, 0xd3, 0xd9, 0xda, 0xdb, 0xdc, 0xdd,
           0xde, 0xdf, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xff, 0x00, 0x7f]
for i in range(int(sys.argv[3])):
    b = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        k = rng.randrange(len(b)); op = rng.randrange(4)
        if op == 0: b[k] ^= 1 << rng.randrange(8)
        elif op == 1: b[k] = rng.choice(markers)
        elif op == 2: b = b[:k]
        else: b = b[:k] + b[k:k + rng.randint(1, 64)] * rng.randint(2, 4) + b[k:]
        if not b: b = bytearray(b"\x80")
    cases.append(bytes(b))
replies = texts = 0
findings, answers = [], {}
for payload in cases:
    with ws.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as c:
        c.recv()
        c.send(payload)
        r = c.recv(timeout=30)
    answers[payload] = r
    if isinstance(r, bytes):
        replies += 1
    elif (r.startswith("request: ") or r.startswith("observation ")) and "\n" not in r:
        texts += 1
    else:
        findings.append(r[:300])
r = WebsocketClientPolicy(host="127.0.0.1", port=port).infer(a)["actions"].tolist()
print(json.dumps({"cases": len(cases), "replies": replies, "texts": texts, "findings": findings, "after": r,
                  "not_utf8": answers[not_utf8]}))
"""


def test_mutated_requests_are_answered_and_never_stop_the_server(made, server):
    out = json.loads(run_openpi(FUZZ, server.port, made / "obs.npz", 200))
    assert not out["findings"], out["findings"]
    assert out["replies"] + out["texts"] == out["cases"] and out["texts"] > out["cases"] // 2, out
    assert out["not_utf8"].startswith("request: field 'observation.st?te': dtype '<U1'"), out["not_utf8"]
    assert server.proc.poll() is None
    ref = np.load(made / "ref.npz")
    assert np.abs(np.array(out["after"]) - ref["a"]).max() <= 1e-5 * max(1.0, np.abs(ref["a"]).max())


def outside_address():
    """This machine's address on its default route (not a loopback one), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def test_listens_on_localhost_by_default_and_answers_healthz(server):
    assert server.host == "127.0.0.1"
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as r:
        assert r.status == 200 and r.read() == b"OK\n"
    ip = outside_address()
    if ip is not None:  # not reachable from the network
        with pytest.raises(OSError):
            socket.create_connection((ip, server.port), timeout=2).close()


def test_latency_report_and_bad_policy_folder(made, tmp_path):
    """--report-every 2: a latency line every two requests; SIGINT: the summary (requests, p50, p99) and exit 0.
    --host 0.0.0.0 listens on every interface. A folder that is not a policy: one line, exit 1."""
    s = Server(tmp_path / "serve.log", "--policy", made / "policy", "--port", 0, "--host", "0.0.0.0",
               "--report-every", 2)
    try:
        run_openpi(ONE_CLIENT, s.port, made / "obs.npz")
        run_openpi(ONE_CLIENT, s.port, made / "obs.npz")
        ip = outside_address()
        if ip is not None:
            socket.create_connection((ip, s.port), timeout=2).close()
    finally:
        err = s.stop()
    assert s.proc.returncode == 0, err
    lines = [l for l in err.splitlines() if "latency p50" in l]
    assert len(lines) == 4, err  # after 2, 4 and 6 requests (ONE_CLIENT sends 3), and the summary
    assert "served 6 requests on 2 connections (0 errors)" in lines[-1] and "p99" in lines[-1], lines[-1]
    proc = run_lf("serve", "--policy", tmp_path / "nothing", "--port", 0, check=False)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr

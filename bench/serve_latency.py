"""Request latency of `loongforge serve` through openpi-client (the PyPI openpi-client 0.1.2 in .venv-openpi: its
WebsocketClientPolicy.infer, timed around the call on the client: msgpack encode, the websocket round trip, the
server's decode + predict + encode, the client's decode) against LeRobot in-process on the same observation (its
prepare_observation_for_inference -> preprocessor -> predict_action_chunk -> postprocessor, as LeRobot's record / eval
loops run a policy, no network), in one run on the same machine, fp32, the same thread count. Prints a table of p50 /
p99 per policy; with --out, writes it as markdown too.

    [LOONGFORGE_BIN=build/loongforge] .venv/bin/python bench/serve_latency.py [--shapes act,pi0small]
        [--requests 50] [--warmup 5] [--threads 2] [--out bench/results/serve_latency.md]

Policies (random weights, processor files with fixed statistics, made with the lerobot package in .venv-lerobot):
ACT at LeRobot's defaults (d512, resnet18, 4 encoder / 1 decoder layers, chunk 100) with one 480 x 640 camera and a
14-dim state (an ALOHA-like robot: the request carries a 900 KB frame); a small π0 (bench/policy_cpu.py's pi0small
shape: LeRobot's PI0Policy built small as tests/python/test_pi0_parity.py builds it, one 224 x 224 camera resized to
112, chunk 50, 10 Euler steps, a prompt through a small Gemma-like tokenizer made here)."""
import argparse
import json
import os
import pathlib
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_pi0_parity import SMALL_PI0  # noqa: E402  (LeRobot's π0 built small)
from test_pi0_train import TOKENIZER, TOKENIZER_ARGS  # noqa: E402  (a small Gemma-like tokenizer)
from policy_cpu import PI0_SIZES, PI0_VISION  # noqa: E402

LF = pathlib.Path(os.environ.get("LOONGFORGE_BIN", ROOT / "build" / "loongforge"))
LEROBOT_PY = pathlib.Path(os.environ.get("LOONGFORGE_LEROBOT_PYTHON", ROOT / ".venv-lerobot" / "bin" / "python"))
OPENPI_PY = pathlib.Path(os.environ.get("LOONGFORGE_OPENPI_PYTHON", ROOT / ".venv-openpi" / "bin" / "python"))

SHAPES = {
    "act": dict(kind="act", name="ACT d512 (LeRobot's defaults), resnet18, one 480x640 camera, state 14, chunk 100",
                image=[480, 640], state=14, action=14),
    "pi0small": dict(kind="pi0", name="π0 small (PaliGemma w512 d4, expert w256 d4, SigLIP w256 d4), one 224x224 "
                                      "camera resized to 112, state 14, chunk 50, 10 Euler steps, a prompt",
                     image=[224, 224], state=14, action=14),
}

# In the lerobot environment: the policy of spec argv[2] saved to argv[1]/policy with its processor files (and for
# π0 the tokenizer, made by TOKENIZER in argv[1]/tokenizer, and the size fields LoongForge reads), a raw observation
# to argv[1]/obs.npz (+ prompt in obs.json), then LeRobot's own latency on it: WARMUP + REQUESTS calls, each timed.
LEROBOT = ("SMALL_PI0 = " + repr(SMALL_PI0) + "\nTOKENIZER = " + repr(TOKENIZER) + "\nTOKENIZER_ARGS = "
           + repr(TOKENIZER_ARGS) + r"""
import importlib, json, os, sys, time
import numpy as np, torch
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.factory import make_pre_post_processors
from lerobot.policies.utils import prepare_observation_for_inference
out, S = sys.argv[1], json.loads(sys.argv[2])
torch.set_num_threads(S["threads"])
torch.manual_seed(0)
H, W = S["image"]
feats = {"observation.state": PolicyFeature(FeatureType.STATE, (S["state"],)),
         "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, H, W))}
outs = {"action": PolicyFeature(FeatureType.ACTION, (S["action"],))}
prompt = ""
if S["kind"] == "act":
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.act.modeling_act import ACTPolicy
    cfg = ACTConfig(input_features=feats, output_features=outs, device="cpu", pretrained_backbone_weights=None)
    policy = ACTPolicy(cfg)
else:
    os.makedirs(out + "/tokenizer", exist_ok=True)
    argv = sys.argv
    sys.argv = [argv[0], out + "/tokenizer", *TOKENIZER_ARGS]
    exec(TOKENIZER, {})
    sys.argv = argv
    exec(SMALL_PI0)
    M, Config, Policy = small_pi0("pi0", S["sizes"], S["vocab"], S["vision"])
    P = importlib.import_module("lerobot.policies.pi0.processor_pi0")
    step = P.TokenizerProcessorStep
    P.TokenizerProcessorStep = lambda **kw: step(**dict(kw, tokenizer_name=out + "/tokenizer"))
    cfg = Config(input_features=feats, output_features=outs, device="cpu", paligemma_variant="gemma_bench",
                 action_expert_variant="gemma_bench_expert", image_resolution=(112, 112), chunk_size=50,
                 n_action_steps=50, tokenizer_max_length=16)
    policy = Policy(cfg)
    prompt = "pick up the cube"
g = torch.Generator().manual_seed(3)
stats = {"observation.state": {"mean": torch.randn(S["state"], generator=g), "std": torch.rand(S["state"], generator=g) + 0.5},
         "observation.images.top": {"mean": torch.full((3, 1, 1), 0.45), "std": torch.full((3, 1, 1), 0.25)},
         "action": {"mean": torch.randn(S["action"], generator=g), "std": torch.rand(S["action"], generator=g) + 0.5}}
for k in stats:  # min / max / quantiles for the normalisers that read them
    stats[k].update(min=stats[k]["mean"] - 3, max=stats[k]["mean"] + 3, q01=stats[k]["mean"] - 2, q99=stats[k]["mean"] + 2)
pre, post = make_pre_post_processors(policy.config, dataset_stats=stats)
policy.save_pretrained(out + "/policy")
pre.save_pretrained(out + "/policy"); post.save_pretrained(out + "/policy")
if S["kind"] == "pi0":
    import shutil
    for f in os.listdir(out + "/tokenizer"): shutil.copy(out + "/tokenizer/" + f, out + "/policy")
    saved = json.loads(open(out + "/policy/config.json").read())
    saved.update(variant_sizes=S["sizes"], vocab_size=S["vocab"], vision_config=dict(S["vision"], image_size=112))
    open(out + "/policy/config.json", "w").write(json.dumps(saved, indent=4))
rng = np.random.default_rng(0)
raw = {"observation.state": rng.standard_normal(S["state"]).astype(np.float32),
       "observation.images.top": rng.integers(0, 256, (H, W, 3), dtype=np.uint8)}
np.savez(out + "/obs.npz", **raw)
json.dump({"prompt": prompt}, open(out + "/obs.json", "w"))
policy.eval()
times = []
for i in range(S["warmup"] + S["requests"]):
    t0 = time.perf_counter()
    batch = prepare_observation_for_inference({k: v.copy() for k, v in raw.items()}, torch.device("cpu"),
                                              task=prompt or None)
    with torch.no_grad():
        actions = post(policy.predict_action_chunk(pre(batch)))[0].numpy()
    if i >= S["warmup"]:
        times.append(time.perf_counter() - t0)
print(json.dumps({"times": times, "shape": list(actions.shape)}))
""")

# In the openpi-client environment: WARMUP + REQUESTS infer calls on one connection, each timed on the client, with
# the server's own timings.
CLIENT = r"""
import json, sys, time
import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy
port, folder, warmup, requests = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
obs = dict(np.load(folder + "/obs.npz"))
prompt = json.load(open(folder + "/obs.json"))["prompt"]
if prompt: obs["prompt"] = prompt
client = WebsocketClientPolicy(host="127.0.0.1", port=port)
times, server, predict = [], [], []
for i in range(warmup + requests):
    t0 = time.perf_counter()
    r = client.infer(obs)
    t = time.perf_counter() - t0
    if i >= warmup:
        times.append(t); server.append(r["server_timing"]["infer_ms"] / 1e3); predict.append(r["policy_timing"]["infer_ms"] / 1e3)
print(json.dumps({"times": times, "server": server, "predict": predict, "shape": list(r["actions"].shape),
                  "metadata": client.get_server_metadata()}))
"""


def run(cmd, env, what):
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        sys.exit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve(folder, spec):
    """Starts `loongforge serve` on the policy, runs the openpi client against it, stops it (SIGINT); returns the
    client's timings and the server's summary line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    with open(folder / "serve.log", "w") as log:
        proc = subprocess.Popen([str(LF), "serve", "--policy", str(folder / "policy"), "--port", "0",
                                 "--report-every", "0"], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            line = ""
            if select.select([proc.stdout], [], [], 120)[0]:
                line = proc.stdout.readline()
            if "ws://" not in line:
                sys.exit(f"loongforge serve did not start:\n{(folder / 'serve.log').read_text()[-3000:]}")
            port = line.strip().rsplit(":", 1)[1]
            res = run([str(OPENPI_PY), "-c", CLIENT, port, str(folder), str(spec["warmup"]), str(spec["requests"])],
                      {"OMP_NUM_THREADS": "1"}, "the openpi client")
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    summary = [l for l in (folder / "serve.log").read_text().splitlines() if "served" in l]
    return res, summary[-1] if summary else ""


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(-(-p * len(xs) // 100)) - 1))]


def cpu_model():
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="act,pi0small")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    rows = []
    for key in a.shapes.split(","):
        shape = SHAPES[key]
        spec = dict(shape, threads=a.threads, requests=a.requests, warmup=a.warmup, sizes=PI0_SIZES, vocab=1024,
                    vision=PI0_VISION)
        with tempfile.TemporaryDirectory(prefix="lf_serve_bench_") as tmp:
            tmp = pathlib.Path(tmp)
            ref = run([str(LEROBOT_PY), "-c", LEROBOT, str(tmp), json.dumps(spec)],
                      {"OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1"}, "lerobot")
            got, summary = serve(tmp, spec)
        assert got["shape"] == ref["shape"], (got["shape"], ref["shape"])
        ms = lambda xs, p: 1e3 * pct(xs, p)  # noqa: E731
        rows.append((shape, ms(got["times"], 50), ms(got["times"], 99), ms(got["server"], 50), ms(got["predict"], 50),
                     ms(ref["times"], 50), ms(ref["times"], 99), summary))
        print(f"{key}: openpi-client -> loongforge serve p50 {rows[-1][1]:.1f} ms, p99 {rows[-1][2]:.1f} ms; "
              f"LeRobot in-process p50 {rows[-1][5]:.1f} ms, p99 {rows[-1][6]:.1f} ms\n  server: {summary}",
              file=sys.stderr, flush=True)
    load1 = os.getloadavg()[0]
    lines = [f"Request latency on the CPU ({cpu_model()}, {a.threads} threads, fp32): openpi-client 0.1.2's "
             f"`infer` against `loongforge serve` on 127.0.0.1 (timed on the client: encode, round trip, server, "
             f"decode) vs LeRobot 0.6.1 in-process on the same raw observation (prepare_observation_for_inference + "
             f"preprocessor + predict_action_chunk + postprocessor); {a.requests} requests after {a.warmup} warm-up, "
             f"one client; {time.strftime('%Y-%m-%d')}; load average {load0:.1f} -> {load1:.1f}", "",
             "| policy | openpi-client -> serve p50 ms | p99 ms | server p50 ms (decode + predict + encode) | "
             "predict p50 ms | LeRobot in-process p50 ms | p99 ms | p50 ratio (LeRobot / serve) |",
             "|---|---|---|---|---|---|---|---|"]
    for shape, p50, p99, srv, pred, r50, r99, _ in rows:
        lines.append(f"| {shape['name']} | {p50:.1f} | {p99:.1f} | {srv:.1f} | {pred:.1f} | {r50:.1f} | {r99:.1f} | "
                     f"{r50 / p50:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

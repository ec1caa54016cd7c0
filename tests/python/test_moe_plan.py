"""`loongforge moe-plan`: every number in OUT.json recomputed here from the slots and tokens (conservation, rank
loads, overload, the traffic model of docs/moe_plan.md), EPLB's algorithm re-implemented in Python on its published
case, and bad input rejected with one line naming the file and the field."""
import json

import pytest

from conftest import run_lf

EPLB_CASE = [600, 560, 120, 120, 20, 10, 10, 10]


def plan(tmp_path, doc, *extra):
    inp, out = tmp_path / "in.json", tmp_path / "out.json"
    inp.write_text(json.dumps(doc))
    run_lf("moe-plan", "--input", inp, "--out", out, *extra)
    return json.loads(out.read_text())


def traffic(loads, slots, tokens, R, G, S, hidden, bpe, expert_params):
    """The documented model: expert e's tokens come load/R from every rank and go to the nearest slot with quota
    (same rank, same node, other node); dispatch + combine = 2 * hidden * bpe per token moved. Every slot beyond the
    primary (on the node with most of the expert's slots) costs 2 * expert_params * bpe of weights + gradients."""
    intra = inter = w_intra = w_inter = 0.0
    tb = 2.0 * hidden * bpe
    for e, load in enumerate(loads):
        mine = [(i // S, tokens[i]) for i in range(R * S) if slots[i] == e]
        supply = [load / R] * R
        left = []
        for r, q in mine:
            m = min(supply[r], q)
            supply[r] -= m
            left.append((r, q - m))
        for n in range(R // G):
            s = sum(supply[n * G:(n + 1) * G])
            q = sum(x for r, x in left if r // G == n)
            intra += min(s, q) * tb
            inter += (s - min(s, q)) * tb
        if expert_params and len(mine) > 1:
            per_node = [sum(1 for r, _ in mine if r // G == n) for n in range(R // G)]
            home = per_node.index(max(per_node))
            w_intra += (per_node[home] - 1) * 2.0 * expert_params * bpe
            w_inter += (len(mine) - per_node[home]) * 2.0 * expert_params * bpe
    return intra, inter, w_intra, w_inter


def check_layer(p, loads, R, G, S, hidden=4096, bpe=2, expert_params=0):
    slots, tokens = p["slots"], p["tokens"]
    assert len(slots) == R * S and len(tokens) == R * S
    for e, load in enumerate(loads):
        mine = [tokens[i] for i in range(R * S) if slots[i] == e]
        assert mine, f"expert {e} has no slot"
        assert sum(mine) == load, f"expert {e}: {sum(mine)} tokens for load {load}"
    assert all(t == 0 for s, t in zip(slots, tokens) if s == -1)
    rank_loads = [sum(tokens[r * S:(r + 1) * S]) for r in range(R)]
    assert p["rank_loads"] == rank_loads
    overload = max(rank_loads) / (sum(loads) / R)
    assert p["overload"] == pytest.approx(overload, rel=1e-12)
    ti, tx, wi, wx = traffic(loads, slots, tokens, R, G, S, hidden, bpe, expert_params)
    assert p["token_intra_node_bytes"] == pytest.approx(ti, rel=1e-9, abs=1e-6)
    assert p["token_inter_node_bytes"] == pytest.approx(tx, rel=1e-9, abs=1e-6)
    assert p["intra_node_bytes"] == pytest.approx(ti + wi, rel=1e-9, abs=1e-6)
    assert p["inter_node_bytes"] == pytest.approx(tx + wx, rel=1e-9, abs=1e-6)
    assert p["planner_ms"] >= 0
    return overload


def eplb_global(loads, R, S):
    """EPLB's global policy (one node), from its description: give each free slot to the expert with the largest
    load per replica, then pack the physical experts S per rank, heaviest first into the lightest rank with room."""
    cnt = [1] * len(loads)
    for _ in range(R * S - len(loads)):
        e = max(range(len(loads)), key=lambda i: (loads[i] / cnt[i], -i))
        cnt[e] += 1
    phys = [(loads[e] / cnt[e], e) for e in range(len(loads)) for _ in range(cnt[e])]
    phys.sort(key=lambda x: -x[0])
    rank_w, rank_n = [0.0] * R, [0] * R
    for w, e in phys:
        r = min((r for r in range(R) if rank_n[r] < S), key=lambda r: rank_w[r])
        rank_w[r] += w
        rank_n[r] += 1
    return max(rank_w) / (sum(loads) / R)


def test_eplb_case(tmp_path):
    out = plan(tmp_path, {"loads": [EPLB_CASE], "ranks": 8, "ranks_per_node": 8, "slots_per_rank": 2})
    layer = out["layers"][0]
    assert layer["planner"] == "topology_aware"
    topo = check_layer(layer, EPLB_CASE, 8, 8, 2)
    base = check_layer(layer["baseline"], EPLB_CASE, 8, 8, 2)
    assert topo <= 1.05
    assert base == pytest.approx(eplb_global(EPLB_CASE, 8, 2), rel=1e-12)
    assert base == pytest.approx(232 / 181.25, rel=1e-12)
    assert out["summary"]["topology_aware"]["max_overload"] == pytest.approx(topo)
    assert out["summary"]["eplb"]["max_overload"] == pytest.approx(base)


def test_multi_node_zipf(tmp_path):
    import random
    rnd = random.Random(3)
    E, R, G, S = 64, 24, 8, 4
    layers = []
    for s in (0.8, 1.2):
        w = [1 / (i + 1) ** s for i in range(E)]
        rnd.shuffle(w)
        layers.append([int(200000 * x / sum(w)) for x in w])
    doc = {"loads": layers, "ranks": R, "ranks_per_node": G, "slots_per_rank": S, "hidden_size": 1024,
           "bytes_per_element": 2, "expert_params": 3 * 1024 * 512, "inter_node_gbps": 25}
    out = plan(tmp_path, doc)
    for loads, layer in zip(layers, out["layers"]):
        t = check_layer(layer, loads, R, G, S, 1024, 2, 3 * 1024 * 512)
        b = check_layer(layer["baseline"], loads, R, G, S, 1024, 2, 3 * 1024 * 512)
        assert t <= b + 1e-12
    # --planner eplb / topo give the same plans as both.
    for which, key in (("eplb", "baseline"), ("topo", None)):
        one = plan(tmp_path, doc, "--planner", which)
        for layer, ref in zip(one["layers"], out["layers"]):
            ref = ref[key] if key else ref
            assert layer["slots"] == ref["slots"] and layer["tokens"] == ref["tokens"]


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.pop("loads"), "loads"),
    (lambda d: d.update(loads=[[1, 2, -3, 4]]), "loads[0][2]"),
    (lambda d: d.update(loads=[[1, 2, 3, 4], [1, 2]]), "loads[1]"),
    (lambda d: d.update(loads=[[1, "x", 3, 4]]), "loads[0][1]"),
    (lambda d: d.update(slots_per_rank=1), "slots_per_rank"),
    (lambda d: d.update(ranks=3), "ranks_per_node"),
    (lambda d: d.pop("ranks"), "ranks"),
    (lambda d: d.update(inter_node_gbps=0), "inter_node_gbps"),
    (lambda d: d.update(num_groups=3), "num_groups"),
    (lambda d: d.update(rank=2), "rank"),
])
def test_bad_input(tmp_path, edit, field):
    doc = {"loads": [[1, 2, 3, 4]], "ranks": 2, "ranks_per_node": 2, "slots_per_rank": 2}
    edit(doc)
    inp, out = tmp_path / "in.json", tmp_path / "out.json"
    inp.write_text(json.dumps(doc))
    proc = run_lf("moe-plan", "--input", inp, "--out", out, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{inp}: field '{field}'" in lines[0], lines[0]
    assert not out.exists()


def test_bad_json_and_help(tmp_path):
    inp = tmp_path / "in.json"
    inp.write_text("{not json")
    proc = run_lf("moe-plan", "--input", inp, "--out", tmp_path / "o.json", check=False)
    assert proc.returncode == 1 and str(inp) in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "--planner" in run_lf("moe-plan", "--help").stdout

#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/targets.h): OUT/<target>/seed-*.

Seeds are valid inputs, taken from the repository's own files (recipes, model configs, the fixture tokenizer and
its test texts) and made with the reference libraries the tests compare with (safetensors, tokenizers,
sentencepiece, transformers / diffusers configs, Pillow, pyarrow, PyAV, h5py). Framing of multi-part inputs follows
targets.cpp: "A\\0B" for recipe + --set lines and template + context; a 4-byte length before a shard's .idx and
before each LeRobot file but the last (split_lengths). HDF5 seeds need h5py (.venv, or .venv-lerobot).

Usage: .venv/bin/python scripts/fuzz_seeds.py OUT [--quick]   (--quick: leaves out the large files, for the CI smoke)
"""
import io
import json
import pathlib
import struct
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main():
    out = pathlib.Path(sys.argv[1])
    quick = "--quick" in sys.argv
    seeds = {}

    def add(target, data):
        if isinstance(data, str):
            data = data.encode()
        seeds.setdefault(target, []).append(data)

    # ---- safetensors -----------------------------------------------------------------------------------------------
    import torch
    from safetensors.torch import save

    add("safetensors", save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}))
    add("safetensors", save({"a": torch.zeros(0, 4, dtype=torch.bfloat16), "b": torch.tensor(3, dtype=torch.int64),
                             "c": torch.ones(2, 2, 2, dtype=torch.float16)}, metadata={"format": "pt"}))
    add("safetensors", save({"m": torch.tensor([True, False]), "u": torch.arange(5, dtype=torch.uint8)}))
    if not quick:
        add("safetensors", (ROOT / "tests/fixtures/hf_llama/model.safetensors").read_bytes())
    add("safetensors_index", json.dumps({"metadata": {"total_size": 40},
                                         "weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))
    add("safetensors_index", json.dumps({"weight_map": {"w": "a.safetensors"}}))

    # ---- model configs ---------------------------------------------------------------------------------------------
    for p in sorted((ROOT / "configs").rglob("*.json")) + [ROOT / "tests/fixtures/hf_llama/config.json"]:
        add("model_config", p.read_bytes())
    import transformers
    for name, kw in [("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2)), ("mixtral", {}),
                     ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=16)),
                     ("t5", {}), ("umt5", {}), ("qwen2_5_vl", {}), ("qwen3_vl", {}), ("llava", {}), ("mistral", {})]:
        try:
            add("model_config", transformers.AutoConfig.for_model(name, **kw).to_json_string())
        except Exception as e:  # a model type this transformers lacks: fewer seeds, not an error
            print(f"fuzz_seeds: no {name} config ({e})", file=sys.stderr)
    try:
        import diffusers
        for cls, kw in [("DiTTransformer2DModel", dict(num_layers=1, num_attention_heads=2, attention_head_dim=8,
                                                       in_channels=4, sample_size=8, patch_size=2)),
                        ("AutoencoderKL", dict(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)),
                        ("WanTransformer3DModel", dict(num_layers=1, num_attention_heads=2, attention_head_dim=8,
                                                       in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
                                                       ffn_dim=32)),
                        ("AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1))]:
            try:
                m = getattr(diffusers, cls)(**kw)
                add("model_config", json.dumps({"_class_name": cls, **{k: v for k, v in m.config.items()
                                                                      if not k.startswith("_")}}, default=list))
            except Exception as e:
                print(f"fuzz_seeds: no {cls} config ({e})", file=sys.stderr)
    except ImportError:
        pass

    # ---- tokenizers ------------------------------------------------------------------------------------------------
    tok_dir = ROOT / "tests/fixtures/tok_bytelevel_gpt2"
    if not quick:
        add("tokenizer_json", (tok_dir / "tokenizer.json").read_bytes())
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    corpus = ["hello world", "the quick brown fox", "héllo wörld 漢字", "numbers 12345 and spaces  here"] * 5
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_end|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    add("tokenizer_json", t.to_str())
    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece()
    t.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=80, special_tokens=["[UNK]"]))
    add("tokenizer_json", t.to_str())
    t = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.pre_tokenizer = pre_tokenizers.Split(pattern=r"\d|[a-z]+", behavior="isolated")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    add("tokenizer_json", t.to_str())
    cases = json.loads((tok_dir / "cases.json").read_text())
    for c in (cases if isinstance(cases, list) else cases.get("cases", [])):
        add("bpe_text", c["text"] if isinstance(c, dict) else str(c))
    add("bpe_text", "plain text\x00" + "\x01\x00\x02\x00\xff\x07")

    import sentencepiece as spm
    with tempfile.TemporaryDirectory() as d:
        text = pathlib.Path(d) / "t.txt"
        text.write_text("\n".join(corpus * 4))
        for kind in ("unigram", "bpe"):
            stream = io.BytesIO()
            spm.SentencePieceTrainer.train(input=str(text), model_writer=stream, vocab_size=40, model_type=kind,
                                           minloglevel=2, hard_vocab_limit=False,
                                           normalization_rule_name="identity" if kind == "bpe" else "nmt_nfkc")
            add("sentencepiece", stream.getvalue())

    # ---- recipes ---------------------------------------------------------------------------------------------------
    for p in sorted((ROOT / "configs").rglob("*.yaml")):
        add("recipe", p.read_bytes() + b"\0train.steps=3\noptim.lr=1e-4\nlora.target_modules=[q_proj,v_proj]")
    add("recipe", b"\0parallel.tp=2\ndata.seq_len=64")

    # ---- token shards (LFIDX: magic, version, dtype code, docs, tokens, offsets) -----------------------------------
    for docs, width in ([[1, 2, 3], [4], [], [5, 6]], 2), ([[70000, 1], [2, 3, 4]], 4):
        offs = [0]
        for d_ in docs:
            offs.append(offs[-1] + len(d_))
        idx = b"LFIDX\0\0\0" + struct.pack("<IIQQ", 1, width, len(docs), offs[-1]) + struct.pack(f"<{len(offs)}Q", *offs)
        binary = b"".join(struct.pack("<H" if width == 2 else "<I", x) for d_ in docs for x in d_)
        add("token_shard", struct.pack("<I", len(idx)) + idx + binary)

    # ---- SFT data and chat templates -------------------------------------------------------------------------------
    lines = [
        {"instruction": "add 2 and 3", "input": "", "output": "5"},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "system": "be nice"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"},
                      {"role": "assistant", "content": "a2"}]},
    ]
    jsonl = "\n".join(json.dumps(x) for x in lines) + "\n"
    add("sft_data", b"\x00" + jsonl.encode())
    add("sft_data", b"\x02" + jsonl.encode() + b"{not json\n")
    add("sft_data", b"\x01" + json.dumps(lines).encode())
    add("sft_data", b"\x04" + jsonl.encode())

    templates = [
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content | trim }} [/INST]"
        "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
        "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% set ns.s = ns.s ~ m.role[:1] %}{% endfor %}{{ ns.n }}{{ ns.s | upper }}{{ messages | tojson }}",
        "{% macro show(x, d=0) %}{% if x is mapping %}{% for k, v in x.items() %}{{ k }}={{ show(v, d + 1) }};"
        "{% endfor %}{% else %}{{ x }}{% endif %}{% endmacro %}{{ show(messages[0]) }}{{ range(3) | join(',') }}"
        "{{ 'a,b' .split(',') | length }}{{ messages[-1].content if messages else raise_exception('none') }}",
    ]
    ctx = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
           "add_generation_prompt": True, "bos_token": "<s>", "eos_token": "</s>", "tools": None}
    for tpl in templates:
        add("chat_template", tpl)
        add("chat_template", tpl + "\0" + json.dumps(ctx))

    # ---- MoE plan input --------------------------------------------------------------------------------------------
    add("moe_plan", json.dumps({"loads": [[600, 560, 120, 120, 20, 10, 10, 10]], "ranks": 4, "ranks_per_node": 2,
                                "slots_per_rank": 3}))
    add("moe_plan", json.dumps({"loads": [[1, 2, 3, 4], [4, 3, 2, 1]], "ranks": 2, "ranks_per_node": 2,
                                "slots_per_rank": 2, "hidden_size": 64, "expert_params": 1000, "num_groups": 2}))

    # ---- images ----------------------------------------------------------------------------------------------------
    from PIL import Image
    import numpy as np
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8))
    for im, fmt, kw in [(rgb, "PNG", {}), (rgb.convert("RGBA"), "PNG", {}), (rgb.convert("L"), "PNG", {}),
                        (rgb.convert("P"), "PNG", {}), (rgb, "JPEG", {"quality": 80}),
                        (rgb, "JPEG", {"progressive": True}), (rgb.convert("L"), "JPEG", {})]:
        b = io.BytesIO()
        im.save(b, fmt, **kw)
        add("image", b.getvalue())
    # depth images as lerobot writes them (Pillow I;16 / F, raw TIFF), an LZW one, and an RGB one (refused)
    depth = rng.integers(0, 60000, (9, 7)).astype(np.uint16)
    for im, kw in [(Image.fromarray(depth), {"compression": "raw"}),
                   (Image.fromarray(depth.astype(np.float32) / 1000), {"compression": "raw"}),
                   (Image.fromarray(depth), {"compression": "tiff_lzw"}), (rgb, {"compression": "raw"})]:
        b = io.BytesIO()
        im.save(b, "TIFF", **kw)
        add("depth_tiff", b.getvalue())

    # ---- Parquet ---------------------------------------------------------------------------------------------------
    import pyarrow as pa
    import pyarrow.parquet as pq
    png = seeds["image"][0]
    table = pa.table({
        "index": pa.array([0, 1, 2], pa.int64()),
        "timestamp": pa.array([0.0, 0.1, 0.2], pa.float32()),
        "observation.state": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], pa.list_(pa.float32(), 2)),
        "action": pa.array([[1.0], [2.0], [3.0]], pa.list_(pa.float64())),
        "done": pa.array([False, False, True]),
        "task": pa.array(["a", "b", "c"]),
        "tasks": pa.array([["x"], ["y", "z"], []], pa.list_(pa.string())),
        "image": pa.array([{"bytes": png, "path": None}] * 3,
                          pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    })
    for kw in ({}, {"row_group_size": 1, "compression": "zstd"}):
        b = io.BytesIO()
        pq.write_table(table, b, **kw)
        add("parquet", b.getvalue())

    # ---- video -----------------------------------------------------------------------------------------------------
    import av
    for codec in ("mpeg4", "libx264"):
        b = io.BytesIO()
        try:
            with av.open(b, "w", format="mp4") as c:
                s = c.add_stream(codec, rate=10)
                s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
                for i in range(3):
                    frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), 40 * i, np.uint8), format="rgb24")
                    for p in s.encode(frame):
                        c.mux(p)
                for p in s.encode():
                    c.mux(p)
            add("video", b.getvalue())
        except Exception as e:
            print(f"fuzz_seeds: no {codec} video ({e})", file=sys.stderr)

    # ---- robot datasets --------------------------------------------------------------------------------------------
    lerobot_seeds(add, png, quick)
    hdf5_seeds(add, quick)

    # ---- policy server requests ------------------------------------------------------------------------------------
    serve_seeds(add)

    for target, items in seeds.items():
        d = out / target
        d.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(items):
            (d / f"seed-{i:03d}").write_bytes(data)
    print(" ".join(f"{t}:{len(v)}" for t, v in sorted(seeds.items())))


def framed(*parts):
    """Files in one input as targets.cpp's split_lengths reads them: each but the last after its 4-byte length."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts[:-1]) + parts[-1]


def parquet_bytes(table, **kw):
    import pyarrow.parquet as pq
    b = io.BytesIO()
    pq.write_table(table, b, **kw)
    return b.getvalue()


def lerobot_seeds(add, png, quick):
    """The lerobot target's inputs: small LeRobot datasets laid out as lerobot writes them (tests/python/
    lerobot_oracle.py), framed info.json, three metadata files, the data Parquet (targets.cpp's lerobot)."""
    import pyarrow as pa
    lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows).encode()  # noqa: E731

    def features(state, image=False, video=False):
        f = {"observation.state": {"dtype": "float32", "shape": [state], "names": [f"joint{i}" for i in range(state)]},
             "action": {"dtype": "float32", "shape": [state], "names": None}}
        for cam, on, kind in (("observation.images.wrist", image, "image"), ("observation.images.top", video, "video")):
            if on:
                f[cam] = {"dtype": kind, "shape": [4, 4, 3], "names": ["height", "width", "channels"]}
        for k, dt in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                      ("index", "int64"), ("task_index", "int64")):
            f[k] = {"dtype": dt, "shape": [1], "names": None}
        return f

    def frames(lengths, state, fixed, image=False):
        eps = [e for e, n in enumerate(lengths) for _ in range(n)]
        local = [i for n in lengths for i in range(n)]
        vec = pa.list_(pa.float32(), state) if fixed else pa.list_(pa.float32())
        cols = {"observation.state": pa.array([[0.5 * k + j for j in range(state)] for k in range(len(eps))], vec),
                "action": pa.array([[-0.25 * k] * state for k in range(len(eps))], vec),
                "timestamp": pa.array([i / 10 for i in local], pa.float32()),
                "frame_index": pa.array(local, pa.int64()), "episode_index": pa.array(eps, pa.int64()),
                "index": pa.array(range(len(eps)), pa.int64()), "task_index": pa.array([e % 2 for e in eps], pa.int64())}
        if image:
            cols["observation.images.wrist"] = pa.array(
                [{"bytes": png, "path": f"frame_{k:06d}.png"} for k in range(len(eps))],
                pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
        return pa.table(cols)

    def stats(state, count):
        vec = {"min": [0.0] * state, "max": [1.0] * state, "mean": [0.5] * state, "std": [0.25] * state,
               "count": [count]}
        return {"observation.state": vec, "action": vec,
                "timestamp": {"min": [0.0], "max": [0.2], "mean": [0.1], "std": [0.08], "count": [count]}}

    def info(version, state, lengths, **cams):
        v3 = version == "v3.0"
        return json.dumps({
            "codebase_version": version, "robot_type": "so100", "total_episodes": len(lengths),
            "total_frames": sum(lengths), "total_tasks": 2, "chunks_size": 1000, "fps": 10,
            "splits": {"train": f"0:{len(lengths)}"},
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet" if v3 else
                         "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4" if v3 else
                          "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            "features": features(state, **cams)}, indent=4).encode()

    tasks = ["pick the cube", "place the cube"]
    # v2.1: one episode (its own data file), jsonl metadata, per-episode stats
    for state, fixed in [(2, False)] + ([] if quick else [(3, True)]):
        add("lerobot", framed(info("v2.1", state, [3]),
                              lines([{"episode_index": 0, "tasks": tasks[:1], "length": 3}]),
                              lines([{"task_index": i, "task": t} for i, t in enumerate(tasks)]),
                              lines([{"episode_index": 0, "stats": stats(state, 3)}]),
                              parquet_bytes(frames([3], state, fixed))))
    # v3.0: episodes in one data file (row groups across them), tasks.parquet, stats.json; an image camera in the
    # Parquet, or a video camera (its mp4 is not in the input: the episodes' video columns are read, not the file)
    for lengths, cams, kw in [([3, 2], {"image": True}, {"row_group_size": 2}), ([2, 2], {"video": True}, {})] + \
            ([] if quick else [([4, 1, 2], {"image": True}, {"compression": "zstd"})]):
        eps = {"episode_index": pa.array(range(len(lengths)), pa.int64()),
               "tasks": pa.array([[tasks[e % 2]] for e in range(len(lengths))], pa.list_(pa.string())),
               "length": pa.array(lengths, pa.int64()),
               "data/chunk_index": pa.array([0] * len(lengths), pa.int64()),
               "data/file_index": pa.array([0] * len(lengths), pa.int64()),
               "dataset_from_index": pa.array([sum(lengths[:e]) for e in range(len(lengths))], pa.int64()),
               "dataset_to_index": pa.array([sum(lengths[:e + 1]) for e in range(len(lengths))], pa.int64())}
        if cams.get("video"):
            p = "videos/observation.images.top/"
            eps |= {p + "chunk_index": pa.array([0] * len(lengths), pa.int64()),
                    p + "file_index": pa.array([0] * len(lengths), pa.int64()),
                    p + "from_timestamp": pa.array([sum(lengths[:e]) / 10 for e in range(len(lengths))], pa.float64()),
                    p + "to_timestamp": pa.array([sum(lengths[:e + 1]) / 10 for e in range(len(lengths))],
                                                 pa.float64())}
        add("lerobot", framed(info("v3.0", 2, lengths, **cams), parquet_bytes(pa.table(eps)),
                              parquet_bytes(pa.table({"task_index": pa.array([0, 1], pa.int64()),
                                                      "task": pa.array(tasks)})),
                              json.dumps(stats(2, sum(lengths))).encode(),
                              parquet_bytes(frames(lengths, 2, True, cams.get("image", False)), **kw)))


# ALOHA episode files and a robomimic file (as tests/python/test_robot_hdf5.py writes them): argv = folder, quick ("1" or "0").
HDF5_WRITER = r"""
import io, sys
import h5py, numpy as np
from PIL import Image
folder, quick = sys.argv[1], sys.argv[2] == "1"
rng = np.random.default_rng(0)
T = 4
def arrays(f, dtype=np.float64):
    f.create_dataset("observations/qpos", data=rng.standard_normal((T, 3)).astype(dtype))
    f.create_dataset("observations/qvel", data=rng.standard_normal((T, 3)).astype(dtype))
    f.create_dataset("action", data=rng.standard_normal((T, 3)).astype(np.float32))
with h5py.File(f"{folder}/raw.hdf5", "w") as f:
    f.attrs["sim"] = True
    arrays(f)
    f.create_dataset("observations/images/top", data=rng.integers(0, 256, (T, 4, 4, 3), dtype=np.uint8))
with h5py.File(f"{folder}/compressed.hdf5", "w") as f:
    f.attrs["compress"] = True
    arrays(f)
    rows = []
    for t in range(T):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=70)
        rows.append(np.frombuffer(buf.getvalue(), np.uint8))
    data = np.zeros((T, max(len(r) for r in rows) + 5), np.uint8)
    for t, r in enumerate(rows):
        data[t, :len(r)] = r
    f.create_dataset("observations/images/top", data=data, chunks=(1, data.shape[1]))
with h5py.File(f"{folder}/robomimic.hdf5", "w") as f:  # robomimic's layout: demos in one file
    data = f.create_group("data")
    data.attrs["env_args"] = '{"env_name": "Lift", "env_kwargs": {"control_freq": 20}}'
    for d, n in (("demo_0", T), ("demo_1", T - 1)):
        g = data.create_group(d)
        g.attrs["num_samples"] = n
        g.create_dataset("actions", data=rng.standard_normal((n, 2)))
        g.create_dataset("obs/eef_pos", data=rng.standard_normal((n, 3)))
        g.create_dataset("obs/agentview_image", data=rng.integers(0, 256, (n, 4, 4, 3), dtype=np.uint8))
if not quick:
    with h5py.File(f"{folder}/two_cameras.hdf5", "w") as f:
        arrays(f, np.float32)
        f.create_dataset("observations/effort", data=rng.integers(-9, 9, (T, 3), dtype=np.int32))
        for cam in ("left_wrist", "top"):
            f.create_dataset(f"observations/images/{cam}", data=rng.integers(0, 256, (T, 6, 5, 3), dtype=np.uint8),
                             chunks=(1, 6, 5, 3), compression="gzip")
"""


def hdf5_seeds(add, quick):
    """The hdf5_episode target's inputs, written with h5py: from this environment when it has h5py, else from the
    lerobot oracle environment (.venv-lerobot, as the HDF5 tests do); without either, none (said on stderr)."""
    import importlib.util
    import os
    import subprocess
    python = sys.executable if importlib.util.find_spec("h5py") else os.environ.get(
        "LOONGFORGE_LEROBOT_PYTHON", str(ROOT / ".venv-lerobot" / "bin" / "python"))
    with tempfile.TemporaryDirectory() as d:
        try:
            subprocess.run([python, "-c", HDF5_WRITER, d, "1" if quick else "0"], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"fuzz_seeds: no HDF5 seeds (h5py in neither .venv nor {python}: {e})", file=sys.stderr)
            return
        for f in sorted(pathlib.Path(d).glob("*.hdf5")):
            add("hdf5_episode", f.read_bytes())


# openpi-client's own encoding of observations (msgpack_numpy), one seed per line as hex.
SERVE_WRITER = r"""
import numpy as np
from openpi_client import msgpack_numpy
rng = np.random.default_rng(0)
obs = [{"observation.state": rng.standard_normal(4).astype(np.float32),
        "observation.images.top": rng.integers(0, 256, (6, 8, 3), dtype=np.uint8), "prompt": "pick up the cube"},
       {"observation": {"state": [0.5, -1.0, 2.0], "images": {"wrist": np.zeros((2, 3, 4), np.float16)}},
        "gripper": np.float64(0.25), "step": np.int32(7), "done": np.bool_(False)},
       {"observation.state": np.arange(6, dtype=np.int64).reshape(2, 3), "mask": np.array([True, False]),
        "list": [[1, 2], [3, 4]], "u16": np.arange(3, dtype=np.uint16), "f8": np.zeros((0, 2))}]
for o in obs:
    print(msgpack_numpy.packb(o).hex())
"""


def serve_seeds(add):
    """The serve_request target's inputs, written by openpi-client (.venv-openpi); without it, none (said on
    stderr)."""
    import os
    import subprocess
    python = os.environ.get("LOONGFORGE_OPENPI_PYTHON", str(ROOT / ".venv-openpi" / "bin" / "python"))
    try:
        out = subprocess.run([python, "-c", SERVE_WRITER], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"fuzz_seeds: no serve_request seeds (openpi-client not in {python}: {e})", file=sys.stderr)
        return
    for line in out.split():
        add("serve_request", bytes.fromhex(line))


if __name__ == "__main__":
    main()

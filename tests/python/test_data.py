"""`loongforge data tokenize` against the Hugging Face `tokenizers` library.

The shard is read back with numpy (layout: docs/data_format.md) and every document must hold exactly
tokenizers' `encode(text).ids` (+ the EOS id when one is appended).
"""
import json
import shutil
import struct

import numpy as np
import pytest
from conftest import run_lf

tokenizers = pytest.importorskip("tokenizers")

EOS, IM_END = 0, 2  # <|endoftext|>, <|im_end|> in tok_bytelevel_gpt2


def read_shard(prefix):
    idx = open(f"{prefix}.idx", "rb").read()
    magic, version, code, docs, tokens = struct.unpack_from("<8sIIQQ", idx)
    assert magic == b"LFIDX\0\0\0" and version == 1 and code in (2, 4)
    offsets = np.frombuffer(idx, dtype="<u8", offset=32)
    assert len(offsets) == docs + 1 and offsets[0] == 0 and offsets[-1] == tokens
    ids = np.fromfile(f"{prefix}.bin", dtype="<u2" if code == 2 else "<u4")
    assert len(ids) == tokens
    return code, [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(docs)]


@pytest.fixture(scope="module")
def tok_dir(fixtures_dir):
    return fixtures_dir / "tok_bytelevel_gpt2"


@pytest.fixture(scope="module")
def hf(tok_dir):
    return tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


@pytest.fixture
def tok_with_eos(tmp_path, tok_dir):
    """The fixture tokenizer plus a tokenizer_config.json naming the EOS token (in the object form)."""
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    return d


@pytest.fixture(scope="module")
def case_texts(tok_dir):
    return [c["text"] for c in json.loads((tok_dir / "cases.json").read_text(encoding="utf-8"))]


PARAGRAPHS = [
    "The quick brown fox\njumps over the lazy dog.",
    "  indented first line\nsecond line with trailing spaces   \n\tthird with a tab",
    "Привет мир 你好 世界 👨‍👩‍👧‍👦 café",
    "one line",
    "code: def f(x):\n    return x**2 <|im_end|> special inside",
]


def write_paragraphs(path, paragraphs):
    # Blank lines (some with spaces, some several) separate documents; a CRLF file reads like an LF one.
    seps = ["\n\n", "\n   \n", "\n\n\n\n", "\n\t\n"]
    text = "\n\n"
    for i, p in enumerate(paragraphs):
        text += p + seps[i % len(seps)]
    path.write_bytes(text.encode("utf-8"))


def test_text_paragraphs_match_tokenizers(tmp_path, tok_with_eos, hf):
    src = tmp_path / "corpus.txt"
    write_paragraphs(src, PARAGRAPHS)
    out = tmp_path / "txt"
    proc = run_lf("data", "tokenize", "--tokenizer", tok_with_eos, "--input", src, "--out", out, "--threads", 2)
    assert "5 docs" in proc.stdout and "tokens/s" in proc.stdout, proc.stdout
    code, docs = read_shard(out)
    assert code == 2  # vocab 2000: uint16
    assert docs == [hf.encode(p).ids + [EOS] for p in PARAGRAPHS]

    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(src.read_bytes().replace(b"\n", b"\r\n"))
    run_lf("data", "tokenize", "--tokenizer", tok_with_eos, "--input", crlf, "--out", tmp_path / "crlf")
    assert read_shard(tmp_path / "crlf")[1] == docs


def test_jsonl_matches_tokenizers(tmp_path, tok_dir, hf, case_texts):
    src = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"id": i, "content": t}) for i, t in enumerate(case_texts)]
    lines.insert(3, "")  # blank lines are skipped
    lines.insert(5, json.dumps({"content": ""}))  # so are empty documents
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "jl"
    # The fixture folder has no tokenizer_config.json: no EOS unless asked for.
    proc = run_lf("data", "tokenize", "--tokenizer", tok_dir, "--input", src, "--out", out, "--field", "content")
    assert "no eos_token" in proc.stderr
    expected = [hf.encode(t).ids for t in case_texts if t]
    assert read_shard(out) == (2, expected)

    run_lf("data", "tokenize", "--tokenizer", tok_dir / "tokenizer.json", "--input", src, "--out", out,
           "--field", "content", "--eos-token", "<|im_end|>", "--dtype", "uint32", "--threads", 3)
    assert read_shard(out) == (4, [ids + [IM_END] for ids in expected])


def test_several_inputs_keep_their_order(tmp_path, tok_with_eos, hf, case_texts):
    txt, jl = tmp_path / "a.txt", tmp_path / "b.jsonl"
    write_paragraphs(txt, PARAGRAPHS)
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in case_texts), encoding="utf-8")
    out = tmp_path / "both"
    run_lf("data", "tokenize", "--tokenizer", tok_with_eos, "--input", txt, jl, txt, "--out", out,
           "--no-append-eos", "--threads", 4)
    texts = PARAGRAPHS + [t for t in case_texts if t] + PARAGRAPHS
    assert read_shard(out)[1] == [hf.encode(t).ids for t in texts]


@pytest.mark.parametrize("line, parts", [
    ('{"text": "ok"', ["bad.jsonl:3", "field 'text'", "invalid JSON"]),
    ('{"body": "no text field"}', ["bad.jsonl:3", "field 'text'", "missing"]),
    ('{"text": 42}', ["bad.jsonl:3", "field 'text'", "expected a string"]),
    ('["text"]', ["bad.jsonl:3", "field 'text'", "not a JSON object"]),
])
def test_bad_jsonl_is_a_one_line_error_and_keeps_the_existing_shard(tmp_path, tok_with_eos, line, parts):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello"}\n{"text": "world"}\n')
    out = tmp_path / "shard"
    run_lf("data", "tokenize", "--tokenizer", tok_with_eos, "--input", good, "--out", out)
    before = (out.with_suffix(".bin").read_bytes(), out.with_suffix(".idx").read_bytes())

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n{"text": "world"}\n' + line + '\n{"text": "after"}\n')
    proc = run_lf("data", "tokenize", "--tokenizer", tok_with_eos, "--input", good, bad, "--out", out, check=False)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert "\n" not in err and err.startswith("loongforge: error: "), err
    for p in parts:
        assert p in err, err
    assert (out.with_suffix(".bin").read_bytes(), out.with_suffix(".idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "shard.bin", "shard.idx", "tok"]


def test_eos_and_input_errors(tmp_path, tok_dir, tok_with_eos):
    src = tmp_path / "c.txt"
    src.write_text("hello\n")

    def err(*args):
        proc = run_lf("data", "tokenize", *args, "--out", tmp_path / "o", check=False)
        assert proc.returncode != 0
        assert "\n" not in proc.stderr.strip(), proc.stderr
        return proc.stderr

    assert "--eos-token" in err("--tokenizer", tok_dir, "--input", src, "--append-eos")
    assert "'<nope>'" in err("--tokenizer", tok_dir, "--input", src, "--eos-token", "<nope>")
    assert "unsupported input type '.csv'" in err("--tokenizer", tok_dir, "--input", tmp_path / "x.csv")
    assert "missing.txt" in err("--tokenizer", tok_dir, "--input", tmp_path / "missing.txt")
    cfg = tok_with_eos / "tokenizer_config.json"
    cfg.write_text(json.dumps({"eos_token": 5}))
    assert "tokenizer_config.json: field 'eos_token'" in err("--tokenizer", tok_with_eos, "--input", src)
    assert not list(tmp_path.glob("o.*"))

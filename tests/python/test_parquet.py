"""Parquet through Apache Arrow's C++ reader (data/parquet.h), checked against pyarrow through
`loongforge data parquet`: files written here with pyarrow in several row groups, with the column kinds a LeRobot
dataset holds (int64 indices, float32 timestamps, fixed-size and variable lists of float32, nested stats lists,
image structs {bytes, path}, strings), read whole and by row ranges and compared with pyarrow's to_numpy; the
schema, row groups and key-value metadata compared with pyarrow's; bad files and bad requests fail in one line.
Nulls are rejected (one line naming the file, column and row)."""
import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from conftest import TESTS_BIN, run_gtest_hook, run_lf

pa = pytest.importorskip("pyarrow")  # requirements.txt pins it; an image without it skips these tests
pq = pytest.importorskip("pyarrow.parquet")

ROWS, GROUP = 30, 7  # five row groups: 7, 7, 7, 7, 2


def make_table(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    state = rng.standard_normal((rows, 6)).astype(np.float32)
    action = rng.standard_normal((rows, 4)).astype(np.float32)
    stats = rng.standard_normal((rows, 2, 3))
    images = [{"bytes": rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8).tobytes(),
               "path": f"frame_{i:06d}.png"} for i in range(rows)]
    cols = {
        "episode_index": pa.array(np.arange(rows) // 12, pa.int64()),
        "frame_index": pa.array(np.arange(rows) % 12, pa.int64()),
        "timestamp": pa.array((np.arange(rows) % 12) / np.float32(30), pa.float32()),
        "task_index": pa.array(rng.integers(-5, 5, rows), pa.int32()),
        "x.f64": pa.array(rng.standard_normal(rows), pa.float64()),
        "x.f16": pa.array(rng.standard_normal(rows).astype(np.float16), pa.float16()),
        "x.i16": pa.array(rng.integers(-300, 300, rows), pa.int16()),
        "x.i8": pa.array(rng.integers(-100, 100, rows), pa.int8()),
        "x.u8": pa.array(rng.integers(0, 256, rows), pa.uint8()),
        "next.done": pa.array(rng.random(rows) < 0.3, pa.bool_()),
        "observation.state": pa.FixedSizeListArray.from_arrays(pa.array(state.ravel(), pa.float32()), 6),
        "action": pa.array(list(action), pa.list_(pa.float32())),
        "stats": pa.array([[list(r) for r in s] for s in stats], pa.list_(pa.list_(pa.float64()))),
        "flags": pa.array([list(r) for r in rng.random((rows, 3)) < 0.5], pa.list_(pa.bool_(), 3)),
        "observation.image": pa.array(images, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "note": pa.array([f"row {i} é" * (i % 3) for i in range(rows)], pa.string()),
        "blob": pa.array([bytes([i]) * (i % 5) for i in range(rows)], pa.large_binary()),
        "tags": pa.array([["a", "bé", "c"][: i % 4] for i in range(rows)], pa.list_(pa.string())),
        "other": pa.array([{"x": i, "y": 1.5} for i in range(rows)], pa.struct([("x", pa.int64()),
                                                                                 ("y", pa.float64())])),
    }
    meta = {"huggingface": json.dumps({"info": {"features": {"action": "x"}}}), "fps": "30"}
    return pa.table(cols).replace_schema_metadata(meta)


@pytest.fixture(scope="module")
def pfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("parquet") / "episode.parquet"
    pq.write_table(make_table(), path, row_group_size=GROUP, compression="zstd")
    return path


def numpy_of(table, name, begin=0, end=None):
    """pyarrow's values of column NAME (rows [begin, end)) as an array [rows, list sizes...]."""
    return numpy_whole(table, name)[begin:end]


def numpy_whole(table, name):
    col = table.column(name)
    t = col.type
    depth = 0
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        depth, t = depth + 1, t.value_type
    if depth == 0:
        return col.to_numpy()
    rows = col.to_pylist()
    return np.array(rows, dtype=t.to_pandas_dtype())


def read(tmp_path, pfile, *args):
    out = tmp_path / "out.safetensors"
    run_lf("data", "parquet", "--file", pfile, "--out", out, *args)
    with safe_open(str(out), "np") as f:
        meta = json.loads(f.metadata()["parquet"])
    return load_file(str(out)), meta


def one_line_error(*args):
    proc = run_lf(*args, check=False)
    err = proc.stderr.strip()
    assert proc.returncode != 0 and err and len(err.splitlines()) == 1, err
    return err


def test_schema_row_groups_and_metadata(pfile):
    desc = json.loads(run_lf("data", "parquet", "--file", pfile).stdout)
    ref = pq.ParquetFile(pfile)
    schema = ref.schema_arrow
    assert desc["num_rows"] == ref.metadata.num_rows == ROWS
    starts = np.cumsum([0] + [ref.metadata.row_group(g).num_rows for g in range(ref.metadata.num_row_groups)])
    assert desc["row_group_starts"] == starts.tolist() and len(starts) == 6
    assert [c["name"] for c in desc["columns"]] == schema.names
    assert [c["type"] for c in desc["columns"]] == [str(f.type) for f in schema]
    kinds = {c["name"]: c["kind"] for c in desc["columns"]}
    assert kinds["observation.image"] == "image" and kinds["note"] == "bytes" and kinds["blob"] == "bytes"
    assert kinds["tags"] == "byte_lists" and kinds["other"] == "other" and kinds["observation.state"] == "numeric"
    by = {c["name"]: c for c in desc["columns"]}
    assert by["observation.state"]["shape"] == [6] and by["observation.state"]["dtype"] == "float32"
    assert by["action"]["shape"] == [-1] and by["action"]["row_shape"] == [4]
    assert by["stats"]["shape"] == [-1, -1] and by["stats"]["row_shape"] == [2, 3]
    assert by["flags"]["dtype"] == "bool" and by["x.f16"]["dtype"] == "float16"
    kv = {k.decode(): v.decode() for k, v in ref.metadata.metadata.items()}
    assert desc["metadata"] == kv and kv["fps"] == "30" and "huggingface" in kv and "ARROW:schema" in kv


def check_rows(tensors, table, names, begin, end):
    for name in names:
        col = table.column(name)
        if pa.types.is_list(col.type) and pa.types.is_string(col.type.value_type):
            lists = col.slice(begin, end - begin).to_pylist()
            strings = [x.encode() for row in lists for x in row]
            np.testing.assert_array_equal(tensors[name + ".row_offsets"], np.cumsum([0] + [len(r) for r in lists]))
            np.testing.assert_array_equal(tensors[name + ".offsets"], np.cumsum([0] + [len(x) for x in strings]))
            assert tensors[name].tobytes() == b"".join(strings), name
            continue
        if pa.types.is_struct(col.type) or pa.types.is_binary(col.type) or pa.types.is_string(col.type) \
                or pa.types.is_large_binary(col.type):
            rows = col.slice(begin, end - begin).to_pylist()
            rows = [r["bytes"] if isinstance(r, dict) else r for r in rows]
            rows = [r.encode() if isinstance(r, str) else r for r in rows]
            offsets = np.cumsum([0] + [len(r) for r in rows])
            np.testing.assert_array_equal(tensors[name + ".offsets"], offsets)
            assert tensors[name].tobytes() == b"".join(rows), name
            continue
        ref = numpy_of(table, name, begin, end)
        got = tensors[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape, (name, got.dtype, ref.dtype, got.shape, ref.shape)
        np.testing.assert_array_equal(got, ref, err_msg=name)


def test_whole_file_matches_pyarrow(tmp_path, pfile):
    tensors, meta = read(tmp_path, pfile)
    table = pq.read_table(pfile)
    readable = [n for n in table.column_names if n != "other"]
    assert set(tensors) == set(readable) | {n + ".offsets" for n in ("observation.image", "note", "blob", "tags")} \
        | {"tags.row_offsets"}
    check_rows(tensors, table, readable, 0, ROWS)
    assert meta["num_rows"] == ROWS


@pytest.mark.parametrize("rows", ["0:3", "5:9", "6:7", "7:14", "3:29", "12:", ":30", "28:30", "10:10"])
def test_row_ranges_match_pyarrow(tmp_path, pfile, rows):
    names = ["frame_index", "observation.state", "action", "stats", "next.done",
             "observation.image", "note", "tags"]
    tensors, _ = read(tmp_path, pfile, "--columns", ",".join(names), "--rows", rows)
    b, e = rows.split(":")
    begin, end = int(b or 0), int(e or ROWS)
    assert set(tensors) == set(names) | {"observation.image.offsets", "note.offsets", "tags.offsets",
                                         "tags.row_offsets"}
    check_rows(tensors, pq.read_table(pfile), names, begin, end)


def test_reads_only_the_row_groups_a_range_needs(tmp_path):
    """A file whose fourth row group has a destroyed page header: ranges outside it read (their groups are the only
    ones decoded), a range that touches it fails in one line naming the file."""
    path = tmp_path / "broken.parquet"
    pq.write_table(make_table(), path, row_group_size=GROUP, compression="zstd")
    md = pq.ParquetFile(path).metadata
    rg = md.row_group(3)
    col = next(rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema == "timestamp")
    data = bytearray(path.read_bytes())
    start = col.data_page_offset if col.dictionary_page_offset is None else col.dictionary_page_offset
    data[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(data))
    table = make_table()
    tensors, _ = read(tmp_path, path, "--columns", "timestamp", "--rows", "0:21")
    check_rows(tensors, table, ["timestamp"], 0, 21)
    tensors, _ = read(tmp_path, path, "--columns", "timestamp", "--rows", "28:30")
    check_rows(tensors, table, ["timestamp"], 28, 30)
    tensors, _ = read(tmp_path, path, "--columns", "frame_index", "--rows", "20:29")  # other columns are intact
    check_rows(tensors, table, ["frame_index"], 20, 29)
    err = one_line_error("data", "parquet", "--file", path, "--columns", "timestamp", "--rows", "20:22",
                         "--out", tmp_path / "x.safetensors")
    assert str(path) in err and "rows [20, 22)" in err


def test_bad_files_fail_in_one_line(tmp_path, pfile):
    out = tmp_path / "x.safetensors"
    missing = tmp_path / "missing.parquet"
    assert one_line_error("data", "parquet", "--file", missing).endswith(f"{missing}: no such file")
    text = tmp_path / "text.parquet"
    text.write_text("this is not a parquet file, just some text that is long enough\n" * 3)
    err = one_line_error("data", "parquet", "--file", text, "--out", out)
    assert f"{text}: not a readable Parquet file" in err
    data = pfile.read_bytes()
    for cut in (len(data) // 2, len(data) - 3, 6, 0):
        trunc = tmp_path / f"trunc{cut}.parquet"
        trunc.write_bytes(data[:cut])
        err = one_line_error("data", "parquet", "--file", trunc, "--out", out)
        assert f"{trunc}: not a readable Parquet file" in err, err
    assert not out.exists()


def test_bad_requests_fail_in_one_line(tmp_path, pfile):
    out = tmp_path / "x.safetensors"
    err = one_line_error("data", "parquet", "--file", pfile, "--columns", "action,observation.velocity", "--out", out)
    assert f"{pfile}: column 'observation.velocity': no such column" in err
    err = one_line_error("data", "parquet", "--file", pfile, "--columns", "other", "--out", out)
    assert f"{pfile}: column 'other': holds values of a type this reader does not handle (struct<" in err
    for rows, what in [("25:31", "rows [25, 31)"), ("9:3", "rows [9, 3)")]:
        err = one_line_error("data", "parquet", "--file", pfile, "--rows", rows, "--out", out)
        assert f"{pfile}: {what} are outside the file's 30 rows" in err
    err = one_line_error("data", "parquet", "--file", pfile, "--rows", "x:3", "--out", out)
    assert "--rows 'x:3'" in err
    assert not out.exists()


@pytest.mark.parametrize("column,array,row", [
    ("timestamp", pa.array([0.0, 1.0, None, 3.0] * 5, pa.float32()), 2),
    ("action", pa.array([[1.0, 2.0]] * 13 + [None] + [[1.0, 2.0]] * 6, pa.list_(pa.float32())), 13),
    ("action", pa.array([[1.0, 2.0]] * 13 + [[1.0, None]] + [[1.0, 2.0]] * 6, pa.list_(pa.float32())), None),
    ("observation.image", pa.array([{"bytes": b"x", "path": "p"}] * 8 + [{"bytes": None, "path": "p"}] * 12,
                                    pa.struct([("bytes", pa.binary()), ("path", pa.string())])), 8),
    ("observation.image", pa.array([{"bytes": b"x", "path": "p"}] * 17 + [None] * 3,
                                    pa.struct([("bytes", pa.binary()), ("path", pa.string())])), 17),
])
def test_nulls_are_rejected_in_one_line(tmp_path, column, array, row):
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({column: array}), path, row_group_size=GROUP)
    err = one_line_error("data", "parquet", "--file", path, "--out", tmp_path / "x.safetensors")
    assert f"{path}: column '{column}'" in err and "null" in err
    if row is not None:
        assert f"row {row} " in err


def test_ragged_lists_are_rejected_in_one_line(tmp_path):
    path = tmp_path / "ragged.parquet"
    pq.write_table(pa.table({"action": pa.array([[1.0, 2.0]] * 9 + [[1.0]] + [[1.0, 2.0]] * 3,
                                                pa.list_(pa.float32()))}), path, row_group_size=GROUP)
    err = one_line_error("data", "parquet", "--file", path, "--out", tmp_path / "x.safetensors")
    assert f"{path}: column 'action': row 9 holds 1 values where earlier rows hold 2" in err
    # Rows before the ragged one read (row-group aware: the range stops in the first group).
    tensors, _ = read(tmp_path, path, "--rows", "0:7")
    np.testing.assert_array_equal(tensors["action"], np.ones((7, 2), np.float32) * [1, 2])


def test_empty_file(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(make_table().slice(0, 0), path)
    tensors, meta = read(tmp_path, path, "--columns", "observation.state,action,note")
    assert meta["num_rows"] == 0
    assert tensors["observation.state"].shape == (0, 6) and tensors["action"].shape == (0, 0)
    assert tensors["note"].shape == (0,) and tensors["note.offsets"].tolist() == [0]


def test_cpp_api(tmp_path, pfile):
    """The C++ API itself (tests/cpp/test_parquet.cpp: schema, row_shape, several columns at once, threads
    sharing one file, metadata, errors) on the file pyarrow wrote."""
    if not TESTS_BIN.exists():
        pytest.skip("no gtest binary")
    run_gtest_hook("Parquet.ApiOnPyarrowFile", {"LF_TEST_PARQUET": str(pfile)})

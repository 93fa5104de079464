"""KV mode's shards and rows without a Spark session: the data source's writer and reader are
plain Python (a task's writer, the driver's commit, the planning and each partition's read).

A KV shard is made a batch of rows at a time (a buffer per column, the header text in one
pass): it must be the very file stream_st's general writer makes of the same tensors in the
same order, and read back row for row, whatever the layout of the shards read (tensors of a
column back to back, or a row's tensors together as another writer lays them out), with its
digests checked. Where the write recorded where a shard's rows lie (``kv_rows``), a read takes
them from there only while the shard's header and that record are the ones written: any change
sends it back to the parsed header, never to wrong rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from pyspark.sql.types import (  # noqa: E402
    ArrayType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)
from safetensors.numpy import load_file  # noqa: E402

import pyspark_safetensors  # noqa: E402
import stream_st  # noqa: E402
from pyspark_safetensors._kv import RowLayout  # noqa: E402
from pyspark_safetensors._write import SafetensorsWriter, WriteOptions  # noqa: E402

from ..servers.http_server import RangeHTTPServer  # noqa: E402

SCHEMA = StructType(
    [
        StructField("name", StringType()),
        StructField("n", LongType()),
        StructField("x", ArrayType(FloatType())),
    ]
)


def batch(names: list[str], widths: list[int] | None = None) -> Any:
    """Rows ``names``: ``n`` its position, ``x`` that many floats (``widths``: each row's
    count; default 3)."""
    widths = widths or [3] * len(names)
    return pa.record_batch(
        {
            "name": pa.array(names, pa.string()),
            "n": pa.array(range(len(names)), pa.int64()),
            "x": pa.array(
                [[float(i) + j / 4 for j in range(w)] for i, w in enumerate(widths)],
                pa.list_(pa.float32()),
            ),
        }
    )


def write(path: Path, tasks: list[list[Any]], **options: str) -> None:
    """The tasks' batches written as a KV dataset at ``path``, committed as Spark would."""
    parsed = WriteOptions.parse({"path": str(path), "name_col": "name", **options}, SCHEMA)
    writer = SafetensorsWriter(parsed, overwrite=True)
    writer.commit([writer.write(iter(batches)) for batches in tasks])


def shards(path: Path) -> list[Path]:
    manifest = json.loads((path / "dataset_manifest.json").read_text())
    return [path / entry["shard_path"] for entry in manifest["shards"]]


def read(
    path: Path | str, schema: StructType | None = None, **options: str
) -> list[dict[str, Any]]:
    """Every row a read gives (of ``schema``, by default the source's), through the planning and
    each partition's read."""
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(path), **options})
    reader: Any = source.reader(schema or source.schema())
    out: list[dict[str, Any]] = []
    for partition in reader.partitions():
        for part in reader.read(partition):
            out += part.to_pylist()
    return out


@pytest.mark.parametrize("checksums", ["false", "true"])
def test_a_kv_shard_is_the_file_the_general_writer_makes(tmp_path: Path, checksums: str) -> None:
    # a batch of rows alike, then one of rows of different widths (taken row by row)
    write(tmp_path, [[batch(["a", "b"]), batch(["c", "d"], [1, 2])]], checksums=checksums)
    (shard,) = shards(tmp_path)
    arrays = load_file(str(shard))  # the reference reads it
    header = anyio.run(stream_st.read_header, str(shard))
    # each block of rows a column after another, each column's rows in order
    order = ["a__n", "b__n", "a__x", "b__x", "c__n", "c__x", "d__n", "d__x"]
    assert header.names() == order
    assert arrays["d__x"].tolist() == [1.0, 1.25] and arrays["b__n"].tolist() == 1
    general = {key: arrays[key] for key in order}
    other = tmp_path / "general.safetensors"
    anyio.run(
        lambda: stream_st.save(str(other), general, order="plan", checksums=checksums == "true")
    )
    assert shard.read_bytes() == other.read_bytes()


def test_last_win_keeps_the_later_row_in_its_place(tmp_path: Path) -> None:
    write(tmp_path, [[batch(["a", "b", "a"]), batch(["b", "c"])]], duplicatesStrategy="lastWin")
    (shard,) = shards(tmp_path)
    header = anyio.run(stream_st.read_header, str(shard))
    assert header.names() == ["a__n", "a__x", "b__n", "b__x", "c__n", "c__x"]
    arrays = load_file(str(shard))
    assert {key: value.tolist() for key, value in arrays.items() if key.endswith("__n")} == {
        "a__n": 2,
        "b__n": 0,
        "c__n": 1,
    }
    rows = read(tmp_path)
    assert [(row["name"], row["n"]) for row in rows] == [("a", 2), ("b", 0), ("c", 1)]
    with pytest.raises(stream_st.WriterError, match="'a__n' is written twice"):
        write(tmp_path / "fail", [[batch(["a", "b", "a"])]])


@pytest.mark.parametrize(
    ("columns", "separator", "refused"),
    [
        (["b", "a__b"], "__", "'a__b'"),  # y + __a__b or y__a + __b
        (["b", "_b"], "__", "'_b'"),  # y + ___b or y_ + __b
        (["b"], "", "kv_separator is empty"),
    ],
)
def test_a_column_whose_keys_could_be_another_names_is_refused_on_the_driver(
    tmp_path: Path, columns: list[str], separator: str, refused: str
) -> None:
    schema = StructType(
        [StructField("name", StringType()), *(StructField(c, LongType()) for c in columns)]
    )
    options = {"path": str(tmp_path), "name_col": "name", "kv_separator": separator}
    with pytest.raises(stream_st.UsageError, match=refused):
        WriteOptions.parse(options, schema)
    WriteOptions.parse({**options, "kv_separator": "/"}, schema)  # another separator is taken


def test_a_column_holding_the_separator_alone_is_written_and_read(tmp_path: Path) -> None:
    """A column holding the separator (``hidden__state``) beside none whose name its own ends
    with: each key ends in the whole column name, one way only (the reader matches it whole),
    so the write is taken, as before the clash check."""
    schema = StructType([StructField("name", StringType()), StructField("a__b", LongType())])
    WriteOptions.parse({"path": str(tmp_path), "name_col": "name"}, schema)


def test_a_column_ending_in_part_of_the_separator_is_read_back(tmp_path: Path) -> None:
    """``_v`` with ``__``: keys ``a___v``, which were split at their last ``__`` (``a_`` and
    ``v``) where a shard records no layout (checksums), so its rows were refused, and a shard
    a commit rewrote counted a name twice."""
    schema = StructType(
        [
            StructField("name", StringType()),
            StructField("_v", LongType()),
            StructField("w", LongType()),
        ]
    )

    def rows(names: list[str]) -> Any:
        numbers = pa.array(range(len(names)), pa.int64())
        return pa.record_batch({"name": names, "_v": numbers, "w": numbers})

    options = {"path": str(tmp_path), "name_col": "name", "checksums": "true"}
    writer = SafetensorsWriter(WriteOptions.parse(options, schema), overwrite=True)
    writer.commit([writer.write(iter([rows(["a", "b"])]))])
    assert read(tmp_path) == [{"name": "a", "_v": 0, "w": 0}, {"name": "b", "_v": 1, "w": 1}]
    append(tmp_path, [rows(["a"])], schema, duplicatesStrategy="lastWin")  # a's row moves on
    assert [entry["samples_count"] for entry in manifest_of(tmp_path)["shards"]] == [1, 1]
    assert read(tmp_path) == [{"name": "b", "_v": 1, "w": 1}, {"name": "a", "_v": 0, "w": 0}]


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ([("name", StringType()), ("n", LongType()), ("nope", LongType())], "no column 'nope'"),
        ([("name", StringType()), ("nope", StringType())], "no column 'nope'"),
        ([("name", LongType()), ("n", LongType())], r"written as string: .* as bigint"),
    ],
)
def test_a_given_schema_the_dataset_cannot_fill_is_refused_before_any_task(
    tmp_path: Path, fields: list[tuple[str, Any]], refused: str
) -> None:
    """It was a bare KeyError (a column the dataset lacks) or pyarrow's ArrowInvalid, from the
    task (names of text read as bigint)."""
    write(tmp_path, [[batch(["a", "b"])]])
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(tmp_path)})
    with pytest.raises(stream_st.UsageError, match=refused):
        source.reader(StructType([StructField(name, kind) for name, kind in fields]))
    given = StructType([StructField("n", LongType()), StructField("name", StringType())])
    names_alone = StructType(given.fields[1:])
    for schema, expected in [
        (given, [{"n": 0, "name": "a"}, {"n": 1, "name": "b"}]),  # another order
        (names_alone, [{"name": "a"}, {"name": "b"}]),  # the names alone (was a bare ValueError)
        (StructType(given.fields[:1]), [{"n": 0}, {"n": 1}]),  # no names (was a bare KeyError)
    ]:
        reader: Any = source.reader(schema)
        rows = [r for p in reader.partitions() for part in reader.read(p) for r in part.to_pylist()]
        assert rows == expected


def test_integer_names_read_as_their_text_or_a_wider_integer(tmp_path: Path) -> None:
    schema = StructType([StructField("id", IntegerType()), StructField("n", LongType())])
    parsed = WriteOptions.parse({"path": str(tmp_path), "name_col": "id"}, schema)
    writer = SafetensorsWriter(parsed, overwrite=True)
    ids = pa.array([5, -7], pa.int32())
    writer.commit([writer.write(iter([pa.record_batch({"id": ids, "n": pa.array([1, 2])})]))])
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(tmp_path)})
    for kind, names in [(StringType(), ["5", "-7"]), (LongType(), [5, -7])]:
        reader: Any = source.reader(StructType([StructField("id", kind)]))
        rows = [r for p in reader.partitions() for part in reader.read(p) for r in part.to_pylist()]
        assert [row["id"] for row in rows] == names
    with pytest.raises(stream_st.UsageError, match=r"written as int: .* as smallint"):
        source.reader(StructType([StructField("id", ShortType())]))


def test_rows_come_back_in_order_across_partitions(tmp_path: Path) -> None:
    names = [f"k{i}" for i in range(300)]
    # two tasks; a batch of rows alike (20 kB each: partitions of 1 MB cut the shard), one of
    # rows of two widths
    write(
        tmp_path,
        [
            [batch(names[:100], [5000] * 100), batch(names[100:150], [4, 2] * 25)],
            [batch(names[150:])],
        ],
    )
    options = {"path": str(tmp_path), "max_partition_mb": "1"}
    source = pyspark_safetensors.SafetensorsDataSource(options)
    # the first shard (2 MB, under 2 MiB, 150 rows) cut in two ranges of rows, the small second
    # one with the last
    parts = [p.value for p in source.reader(source.schema()).partitions()]
    assert [[(p.start, p.stop) for p in part] for part in parts] == [
        [(0, 75)],
        [(75, 150), (0, 150)],
    ]
    rows = read(tmp_path, max_partition_mb="1")
    assert [row["name"] for row in rows] == names
    assert rows[99]["x"][:2] == [99.0, 99.25] and len(rows[99]["x"]) == 5000
    assert rows[120]["x"] == [20.0, 20.25, 20.5, 20.75] and rows[121]["x"] == [21.0, 21.25]
    assert rows[299] == {"name": "k299", "n": 149, "x": [149.0, 149.25, 149.5]}
    assert read(tmp_path, columns="n")[5] == {"name": "k5", "n": 5}


def test_rows_of_shards_laid_out_otherwise_and_names_without_a_column(tmp_path: Path) -> None:
    """A shard whose rows each hold their tensors together (another writer's order) is read run
    by run; an append of other names without column ``x`` reads null there."""
    write(tmp_path, [[batch(["a", "b", "c"])]])
    (shard,) = shards(tmp_path)
    arrays = load_file(str(shard))
    interleaved = {f"{n}__{c}": arrays[f"{n}__{c}"] for n in "abc" for c in ("n", "x")}
    anyio.run(lambda: stream_st.save(str(shard), interleaved, order="plan"))
    manifest = tmp_path / "dataset_manifest.json"
    document = json.loads(manifest.read_text())
    document["shards"][0]["bytes"] = shard.stat().st_size
    manifest.write_text(json.dumps(document))
    only_n = StructType([StructField("name", StringType()), StructField("n", LongType())])
    parsed = WriteOptions.parse({"path": str(tmp_path), "name_col": "name"}, only_n)
    writer = SafetensorsWriter(parsed, overwrite=False)
    extra = pa.record_batch({"name": ["d"], "n": pa.array([7], pa.int64())})
    writer.commit([writer.write(iter([extra]))])
    rows = read(tmp_path)
    assert rows == [
        {"name": "a", "n": 0, "x": [0.0, 0.25, 0.5]},
        {"name": "b", "n": 1, "x": [1.0, 1.25, 1.5]},
        {"name": "c", "n": 2, "x": [2.0, 2.25, 2.5]},
        {"name": "d", "n": 7, "x": None},
    ]
    assert read(tmp_path, StructType([StructField("x", ArrayType(FloatType()))]))[2:] == [
        {"x": [2.0, 2.25, 2.5]},
        {"x": None},
    ]  # the rows without their names (was a bare KeyError)


def test_a_damaged_tensor_is_refused_naming_its_key(tmp_path: Path) -> None:
    write(tmp_path, [[batch(["a", "b", "c"])]], checksums="true")
    (shard,) = shards(tmp_path)
    header = anyio.run(stream_st.read_header, str(shard))
    assert read(tmp_path)[1]["x"] == [1.0, 1.25, 1.5]
    damaged = bytearray(shard.read_bytes())
    damaged[header.data_start + header["b__x"].start] ^= 1
    shard.write_bytes(bytes(damaged))
    with pytest.raises(stream_st.IntegrityError, match=r"'b__x' .* does not match its xxh3-128"):
        read(tmp_path)


def test_a_shard_with_bytes_after_its_data_or_a_damaged_header_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    """Whole rows were read from a shard with bytes appended (as the batch reader, ``raw=true``
    and ``stream_st.load`` refuse it), and a header that is no JSON was refused naming no
    shard."""
    for checksums in ("false", "true"):  # laid out, or read from its header
        path = tmp_path / checksums
        write(path, [[batch(["a", "b"])]], checksums=checksums)
        (shard,) = shards(path)
        shard.write_bytes(shard.read_bytes() + bytes(8))
        where = re.escape(str(shard))
        with pytest.raises(stream_st.TrailingDataError, match=f"^{where}: 8 bytes follow"):
            read(path)
    shard.write_bytes(b"\x10" + bytes(7) + b"{not json!!!!!!}")
    with pytest.raises(stream_st.HeaderError, match=f"^{where}: header is not valid JSON"):
        read(path)


@pytest.mark.parametrize("checksums", ["true", "false"])  # "false": laid out, see below
def test_rows_read_over_http_with_ranged_requests(tmp_path: Path, checksums: str) -> None:
    write(tmp_path, [[batch(["a", "b"])], [batch(["c"])]], checksums=checksums)
    with RangeHTTPServer() as server:
        for path in tmp_path.iterdir():
            server.objects[f"/ds/{path.name}"] = path.read_bytes()
        rows = read(server.url("/ds/dataset_manifest.json"))
    assert [(row["name"], row["n"], row["x"][1]) for row in rows] == [
        ("a", 0, 0.25),
        ("b", 1, 1.25),
        ("c", 0, 0.25),
    ]


def append(path: Path, batches: list[Any], schema: StructType = SCHEMA, **options: str) -> None:
    """``batches`` appended to the KV dataset at ``path`` by one task, committed."""
    parsed = WriteOptions.parse({"path": str(path), "name_col": "name", **options}, schema)
    writer = SafetensorsWriter(parsed, overwrite=False)
    writer.commit([writer.write(iter(batches))])


def whole(path: Path) -> Any:
    return json.loads((path / "dataset_manifest.json").read_text())["kv"]["whole_rows"]


def test_rows_stay_whole_through_an_append_of_the_same_columns_only(tmp_path: Path) -> None:
    write(tmp_path, [[batch(["a", "b"])], [batch(["c"])]])
    assert whole(tmp_path) is True
    append(tmp_path, [batch(["b", "d"])], duplicatesStrategy="lastWin")  # b's row moves on
    assert whole(tmp_path) is True
    rows = read(tmp_path)
    assert [(row["name"], row["n"]) for row in rows] == [("a", 0), ("c", 0), ("b", 0), ("d", 1)]
    only_n = StructType([StructField("name", StringType()), StructField("n", LongType())])
    nine = pa.record_batch({"name": ["a"], "n": pa.array([9])})
    append(tmp_path, [nine], only_n, duplicatesStrategy="lastWin")
    assert whole(tmp_path) is False  # a now lies in two shards
    assert read(tmp_path)[0] == {"name": "a", "n": 9, "x": [0.0, 0.25, 0.5]}


def test_whole_rows_are_planned_without_a_header_and_checked_by_the_tasks(
    tmp_path: Path,
) -> None:
    write(tmp_path, [[batch(["a", "b"])], [batch(["c"])]])
    second = shards(tmp_path)[1]
    second.write_bytes(b"\xff" * 8 + second.read_bytes()[8:])  # no header a driver could read
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(tmp_path)})
    reader: Any = source.reader(source.schema())
    (partition,) = reader.partitions()
    with pytest.raises(stream_st.HeaderError, match="header length"):
        list(reader.read(partition))
    manifest = tmp_path / "dataset_manifest.json"
    document = json.loads(manifest.read_text())
    document["shards"] = document["shards"][:1]
    document["shards"][0]["samples_count"] = 3
    manifest.write_text(json.dumps(document))
    with pytest.raises(stream_st.HeaderError, match="says its 3 rows are whole; the shard holds 2"):
        read(tmp_path)


def test_an_empty_write_reads_back_with_its_columns(tmp_path: Path) -> None:
    """A KV write of no row recorded no column (its one shard holds no tensor): a read gave the
    names alone, where docs/spark.md promises no rows in the written types."""
    for path in (tmp_path / "some", tmp_path / "every"):
        parsed = WriteOptions.parse({"path": str(path), "name_col": "name"}, SCHEMA)
        writer = SafetensorsWriter(parsed, overwrite=True)
        writer.commit([writer.write(iter([]))])
        source = pyspark_safetensors.SafetensorsDataSource({"path": str(path)})
        assert source.schema().simpleString() == "struct<name:string,n:bigint,x:array<float>>"
        assert read(path) == []
    only_n = StructType([StructField("name", StringType()), StructField("n", LongType())])
    append(tmp_path / "some", [pa.record_batch({"name": ["a"], "n": pa.array([9])})], only_n)
    assert whole(tmp_path / "some") is False  # a has no x
    assert read(tmp_path / "some") == [{"name": "a", "n": 9, "x": None}]
    append(tmp_path / "every", [batch(["a"])])
    assert whole(tmp_path / "every") is True
    assert read(tmp_path / "every") == [{"name": "a", "n": 0, "x": [0.0, 0.25, 0.5]}]


def manifest_of(path: Path) -> Any:
    return json.loads((path / "dataset_manifest.json").read_text())


def rewrite_manifest(path: Path, document: Any) -> None:
    (path / "dataset_manifest.json").write_text(json.dumps(document))


def layouts(path: Path) -> list[Any]:
    return [entry.get("kv_rows") for entry in manifest_of(path)["shards"]]


def without_layouts(path: Path) -> None:
    """The dataset as written before shards recorded where their rows lie."""
    document = manifest_of(path)
    for entry in document["shards"]:
        entry.pop("kv_rows", None)
    rewrite_manifest(path, document)


def test_shards_record_where_their_rows_lie_and_read_the_same_without(tmp_path: Path) -> None:
    names = [f"k{i}" for i in range(300)] + ["é", "日本"]
    # blocks of rows alike, a block of rows of two widths (a block per row), two tasks
    tasks = [
        [batch(names[:100], [500] * 100), batch(names[100:150], [4, 2] * 25)],
        [batch(names[150:])],
    ]
    write(tmp_path, tasks)
    first, second = layouts(tmp_path)
    assert [block[0] for block in first["blocks"]] == [100] + [1] * 50
    assert first["columns"] == ["n", "x"] and second["specs"] == [["I64", []], ["F32", [3]]]
    laid_out = read(tmp_path, max_partition_mb="1")  # the first shard cut in ranges of rows
    assert [row["name"] for row in laid_out] == names
    assert laid_out[120]["x"] == [20.0, 20.25, 20.5, 20.75] and laid_out[-1]["n"] == 151
    assert read(tmp_path, columns="x")[5] == {"name": "k5", "x": laid_out[5]["x"]}
    without_layouts(tmp_path)
    assert read(tmp_path, max_partition_mb="1") == laid_out


NO_LAYOUT = {  # the write's batches and options, the names read back
    "checksums": ([batch(["a", "b"])], {"checksums": "true"}, ["a", "b"]),
    "a key written twice in a shard": (
        [batch(["a", "b", "a"])],
        {"duplicatesStrategy": "lastWin"},
        ["b", "a"],
    ),
    "names JSON escapes": ([batch(['a"b', "c\\d"])], {}, ['a"b', "c\\d"]),
}


@pytest.mark.parametrize("case", list(NO_LAYOUT))
def test_shards_whose_rows_no_layout_describes_record_none(tmp_path: Path, case: str) -> None:
    batches, options, names = NO_LAYOUT[case]
    write(tmp_path, [batches], **options)
    assert layouts(tmp_path) == [None]
    assert [row["name"] for row in read(tmp_path)] == names


def test_an_append_keeps_the_layouts_of_the_shards_it_keeps(tmp_path: Path) -> None:
    write(tmp_path, [[batch(["a", "b"])], [batch(["c"])]])
    before = layouts(tmp_path)
    append(tmp_path, [batch(["b", "d"])], duplicatesStrategy="lastWin")  # the first rewritten
    after = layouts(tmp_path)
    assert after[0] is None and after[1] == before[1] and after[2] is not None
    assert [(row["name"], row["n"]) for row in read(tmp_path)] == [
        ("a", 0),
        ("c", 0),
        ("b", 0),
        ("d", 1),
    ]


def swap(blob: bytes, one: bytes, other: bytes) -> bytes:
    """``blob`` with texts ``one`` and ``other`` (one each, as long) swapped."""
    assert blob.count(one) == blob.count(other) == 1 and len(one) == len(other)
    out = bytearray(blob)
    at, to = blob.index(one), blob.index(other)
    out[at : at + len(one)], out[to : to + len(one)] = other, one
    return bytes(out)


def test_a_shard_whose_header_changed_is_read_from_its_header(tmp_path: Path) -> None:
    """Tensors ``a__x`` and ``b__x`` swap places in the header (the same length): the layout
    recorded no longer holds, the header's digest says so, and the rows are the header's."""
    write(tmp_path, [[batch(["a", "b"])]])
    (shard,) = shards(tmp_path)
    shard.write_bytes(swap(shard.read_bytes(), b"[16,28]", b"[28,40]"))
    assert [(row["name"], row["x"][0]) for row in read(tmp_path)] == [("a", 1.0), ("b", 0.0)]
    # a header of another length, that the manifest's size no longer matches: refused
    arrays = load_file(str(shard))
    anyio.run(lambda: stream_st.save(str(shard), {"a__n": arrays["a__n"]}))
    with pytest.raises(stream_st.HeaderError, match=r"the manifest says \d+ bytes"):
        read(tmp_path)


def test_a_sub_byte_tensor_among_the_rows_is_refused_and_read_raw(tmp_path: Path) -> None:
    """This source writes no F4 or F6 tensor; one a shard holds since (its header rewritten)
    arrives as its packed bytes, which the rows would give as numbers of those bytes: refused,
    naming the read that gives it, as a tensor struct of its own dtype and shape."""
    write(tmp_path, [[batch(["a", "b"], [4, 4])]])
    (shard,) = shards(tmp_path)
    blob = shard.read_bytes()
    shard.write_bytes(blob.replace(b'"dtype":"F32","shape":[4]', b'"dtype":"F4","shape":[32]', 1))
    with pytest.raises(stream_st.UsageError, match=r"'x' holds F4 tensors.*raw=true"):
        read(tmp_path)
    tensors = {row["tensor_key"]: row["tensor"] for row in read(tmp_path, raw="true")}
    assert (tensors["a__x"]["dtype"], tensors["a__x"]["shape"]) == ("F4", [32])


@pytest.mark.parametrize("field", ["header", "blocks", "specs", "columns"])
def test_a_layout_changed_in_the_manifest_is_not_trusted(tmp_path: Path, field: str) -> None:
    write(tmp_path, [[batch(["a", "bb", "c"])]])
    expected = read(tmp_path)
    document = manifest_of(tmp_path)
    layout = document["shards"][0]["kv_rows"]
    if field == "header":
        layout["header"]["xxh3-128"] = "0" * 32
    elif field == "blocks":
        layout["blocks"][0][1] += 1  # the names a byte later: the digest tells
    elif field == "specs":
        layout["specs"] = "I64"
    else:
        layout["columns"].reverse()  # still the dataset's columns: the digest tells
    rewrite_manifest(tmp_path, document)
    assert read(tmp_path) == expected


def test_a_layout_that_describes_no_such_shard_is_not_used(tmp_path: Path) -> None:
    """Whatever a manifest holds where a layout goes, it is parsed into one that matches the
    shard's entry, or none (the shard then read from its parsed header), never an error."""
    write(tmp_path, [[batch(["a", "b"])]])
    entry = manifest_of(tmp_path)["shards"][0]
    good, samples, size = entry["kv_rows"], entry["samples_count"], entry["bytes"]
    assert RowLayout.parse(good, ["x", "n"], samples, size) is not None
    changes: list[tuple[str, Any]] = [
        ("header", None),
        ("header", {"bytes": True, "xxh3-128": "00"}),
        ("header", {"bytes": 10**9, "xxh3-128": "00"}),
        ("columns", ["n"]),
        ("columns", ["n", "n"]),
        ("columns", [["n"], "x"]),
        ("specs", [[["I64"], []], ["F32", [3]]]),
        ("specs", [["F4", [3]], ["F32", [3]]]),
        ("specs", [["I64", [-1]], ["F32", [3]]]),
        ("specs", [["I64", [2**70]], ["F32", [3]]]),
        ("blocks", [[2, 1, 10, 0, 2]]),
        ("blocks", [[2, 10, 1, 0, 1]]),
        ("blocks", [[0, 1, 10, 0, 1]]),
        ("blocks", [[2, 1, 10, 0, 1.5]]),
        ("blocks", [[1, 1, 10, 0, 1]]),
        ("blocks", []),
    ]
    for field, value in changes:
        assert RowLayout.parse({**good, field: value}, ["n", "x"], samples, size) is None
    assert RowLayout.parse(good, ["n", "x"], samples, size + 1) is None
    assert RowLayout.parse(good, ["n", "x"], samples + 1, size) is None
    assert RowLayout.parse("layout", ["n", "x"], samples, size) is None

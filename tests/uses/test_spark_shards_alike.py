"""A column reads as one type from every shard, or not at all: an append under another type, or
(batch mode) of other columns, or (KV mode) of a column whose keys could be another's of the
dataset, is refused, shards of different dtypes are refused (as the torch
dataset refuses them), never cast to the first shard's type; a shard of no tensor is read as no
row; the columns a write or read names, and the folders an abort leaves, are checked on the
driver. These run without a Spark session: the data source's writer and reader are plain Python
(a task's writer, the driver's commit and abort, the planning and each partition's read);
``test_spark.py`` appends through Spark.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from pyspark.sql.pandas.types import to_arrow_type  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType,
    ByteType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)

import pyspark_safetensors  # noqa: E402
import stream_st  # noqa: E402
from pyspark_safetensors._write import SafetensorsWriter, WriteOptions  # noqa: E402
from stream_st.numpy import save_file  # noqa: E402


def commit(
    path: Path, schema: StructType, columns: dict[str, Any], mode: str, **options: str
) -> None:
    """One task's batch of ``columns`` (Arrow arrays) written at ``path`` and committed as
    Spark does it: the job aborted (its staging removed) where the commit fails."""
    parsed = WriteOptions.parse({"path": str(path), **options}, schema)
    writer = SafetensorsWriter(parsed, overwrite=mode == "overwrite")
    message = writer.write(iter([pa.record_batch(columns)]))
    try:
        writer.commit([message])
    except BaseException:
        writer.abort([message])
        raise


def read(path: Path, schema: StructType | None = None, **options: str) -> list[dict[str, Any]]:
    """Every row a read gives (of ``schema``, by default the source's), through the planning
    and each partition's read."""
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(path), **options})
    reader: Any = source.reader(schema or source.schema())
    return [row for p in reader.partitions() for part in reader.read(p) for row in part.to_pylist()]


def manifest(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((path / "dataset_manifest.json").read_text())
    return document


NUMBERS = StructType([StructField("x", DoubleType()), StructField("n", LongType())])


@pytest.mark.parametrize(
    ("schema", "columns"),
    [
        (
            StructType([StructField("x", IntegerType()), StructField("n", IntegerType())]),
            {"x": pa.array([7], pa.int32()), "n": pa.array([8], pa.int32())},
        ),
        (  # the same Spark types, another dtype (option dtype)
            NUMBERS,
            {"x": pa.array([7.0]), "n": pa.array([8])},
        ),
    ],
    ids=["other Spark type", "other dtype"],
)
def test_an_append_under_another_type_is_refused(
    tmp_path: Path, schema: StructType, columns: dict[str, Any]
) -> None:
    """The earlier shards were read cast to the append's type (0.5 as 0, 2**40 as 0)."""
    first = {"x": pa.array([0.5, 1.7]), "n": pa.array([2**40, 3])}
    commit(tmp_path, NUMBERS, first, "overwrite", batch_size="10")
    before = manifest(tmp_path)
    options = {"dtype": "x:F32"} if schema == NUMBERS else {}
    with pytest.raises(stream_st.UsageError, match="column 'x' of the dataset is double"):
        commit(tmp_path, schema, columns, "append", batch_size="10", **options)
    assert manifest(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["dataset_manifest.json", *(s["shard_path"] for s in before["shards"])]
    )
    assert read(tmp_path) == [{"x": 0.5, "n": 2**40}, {"x": 1.7, "n": 3}]
    # under the dataset's types: taken
    commit(tmp_path, NUMBERS, {"x": pa.array([7.0]), "n": pa.array([8])}, "append", batch_size="9")
    assert [row["x"] for row in read(tmp_path)] == [0.5, 1.7, 7.0]


def test_shards_whose_column_differs_in_dtype_are_refused(tmp_path: Path) -> None:
    """As the torch dataset refuses them (they were read cast to the first shard's type); read
    raw (each row a tensor struct of its own dtype, nothing cast) they are taken."""

    async def write() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as w:
            await w.write_batch({"label": np.array([1, 2], np.int32), "x": np.ones(2)}, 2)
            await w.write_batch({"label": np.array([2**40, 3]), "x": np.ones(2)}, 2)

    anyio.run(write)
    with pytest.raises(stream_st.UsageError, match="column 'label' differs between shards"):
        read(tmp_path)
    assert len(read(tmp_path, columns="x")) == 4  # the column alike in every shard
    rows = read(tmp_path, raw="true")
    assert [row["label"]["dtype"] for row in rows] == ["I32", "I32", "I64", "I64"]


def test_a_schema_given_to_a_read_refuses_a_value_it_cannot_hold(tmp_path: Path) -> None:
    """They were cast with numpy's wrap-around: U8 200 read as tinyint -56, F32 NaN and 3e9 as
    int -2147483648, U64 2**63 + 5 as bigint a negative number."""

    async def write() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as w:
            u = np.array([1, 200], np.uint8)
            f = np.array([1.5, 3e9, np.nan], np.float32)
            q = np.array([1, 2**63 + 5], np.uint64)
            await w.write_batch({"u": u, "f": f[[0, 1]], "q": q}, 2)
            await w.write_batch({"u": u, "f": f[[0, 2]], "q": q[[0, 0]]}, 2)

    anyio.run(write)
    refused = [
        ("u", ByteType(), "200 does not fit tinyint (-128 to 127; the type it is read as"),
        ("f", IntegerType(), "3000000000.0 does not fit int"),
        ("f", LongType(), "nan does not fit bigint"),  # 3e9 fits
        ("q", LongType(), "9223372036854775813 does not fit bigint"),
    ]
    for column, kind, message in refused:
        with pytest.raises(
            stream_st.UsageError, match=re.escape(f"'{column}': the value {message}")
        ):
            read(tmp_path, StructType([StructField(column, kind)]))
    wider = StructType([StructField("u", ShortType()), StructField("f", DoubleType())])
    assert [(row["u"], row["f"]) for row in read(tmp_path, wider)][:2] == [(1, 1.5), (200, 3e9)]


def test_a_shapes_override_changing_the_nesting_reads_back_flat(tmp_path: Path) -> None:
    """``shapes`` of ``[6]`` or ``[1, 2, 3]`` on an ``array<array<int>>`` column recorded that
    type, which such tensors cannot be read as: the default read refused the dataset written."""
    schema = StructType([StructField("y", ArrayType(ArrayType(IntegerType())))])
    y = pa.array([[[1, 2, 3], [4, 5, 6]]] * 2, to_arrow_type(schema["y"].dataType))
    for shape in ([6], [1, 2, 3], [3, 2]):
        path, shapes = tmp_path / str(shape), json.dumps({"y": shape})
        commit(path, schema, {"y": y}, "overwrite", batch_size="2", shapes=shapes)
        commit(path, schema, {"y": y}, "append", batch_size="2", shapes=shapes)  # alike: taken
        flat = len(shape) != 2
        assert manifest(path)["schema"]["y"]["spark_type"] == (
            "array<int>" if flat else "array<array<int>>"
        )
        value = [1, 2, 3, 4, 5, 6] if flat else [[1, 2], [3, 4], [5, 6]]
        assert read(path) == [{"y": value}] * 4


def test_a_shard_of_no_tensor_holds_no_row(tmp_path: Path) -> None:
    """An empty dataset of open_dataset_writer appended to, and a directory whose first shard
    holds no tensor, read as the torch dataset reads them (a bare KeyError before)."""

    async def empty() -> None:
        async with stream_st.open_dataset_writer(tmp_path / "appended"):
            pass

    anyio.run(empty)
    schema = StructType(
        [StructField("label", IntegerType()), StructField("x", ArrayType(FloatType()))]
    )
    columns = {
        "label": pa.array([1, 2], pa.int32()),
        "x": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32())),
    }
    commit(tmp_path / "appended", schema, columns, "append", batch_size="2")
    assert read(tmp_path / "appended") == [
        {"label": 1, "x": [1.0, 2.0]},
        {"label": 2, "x": [3.0, 4.0]},
    ]
    listing = tmp_path / "listing"
    listing.mkdir()
    save_file({}, str(listing / "part-00000-0000-a.safetensors"))
    save_file({"x": np.arange(3, dtype=np.int32)}, str(listing / "part-00001-0000-b.safetensors"))
    assert read(listing) == [{"x": 0}, {"x": 1}, {"x": 2}]


def test_a_kv_record_naming_the_rows_by_a_column_is_refused(tmp_path: Path) -> None:
    """A manifest whose KV record's name column is also a column of its schema (a row cannot
    hold both): a clear error (a bare KeyError before); read raw, a row per tensor."""
    schema = StructType([StructField("name", StringType()), StructField("k", IntegerType())])
    columns = {"name": pa.array(["a", "b"]), "k": pa.array([1, 2], pa.int32())}
    commit(tmp_path, schema, columns, "overwrite", name_col="name")
    document = manifest(tmp_path)
    document["kv"]["name_col"] = "k"
    (tmp_path / "dataset_manifest.json").write_text(json.dumps(document))
    with pytest.raises(stream_st.UsageError, match="names the rows by 'k', a column"):
        read(tmp_path)
    assert sorted(row["tensor_key"] for row in read(tmp_path, raw="true")) == ["a__k", "b__k"]


@pytest.mark.parametrize(
    ("schema", "columns"),
    [
        (StructType([StructField("x", DoubleType())]), {"x": pa.array([7.0])}),
        (
            StructType([*NUMBERS.fields, StructField("m", LongType())]),
            {"x": pa.array([7.0]), "n": pa.array([8]), "m": pa.array([9])},
        ),
    ],
    ids=["fewer", "more"],
)
def test_a_batch_mode_append_of_other_columns_is_refused(
    tmp_path: Path, schema: StructType, columns: dict[str, Any]
) -> None:
    """It was taken: its shards held other tensors than the earlier ones, and every reader
    took the dataset for KV-mode rows (46 samples read as 2 rows)."""
    commit(
        tmp_path,
        NUMBERS,
        {"x": pa.array([0.5, 1.7]), "n": pa.array([2, 3])},
        "overwrite",
        batch_size="10",
    )
    before = manifest(tmp_path)
    with pytest.raises(stream_st.UsageError, match=r"columns are \['n', 'x'\].*or overwrite"):
        commit(tmp_path, schema, columns, "append", batch_size="10")
    assert manifest(tmp_path) == before
    assert read(tmp_path) == [{"x": 0.5, "n": 2}, {"x": 1.7, "n": 3}]


@pytest.mark.parametrize(("dataset", "appended"), [("b", "a__b"), ("a__b", "b")])
def test_a_kv_append_of_a_column_whose_keys_could_be_the_datasets_is_refused(
    tmp_path: Path, dataset: str, appended: str
) -> None:
    """A write of both columns is refused (x__a__b: row x's a__b or row x__a's b); appending
    one to a dataset of the other was taken."""

    def kv(column: str, name: str) -> tuple[StructType, dict[str, Any]]:
        schema = StructType([StructField("name", StringType()), StructField(column, LongType())])
        return schema, {"name": pa.array([name]), column: pa.array([1])}

    commit(tmp_path, *kv(dataset, "y"), "overwrite", name_col="name")
    before = manifest(tmp_path)
    refused = rf"a key \{{name\}}__a__b .* the dataset appended to holds \['{dataset}'\]"
    with pytest.raises(stream_st.UsageError, match=refused):
        commit(tmp_path, *kv(appended, "x"), "append", name_col="name")
    assert manifest(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["dataset_manifest.json", *(s["shard_path"] for s in before["shards"])]
    )
    commit(tmp_path, *kv("c", "x"), "append", name_col="name")  # a column of no clash: taken
    assert read(tmp_path) == [
        {"name": "y", dataset: 1, "c": None},
        {"name": "x", dataset: None, "c": 1},
    ]


def test_an_empty_dataframe_reads_back_with_its_columns_in_order(tmp_path: Path) -> None:
    """The manifest's schema listed them in the shard header's order (by dtype)."""
    schema = StructType(
        [
            StructField("l", LongType()),
            StructField("i", IntegerType()),
            StructField("d", DoubleType()),
            StructField("f", ArrayType(FloatType())),
        ]
    )
    columns = {field.name: pa.array([], to_arrow_type(field.dataType)) for field in schema}
    commit(tmp_path, schema, columns, "overwrite", batch_size="5")
    assert list(manifest(tmp_path)["schema"]) == ["l", "i", "d", "f"]
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(tmp_path)})
    assert source.schema().names == ["l", "i", "d", "f"]


def test_an_empty_dataframe_appended_to_reads_as_the_rows_appended(tmp_path: Path) -> None:
    """The empty shard's ``[0, 0]`` array column was taken, by the torch dataset, for rows of
    another shape than the appended ``[2, 2]`` ("column 'x' differs between shards")."""
    torch_dataset = pytest.importorskip("stream_st.integrations.torch_dataset")
    schema = StructType([StructField("x", ArrayType(FloatType())), StructField("n", LongType())])
    empty = {"x": pa.array([], pa.list_(pa.float32())), "n": pa.array([], pa.int64())}
    commit(tmp_path, schema, empty, "overwrite", batch_size="2")
    rows = {"x": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32())), "n": pa.array([5, 6])}
    commit(tmp_path, schema, rows, "append", batch_size="2")
    assert [entry["samples_count"] for entry in manifest(tmp_path)["shards"]] == [0, 2]
    expected = [{"x": [1.0, 2.0], "n": 5}, {"x": [3.0, 4.0], "n": 6}]
    assert read(tmp_path) == expected
    samples = torch_dataset.SafetensorsDataset(str(tmp_path))
    assert [{k: v.tolist() for k, v in sample.items()} for sample in samples] == expected


def test_an_aborted_write_leaves_no_folder_it_made(tmp_path: Path) -> None:
    """A job that failed left the (empty) folder of its new dataset; a folder that was there
    before stays."""
    for path in (tmp_path / "new" / "data", tmp_path):
        parsed = WriteOptions.parse({"path": str(path), "batch_size": "2"}, NUMBERS)
        SafetensorsWriter(parsed, overwrite=True).abort([])  # as Spark, a task having failed
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_read_naming_a_column_twice_is_refused(tmp_path: Path) -> None:
    """A bare ValueError in a task (a JVM Arrow error in KV mode), not on the driver."""
    commit(
        tmp_path / "b",
        NUMBERS,
        {"x": pa.array([0.5]), "n": pa.array([2])},
        "overwrite",
        batch_size="1",
    )
    kv = StructType([StructField("name", StringType()), StructField("n", LongType())])
    commit(
        tmp_path / "kv",
        kv,
        {"name": pa.array(["a"]), "n": pa.array([1])},
        "overwrite",
        name_col="name",
    )
    for path in (tmp_path / "b", tmp_path / "kv"):
        source = pyspark_safetensors.SafetensorsDataSource({"path": str(path), "columns": "n,n"})
        with pytest.raises(stream_st.UsageError, match="names 'n' twice"):
            source.schema()

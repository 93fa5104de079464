"""Sizes Spark's Arrow batches cannot carry are refused with a clear error, never a crash.

A safetensors header may declare what no Spark column holds: ``F32 [10**15, 0]`` (no byte,
10**15 rows), a dimension beyond the tensor struct's int32 shape, a row of more than 2 GiB, a
row of sub-byte values (F4, F6) that is no whole number of bytes; sub-byte tensors, which arrive
as their packed bytes, are read as tensor structs of their own dtype and shape. These run
without a Spark session (the data source's planning and its Arrow columns are plain Python); one
read through Spark is in ``test_spark_types.py``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from pyspark.sql.types import ArrayType, ByteType, StructField, StructType  # noqa: E402

import pyspark_safetensors  # noqa: E402
import stream_st  # noqa: E402
from pyspark_safetensors._arrow import (  # noqa: E402
    ARROW_LIMIT,
    TENSOR_TYPE,
    stack_rows,
    tensor_column,
    typed_column,
)
from pyspark_safetensors._types import TENSOR_COLUMN, column_of, parse_type  # noqa: E402

SHARD = "part-00000-0000-00000000-0000-0000-0000-000000000000.safetensors"


def write_tensors(directory: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> Path:
    """A shard of the given tensors (dtype, shape and bytes), in order."""
    header, offset = {}, 0
    for name, (code, shape, data) in tensors.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    data = b"".join(data for _, _, data in tensors.values())
    (directory / SHARD).write_bytes(struct.pack("<Q", len(text)) + text + data)
    return directory


def write_header(directory: Path, tensors: dict[str, list[int]]) -> Path:
    """A shard of F32 tensors of the given shapes, each of no byte (a dimension is 0)."""
    return write_tensors(directory, {name: ("F32", shape, b"") for name, shape in tensors.items()})


def plan(directory: Path, **options: str) -> Any:
    """The data source's schema and reader for ``directory``: what the driver does before any
    task runs."""
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(directory), **options})
    return source.reader(source.schema())


def read(directory: Path, **options: str) -> list[Any]:
    """The Arrow batches a read of ``directory`` gives, through the planning and each
    partition's read."""
    reader = plan(directory, **options)
    return [batch for partition in reader.partitions() for batch in reader.read(partition)]


@pytest.mark.parametrize("options", [{}, {"raw": "true"}])
def test_too_many_rows_of_no_byte_are_refused_when_planning(
    tmp_path: Path, options: dict[str, str]
) -> None:
    write_header(tmp_path, {"x": [10**15, 0]})
    with pytest.raises(stream_st.UsageError, match=r"'x' .*10{15} rows in one piece"):
        plan(tmp_path, **options)


def test_rows_of_no_byte_within_the_limit_are_read_in_bounded_batches(tmp_path: Path) -> None:
    write_header(tmp_path, {"x": [3, 0], "y": [3, 5, 0]})
    reader = plan(tmp_path)
    (partition,) = reader.partitions()
    batches = list(reader.read(partition))
    assert sum(b.num_rows for b in batches) == 3
    assert batches[0].column("x").to_pylist() == [[], [], []]
    assert batches[0].column("y").to_pylist() == [[[]] * 5] * 3


def test_a_dimension_beyond_the_shape_type_is_refused(tmp_path: Path) -> None:
    """KV mode gives each tensor as a tensor struct, its shape ``array<int>``."""
    write_header(tmp_path, {"x": [10**15, 0]})
    with pytest.raises(stream_st.UsageError, match=r"'x' .*does not fit the tensor struct's shape"):
        plan(tmp_path, name_col="name")
    with pytest.raises(stream_st.UsageError, match="does not fit the tensor struct's shape"):
        tensor_column(np.zeros((1, 2**31, 0), np.float32), "x")
    wide = column_of(parse_type("struct<data:binary,shape:array<bigint>,dtype:string>"))
    assert wide is not None
    column = tensor_column(np.zeros((1, 2**31, 0), np.float32), "x", wide)
    assert column.field("shape").to_pylist() == [[2**31, 0]]
    # a schema with bigint shapes carries it
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(tmp_path), "name_col": "n"})
    schema = parse_type("struct<tensor_key:string,tensor:" + wide.spark.simpleString() + ">")
    assert isinstance(schema, StructType)
    reader: Any = source.reader(schema)
    (partition,) = reader.partitions()
    (batch,) = reader.read(partition)
    assert batch.column("tensor").field("shape").to_pylist() == [[10**15, 0]]


def test_nested_arrays_beyond_the_limit_are_refused(tmp_path: Path) -> None:
    write_header(tmp_path, {"x": [2, 2**32, 0]})
    with pytest.raises(stream_st.UsageError, match=r"'x' .*more than Spark's Arrow batches hold"):
        plan(tmp_path)


def test_the_column_builders_refuse_rows_and_batches_too_large() -> None:
    """Checked before any buffer is made: the arrays here take no memory (zero strides)."""
    big = np.broadcast_to(np.zeros(1, np.uint8), (1, 2**16, 2**16))
    numbers = column_of(parse_type("array<tinyint>"))
    assert numbers is not None
    for build in (
        lambda a: tensor_column(a, "x"),
        lambda a: typed_column(a, numbers, "x"),
    ):
        with pytest.raises(stream_st.UsageError, match="more than Spark's Arrow batches hold"):
            build(big)
        with pytest.raises(stream_st.UsageError, match="more than one Arrow batch holds"):
            build(np.broadcast_to(np.zeros(1, np.uint8), (3, ARROW_LIMIT // 2)))
    with pytest.raises(stream_st.UsageError, match=r"10{15} rows in one piece"):
        tensor_column(np.zeros((10**15, 0), np.float32), "x")


def test_written_shapes_whose_product_overflows_are_refused() -> None:
    """A tensor struct whose bigint shape multiplies past 64 bits, or an option ``shapes``
    doing so, is refused rather than wrapped around to 0 bytes."""
    shape_type = pa.list_(pa.int64())
    struct_type = pa.struct([("data", pa.binary()), ("shape", shape_type), ("dtype", pa.string())])
    rows = pa.array([{"data": b"", "shape": [2**40, 2**40, 0], "dtype": "F32"}], struct_type)
    with pytest.raises(stream_st.UsageError, match=r"no array can have the shape"):
        stack_rows(rows, "t")
    wrapped = pa.array([{"data": b"", "shape": [2**32, 2**32], "dtype": "U8"}], struct_type)
    with pytest.raises(stream_st.UsageError, match=r"does not hold 18446744073709551616 bytes"):
        stack_rows(wrapped, "t")
    empty = pa.array([[], []], pa.list_(pa.float32()))
    with pytest.raises(stream_st.UsageError, match=r"no array can have the shape"):
        stack_rows(empty, "x", shape=(2**40, 2**40, 0))
    assert TENSOR_COLUMN.shape_type == np.int32


def test_sub_byte_tensors_read_as_tensor_structs_of_their_dtype_and_shape(tmp_path: Path) -> None:
    """KV mode: F4 and F6 tensors arrive as their packed bytes (numpy has no such types); the
    struct carries the header's dtype and shape, not U8 and the bytes' count."""
    tensors = {
        "w4": ("F4", [4], b"\x21\x43"),
        "odd": ("F4", [2, 3], b"\x21\x43\x65"),  # an odd last dimension
        "w6": ("F6_E2M3", [8], bytes(range(6))),
        "none": ("F4", [0], b""),
    }
    write_tensors(tmp_path, tensors)
    for options in ({"name_col": "name"}, {"name_col": "name", "raw": "true"}):
        rows = [row for batch in read(tmp_path, **options) for row in batch.to_pylist()]
        assert {row["tensor_key"]: row["tensor"] for row in rows} == {
            name: {"data": data, "shape": shape, "dtype": code}
            for name, (code, shape, data) in tensors.items()
        }


@pytest.mark.parametrize("options", [{}, {"raw": "true"}])
def test_sub_byte_columns_read_a_tensor_struct_per_row(
    tmp_path: Path, options: dict[str, str]
) -> None:
    """Batch mode: each row of an F4 or F6 column is its bytes, with the dtype and the shape of
    a row, whether the tensor arrives with its rows (F4, an even last dimension) or as its bytes
    alone (F6), read whole or a range of rows at a time (pieces of at most 1 MiB)."""
    rows = 2**18
    w4, w6 = np.random.default_rng(0).integers(0, 256, (2, rows * 6), np.uint8)
    write_tensors(
        tmp_path,
        {
            "w4": ("F4", [rows, 2], w4[:rows].tobytes()),
            "w6": ("F6_E3M2", [rows, 8], w6.tobytes()),
        },
    )
    batches = read(tmp_path, max_partition_mb="1", **options)
    assert len(batches) == 2  # two pieces, the second a range of rows
    for name, code, shape, data in (("w4", "F4", [2], w4[:rows]), ("w6", "F6_E3M2", [8], w6)):
        column = pa.concat_arrays([batch.column(name) for batch in batches])
        assert column.field("data").to_pylist() == [bytes(r) for r in data.reshape(rows, -1)]
        assert column.field("dtype").unique().to_pylist() == [code]
        shapes = column.field("shape").flatten().to_numpy().reshape(rows, -1)
        assert (shapes == shape).all()


@pytest.mark.parametrize(("code", "shape"), [("F4", [4, 3]), ("F6_E2M3", [4, 2])])
def test_sub_byte_rows_of_no_whole_byte_are_refused_when_planning(
    tmp_path: Path, code: str, shape: list[int]
) -> None:
    """A row of 12 bits has no bytes of its own to give as a tensor struct's data."""
    write_tensors(tmp_path, {"w": (code, shape, bytes(6)), "n": ("I64", [4], bytes(32))})
    for options in ({}, {"raw": "true"}):
        with pytest.raises(stream_st.UsageError, match=rf"'w' .*{code} .*no whole number of bytes"):
            plan(tmp_path, **options)


def test_sub_byte_values_read_as_numbers_are_refused_when_planning(tmp_path: Path) -> None:
    """They arrive as their packed bytes: as numbers they would be those bytes' values."""
    write_tensors(tmp_path, {"w4": ("F4", [2, 2], b"\x21\x43")})
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(tmp_path)})
    with pytest.raises(stream_st.UsageError, match=r"'w4' .*F4 values cannot be read as"):
        source.reader(StructType([StructField("w4", ArrayType(ByteType()))]))


def test_a_null_in_a_written_tensor_structs_shape_is_refused() -> None:
    """Each shape number is checked, not only the shape (Arrow's conversion failed on it)."""
    rows = pa.array([{"data": b"\0\0\x80\x3f", "shape": [None], "dtype": "F32"}], TENSOR_TYPE)
    with pytest.raises(stream_st.UsageError, match=r"column 't' holds a null"):
        stack_rows(rows, "t")

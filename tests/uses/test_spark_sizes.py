"""Sizes Spark's Arrow batches cannot carry are refused with a clear error, never a crash.

A safetensors header may declare what no Spark column holds: ``F32 [10**15, 0]`` (no byte,
10**15 rows), a dimension beyond the tensor struct's int32 shape, a row of more than 2 GiB.
These run without a Spark session (the data source's planning and its Arrow columns are plain
Python); one read through Spark is in ``test_spark_types.py``.
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

from pyspark.sql.types import StructType  # noqa: E402

import pyspark_safetensors  # noqa: E402
import stream_st  # noqa: E402
from pyspark_safetensors._arrow import (  # noqa: E402
    ARROW_LIMIT,
    stack_rows,
    tensor_column,
    typed_column,
)
from pyspark_safetensors._types import TENSOR_COLUMN, column_of, parse_type  # noqa: E402

SHARD = "part-00000-0000-00000000-0000-0000-0000-000000000000.safetensors"


def write_header(directory: Path, tensors: dict[str, list[int]]) -> Path:
    """A shard of F32 tensors of the given shapes, each of no byte (a dimension is 0)."""
    header = {
        name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
        for name, shape in tensors.items()
    }
    text = json.dumps(header).encode()
    (directory / SHARD).write_bytes(struct.pack("<Q", len(text)) + text)
    return directory


def plan(directory: Path, **options: str) -> Any:
    """The data source's schema and reader for ``directory``: what the driver does before any
    task runs."""
    source = pyspark_safetensors.SafetensorsDataSource({"path": str(directory), **options})
    return source.reader(source.schema())


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

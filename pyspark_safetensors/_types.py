"""Spark column types and the tensors they become: what the writer accepts, what the reader gives.

A column the writer accepts is one of:

* a tensor struct, ``struct<data: binary, shape: array<int>, dtype: string>`` (``shape`` may be
  ``array<bigint>``; the fields in any order): its bytes are written as they are;
* a number (``tinyint``, ``smallint``, ``int``, ``bigint``, ``float``, ``double``) or a
  ``boolean``: one value per sample;
* an array of those, nested to any depth: one tensor per sample, shaped by the nesting.

The writer records each column's Spark type (:func:`type_text`) in the manifest's schema entry
(``"spark_type"``), so that a read gives the columns back with the types they were written
with. A dataset without them (written by another tool) is read with types told from each
tensor's dtype and shape (:func:`inferred_type`). This module needs no Spark session: types are
parsed from their ``simpleString`` by :func:`parse_type`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)

from stream_st.core.shards import MANIFEST_DTYPES as SEED_DTYPES
from stream_st.errors import UsageError

__all__ = [
    "SEED_DTYPES",
    "TENSOR_COLUMN",
    "TENSOR_STRUCT",
    "Column",
    "column_of",
    "inferred_type",
    "parse_type",
    "type_text",
    "without_nulls",
]

TENSOR_STRUCT = StructType(
    [
        StructField("data", BinaryType()),
        StructField("shape", ArrayType(IntegerType())),
        StructField("dtype", StringType()),
    ]
)
"""A tensor column's type: ``struct<data: binary, shape: array<int>, dtype: string>``."""

NUMBERS: dict[str, tuple[type[DataType], np.dtype[Any], str]] = {
    "tinyint": (ByteType, np.dtype(np.int8), "I8"),
    "smallint": (ShortType, np.dtype(np.int16), "I16"),
    "int": (IntegerType, np.dtype(np.int32), "I32"),
    "bigint": (LongType, np.dtype(np.int64), "I64"),
    "float": (FloatType, np.dtype(np.float32), "F32"),
    "double": (DoubleType, np.dtype(np.float64), "F64"),
    "boolean": (BooleanType, np.dtype(np.bool_), "U8"),  # BOOL is not a dtype of the layout
}
"""Spark's name of each number type -> its class, numpy dtype, and the dtype it is written as."""

_BY_DTYPE = {code: name for name, (_, _, code) in NUMBERS.items() if name != "boolean"}


@dataclass(frozen=True)
class Column:
    """How a column of Spark type ``spark`` becomes tensors and back.

    ``tensor``: a tensor struct (``shape`` holds ``shape_type`` numbers); otherwise values of
    numpy dtype ``numpy`` nested ``depth`` arrays deep, written as ``dtype``.
    """

    spark: DataType
    tensor: bool
    numpy: np.dtype[Any]
    depth: int
    dtype: str

    @cached_property
    def arrow(self) -> Any:
        """The Arrow type of the column, as Spark expects it (``pa.DataType``: the nullability
        of array elements, list fields named as Spark names them)."""
        return to_arrow_type(self.spark)

    @property
    def element(self) -> DataType:
        """The type of its numbers (``spark`` itself where it is no array)."""
        inner = self.spark
        while isinstance(inner, ArrayType):
            inner = inner.elementType
        return inner

    @property
    def shape_type(self) -> np.dtype[Any]:
        """The tensor struct's shape numbers: int32 or int64."""
        assert isinstance(self.spark, StructType)
        shape = self.spark["shape"].dataType
        assert isinstance(shape, ArrayType)
        return np.dtype(np.int64 if isinstance(shape.elementType, LongType) else np.int32)


TENSOR_COLUMN = Column(TENSOR_STRUCT, True, np.dtype(np.uint8), 0, "U8")
"""How a tensor struct column is written and read (``shape`` as int32 here)."""


def _is_tensor_struct(kind: DataType) -> bool:
    if not isinstance(kind, StructType) or set(kind.names) != {"data", "shape", "dtype"}:
        return False
    shape = kind["shape"].dataType
    return (
        isinstance(kind["data"].dataType, BinaryType)
        and isinstance(kind["dtype"].dataType, StringType)
        and isinstance(shape, ArrayType)
        and isinstance(shape.elementType, IntegerType | LongType)
    )


def column_of(kind: DataType) -> Column | None:
    """How a column of ``kind`` is written and read; None if it cannot hold tensors."""
    if _is_tensor_struct(kind):
        return replace(TENSOR_COLUMN, spark=kind)
    depth, inner = 0, kind
    while isinstance(inner, ArrayType):
        depth, inner = depth + 1, inner.elementType
    found = NUMBERS.get(inner.simpleString())
    if found is None:
        return None
    return Column(kind, False, found[1], depth, found[2])


def without_nulls(kind: DataType) -> DataType:
    """``kind`` with no nullable array element or struct field, at any depth."""
    if isinstance(kind, ArrayType):
        return ArrayType(without_nulls(kind.elementType), containsNull=False)
    if isinstance(kind, StructType):
        return StructType([StructField(f.name, without_nulls(f.dataType), False) for f in kind])
    return kind


def type_text(kind: DataType) -> str:
    """The text a type is recorded as (Spark's ``simpleString``; :func:`parse_type` reads it)."""
    return kind.simpleString()


def parse_type(text: str) -> DataType:
    """A type :func:`type_text` wrote: numbers, ``boolean``, ``binary``, ``string``,
    ``array<...>`` and ``struct<name:type,...>``."""
    kind, rest = _parse(text.replace(" ", ""))
    if rest:
        raise UsageError(f"cannot read the Spark type {text!r}")
    return kind


_SIMPLE: dict[str, type[DataType]] = {
    **{name: cls for name, (cls, _, _) in NUMBERS.items()},
    "binary": BinaryType,
    "string": StringType,
}


def _parse(text: str) -> tuple[DataType, str]:
    if text.startswith("array<"):
        inner, rest = _parse(text[len("array<") :])
        if not rest.startswith(">"):
            raise UsageError(f"cannot read the Spark type at {text!r}")
        return ArrayType(inner), rest[1:]
    if text.startswith("struct<"):
        fields: list[StructField] = []
        rest = text[len("struct<") :]
        while not rest.startswith(">"):
            name, colon, rest = rest.partition(":")
            if not colon or not name:
                raise UsageError(f"cannot read the Spark type at {text!r}")
            kind, rest = _parse(rest)
            fields.append(StructField(name, kind))
            rest = rest.removeprefix(",")
        return StructType(fields), rest[1:]
    for name, cls in _SIMPLE.items():
        if text.startswith(name) and not text[len(name) : len(name) + 1].isalnum():
            return cls(), text[len(name) :]
    raise UsageError(f"cannot read the Spark type at {text!r}")


def inferred_type(dtype: str, sample_rank: int) -> DataType:
    """The type a column of ``dtype`` tensors, each sample of rank ``sample_rank``, is read as
    when the manifest records none: numbers (nested arrays for ranks above 0) where Spark has
    the dtype's type (I8-I64, F32, F64), the tensor struct otherwise (unsigned, F16, BF16)."""
    name = _BY_DTYPE.get(dtype)
    if name is None:
        return TENSOR_STRUCT
    kind: DataType = NUMBERS[name][0]()
    for _ in range(sample_rank):
        kind = ArrayType(kind)
    return kind

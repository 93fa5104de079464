"""Arrow columns <-> numpy arrays: the tensor struct, numeric arrays (nested) and numeric scalars.

A tensor column is ``struct<data: binary, shape: array<int>, dtype: string>`` (``data`` the
little-endian bytes, ``dtype`` a safetensors code); a column of (nested) arrays of numbers gives
one tensor per row shaped by its nesting; a numeric column one scalar per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from stream_st.core.dtypes import dtype_for, dtype_from_code
from stream_st.errors import UsageError

__all__ = ["TENSOR_TYPE", "is_tensor_type", "stack_rows", "tensor_column"]

Array = np.ndarray[Any, Any]

TENSOR_TYPE = pa.struct(
    [("data", pa.binary()), ("shape", pa.list_(pa.int32())), ("dtype", pa.string())]
)
"""The Arrow type of a tensor column (Spark's ``struct<data: binary, shape: array<int>, dtype:
string>``)."""


def is_tensor_type(kind: pa.DataType) -> bool:
    return pa.types.is_struct(kind) and {kind.field(i).name for i in range(kind.num_fields)} == {
        "data",
        "shape",
        "dtype",
    }


def _no_nulls(column: pa.Array, name: str) -> None:
    if column.null_count:
        raise UsageError(f"column {name!r} holds a null: every row needs a value")


def _uniform(values: Array, what: str, name: str) -> Any:
    """The one value ``values`` all hold (``what`` says what they are, for the error)."""
    if len(values) and (values != values[0]).any():
        raise UsageError(f"column {name!r}: rows of a batch differ in {what}")
    return values[0]


def _struct_rows(column: pa.StructArray, name: str) -> Array:
    count = len(column)
    codes = column.field("dtype")
    shapes = column.field("shape")
    data = column.field("data")
    for part in (codes, shapes, data):
        _no_nulls(part, name)
    code = _uniform(np.asarray(codes.to_numpy(zero_copy_only=False)), "dtype", name)
    ranks = shapes.value_lengths().to_numpy()
    rank = int(_uniform(ranks, "shape", name))
    flat = shapes.flatten().to_numpy().reshape(count, rank)
    shape = tuple(int(d) for d in _uniform(flat, "shape", name)) if rank else ()
    dtype = dtype_from_code(code)
    offsets = np.frombuffer(data.buffers()[1], np.int32)[data.offset : data.offset + count + 1]
    row_bytes = dtype.bits * int(np.prod(shape)) // 8
    if (np.diff(offsets) != row_bytes).any():
        raise UsageError(
            f"column {name!r}: a row's data does not hold {row_bytes} bytes ({code} {list(shape)})"
        )
    raw = np.frombuffer(data.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
    return raw.view(dtype.numpy).reshape(count, *shape)


def _array_rows(column: pa.Array, name: str) -> Array:
    count = len(column)
    dims: list[int] = []
    while pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        _no_nulls(column, name)
        dims.append(int(_uniform(column.value_lengths().to_numpy(), "shape", name)))
        column = column.flatten()
    _no_nulls(column, name)
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)) and not (
        pa.types.is_boolean(column.type)
    ):
        raise UsageError(f"column {name!r} of {column.type} cannot become a tensor")
    return np.asarray(column.to_numpy(zero_copy_only=False)).reshape(count, *dims)


def stack_rows(column: pa.Array, name: str, code: str | None = None) -> Array:
    """The rows of ``column`` as one array ``[rows, *shape]`` (every row must have the same
    shape and dtype), cast to the safetensors dtype ``code`` if given (tensor columns carry their
    own)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if is_tensor_type(column.type):
        _no_nulls(column, name)
        return _struct_rows(column, name)
    array = _array_rows(column, name)
    if code is not None:
        array = array.astype(dtype_from_code(code).numpy)
    dtype_for(array.dtype)  # refuses what safetensors cannot carry
    return array


def tensor_column(array: Array) -> pa.StructArray:
    """``array`` ``[rows, *shape]`` as a tensor column of ``rows`` rows (its memory is shared)."""
    count = array.shape[0]
    row_bytes = array.nbytes // count if count else 0
    offsets = np.arange(count + 1, dtype=np.int32) * row_bytes
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    data = pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(raw)]
    )
    shape = pa.array([list(array.shape[1:])] * count, pa.list_(pa.int32()))
    code = pa.array([dtype_for(array.dtype).code] * count, pa.string())
    return pa.StructArray.from_arrays([data, shape, code], fields=list(TENSOR_TYPE))

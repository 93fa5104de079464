"""Arrow columns <-> numpy arrays: the tensor struct, numbers and (nested) arrays of numbers.

A tensor column is ``struct<data: binary, shape: array<int>, dtype: string>`` (``data`` the
little-endian bytes, ``dtype`` a safetensors code); a column of (nested) arrays of numbers gives
one tensor per row shaped by its nesting; a number column one scalar per row. Both directions
work on whole columns: numpy views of Arrow buffers and back, no Python object per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from stream_st.core.dtypes import dtype_for, dtype_from_code
from stream_st.errors import UsageError

from ._types import SEED_DTYPES, Column

__all__ = [
    "TENSOR_TYPE",
    "cast",
    "is_tensor_type",
    "stack_rows",
    "tensor_column",
    "truncate_to_bf16",
    "truncate_to_f16",
    "typed_column",
]

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
    if code not in SEED_DTYPES:
        raise UsageError(
            f"column {name!r}: dtype {code!r} is not one the dataset layout allows "
            f"({', '.join(SEED_DTYPES)})"
        )
    ranks = shapes.value_lengths().to_numpy()
    rank = int(_uniform(ranks, "shape", name))
    flat = shapes.flatten().to_numpy().reshape(count, rank)
    shape = tuple(int(d) for d in _uniform(flat, "shape", name)) if rank else ()
    if any(d < 0 for d in shape):
        raise UsageError(f"column {name!r}: a negative dimension in shape {list(shape)}")
    dtype = dtype_from_code(code)
    offsets: Array
    if data.type == pa.large_binary():
        offsets = np.frombuffer(data.buffers()[1], np.int64)[data.offset : data.offset + count + 1]
    else:
        offsets = np.frombuffer(data.buffers()[1], np.int32)[data.offset : data.offset + count + 1]
    row_bytes = dtype.bits * int(np.prod(shape)) // 8
    if (np.diff(offsets) != row_bytes).any():
        raise UsageError(
            f"column {name!r}: a row's data does not hold {row_bytes} bytes ({code} {list(shape)})"
        )
    if not count or not row_bytes:
        return np.zeros((count, *shape), dtype.numpy)
    raw = np.frombuffer(data.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
    return raw.view(dtype.numpy).reshape(count, *shape)


def _array_rows(column: pa.Array, name: str) -> Array:
    count = len(column)
    dims: list[int] = []
    while pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        _no_nulls(column, name)
        lengths = column.value_lengths().to_numpy()
        dims.append(int(_uniform(lengths, "shape", name)) if len(lengths) else 0)
        column = column.flatten()
    _no_nulls(column, name)
    if not (
        pa.types.is_integer(column.type)
        or pa.types.is_floating(column.type)
        or pa.types.is_boolean(column.type)
    ):
        raise UsageError(f"column {name!r} of {column.type} cannot become a tensor")
    return np.asarray(column.to_numpy(zero_copy_only=False)).reshape(count, *dims)


def truncate_to_f16(values: Array) -> Array:
    """F16 bit patterns (uint16) of ``values`` as the Scala connector makes them: each value
    taken as a double, rounded to float32, then its bits cut down, not rounded: the exponent
    rebiased, the mantissa's low 13 bits dropped; float32 subnormals and anything below F16's
    smallest normal become a signed zero, anything above its largest finite value a signed
    infinity, a NaN the quiet NaN ``0x7e00`` (with the sign)."""
    bits = np.asarray(values).astype(np.float64).astype(np.float32).view(np.uint32)
    sign = ((bits >> 31) << 15).astype(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int64)
    mantissa = bits & 0x7FFFFF
    rebiased = exponent - 127 + 15
    normal = sign | (np.clip(rebiased, 0, 0x1F).astype(np.uint32) << 10) | (mantissa >> 13)
    out = np.where(rebiased <= 0, sign, normal)
    out = np.where(rebiased >= 0x1F, sign | 0x7C00, out)
    out = np.where(exponent == 0, sign, out)
    special = sign | 0x7C00 | np.where(mantissa != 0, 0x200, 0).astype(np.uint32)
    out = np.where(exponent == 0xFF, special, out)
    return out.astype(np.uint16)


def truncate_to_bf16(values: Array) -> Array:
    """BF16 bit patterns (uint16) of ``values`` as the Scala connector makes them: each value
    taken as a double, rounded to float32, and the top 16 bits of that float kept."""
    bits = np.asarray(values).astype(np.float64).astype(np.float32).view(np.uint32)
    return (bits >> 16).astype(np.uint16)


def cast(array: Array, code: str, rounding: str = "nearest") -> Array:
    """``array`` as safetensors dtype ``code``: numpy's conversion (round to nearest even), or
    for F16 and BF16 with ``rounding="truncate"``, the connector's truncation."""
    target = dtype_from_code(code).numpy
    if rounding == "truncate" and code == "F16":
        return truncate_to_f16(array).view(target)
    if rounding == "truncate" and code == "BF16":
        return truncate_to_bf16(array).view(target)
    if array.dtype == target:
        return array
    return array.astype(target)


def stack_rows(
    column: pa.Array,
    name: str,
    code: str | None = None,
    *,
    kind: Column | None = None,
    shape: tuple[int, ...] | None = None,
    rounding: str = "nearest",
) -> Array:
    """The rows of ``column`` as one array ``[rows, *shape]`` (every row must have the same
    shape and dtype). Numbers are cast to the safetensors dtype ``code`` if given (else the one
    ``kind`` says: booleans become U8), each row reshaped to ``shape`` if given; tensor
    structs carry their own dtype and shape."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if is_tensor_type(column.type):
        _no_nulls(column, name)
        return _struct_rows(column, name)
    array = _array_rows(column, name)
    if shape is not None:
        size = int(np.prod(shape))
        if array.size != len(array) * size:
            raise UsageError(
                f"column {name!r}: a row of {array[0].size if len(array) else 0} values cannot "
                f"take the shape {list(shape)} (option shapes)"
            )
        array = array.reshape(len(array), *shape)
    code = code if code is not None else (kind.dtype if kind is not None else None)
    if code is not None:
        array = cast(array, code, rounding)
    dtype_for(array.dtype)  # refuses what safetensors cannot carry
    return array


def tensor_column(array: Array, shape_type: pa.DataType | None = None) -> pa.StructArray:
    """``array`` ``[rows, *shape]`` as a tensor column of ``rows`` rows (its memory is shared);
    ``shape_type`` the numbers of ``shape`` (int32 unless given)."""
    count = array.shape[0]
    row_bytes = array.nbytes // count if count else 0
    offsets = np.arange(count + 1, dtype=np.int32) * row_bytes
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    data = pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(raw)]
    )
    dims = pa.array(np.tile(np.asarray(array.shape[1:], np.int64), count), shape_type or pa.int32())
    rank = len(array.shape) - 1
    shape = pa.ListArray.from_arrays(pa.array(np.arange(count + 1, dtype=np.int32) * rank), dims)
    code = pa.repeat(pa.scalar(dtype_for(array.dtype).code, pa.string()), count)
    fields = [
        pa.field("data", pa.binary()),
        pa.field("shape", shape.type),
        pa.field("dtype", pa.string()),
    ]
    return pa.StructArray.from_arrays([data, shape, code], fields=fields)


def typed_column(array: Array, kind: Column, name: str) -> pa.Array:
    """``array`` ``[rows, *shape]`` as an Arrow column of the Spark type ``kind`` describes:
    numbers, or arrays nested ``kind.depth`` deep (a deeper tensor is flattened into a 1-deep
    array; a one-value tensor becomes a number)."""
    if kind.tensor:
        struct = tensor_column(array, pa.from_numpy_dtype(kind.shape_type))
        names = [field.name for field in kind.spark.fields]  # type: ignore[attr-defined]
        return pa.StructArray.from_arrays([struct.field(n) for n in names], names=names)
    rows, sample = array.shape[0], array.shape[1:]
    if len(sample) != kind.depth:
        size = int(np.prod(sample))
        if kind.depth == 1:
            sample = (size,)
        elif kind.depth == 0 and size == 1:
            sample = ()
        else:
            raise UsageError(
                f"column {name!r}: a tensor of shape {list(sample)} cannot be read as "
                f"{kind.spark.simpleString()} (read it with option raw=true)"
            )
    values = array.reshape(-1)
    if values.dtype != kind.numpy:
        values = values.astype(kind.numpy)
    column: pa.Array = pa.array(values)
    for level in reversed(range(len(sample))):
        lists = rows * int(np.prod(sample[:level]))  # the arrays at this depth
        offsets = pa.array(np.arange(lists + 1, dtype=np.int32) * sample[level])
        column = pa.ListArray.from_arrays(offsets, column)
    return column

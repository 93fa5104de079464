"""Arrow columns <-> numpy arrays: the tensor struct, numbers and (nested) arrays of numbers.

A tensor column is ``struct<data: binary, shape: array<int>, dtype: string>`` (``data`` the
little-endian bytes, ``dtype`` a safetensors code); a column of (nested) arrays of numbers gives
one tensor per row shaped by its nesting; a number column one scalar per row. Both directions
work on whole columns: numpy views of Arrow buffers and back, no Python object per row. Sub-byte
tensors (F4, F6), which arrive as their packed bytes, are given as tensor structs of the dtype
and shape their header says, a row of whole bytes each.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa

from stream_st.core.dtypes import DType, dtype_for, dtype_from_code
from stream_st.errors import UsageError
from stream_st.integrations.dataset import Spec

from ._types import SEED_DTYPES, TENSOR_COLUMN, Column

__all__ = [
    "ARROW_LIMIT",
    "TENSOR_TYPE",
    "arrow_row_bytes",
    "cast",
    "is_tensor_type",
    "row_bytes",
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


ARROW_LIMIT = 2**31 - 1
"""What one Arrow batch Spark takes may count: rows, entries of a list column, bytes of a binary
column (32-bit offsets); Spark's arrays and binary values are bounded by it too."""


def _nested(sample: tuple[int, ...], kind: Column, name: str) -> tuple[int, ...]:
    """The shape a sample of ``sample`` has as ``kind``'s arrays nest it (``kind.depth`` deep):
    a deeper tensor is flattened into one array, a one-value tensor becomes a number."""
    if len(sample) == kind.depth:
        return sample
    size = math.prod(sample)
    if kind.depth == 1:
        return (size,)
    if kind.depth == 0 and size == 1:
        return ()
    raise UsageError(
        f"column {name!r}: a tensor of shape {list(sample)} cannot be read as "
        f"{kind.spark.simpleString()} (read it with option raw=true)"
    )


def arrow_row_bytes(
    name: str, rows: int, sample: tuple[int, ...], dtype: DType, kind: Column
) -> int:
    """About how many bytes one row of a column of ``rows`` samples of shape ``sample`` (values
    of ``dtype``) takes as Arrow column ``kind`` (values and offsets, at least 1); refuses
    (:class:`~stream_st.UsageError`) what Spark's Arrow batches cannot carry: more than
    :data:`ARROW_LIMIT` rows, or a row of more bytes, values or list entries than that, or a
    dimension the tensor struct's shape numbers cannot hold, or a row of sub-byte values that
    is no whole number of bytes; and sub-byte values read as numbers (they arrive as their
    packed bytes)."""
    where = f"{name!r} (rows of shape {list(sample)})"
    if rows > ARROW_LIMIT:
        raise UsageError(
            f"{where}: {rows} rows in one piece, more than Spark's Arrow batches count "
            f"({ARROW_LIMIT}); read the shard with stream_st instead"
        )
    if kind.tensor:
        bound = int(np.iinfo(kind.shape_type).max)
        if any(d > bound for d in sample):
            raise UsageError(
                f"{where}: a dimension does not fit the tensor struct's shape "
                f"({kind.spark.simpleString()})"
            )
        nbytes = dtype.nbytes(math.prod(sample))
        if nbytes is None:
            raise UsageError(
                f"{where}: a row of {dtype.code} values is no whole number of bytes, which a "
                "tensor struct's data cannot hold; read the shard with stream_st instead"
            )
        entries = [nbytes]  # the binary value's bytes
        offsets = 2 + len(sample)  # the data's, the shape's and its numbers
    elif dtype.packed:
        raise UsageError(
            f"{where}: {dtype.code} values cannot be read as {kind.spark.simpleString()} (read "
            "it as the tensor struct, or with option raw=true)"
        )
    else:
        nested = _nested(sample, kind, name)
        entries = [math.prod(nested[: level + 1]) for level in range(len(nested))]
        offsets = 1 + sum(entries[:-1])  # the arrays at every depth
        entries.append(math.prod(nested) * kind.numpy.itemsize)
    if max(entries) > ARROW_LIMIT:
        raise UsageError(
            f"{where}: a row of {max(entries)} bytes or values is more than Spark's Arrow "
            f"batches hold ({ARROW_LIMIT})"
        )
    return max(1, entries[-1] + 4 * offsets)


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


def _allocatable(name: str, dims: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """Refuse ``dims`` numpy cannot make an array of, even of no value (its dimensions other
    than 0, times the item size, must fit a signed 64-bit size)."""
    if math.prod(d for d in dims if d) * dtype.itemsize > np.iinfo(np.intp).max:
        raise UsageError(f"column {name!r}: no array can have the shape {list(dims)}")


def _struct_rows(column: pa.StructArray, name: str) -> Array:
    count = len(column)
    codes = column.field("dtype")
    shapes = column.field("shape")
    data = column.field("data")
    for part in (codes, shapes, shapes.flatten(), data):
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
    row_bytes = dtype.bits * math.prod(shape) // 8
    if (np.diff(offsets) != row_bytes).any():
        raise UsageError(
            f"column {name!r}: a row's data does not hold {row_bytes} bytes ({code} {list(shape)})"
        )
    if not count or not row_bytes:
        _allocatable(name, (count, *shape), dtype.numpy)
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
    smallest normal become a signed zero, anything from 2**16 up a signed infinity (between
    F16's largest finite value, 65504, and 2**16: cut down to 65504), a NaN the quiet NaN
    ``0x7e00`` (with the sign)."""
    bits = _float32_bits(values)
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
    return (_float32_bits(values) >> 16).astype(np.uint16)


def _float32_bits(values: Array) -> Array:
    """The float32 bits (uint32) of ``values`` taken as doubles, rounded to float32: one beyond
    its range becomes a signed infinity, as documented, without numpy's overflow warning."""
    with np.errstate(over="ignore"):
        return np.asarray(values).astype(np.float64).astype(np.float32).view(np.uint32)


CAST_HINT = "option dtype"
"""What a write's refused cast names as its cause."""


def cast(array: Array, code: str, name: str, rounding: str = "nearest") -> Array:
    """``array`` (column ``name``) as safetensors dtype ``code``: numpy's conversion (floats
    round to nearest even, and toward zero into integers), or for F16 and BF16 with
    ``rounding="truncate"``, the connector's truncation. Refuses a value the dtype cannot hold
    rather than wrap it (:func:`converted`); an integer too large for F16 is refused whichever
    the rounding."""
    target = dtype_from_code(code).numpy
    truncate = {"F16": truncate_to_f16, "BF16": truncate_to_bf16}.get(code)
    if rounding == "truncate" and truncate is not None:
        out = truncate(array).view(target)
        _finite(array, out, name, code, CAST_HINT)
        return out
    return converted(array, target, name, code, CAST_HINT)


def converted(array: Array, target: np.dtype[Any], name: str, what: str, hint: str) -> Array:
    """``array`` (column ``name``) as numpy dtype ``target`` (numpy's conversion: floats round
    to nearest even, and toward zero into integers), refusing (:class:`~stream_st.UsageError`
    naming the column, the value, ``what`` the target is called and ``hint``) a value it cannot
    hold rather than wrap it: for an integer dtype, one out of its range, a NaN or an infinity;
    for a float dtype, an integer beyond its range, which would become an infinity. A float
    beyond a narrower float's range becomes its infinity, as IEEE rounding has it."""
    if array.dtype == target:
        return array
    if np.can_cast(array.dtype, target):  # it holds every value (a wider type)
        return array.astype(target)
    if target.kind in "iu" and array.size:
        _in_range(array, target, name, what, hint)
    with np.errstate(over="ignore"):  # a float's infinity is the result; an integer's refused
        out = array.astype(target)
    _finite(array, out, name, what, hint)
    return out


def _in_range(array: Array, target: np.dtype[Any], name: str, what: str, hint: str) -> None:
    """Refuses a value of ``array`` that integer dtype ``target`` cannot hold: out of its range
    (a float taken toward zero), or a NaN or infinity."""
    bounds = np.iinfo(target)
    if array.dtype.kind == "f":
        whole = np.trunc(array)  # every integer bound is a power of two, so exact as a float
        kept = np.isfinite(whole) & (whole >= float(bounds.min)) & (whole < float(bounds.max + 1))
    elif array.dtype.kind in "iu":
        kept = (array >= bounds.min) & (array <= bounds.max)
    else:  # booleans: 0 or 1
        return
    _refuse_unkept(array, kept, name, f"{what} ({bounds.min} to {bounds.max}; {hint})")


def _finite(array: Array, out: Array, name: str, what: str, hint: str) -> None:
    """Refuses an integer of ``array`` that became an infinity in ``out``, of a float dtype too
    narrow for it (F16's largest is 65504)."""
    if array.dtype.kind in "iu" and out.dtype.kind not in "iub" and array.size:
        kept = np.isfinite(out)
        _refuse_unkept(array, kept, name, f"{what} (it would become an infinity; {hint})")


def _refuse_unkept(array: Array, kept: Array, name: str, where: str) -> None:
    """Refuses the first value of ``array`` not ``kept``, as one that does not fit ``where``."""
    if not kept.all():
        bad = array.reshape(-1)[int(np.argmin(kept.reshape(-1)))]
        raise UsageError(f"column {name!r}: the value {bad.item()!r} does not fit {where}")


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
        size = math.prod(shape)
        if array.size != len(array) * size:
            raise UsageError(
                f"column {name!r}: a row of {array[0].size if len(array) else 0} values cannot "
                f"take the shape {list(shape)} (option shapes)"
            )
        _allocatable(name, (len(array), *shape), array.dtype)
        array = array.reshape(len(array), *shape)
    code = code if code is not None else (kind.dtype if kind is not None else None)
    if code is not None:
        array = cast(array, code, name, rounding)
    dtype_for(array.dtype)  # refuses what safetensors cannot carry
    return array


def row_bytes(code: str, sample: tuple[int, ...]) -> int:
    """The bytes of a row of ``sample`` values of dtype ``code`` (rounded down: a row of
    sub-byte values that is no whole number of bytes is refused by :func:`arrow_row_bytes`)."""
    return dtype_from_code(code).bits * math.prod(sample) // 8


def _rows_of(array: Array, spec: Spec | None) -> tuple[DType, tuple[int, ...]]:
    """The dtype and row shape of the rows of ``array`` ``[rows, ...]``: ``spec``'s where given
    (rows of sub-byte values, which ``array`` carries as ``[rows, row bytes]``), else its own."""
    if spec is None:
        return dtype_for(array.dtype), tuple(array.shape[1:])
    return dtype_from_code(spec[0]), spec[1]


def _batch_checked(array: Array, kind: Column, name: str, spec: Spec | None) -> Spec:
    """Refuse ``array`` ``[rows, ...]`` (its rows' dtype and shape as :func:`_rows_of` tells
    them) as one Arrow batch of column ``kind`` where a row, or the batch, counts more than
    Spark's Arrow batches hold, or a row cannot be given as ``kind`` (:func:`arrow_row_bytes`);
    the rows' dtype code and shape."""
    rows = array.shape[0]
    dtype, sample = _rows_of(array, spec)
    arrow_row_bytes(name, rows, sample, dtype, kind)
    per_row = row_bytes(dtype.code, sample) if kind.tensor else math.prod(sample)
    if rows * per_row > ARROW_LIMIT:
        raise UsageError(
            f"column {name!r}: {rows} rows of {per_row} bytes or values are more than one "
            f"Arrow batch holds ({ARROW_LIMIT}); read them in smaller batches"
        )
    return dtype.code, sample


def tensor_column(
    array: Array, name: str, kind: Column = TENSOR_COLUMN, spec: Spec | None = None
) -> pa.StructArray:
    """``array`` ``[rows, *shape]`` as a tensor column ``name`` of ``rows`` rows (its memory is
    shared), of the Arrow type of ``kind`` (the tensor struct, ``shape`` as int32 unless
    ``kind`` says int64; its fields in ``kind``'s order). Rows of sub-byte values are given as
    ``[rows, row bytes]``, and ``spec`` their dtype code and shape."""
    code, sample = _batch_checked(array, kind, name, spec)
    count = array.shape[0]
    offsets = np.arange(count + 1, dtype=np.int32) * np.int32(row_bytes(code, sample))
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    struct = kind.arrow
    fields = {
        "data": pa.Array.from_buffers(
            pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(raw)]
        ),
        "shape": pa.ListArray.from_arrays(
            pa.array(np.arange(count + 1, dtype=np.int32) * np.int32(len(sample))),
            pa.array(np.tile(np.asarray(sample, kind.shape_type), count)),
            type=struct.field("shape").type,
        ),
        "dtype": pa.repeat(pa.scalar(code, pa.string()), count),
    }
    return pa.StructArray.from_arrays([fields[f.name] for f in struct], fields=list(struct))


READ_HINT = "the type it is read as; read it as another, or with option raw=true"
"""What a read's refused cast names as its cause."""


def typed_column(array: Array, kind: Column, name: str, spec: Spec | None = None) -> pa.Array:
    """``array`` ``[rows, *shape]`` as an Arrow column of the Spark type ``kind`` describes
    (:attr:`Column.arrow`): numbers, or arrays nested ``kind.depth`` deep (a deeper tensor is
    flattened into a 1-deep array; a one-value tensor becomes a number), each value cast to
    its type, refusing one it cannot hold (:func:`converted`); or tensor structs
    (:func:`tensor_column`, which takes ``spec``)."""
    if kind.tensor:
        return tensor_column(array, name, kind, spec)
    _batch_checked(array, kind, name, spec)
    rows, sample = array.shape[0], _nested(tuple(array.shape[1:]), kind, name)
    what = kind.element.simpleString()
    values = converted(array.reshape(-1), kind.numpy, name, what, READ_HINT)
    types = [kind.arrow]  # the list type at each depth, then the numbers'
    while len(types) <= len(sample):
        types.append(types[-1].value_type)
    column: pa.Array = pa.array(values, types[-1])
    for level in reversed(range(len(sample))):
        lists = rows * math.prod(sample[:level])  # the arrays at this depth
        offsets = pa.array(np.arange(lists + 1, dtype=np.int32) * np.int32(sample[level]))
        column = pa.ListArray.from_arrays(offsets, column, type=types[level])
    return column

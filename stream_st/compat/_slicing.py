"""What ``safe_open(...).get_slice(name)[key]`` takes, checked as the reference checks it.

The reference indexes torch tensors (``framework="pt"``) as torch does and numpy arrays by
stricter rules of its own, and so does this.

numpy (:func:`plan`): a key is an int (anything with ``__index__``: a numpy integer, a 0-d
integer tensor, ``True`` and ``False`` as 1 and 0), a slice, ``...``, or a tuple of those. A
slice reaching past the end of a dimension is refused, not clipped; lists other than ``[]`` (no
rows) are refused. Beyond the reference: negative slice bounds count from the end and negative
steps go backwards (as in Python; a bound outside the dimension is refused either way), a slice
whose start passes its stop selects nothing, and a dimension of size 0 can be sliced whole
(``[:]``, ``[0:0]``). An index outside the tensor raises
:class:`~stream_st.compat.SliceError` (a ``SafetensorError`` and an ``IndexError``) with the
reference's message; a slice bound before the first row or past 64 bits, or a step past 64
bits (signed), an ``OverflowError`` too (:class:`~stream_st.compat.SliceOverflowError`), as
the reference's. Checks come in its order: each index's bounds, then its step (past 64 bits,
then 0), before the next index's, and all of them before the dimensions are counted (a bound
of an index past the last dimension, or of any on a 0-d tensor, is one of a dimension of size
0) or a position is checked against the end of its dimension.

torch (:func:`torch_rows`, :func:`pick`): the key is whatever torch takes, and torch itself
applies it to the rows read, so it means what it means to a tensor: ``True`` and ``False`` add a
dimension (of 1 and 0), a bool list, array or tensor is a mask, a list or integer tensor picks
positions, ``None`` adds a dimension, slices are clipped. Torch's refusals come out as
:class:`~stream_st.SafetensorsError` s of the same built-in type.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from types import EllipsisType
from typing import Any, SupportsIndex, cast

from ..core.arrays import load_torch
from ..core.header import TensorInfo
from ..errors import UsageError
from ._errors import SliceError, SliceOverflowError, SliceTypeError, SliceValueError

__all__ = [
    "LAST_WHOLE",
    "BytePlan",
    "Plan",
    "as_bytes",
    "byte_plan",
    "leading",
    "packed_tensor",
    "pick",
    "plan",
    "takes_whole",
    "torch_rows",
]

Index = int | slice
Rows = tuple[int, int] | None
"""Rows of the first dimension to read, ``(start, stop)``; ``None`` for the whole tensor."""


@dataclass(frozen=True)
class Plan:
    """How to read a slice by the numpy rules: ``rows`` of the first dimension (``None``: the
    whole tensor, for a 0-d one or a key that does not narrow it) and ``index``, to apply to
    the array of those rows."""

    rows: Rows
    index: tuple[Index, ...]


def _items(key: object) -> list[object]:
    """The key's indexes, one per dimension it names."""
    if isinstance(key, tuple):
        return list(key)
    if isinstance(key, list):
        if not key:
            return [slice(0, 0)]  # the reference's reading of [], as numpy's: no rows
        raise SliceTypeError("Non empty lists are not implemented")
    return [key]


def _parse(item: object, position: int) -> Index | EllipsisType:
    """One index as an int, a slice with int (or None) bounds, or ``...``."""
    if item is Ellipsis:
        return Ellipsis
    if isinstance(item, slice):
        bounds: list[int | None] = []
        for bound in (item.start, item.stop, item.step):
            value = None if bound is None else _integer(bound)
            if bound is not None and value is None:
                raise SliceTypeError(
                    f"slice bounds must be integers or None, got {type(bound).__name__}"
                )
            bounds.append(value)
        return slice(*bounds)
    value = _integer(item)
    if value is not None:
        return value
    raise SliceTypeError(
        f"Unsupported slice index at position {position}: expected slice, int, or ellipsis"
    )


def _integer(value: object) -> int | None:
    """``value`` as an int if it is one (has ``__index__``: a numpy integer, a 0-d integer
    tensor), else None."""
    try:
        return operator.index(cast(SupportsIndex, value))
    except TypeError:
        return None


def _show(index: Index | EllipsisType) -> str:
    """One index as the reference's messages write it (``2``, ``2:``, ``:20``, ``:``)."""
    if isinstance(index, slice):
        start = "" if index.start is None else str(index.start)
        stop = "" if index.stop is None else str(index.stop)
        step = "" if index.step in (None, 1) else f":{index.step}"
        return f"{start}:{stop}{step}"
    return "..." if index is Ellipsis else str(index)


def plan(key: object, shape: Sequence[int]) -> Plan:
    """The rows to read and the index to apply for ``key`` over a tensor of ``shape``, by the
    reference's numpy rules; :class:`SliceError` (:class:`SliceOverflowError` for a slice bound
    before the first row or past 64 bits) or :class:`SliceTypeError` (all
    :class:`~stream_st.SafetensorsError` s) for a key the reference refuses."""
    parsed = [_parse(item, at) for at, item in enumerate(_items(key))]
    dims = list(shape)
    ellipses = sum(1 for index in parsed if index is Ellipsis)
    if ellipses > 1:
        raise SliceError("an index can only have a single ellipsis ('...')")
    named = len(parsed) - ellipses

    def failed(reason: str) -> SliceError:
        shown = ", ".join(_show(index) for index in parsed)
        return SliceError(f"Error during slicing [{shown}] with shape {dims}: {reason}")

    expanded: list[Index] = []
    for index in parsed:
        if index is Ellipsis:
            expanded.extend(slice(None) for _ in range(len(dims) - named))
        else:
            expanded.append(index)
    sizes = [*dims, *[0] * (len(expanded) - len(dims))]  # none past the last dimension
    bounded = [
        _bounded(index, dim, size, failed)
        for dim, (index, size) in enumerate(zip(expanded, sizes, strict=False))
    ]
    if named > len(dims):
        raise failed("more slicing indexes than dimensions in tensor")
    final = [
        _within(index, dim, size, failed)
        for dim, (index, size) in enumerate(zip(bounded, dims, strict=False))
    ]
    if all(takes_whole(index, size) for index, size in zip(final, dims, strict=False)):
        # the whole tensor: read (and checked) as get_tensor reads it
        return Plan(None, ())
    first = final[0]
    if isinstance(first, int):
        return Plan((first, first + 1), (0, *final[1:]))
    picked = range(*first.indices(dims[0]))
    if not picked:
        return Plan((0, 0), (slice(0, 0), *final[1:]))
    low, high = min(picked[0], picked[-1]), max(picked[0], picked[-1])
    start, stop = picked[0] - low, picked[-1] - low
    end: int | None = stop + 1 if picked.step > 0 else (stop - 1 if stop else None)
    return Plan((low, high + 1), (slice(start, end, picked.step), *final[1:]))


def takes_whole(index: Index, size: int) -> bool:
    """Whether ``index`` takes a dimension of ``size`` whole, in order."""
    return isinstance(index, slice) and index.indices(size) == (0, size, 1)


def _within(index: Index, dim: int, size: int, failed: Callable[[str], SliceError]) -> Index:
    """``index`` (:func:`_bounded`) over a dimension ``dim`` of ``size``; refused (the error
    made by ``failed``) where it reaches past the end of the dimension."""
    if isinstance(index, int):
        return _position(index, dim, size, failed)
    start = 0 if index.start is None else index.start
    stop = size if index.stop is None else index.stop
    if (start >= size and size > 0) or start > size:
        raise failed(f"index {start} out of bounds for tensor dimension #{dim} of size {size}")
    if stop > size:
        raise failed(f"index {stop - 1} out of bounds for tensor dimension #{dim} of size {size}")
    if index.step is not None and index.step < 0:  # from start down to stop (None: to the end)
        return index
    return slice(start, max(start, stop), index.step)


def _position(index: int, dim: int, size: int, failed: Callable[[str], SliceError] | None) -> int:
    """Position ``index`` (negative: from the end) of a dimension ``dim`` of ``size``, refused
    by the numpy rules where ``failed`` (which makes their error) is given, else by torch's."""
    resolved = index + size if index < 0 else index
    if failed is None and not 0 <= resolved < size:
        raise SliceError(f"index {index} is out of bounds for dimension {dim} with size {size}")
    if resolved < 0:
        raise SliceError(f"Invalid index {index} for dimension {dim} of size {size}")
    if failed is not None and resolved >= size:
        raise failed(f"index {resolved} out of bounds for tensor dimension #{dim} of size {size}")
    return resolved


_UNSIGNED = 2**64
"""The first bound past the reference's: it takes a slice bound as an unsigned 64-bit int."""

_SIGNED = 2**63
"""The first step past the reference's either way: it takes a slice step as a signed 64-bit
int."""


def _bounded(index: Index, dim: int, size: int, failed: Callable[[str], SliceError]) -> Index:
    """``index`` over a dimension ``dim`` of ``size`` with its negative position, or its slice
    bounds (None kept), as positions from the start of the dimension, checked as the reference
    checks each index before the next (a position past the end is checked later, by
    :func:`_within`): :class:`SliceOverflowError` (an ``OverflowError``, as the reference's for
    any negative bound and any past 64 bits) for a slice bound before the first row or past 64
    bits, then for a step past 64 bits (signed), then :class:`SliceError` for a step of 0 or a
    position before the first row."""
    if isinstance(index, int):
        return _position(index, dim, size, failed) if index < 0 else index
    start, stop = _resolved(index.start, dim, size), _resolved(index.stop, dim, size)
    if index.step is not None and not -_SIGNED <= index.step < _SIGNED:
        raise SliceOverflowError(
            f"Invalid step {index.step} for dimension {dim} of size {size}: "
            "a slice step must fit in a signed 64-bit integer"
        )
    if index.step == 0:
        raise SliceError("Slice step must be a positive integer, got 0")
    return slice(start, stop, index.step)


def _resolved(bound: int | None, dim: int, size: int) -> int | None:
    """One slice bound of :func:`_bounded` (negative: from the end of the dimension)."""
    if bound is None:
        return None
    position = bound + size if bound < 0 else bound
    if not 0 <= position < _UNSIGNED:
        raise SliceOverflowError(f"Invalid index {bound} for dimension {dim} of size {size}")
    return position


# ------------------------------------------------------------------------------------ torch


def _plain_int(item: object) -> bool:
    """Whether torch takes ``item`` as one position (a Python or numpy integer), which drops
    its dimension: not a bool, which adds one."""
    return isinstance(item, numbers.Integral) and not isinstance(item, bool)


def torch_rows(key: object, shape: Sequence[int]) -> tuple[Rows, object]:
    """The rows of the first dimension to read for torch's ``key`` over a tensor of ``shape``
    and the key to apply to them (:func:`pick`). Only a key that starts with an integer or a
    slice narrows the rows; any other (a mask, ``None``, a bool, a list...) is applied to the
    whole tensor, as it is. An integer outside the first dimension, or a first slice whose step
    is not positive, is refused before anything is read, as torch refuses the key
    (:func:`_torch_refusal`)."""
    items = key if isinstance(key, tuple) else (key,)
    if not shape or not items:
        return None, key
    first, size = items[0], shape[0]
    if _plain_int(first):
        index = operator.index(cast(SupportsIndex, first))
        if not -size <= index < size:
            _torch_refusal(key, shape)
        row = _position(index, 0, size, None)
        return (row, row + 1), (0, *items[1:])
    if not isinstance(first, slice):
        return None, key
    step = 1 if first.step is None else _integer(first.step)
    if step is not None and step <= 0:  # torch's refusals, before reading the whole tensor
        if all(bound is None or _integer(bound) is not None for bound in (first.start, first.stop)):
            # integer bounds change nothing torch says, but an integer tensor as one leaves
            # torch failing (SystemError) at a later zero step with a tensor bound
            items = (slice(None, None, step), *items[1:])
        _torch_refusal(items, shape)
        raise SliceValueError(
            "slice step cannot be zero" if step == 0 else "step must be greater than zero"
        )
    try:
        picked = range(*first.indices(size))
    except TypeError:  # bounds torch may take (or refuse): its own reading of the whole tensor
        return None, key
    rows = (picked.start, picked[-1] + 1) if picked else (0, 0)
    return (None if rows == (0, size) else rows), (slice(None, None, step), *items[1:])


def _torch_refusal(key: object, shape: Sequence[int]) -> None:
    """Raise torch's refusal of ``key`` over a tensor of ``shape``, with its message and type and
    in its order of checks (too many indices before a bad step; an integer past 64 bits a
    ``ValueError``), found on a meta tensor: nothing read, nothing allocated. Returns where
    torch can make no tensor of ``shape``, or takes the key."""
    try:
        probe = load_torch().empty(tuple(shape), device="meta")
    except (RuntimeError, TypeError, ValueError):  # a dimension past 64 bits
        return
    pick(probe, key)


LAST_WHOLE = "its last dimension can only be taken whole"


def packed_tensor(name: str, code: str) -> str:
    """How a refusal names a tensor of a packed dtype ``code``."""
    return f"tensor {name!r} is {code}, packed several values a byte"


# ------------------------------------------------------------- packed tensors as their bytes

FIRST_ONLY = "delivered as its bytes, it can only be cut along its first dimension"
BYTE_BOUNDARY = (
    "its rows are not whole bytes: only a run of rows in order that starts and ends on a byte "
    "boundary can be taken"
)


@dataclass(frozen=True)
class BytePlan:
    """How to read a slice of a tensor delivered as its packed bytes (:func:`byte_plan`): the
    bytes ``span`` (``(start, stop)``; None for all of them), viewed as ``lines`` (rows, bytes a
    row), of which ``index`` takes the rows asked."""

    span: Rows
    lines: tuple[int, int]
    index: Index


def as_bytes(info: TensorInfo) -> TensorInfo | None:
    """The ``U8`` tensor of ``info``'s bytes where ``info`` has several dimensions and is
    delivered as its packed bytes in one (F6; F4 whose last dimension is odd), so that rows read
    of it are bytes; None for any other tensor."""
    if not (info.dtype_info.packed and len(info.shape) > 1 and len(info.array_shape) == 1):
        return None
    return TensorInfo(info.name, "U8", (info.nbytes,), info.start, info.end)


def byte_plan(planned: Plan, info: TensorInfo) -> BytePlan:
    """The bytes to read for ``planned`` (:func:`plan` of a key over ``info``'s shape) of a
    tensor delivered as its packed bytes (:func:`as_bytes`), and the rows of them to take: the
    bytes of whole rows of its first dimension. :class:`SliceError`, naming the tensor, for a
    key that cuts another dimension, or takes rows that are not whole bytes (F4 rows of an odd
    number of values, F6 rows of a number not a multiple of 4) but as one run in order that
    starts and ends on a byte boundary (as the reference refuses a slice of a packed tensor
    that does not end on one)."""
    if planned.rows is None:
        return BytePlan(None, (1, info.nbytes), slice(None))
    shape, dtype = info.shape, info.dtype_info
    named = packed_tensor(info.name, info.dtype)
    first, rest = planned.index[0], planned.index[1:]
    if not all(takes_whole(index, size) for index, size in zip(rest, shape[1:], strict=False)):
        raise SliceError(f"{named}: {FIRST_ONLY}")
    low, high = planned.rows
    values = prod(shape[1:])  # a row's
    size = dtype.nbytes(values)
    if size is not None:
        return BytePlan((low * size, high * size), (high - low, size), first)
    start, stop = dtype.nbytes(low * values), dtype.nbytes(high * values)
    if start is None or stop is None or range(high - low)[first] != range(high - low):
        raise SliceError(f"{named}: {BYTE_BOUNDARY}")
    return BytePlan((start, stop), (1, stop - start), slice(None))


_OURS: tuple[tuple[type[Exception], Callable[[str], Exception]], ...] = (
    (IndexError, SliceError),
    (TypeError, SliceTypeError),
    (ValueError, SliceValueError),
    (RuntimeError, UsageError),
    (SystemError, UsageError),
    (AttributeError, UsageError),
)
"""The error raised for each built-in type torch raises on indexing: ours, of the same type;
a :class:`UsageError` for torch failing inside (``SystemError``, ``AttributeError``: a key with
a tensor bound after torch refused a negative step with one)."""

_TORCH_ERRORS = tuple(kind for kind, _ in _OURS)


def pick(tensor: Any, key: object) -> Any:
    """``tensor[key]`` as torch indexes it; torch's refusal of the key as a
    :class:`~stream_st.SafetensorsError` of the same built-in type, with torch's message."""
    try:
        return tensor[key]
    except _TORCH_ERRORS as exc:
        ours = next(make for kind, make in _OURS if isinstance(exc, kind))
        raise ours(str(exc)) from exc


def leading(key: object, shape: Sequence[int], packed: str) -> object:
    """``key`` less its index of the last dimension of ``shape``, which it must take whole: a
    packed tensor's (two F4 values a byte), whose leading dimensions alone torch can index.
    Only integers, slices, lists of integers and ``...`` (one dimension each) are taken:
    :class:`SliceError` (its message starting with ``packed``, which names the tensor) for any
    other index, or one cutting the last dimension."""
    items = list(key) if isinstance(key, tuple) else [key]
    last = len(shape) - 1

    def refused(why: str) -> SliceError:
        return SliceError(f"{packed}: {why}")

    for item in items:
        if not (
            item is Ellipsis
            or isinstance(item, slice)
            or _plain_int(item)
            or (isinstance(item, list) and all(_plain_int(i) for i in item))
        ):
            raise refused(f"it takes integers, slices, lists of integers and ..., not {item!r}")
    if items.count(Ellipsis) > 1:
        raise SliceError("an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * max(0, len(shape) - len(items) + 1)
    if len(items) <= last:
        return tuple(items)
    if len(items) > len(shape):
        raise SliceError(f"too many indices for tensor of dimension {len(shape)}")
    end = items[last]
    if not isinstance(end, slice) or _indices(end, shape[last]) != (0, shape[last], 1):
        raise refused(LAST_WHOLE)
    return tuple(items[:last])


def _indices(index: slice, size: int) -> tuple[int, int, int] | None:
    """``index.indices(size)``; None for bounds that are not integers."""
    try:
        return index.indices(size)
    except (TypeError, ValueError):
        return None

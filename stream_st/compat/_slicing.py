"""What ``safe_open(...).get_slice(name)[key]`` takes, checked as the reference checks it.

A key is an int (anything with ``__index__``: a numpy integer, a 0-d integer tensor), a slice,
``...``, or a tuple of those. The reference indexes torch tensors (``framework="pt"``) as torch
does and numpy arrays by stricter rules of its own, and so does this (``strict``):

- ``strict`` (numpy): a slice reaching past the end of a dimension is refused, not clipped;
  lists other than ``[]`` (no rows) are refused. Beyond the reference: negative slice bounds
  count from the end (as in Python), a slice whose start passes its stop selects nothing, and
  a dimension of size 0 can be sliced whole (``[:]``, ``[0:0]``).
- torch: slices are clipped to the dimension, and a list of ints picks those positions.

Either way an index outside the tensor raises :class:`~stream_st.compat.SliceError` (a
``SafetensorError`` and an ``IndexError``) with the reference's message.

:func:`plan` turns a key into the rows of the first dimension to read and the numpy index to
apply to those rows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import SupportsIndex, cast

from ._errors import SliceError, SliceTypeError

__all__ = ["Plan", "plan"]

Index = int | slice | list[int]


@dataclass(frozen=True)
class Plan:
    """How to read a slice: ``rows`` of the first dimension (``None``: the whole tensor, for a
    0-d one or a key that does not narrow it) and ``index``, to apply to the array of those
    rows."""

    rows: tuple[int, int] | None
    index: tuple[Index, ...]


def _items(key: object, strict: bool) -> list[object]:
    """The key's indexes, one per dimension it names."""
    if isinstance(key, tuple):
        return list(key)
    if isinstance(key, list):
        if not key:
            return [slice(0, 0)]  # the reference's reading of [], as numpy's: no rows
        if strict:
            raise SliceTypeError("Non empty lists are not implemented")
    return [key]


def _parse(item: object, position: int, strict: bool) -> Index | EllipsisType:
    """One index as an int, a slice with int (or None) bounds, ``...``, or (not ``strict``) a
    list of ints."""
    if isinstance(item, list) and not strict:
        positions = [_integer(i) for i in item]
        if all(p is not None for p in positions):
            return [p for p in positions if p is not None]
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
    error = SliceTypeError if strict else SliceError  # torch's is an IndexError
    raise error(f"Unsupported slice index at position {position}: expected slice, int, or ellipsis")


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


def plan(key: object, shape: Sequence[int], *, strict: bool = True) -> Plan:
    """The rows to read and the index to apply for ``key`` over a tensor of ``shape``, by the
    ``strict`` rules (numpy's) or torch's; :class:`SliceError` or :class:`SliceTypeError`
    (both :class:`~stream_st.SafetensorsError`) for a key the reference refuses."""
    parsed = [_parse(item, at, strict) for at, item in enumerate(_items(key, strict))]
    dims = list(shape)
    ellipses = sum(1 for index in parsed if index is Ellipsis)
    if ellipses > 1:
        raise SliceError("an index can only have a single ellipsis ('...')")
    named = len(parsed) - ellipses

    def failed(reason: str) -> SliceError:
        shown = ", ".join(_show(index) for index in parsed)
        return SliceError(f"Error during slicing [{shown}] with shape {dims}: {reason}")

    if named > len(dims):
        if not strict:
            raise SliceError(f"too many indices for tensor of dimension {len(dims)}")
        raise failed("more slicing indexes than dimensions in tensor")
    expanded: list[Index] = []
    for index in parsed:
        if index is Ellipsis:
            expanded.extend(slice(None) for _ in range(len(dims) - named))
        else:
            expanded.append(index)
    final = [
        _within(index, dim, size, failed if strict else None)
        for dim, (index, size) in enumerate(zip(expanded, dims, strict=False))
    ]
    whole = all(
        isinstance(index, slice) and index.indices(size) == (0, size, 1)
        for index, size in zip(final, dims, strict=False)
    )
    if whole:  # the whole tensor: read (and checked) as get_tensor reads it
        return Plan(None, ())
    first = final[0]
    if isinstance(first, list):
        return Plan(None, tuple(final))
    if isinstance(first, int):
        return Plan((first, first + 1), (0, *final[1:]))
    picked = range(*first.indices(dims[0]))
    if not picked:
        return Plan((0, 0), (slice(0, 0), *final[1:]))
    low, high = min(picked[0], picked[-1]), max(picked[0], picked[-1])
    start, stop = picked[0] - low, picked[-1] - low
    end: int | None = stop + 1 if picked.step > 0 else (stop - 1 if stop else None)
    return Plan((low, high + 1), (slice(start, end, picked.step), *final[1:]))


def _within(index: Index, dim: int, size: int, failed: Callable[[str], SliceError] | None) -> Index:
    """``index`` over a dimension ``dim`` of ``size``, with negative positions resolved;
    refused where it reaches outside the dimension (by the strict rules where ``failed``, which
    makes their error, is given; else torch's)."""
    if isinstance(index, list):
        return [_position(i, dim, size, failed) for i in index]
    if isinstance(index, int):
        return _position(index, dim, size, failed)
    if index.step is not None and index.step == 0:
        raise SliceError("slice step cannot be zero")
    if failed is None or (index.step is not None and index.step < 0):
        return index  # Python's meaning, clipped as Python clips it
    start = _resolved(index.start, size, dim, 0)
    stop = _resolved(index.stop, size, dim, size)
    if (start >= size and size > 0) or start > size:
        raise failed(f"index {start} out of bounds for tensor dimension #{dim} of size {size}")
    if stop > size:
        raise failed(f"index {stop - 1} out of bounds for tensor dimension #{dim} of size {size}")
    return slice(start, max(start, stop), index.step)


def _position(index: int, dim: int, size: int, failed: Callable[[str], SliceError] | None) -> int:
    """Position ``index`` (negative: from the end) of a dimension ``dim`` of ``size``."""
    resolved = index + size if index < 0 else index
    if failed is None and not 0 <= resolved < size:
        raise SliceError(f"index {index} is out of bounds for dimension {dim} with size {size}")
    if resolved < 0:
        raise SliceError(f"Invalid index {index} for dimension {dim} of size {size}")
    if failed is not None and resolved >= size:
        raise failed(f"index {resolved} out of bounds for tensor dimension #{dim} of size {size}")
    return resolved


def _resolved(bound: int | None, size: int, dim: int, default: int) -> int:
    """A slice bound as a position from the start of the dimension."""
    if bound is None:
        return default
    if bound < 0:
        if bound + size < 0:
            raise SliceError(f"Invalid index {bound} for dimension {dim} of size {size}")
        return bound + size
    return bound

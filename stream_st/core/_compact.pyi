"""Stub of the compiled module ``stream_st/core/_compact.c``: a header piece written as the
reference writer writes it, read in C; a plain plan's header laid out in C."""

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

def piece(
    table: Callable[[list[str], list[str], list[tuple[int, ...]], list[int], list[int]], T],
    dtypes: dict[str, tuple[str, int]],
    max_ndim: int,
    plain_bits: int,
    text: str,
    first: bool,
    /,
) -> tuple[dict[str, str] | None, T, bool] | None:
    """The metadata (None if it has none), the ``table`` of the tensors (called with their
    names, dtype codes, shapes, starts and ends) and whether each starts where the one before
    ends, of ``text`` if it is a piece in the reference writer's layout whose every tensor
    plainly passes the header's checks (``dtypes``: each code's own string and bits per value);
    None for any other piece, which the Python parse then reads."""

def untracked(column: list[T], /) -> list[T]:
    """``column`` itself, no longer tracked by the cyclic garbage collector: for a big header's
    columns, which hold only strings, integers, None and tuples of integers (no cycle can pass
    through them), so that no collection walks their places."""

def laid(
    rows: list[Any],
    attrs: tuple[str, str, str] | None,
    head: str,
    dtype_of: Callable[[str, Any], Any],
    layout_of: Callable[[str, Any, tuple[int, ...]], tuple[int, str]],
    /,
) -> (
    tuple[bytes, list[str], list[str], list[tuple[int, ...]], list[int], list[int], dict[str, int]]
    | None
):
    """The header text (unframed), its five columns and each name's position of ``rows`` (each
    a (name, dtype, shape) tuple, or an object whose ``attrs`` are those) laid out back to back
    after ``head`` (the first members, joined), calling ``dtype_of(name, dtype)`` for each row
    whose dtype object is not the row before's and ``layout_of(name, DType, shape)`` for each
    distinct (code, shape), as the Python layout calls them (they raise what is wrong with a
    row); None for a plan that is not plain (a name JSON escapes, ``__metadata__``, a name
    twice, data past 2**64 - 1...), which the Python layout then lays out."""

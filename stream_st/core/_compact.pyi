"""Stub of the compiled module ``stream_st/core/_compact.c``: a header piece written as the
reference writer writes it, read in C."""

from collections.abc import Callable
from typing import TypeVar

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

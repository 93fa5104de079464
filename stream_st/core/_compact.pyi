"""Stub of the compiled module ``stream_st/core/_compact.c``: a header piece written as the
reference writer writes it, read in C."""

Columns = tuple[
    dict[str, str] | None, list[str], list[str], list[tuple[int, ...]], list[int], list[int], bool
]
"""The metadata (None if the piece has none), the names, dtype codes, shapes, starts and ends of
the piece's tensors, and whether each starts where the one before ends."""

def piece(
    text: str, first: bool, dtypes: dict[str, tuple[str, int]], max_ndim: int, plain_bits: int, /
) -> Columns | None:
    """The columns of ``text`` if it is a piece in the reference writer's layout whose every
    tensor plainly passes the header's checks (``dtypes``: each code's own string and bits per
    value); None for any other piece, which the Python parse then reads."""

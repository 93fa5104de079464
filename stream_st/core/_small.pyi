"""Stub of the compiled module ``stream_st/core/_small.c``: a small file of numpy arrays
written whole."""

from typing import Any, Literal

def save(
    tensors: dict[Any, Any],
    path: object,
    formats: dict[str, tuple[str, int]],
    ndarray: type,
    metadata: str | None,
    limit: int,
    block: int,
    max_header: int,
    /,
) -> Literal[True] | None:
    """True once ``tensors`` (a dict of names to plain numpy arrays, at most ``limit`` bytes of
    data, each of a buffer format in ``formats``: its dtype code and rank) is written to the
    local file ``path`` as the Python write writes it (``metadata``: the header's
    ``"__metadata__"`` member, or None; writes cut at multiples of ``block`` bytes; the header
    at most ``max_header`` bytes) and in place; None, nothing written, for anything else."""

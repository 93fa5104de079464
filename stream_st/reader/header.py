"""Receiving a stream's header and parsing it, off the event loop when it is big."""

from __future__ import annotations

import functools
import threading

import anyio.to_thread
import numpy as np

from ..core.header import (
    LENGTH_PREFIX_SIZE,
    Header,
    UnknownDtypes,
    parse_header,
    parse_header_length,
)
from ..errors import TrailingDataError, TruncatedStreamError
from ..transports.options import Clock
from ..transports.registry import Source, SourceLike, open_source
from .turns import give_turn

HEADER_FIRST_READ = 64 << 10
"""On a source of unknown length, the header buffer starts at this size and doubles as bytes
arrive, so a peer that declares a huge header and sends little costs little."""

PARSE_IN_THREAD_ABOVE = 256 << 10
"""A header longer than this is parsed in a worker thread; a shorter one (about 3,000 tensors,
5 ms of work at most on a quiet machine) on the event loop, where the hop to a thread would
cost more than it saves (a first call of 1,000 tensors: 2.2 ms on the loop, 4.3 ms through a
thread; ``benchmarks/bench_header.py --only-sizes``)."""


def _buffer(size: int) -> memoryview:
    """``size`` bytes of fresh memory, not written to: a ``bytearray`` would fill them with
    zeros first, on the event loop (70-170 ms for the 77 MB of a 10**6-tensor header)."""
    return np.empty(size, np.uint8).data


async def _receive_header(source: Source, n: int) -> tuple[memoryview, int]:
    """A buffer of the ``n`` header bytes and how many arrived: fewer if the source ended.

    One read into ``n`` bytes when the source's size is known (and checked to hold them);
    otherwise into a buffer that grows geometrically, bounded by ``n``, only as bytes arrive.
    """
    size = n if source.size is not None else min(n, HEADER_FIRST_READ)
    raw = _buffer(size)
    got = await source.fill(raw)
    while got == len(raw) < n:
        grown = _buffer(min(2 * len(raw), n))
        grown[:got] = raw
        raw = grown
        got += await source.fill(raw[got:])
    return raw, got


async def _parse_off_loop(raw: memoryview, source: Source, unknown_dtypes: UnknownDtypes) -> Header:
    """Parse a big header in a worker thread, within the read's deadline. A cancelled or late
    caller does not wait for the thread: it stops at its next look at the flag."""
    stopped = threading.Event()
    try:
        with source.clock.within_deadline(source.name, LENGTH_PREFIX_SIZE + len(raw)):
            return await anyio.to_thread.run_sync(
                functools.partial(
                    parse_header, raw, stop=stopped.is_set, unknown_dtypes=unknown_dtypes
                ),
                abandon_on_cancel=True,
            )
    finally:
        stopped.set()


async def _read_header(
    source: Source, max_header_size: int, unknown_dtypes: UnknownDtypes = "refuse"
) -> tuple[Header, tuple[bytes, memoryview]]:
    """The validated header of ``source`` (its length at most ``max_header_size``), and the
    length prefix and header bytes as read (the start of the whole object's digest).
    ``unknown_dtypes`` as in :func:`~stream_st.core.header.parse_header`."""
    prefix = bytearray(LENGTH_PREFIX_SIZE)
    got = await source.fill(memoryview(prefix))
    if got < LENGTH_PREFIX_SIZE:
        parse_header_length(bytes(prefix[:got]))  # raises: fewer than 8 bytes
    n = parse_header_length(prefix, max_header_size=max_header_size)
    if source.size is not None and LENGTH_PREFIX_SIZE + n > source.size:
        raise TruncatedStreamError(
            "the header",
            name=None,
            offset=source.size,
            expected=LENGTH_PREFIX_SIZE + n,
            source=source.name,
        )
    raw, got = await _receive_header(source, n)
    if got < n:
        raise TruncatedStreamError(
            "the header",
            name=None,
            offset=LENGTH_PREFIX_SIZE + got,
            expected=LENGTH_PREFIX_SIZE + n,
            source=source.name,
        )
    header = (
        await _parse_off_loop(raw, source, unknown_dtypes)
        if n > PARSE_IN_THREAD_ABOVE
        else parse_header(raw, unknown_dtypes=unknown_dtypes)
    )
    if source.size is not None:
        _check_size(header, source.size, source.name)
    return header, (bytes(prefix), raw)


async def header_only(
    source_like: SourceLike,
    clock: Clock,
    max_header_size: int,
    unknown_dtypes: UnknownDtypes = "refuse",
) -> tuple[Header, str]:
    """The validated header of ``source_like`` (a path, URL, bytes, stream...) read under
    ``clock`` as :meth:`~stream_st.TensorStream.open` reads it, and the source's name; the
    source is closed before it returns. What a header-only read needs, without a stream's
    machinery (its statistics, delivery, recycled memory), which a small local file would
    spend more time building than reading."""
    clock.start()
    await give_turn()
    source = await open_source(source_like, clock)
    try:
        source.clock.start()  # a lent connection brings the clock of its message
        await source.start()
        header, _ = await _read_header(source, max_header_size, unknown_dtypes)
        return header, source.name
    finally:
        await source.aclose()


def _check_size(header: Header, size: int, name: str) -> None:
    """:class:`TrailingDataError` or :class:`TruncatedStreamError` unless a source of ``size``
    bytes holds exactly what ``header`` describes."""
    if size > header.file_size:
        raise TrailingDataError(
            f"{name}: {size - header.file_size} bytes follow the last tensor "
            f"(the header describes {header.file_size} bytes, the source has {size})"
        )
    if size < header.file_size:
        first_short = next(t for t in header.tensors if header.data_start + t.end > size)
        raise TruncatedStreamError(
            f"tensor {first_short.name!r}",
            name=first_short.name,
            offset=size,
            expected=header.data_start + first_short.end,
            source=name,
        )

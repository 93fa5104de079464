"""Receiving a stream's header and parsing it, a step at a time when it is big."""

from __future__ import annotations

import os
import stat

import anyio
import numpy as np

from ..core.header import (
    AT_ONCE_BYTES,
    LENGTH_PREFIX_SIZE,
    ONE_PIECE_BYTES,
    Header,
    UnknownDtypes,
    parse_header,
    parse_header_length,
    parse_steps,
)
from ..errors import (
    HeaderError,
    TrailingDataError,
    TruncatedStreamError,
    integer_at_least,
    rebuilt,
    redact,
)
from ..transports.file.source import _RWF_NOWAIT, _pread_cached, open_path
from ..transports.options import NO_LIMITS, Clock
from ..transports.registry import Source, SourceLike, open_source, scheme_of
from .turns import give_turn, run_in_turns

HEADER_FIRST_READ = 64 << 10
"""On a source of unknown length, the header buffer starts at this size and doubles as bytes
arrive, so a peer that declares a huge header and sends little costs little."""


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


async def _parse(raw: memoryview, source: Source, unknown_dtypes: UnknownDtypes) -> Header:
    """Parse a header on the event loop a step at a time (:func:`parse_steps`), giving the loop
    its turns between steps (:func:`give_turn`), within the read's deadline: a big header holds
    the loop for one step at most, a few milliseconds. A header of one piece is one call."""
    if len(raw) <= ONE_PIECE_BYTES:
        return parse_header(raw, unknown_dtypes=unknown_dtypes)
    steps = parse_steps(raw, unknown_dtypes=unknown_dtypes)
    with source.clock.within_deadline(source.name, LENGTH_PREFIX_SIZE + len(raw)):
        return await run_in_turns(steps)


def _header_length(
    prefix: memoryview, got: int, size: int | None, max_header_size: int, name: str
) -> int:
    """The header length the ``got`` bytes of ``prefix`` declare, checked against
    ``max_header_size`` and against ``size`` (the source's, if known)."""
    if got < LENGTH_PREFIX_SIZE:
        if size is not None and size > got:  # the source said it had more: cut off
            raise TruncatedStreamError(
                "the header length",
                name=None,
                offset=got,
                expected=min(size, LENGTH_PREFIX_SIZE),
                source=name,
            )
        parse_header_length(prefix[:got].tobytes())  # raises: fewer than 8 bytes
    n = parse_header_length(prefix, max_header_size=max_header_size)
    if size is not None and LENGTH_PREFIX_SIZE + n > size:
        raise TruncatedStreamError(
            "the header", name=None, offset=size, expected=LENGTH_PREFIX_SIZE + n, source=name
        )
    return n


def _named(exc: HeaderError, name: str) -> HeaderError:
    """``exc`` naming the source it was read from (``name``), as every other error of a read
    does: of many files or URLs, the message says which one is not a safetensors file. The
    class, attributes and traceback are kept; ``exc`` itself if its message starts with the
    source's name already (a name merely in it, a tensor's, says nothing of the source).
    (A plain function, raised ``from None``: a context manager's machinery was a tenth of a
    small header's first read.)"""
    if str(exc).startswith(f"{name}: "):
        return exc
    return rebuilt(exc, redact(f"{name}: {exc}")).with_traceback(exc.__traceback__)


async def _read_header(
    source: Source, max_header_size: int, unknown_dtypes: UnknownDtypes = "refuse"
) -> tuple[Header, tuple[bytes, memoryview]]:
    """The validated header of ``source`` (its length at most ``max_header_size``), and the
    length prefix and header bytes as read (the start of the whole object's digest).
    ``unknown_dtypes`` as in :func:`~stream_st.core.header.parse_header`."""
    prefix = memoryview(bytearray(LENGTH_PREFIX_SIZE))
    got = await source.fill(prefix)
    try:
        n = _header_length(prefix, got, source.size, max_header_size, source.name)
    except HeaderError as exc:
        raise _named(exc, source.name) from None
    raw, got = await _receive_header(source, n)
    if got < n:
        raise TruncatedStreamError(
            "the header",
            name=None,
            offset=LENGTH_PREFIX_SIZE + got,
            expected=LENGTH_PREFIX_SIZE + n,
            source=source.name,
        )
    try:
        header = await _parse(raw, source, unknown_dtypes)
    except HeaderError as exc:
        raise _named(exc, source.name) from None
    if source.size is not None:
        check_size(header, source.size, source.name)
    return header, (prefix.tobytes(), raw)


async def open_under(source_like: SourceLike, clock: Clock) -> Source:
    """The first step of every read: start ``clock``, open the source of ``source_like``, give
    the loop its turn (many small local files never wait: their turns come from here); a
    cancellation there closes the source (a :class:`Source` given too: the read took it)."""
    clock.start()
    source = await open_source(source_like, clock)  # a Source given: this read's from here
    try:
        await give_turn()
    except BaseException:  # cancelled: closed, as the read would have closed it
        with anyio.CancelScope(shield=True):
            await source.aclose()
        raise
    return source


async def start_and_read_header(
    source: Source,
    max_header_size: int,
    unknown_dtypes: UnknownDtypes = "refuse",
    *,
    read_all: bool = False,
) -> tuple[Header, tuple[bytes, memoryview]]:
    """The second step: start the source :func:`open_under` opened, then read its header
    (:func:`_read_header`). ``read_all`` promises that every tensor will be read next (see
    :meth:`~stream_st.TensorStream.open`)."""
    source.clock.start()  # a lent connection brings the clock of its message
    await source.start(read_all=read_all)
    await give_turn()
    read = await _read_header(source, max_header_size, unknown_dtypes)
    source.clock.check(source.name, source.position)  # a local file's reads never wait on it
    return read


def header_cap(value: object) -> int:
    """``max_header_size`` checked: an integer >= 1 (bytes); :class:`~stream_st.UsageError`
    otherwise (a string or None compared with the header's length was a TypeError, a bool or a
    float a cap that named itself "True bytes")."""
    return integer_at_least("max_header_size", value, 1, " (bytes)")


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
    spend more time building than reading; a local file with no time limit, its header in the
    page cache and parsed in one step, needs no source either (:func:`_cached_header`)."""
    max_header_size = header_cap(max_header_size)
    fspath = getattr(type(source_like), "__fspath__", None)  # os.PathLike's test, without the ABC's
    name = fspath(source_like) if fspath is not None else source_like
    unlimited = clock.limits is NO_LIMITS or not clock.limited  # most reads: known by identity
    if unlimited and isinstance(name, str) and scheme_of(name) is None:
        await give_turn()
        try:
            header = _cached_header(name, max_header_size, unknown_dtypes)
        except HeaderError as exc:
            raise _named(exc, name) from None
        if header is not None:
            return header, name
    source = await open_under(source_like, clock)
    try:
        header, _ = await start_and_read_header(source, max_header_size, unknown_dtypes)
        return header, source.name
    finally:
        await source.aclose()


CACHED_FIRST_READ = 64 << 10
"""Bytes :func:`_cached_header` reads first, hoping they hold the whole header."""

PARSE_AT_ONCE_UP_TO = AT_ONCE_BYTES
"""A cached local header up to this size (about 3,500 tensors, a few milliseconds of work on a
quiet machine) is read and parsed without a turn for the loop, in one piece: the source's
machinery around its steps would cost more than it saves."""


def _cached_header(name: str, max_header_size: int, unknown_dtypes: UnknownDtypes) -> Header | None:
    """The validated header of the regular file at ``name``, read and parsed at once on this
    thread, as :func:`_read_header` would give it; ``None`` (the caller reads it through a
    source) for anything else at ``name``, or a header not all in the page cache or longer than
    :data:`PARSE_AT_ONCE_UP_TO`: reads that would wait, or hold the loop too long.
    Where ``name`` cannot be read at all, the source the caller opens then says why."""
    if not _RWF_NOWAIT:
        return None  # no read that never waits on this system
    try:
        if not stat.S_ISREG(os.stat(name).st_mode):
            return None  # a FIFO, a device, a directory: their sources handle them
    except (OSError, ValueError):
        return None
    opened: list[int] = []  # the file, closed below also where an interrupt came as it opened
    try:
        fd = open_path(name, os.O_RDONLY, opened)
        size = os.fstat(fd).st_size
        first = memoryview(bytearray(min(size, CACHED_FIRST_READ)))  # zeroed in microseconds
        got = _pread_cached(fd, first, 0)
        if got < len(first):
            return None  # not in the page cache
        n = _header_length(first, got, size, max_header_size, name)
        if n > PARSE_AT_ONCE_UP_TO:
            return None
        raw = first[LENGTH_PREFIX_SIZE : LENGTH_PREFIX_SIZE + n]
        if len(raw) < n:  # the rest of the header after the bytes already read
            start = len(raw)
            raw = memoryview(bytearray(n))  # 256 KiB at most: zeroed faster than numpy starts
            raw[:start] = first[LENGTH_PREFIX_SIZE:]
            if _pread_cached(fd, raw[start:], LENGTH_PREFIX_SIZE + start) < n - start:
                return None
    finally:
        for fd in opened:
            os.close(fd)
    header = parse_header(raw, unknown_dtypes=unknown_dtypes)
    check_size(header, size, name)
    return header


def check_size(header: Header, size: int, name: str) -> None:
    """:class:`TrailingDataError` or :class:`TruncatedStreamError` unless a source of ``size``
    bytes holds exactly what ``header`` describes."""
    file_size = header.file_size
    if size > file_size:
        raise TrailingDataError(
            f"{name}: {size - file_size} bytes follow the last tensor "
            f"(the header describes {file_size} bytes, the source has {size})"
        )
    if size < file_size:
        first_short = next(t for t in header.tensors if header.data_start + t.end > size)
        raise TruncatedStreamError(
            f"tensor {first_short.name!r}",
            name=first_short.name,
            offset=size,
            expected=header.data_start + first_short.end,
            source=name,
        )

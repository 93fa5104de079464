"""The streaming reader: drives a source through the header core and yields numpy arrays."""

from __future__ import annotations

import bisect
import contextlib
import functools
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Self

import anyio.lowlevel
import anyio.to_thread
import numpy as np

from ._util import AsyncClosing, task_group
from .core.digests import HASH_INLINE, Digests, Hasher, ObjectDigest, hash_view, update_sliced
from .core.header import (
    DEFAULT_MAX_HEADER_SIZE,
    LENGTH_PREFIX_SIZE,
    Header,
    TensorInfo,
    parse_header,
    parse_header_length,
)
from .core.stats import LoadStats
from .errors import (
    AllocationError,
    TensorNotFoundError,
    TrailingDataError,
    TruncatedStreamError,
    UsageError,
)
from .memory.delivery import Delivery
from .memory.fresh import ALIGN, fresh_bytes
from .memory.recycle import Recycler
from .transports.file.readahead import ReadAhead
from .transports.file.source import FileSource
from .transports.options import Clock
from .transports.registry import Source, SourceLike, open_source

__all__ = ["READ_CHUNK", "Caps", "Include", "TensorStream", "read_hashing"]

Include = Collection[str] | Callable[[str], bool] | str | None
"""Which tensors to deliver: ``None`` for all, names, or a predicate on the name."""


# Caps on what a read may make the reader allocate: ``max_tensor_bytes`` and ``max_total_bytes``.
# A header may declare any size, and the reader commits memory as a tensor's bytes arrive. A
# reader given caps checks the tensors it is about to read against them as soon as their header
# is known, before any of them is allocated, and refuses with AllocationError naming the tensor
# (or the total), the size declared and the cap. Sizes are the tensors' declared bytes, wherever
# they would land (fresh memory, ``into=`` memory, a mapping); a tensor not selected by
# ``include=`` is not read, so it does not count.


def _cap(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{name} must be None or an integer >= 0 (bytes), got {value!r}")
    return value


@dataclass(frozen=True)
class Caps:
    """``tensor``: the most bytes one tensor read may declare; ``total``: the most all the
    tensors of one read may declare together (of every shard, for an index or manifest).
    None: no cap."""

    tensor: int | None = None
    total: int | None = None

    @classmethod
    def of(cls, max_tensor_bytes: object = None, max_total_bytes: object = None) -> Caps:
        """The caps the keywords give; :class:`~stream_st.UsageError` for a bad value."""
        return cls(
            _cap("max_tensor_bytes", max_tensor_bytes), _cap("max_total_bytes", max_total_bytes)
        )

    def check(self, tensors: Iterable[TensorInfo], source: str, before: int = 0) -> int:
        """The bytes ``tensors`` (of ``source``, to be read) declare, plus ``before`` (bytes of
        the same read already counted); :class:`~stream_st.AllocationError` if one tensor or
        the whole is over its cap. Nothing is allocated for them before this passes."""
        total = before
        for info in tensors:
            if self.tensor is not None and info.nbytes > self.tensor:
                raise AllocationError(
                    f"{source}: tensor {info.name!r} declares {info.nbytes} bytes, more than "
                    f"max_tensor_bytes={self.tensor} allows: refused before allocating it"
                )
            total += info.nbytes
        if self.total is not None and total > self.total:
            raise AllocationError(
                f"{source}: the tensors to read declare {total} bytes, more than "
                f"max_total_bytes={self.total} allows: refused before allocating them"
            )
        return total


NO_CAPS = Caps()
"""A read with no cap."""


# Turns for the event loop between pieces of a read that may not wait at all. A read of local
# files in the page cache can run for a long time without awaiting anything that suspends: the
# file opens, headers and small tensors are all read on the loop's thread. give_turn(), called
# where a piece of work begins (a stream opening, its header, each tensor), lets the loop run
# other tasks, and a cancellation arrive, once this thread's loop has gone TURN_EVERY without a
# turn given here, counted across every stream of the thread: many small files are paced as one
# big one.

TURN_EVERY = 0.005
"""Seconds of the reader's work between two turns it gives the loop at most (plus one piece of
work: one inline read of at most 4 MiB, or one header parsed on the loop): well under the 50 ms
the loop may be held, and a turn (``anyio.lowlevel.checkpoint``, a few microseconds) costs
under 0.1 % of that."""


class _Last(threading.local):
    at = 0.0  # time.perf_counter() of this thread's last turn given


_last = _Last()


async def give_turn() -> None:
    """Let the event loop run once, and a pending cancellation be raised, if this thread has
    given none for :data:`TURN_EVERY`; otherwise return at once (one clock read)."""
    now = time.perf_counter()
    if now - _last.at >= TURN_EVERY:
        await anyio.lowlevel.checkpoint()
        _last.at = time.perf_counter()


def _selector(include: Include, header: Header) -> Callable[[str], bool]:
    if include is None:
        return lambda name: True
    if callable(include):
        return include
    names = {include} if isinstance(include, str) else set(include)
    missing = sorted(n for n in names if n not in header)
    if missing:
        raise TensorNotFoundError(f"include= names tensors not in the header: {missing}")
    return names.__contains__


PROVE_ABOVE = 1 << 30
"""On a source of unknown length, a tensor larger than this is allocated only once its first
``PROOF_SIZE`` bytes have arrived, so a short stream claiming a huge tensor costs nothing."""

PROOF_SIZE = 4 << 20

READ_AHEAD_FROM = 8 << 20
"""A local file's tensors are read ahead by worker threads (:meth:`TensorStream._read_ahead`)
when those wanted hold at least this many bytes; smaller reads stay tensor by tensor, mostly
on the loop's thread from the page cache, where starting threads would cost more."""

READ_AHEAD_BYTES = 16 << 20
"""Fresh arrays read ahead of a caller that drops the arrays it is given hold at most this many
bytes, or two tensors of at most :data:`READ_AHEAD_MOST` together, or one tensor. Two, so that
while the caller works on one tensor the threads read the next and the one after is queued:
with one only, the reading waits for the caller at every tensor (measured: half the speed,
streaming or loading 32 MiB tensors). At most 16 MiB beyond that, so that the caller has
dropped earlier tensors, whose memory is used again (:mod:`stream_st._recycle`), before later
ones are allocated: memory in use stays near the tensors in flight."""

READ_AHEAD_MOST = 64 << 20
"""Fresh arrays read ahead hold at most this many bytes (or one tensor). A caller that keeps
every array (a load; judged once it holds :data:`READ_AHEAD_BYTES` and has dropped none) gets
this much read ahead: it keeps those arrays anyway, and more tensors queued keep the threads
busier (loading 490 MiB of 2-6 MiB tensors: 2.7-3.0 GB/s against 2.2-2.4 with 16 MiB)."""


def _room_ahead(queued: int, fresh: int, nbytes: int, keeping: bool) -> bool:
    """Whether a fresh array of ``nbytes`` may be read ahead, ``queued`` tensors (holding
    ``fresh`` bytes of fresh arrays) being read or waiting already; ``keeping``: the caller
    keeps every array (see :data:`READ_AHEAD_MOST`)."""
    total = fresh + nbytes
    if total <= (READ_AHEAD_MOST if keeping else READ_AHEAD_BYTES):
        return True
    return queued < 2 and total <= READ_AHEAD_MOST


Span = tuple[int, int]
"""The addresses ``[start, end)`` of an array's bytes."""


def _span(array: np.ndarray[Any, Any]) -> Span:
    """Where the bytes of ``array`` (contiguous) lie in memory."""
    start: int = array.__array_interface__["data"][0]
    return start, start + array.nbytes


def _overlaps(spans: list[Span], span: Span) -> bool:
    """Whether ``span`` shares a byte with one of ``spans`` (sorted, none sharing a byte)."""
    at = bisect.bisect_left(spans, span[1], key=lambda each: each[0])
    return at > 0 and spans[at - 1][1] > span[0]


def _allocate(
    info: TensorInfo, take: Callable[[int], np.ndarray[Any, Any]] = fresh_bytes
) -> tuple[np.ndarray[Any, Any], memoryview]:
    """A fresh array for ``info`` (its memory from ``take``) and a writable byte view of it."""
    array, view, _ = _allocate_framed(info, lambda nbytes: (take(nbytes), None))
    return array, view


def _allocate_framed(
    info: TensorInfo, take: Callable[[int], tuple[np.ndarray[Any, Any], memoryview | None]]
) -> tuple[np.ndarray[Any, Any], memoryview, memoryview | None]:
    """:func:`_allocate` with ``take`` giving a frame too (see
    :meth:`~stream_st._recycle.Recycler.take_framed`), returned third."""
    try:
        raw, frame = take(info.nbytes)
    except (MemoryError, ValueError, OSError) as exc:
        raise AllocationError(
            f"cannot allocate tensor {info.name!r} of {info.nbytes} bytes: {exc}"
        ) from None
    array = raw.view(info.array_dtype).reshape(info.array_shape)
    return array, raw.data, frame


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ascending ``(start, end)`` ranges with empty ones dropped and touching ones joined."""
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if end <= start:
            continue
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _cut_short(info: TensorInfo, source: Source, base: int) -> TruncatedStreamError:
    """The error for ``info``'s bytes ending at ``source.position``, before the tensor did."""
    return TruncatedStreamError(
        f"tensor {info.name!r}",
        name=info.name,
        offset=source.position,
        expected=base + info.end,
        source=source.name,
    )


async def _read_tensor(
    source: Source,
    info: TensorInfo,
    base: int,
    target: tuple[np.ndarray[Any, Any], memoryview] | None = None,
    digests: Digests | None = None,
    whole: Hasher | None = None,
    take: Callable[[int], np.ndarray[Any, Any]] = fresh_bytes,
) -> np.ndarray[Any, Any]:
    """Read one tensor straight into a fresh array, or into ``target`` (memory the caller owns:
    an array and its byte view); never return a partly filled one, nor one that does not match
    its digest in ``digests``. ``whole`` is also fed the tensor's bytes (the object's digest).
    ``take`` gives the fresh memory (a stream's :class:`~stream_st._recycle.Recycler`)."""
    start = base + info.start
    hasher = None if digests is None else digests.hasher()
    hashers = [h for h in (hasher, whole) if h is not None]
    read = (
        functools.partial(read_hashing, source, hashers=hashers) if hashers else source.read_into_at
    )
    if target is not None:
        array, view = target
        got = await read(start, view) if info.nbytes else 0
    elif source.size is None and info.nbytes > PROVE_ABOVE:
        proof = bytearray(PROOF_SIZE)
        got = await read(start, memoryview(proof))
        if got == PROOF_SIZE:
            array, view = _allocate(info, take)
            view[:PROOF_SIZE] = proof
            got += await read(source.position, view[PROOF_SIZE:])
    else:
        array, view = _allocate(info, take)
        got = await read(start, view) if info.nbytes else 0
    if got < info.nbytes:
        raise _cut_short(info, source, base)
    if digests is not None and hasher is not None:
        digests.check(info.name, hasher, source.name)
    return array


HEADER_FIRST_READ = 64 << 10
"""On a source of unknown length, the header buffer starts at this size and doubles as bytes
arrive, so a peer that declares a huge header and sends little costs little."""

PARSE_IN_THREAD_ABOVE = 64 << 10
"""A header longer than this is parsed in a worker thread; a shorter one (a few ms of work at
most) on the event loop, where the hop to a thread would cost more than it saves."""


async def _receive_header(source: Source, n: int) -> tuple[bytearray, int]:
    """A buffer of the ``n`` header bytes and how many arrived: fewer if the source ended.

    One read into ``n`` bytes when the source's size is known (and checked to hold them);
    otherwise into a buffer that grows geometrically, bounded by ``n``, only as bytes arrive.
    """
    size = n if source.size is not None else min(n, HEADER_FIRST_READ)
    raw = bytearray(size)
    got = await source.fill(memoryview(raw))
    while got == len(raw) < n:
        grown = bytearray(min(2 * len(raw), n))
        grown[:got] = raw
        raw = grown
        got += await source.fill(memoryview(raw)[got:])
    return raw, got


async def _parse_off_loop(raw: bytearray, source: Source) -> Header:
    """Parse a big header in a worker thread, within the read's deadline. A cancelled or late
    caller does not wait for the thread: it stops at its next look at the flag."""
    stopped = threading.Event()
    try:
        with source.clock.within_deadline(source.name, LENGTH_PREFIX_SIZE + len(raw)):
            return await anyio.to_thread.run_sync(
                functools.partial(parse_header, raw, stop=stopped.is_set), abandon_on_cancel=True
            )
    finally:
        stopped.set()


async def _read_header(
    source: Source, max_header_size: int
) -> tuple[Header, tuple[bytes, bytearray]]:
    """The validated header of ``source`` (its length at most ``max_header_size``), and the
    length prefix and header bytes as read (the start of the whole object's digest)."""
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
    header = await _parse_off_loop(raw, source) if n > PARSE_IN_THREAD_ABOVE else parse_header(raw)
    if source.size is not None:
        _check_size(header, source.size, source.name)
    return header, (bytes(prefix), raw)


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


async def _read_ahead(
    source: FileSource,
    wanted: list[TensorInfo],
    base: int,
    delivery: Delivery,
    recycler: Recycler,
    started: Callable[[ReadAhead], None],
) -> AsyncGenerator[tuple[str, Any]]:
    """The tensors of a local file read ahead of the caller by worker threads kept busy (see
    :mod:`stream_st.sources._ahead`): every tensor going into memory the caller gave (but
    memory given for several tensors, such as one staging buffer, takes the next only once
    the tensor before has been handed out and the caller has asked for the next, as without
    read-ahead), and fresh arrays while those not yet handed out leave room
    (:func:`_room_ahead`). ``delivery`` says where tensors land, ``recycler`` gives fresh
    memory; ``started`` is told the :class:`ReadAhead` (for a close from another task)."""
    queued: deque[tuple[TensorInfo, int, Span | None, np.ndarray[Any, Any]]] = deque()
    spans: list[Span] = []  # the caller's memory queued tensors go into, sorted
    upcoming = iter(wanted)
    following = next(upcoming, None)
    fresh = 0  # bytes of fresh arrays read or being read, not yet handed out
    handed = 0  # bytes of fresh arrays handed out
    # Not 'async with': a trio run that ends with this generator left by a 'break' closes
    # the async generators still open in any order, this context's own one maybe first;
    # leaving it as a normal exit then finds it finished, where an exception thrown in
    # would be a RuntimeError. Its exit stops and waits for the threads either way.
    reading = source.reading()
    ahead = await reading.__aenter__()
    try:
        started(ahead)
        while True:
            while following is not None:
                info = following
                target = delivery.target(info)
                span = frame = None
                if target is None:
                    keeping = handed >= READ_AHEAD_BYTES and not recycler.dropped
                    if queued and not _room_ahead(len(queued), fresh, info.nbytes, keeping):
                        break
                    phase = (base + info.start) % ALIGN  # as the bytes lie in the blocks
                    target_array, view, frame = _allocate_framed(
                        info, functools.partial(recycler.take_framed, phase=phase)
                    )
                    fresh += info.nbytes
                else:
                    target_array, view = target
                    span = _span(target_array)
                    if info.nbytes:
                        if _overlaps(spans, span):  # memory used again (a staging buffer)
                            break  # filled once the tensor queued there is handed out
                        bisect.insort(spans, span)
                job = ahead.add(base + info.start, view, frame) if info.nbytes else -1
                queued.append((info, job, span, target_array))
                following = next(upcoming, None)
            if not queued:
                break
            await give_turn()
            info, job, span, array = queued.popleft()
            source.clock.check(source.name, source.position)
            got = await ahead.wait(job) if job >= 0 else 0
            source.position = base + info.start + got
            if got < info.nbytes:
                raise _cut_short(info, source, base)
            if span is None:
                fresh -= info.nbytes
                handed += info.nbytes
            elif info.nbytes:
                spans.remove(span)
            if sys.byteorder == "big" and array.dtype.itemsize > 1:  # pragma: no cover
                array.byteswap(inplace=True)
            yield info.name, delivery.deliver(info, array, span is not None)
            del array
    finally:
        await reading.__aexit__(None, None, None)


class TensorStream(AsyncClosing):
    """One safetensors file read as a stream. Create it with :func:`open_stream`.

    Use it as ``async with open_stream(src) as stream`` to see ``stream.header`` before any data,
    then ``async for name, array in stream``; or iterate it directly, which opens and closes it.
    Arrays are fresh, writable, native-endian and handed over to the caller: the stream keeps no
    reference to them (with ``copy=False``, a local file's are read-only views of its mapping, see
    :func:`open_stream`). ``clock`` holds the time limits of the read (see :func:`open_stream`);
    it starts when the stream opens. ``delivery`` says where tensors land and what they are
    handed out as (see ``framework=`` and ``into=`` of :func:`open_stream`).
    ``max_tensor_bytes`` and ``max_total_bytes`` cap what the read may allocate (see
    :func:`open_stream`). ``verify`` checks the header's digests, if it has any, and the whole
    object's digest when its transport gives one and every tensor is read
    (:meth:`Source.object_digest`); after the read, ``object_check`` says how that went (None:
    the transport gave no digest).
    ``stats`` (a :class:`~stream_st.LoadStats`) counts the bytes, tensors and time of the read.
    """

    def __init__(
        self,
        source: SourceLike,
        *,
        include: Include = None,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        verify: bool = True,
        clock: Clock | None = None,
        delivery: Delivery | None = None,
        copy: bool = True,
        max_tensor_bytes: int | None = None,
        max_total_bytes: int | None = None,
    ) -> None:
        self._caps = Caps.of(max_tensor_bytes, max_total_bytes)
        self._source_like = source
        self._include = include
        self._delivery = delivery or Delivery()
        self._max_header_size = max_header_size
        self._verify = verify
        self._copy = copy
        self._clock = clock or Clock()
        self._source: Source | None = None
        self._header: Header | None = None
        self._iterated = False
        # The iteration, held weakly: a strong reference would make a cycle (its frame holds
        # the stream), so one left with 'break' outside 'async with' would be closed, its file
        # and read-ahead threads released, only when the cycle collector runs. Held strongly
        # too (``_held``) when the stream was open before it began ('async with'): leaving the
        # block closes it then, so what it holds (the array handed out last, tensors read
        # ahead) goes at once, not when the loop gets a turn to finalise it after a 'break'.
        self._generator: weakref.ref[AsyncGenerator[tuple[str, np.ndarray[Any, Any]]]] | None = None
        self._held: AsyncGenerator[tuple[str, np.ndarray[Any, Any]]] | None = None
        self._reading: ReadAhead | None = None  # the iteration's read-ahead, if it has one
        self._recycler = Recycler()  # fresh memory the caller has let go of, for later tensors
        self._closed = False
        self._head: tuple[bytes, bytearray] | None = None  # the prefix and header, as read
        self.object_check: str | None = None
        self.stats = LoadStats()

    @property
    def header(self) -> Header:
        """The validated header; available once the stream is open."""
        if self._header is None:
            raise UsageError("the header is read when the stream opens: use 'async with' first")
        return self._header

    @property
    def source(self) -> Source:
        if self._source is None:
            raise UsageError("the stream is not open")
        return self._source

    async def open(self, *, read_all: bool = False) -> Header:
        """Open the source, read and validate the header. Idempotent.

        ``read_all`` promises that every tensor will be read next, so a ranged transport may
        fetch everything with its first request.
        """
        if self._header is not None:
            return self._header
        if self._closed:
            raise UsageError("the stream is closed")
        self._clock.start()
        await give_turn()  # many small local files never wait: the loop's turns come from here
        self.stats.begin()
        self._source = await open_source(self._source_like, self._clock)
        try:
            self._source.clock.start()  # a lent connection brings the clock of its message
            await self._source.start(read_all=read_all)
            await give_turn()
            self._header, self._head = await _read_header(self._source, self._max_header_size)
            self.stats.received(self._header.data_start)
        except BaseException:
            await self.aclose()
            raise
        return self._header

    async def aclose(self) -> None:
        """Close the source. Bytes not yet read stay unread. An iteration left part way (a
        ``break``) is closed first, so nothing still reads from the source (a local file's
        read-ahead threads are stopped and waited for)."""
        self._closed = True
        await self._close_iteration()
        self._recycler = Recycler()  # no later tensor: let memory kept for one go
        source, self._source = self._source, None
        if source is not None:
            await source.aclose()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def _close_iteration(self) -> None:
        """Close an iteration left part way, if any (its ``finally`` blocks run now), and stop
        its read-ahead threads and wait for them in any case: also where the iteration is
        running in another task at this moment (which then meets the closed source), or was
        dropped after a ``break`` and waits for the loop to close it."""
        alive, self._generator = self._generator, None
        held, self._held = self._held, None
        generator = held if alive is None else alive()
        if generator is not None and not getattr(generator, "ag_running", False):
            await generator.aclose()
        reading, self._reading = self._reading, None
        if reading is not None:
            await reading.close()

    def __aiter__(self) -> AsyncIterator[tuple[str, np.ndarray[Any, Any]]]:
        if self._iterated:
            raise UsageError("a TensorStream can be iterated only once")
        self._iterated = True
        generator = self._iterate()
        self._generator = weakref.ref(generator)
        if self._opened():  # closed with the stream, which 'async with' does (see __init__)
            self._held = generator
        return generator

    def _opened(self) -> bool:
        """Whether the stream was opened (``async with``) before its iteration began."""
        return self._header is not None

    async def _iterate(self) -> AsyncGenerator[tuple[str, np.ndarray[Any, Any]]]:
        self.stats.asked(first=True)
        owns = self._header is None
        # Iterated without 'async with' and nothing to skip: every byte will be read.
        header = await self.open(read_all=owns and self._include is None)
        try:
            selected = _selector(self._include, header)
            self._delivery.check(header.names())
            async with contextlib.aclosing(self._tensors(header, selected)) as items:
                async for item in items:
                    self.stats.handed(header[item[0]].nbytes)
                    yield item
                    del item  # hold no array while the next one is read
                    self.stats.asked()
        finally:
            if owns:
                self._generator = self._held = None  # this one: ending, not closed again
                await self.aclose()

    async def _tensors(
        self, header: Header, selected: Callable[[str], bool]
    ) -> AsyncGenerator[tuple[str, Any]]:
        source = self.source
        delivery = self._delivery
        base = header.data_start
        wanted = [info for info in header.tensors if selected(info.name)]
        self._caps.check(wanted, source.name)  # before anything is allocated for them
        digests = Digests.from_header(header) if self._verify else None
        ranges = merge_ranges((base + t.start, base + t.end) for t in wanted)
        mapped = (
            None
            if self._copy or not isinstance(source, FileSource)
            else source.map(private=delivery.writable)
        )
        if mapped is None:
            await source.plan_reads(ranges)
        else:
            mapped.plan(ranges)
        whole = await self._object_hash(len(wanted) == len(header.tensors))
        hasher = None if whole is None else whole[1]
        if (
            mapped is None
            and digests is None
            and hasher is None
            and isinstance(source, FileSource)
            and sum(info.nbytes for info in wanted) >= READ_AHEAD_FROM
        ):
            ahead = _read_ahead(
                source, wanted, base, delivery, self._recycler, self._started_reading
            )
            async with contextlib.aclosing(ahead) as items:
                async for item in items:
                    yield item
                    del item
            return
        for info in wanted:
            source.clock.check(source.name, source.position)
            await give_turn()
            target = delivery.target(info)
            if mapped is None or target is not None:
                array = await _read_tensor(
                    source, info, base, target, digests, hasher, self._recycler.take
                )
            else:
                array = await mapped.view(info, base)
                if digests is not None:  # a local file: no whole-object digest to feed
                    await digests.check_view(info.name, array, source.name)
            if sys.byteorder == "big" and array.dtype.itemsize > 1:  # pragma: no cover
                array.byteswap(inplace=True)
            yield info.name, delivery.deliver(info, array, target is not None)
            del array
        await self._finish(header)
        if whole is not None:
            digest, hasher = whole
            digest.check(hasher, source.name)
            self.object_check = f"{digest.label}: verified"

    def _started_reading(self, ahead: ReadAhead) -> None:
        self._reading = ahead  # stopped by a close, also one from another task

    async def _object_hash(self, every_byte: bool) -> tuple[ObjectDigest, Hasher] | None:
        """The whole object's digest, if its transport gives one and the read will take every
        byte, with a hasher already fed the prefix and the header; None otherwise."""
        head, self._head = self._head, None
        if not (self._verify and every_byte) or head is None:
            return None
        digest = await self.source.object_digest()
        if digest is None:
            return None
        if digest.new is None:
            self.object_check = f"{digest.label}: not checked, {digest.reason}"
            return None
        hasher = digest.new()
        hasher.update(head[0])
        await hash_view(hasher, memoryview(head[1]))
        return digest, hasher

    async def _finish(self, header: Header) -> None:
        """Consume the message's tail; a whole object must end right after it."""
        source = self.source
        if source.random_access:
            return  # size checked against the header at open
        end = header.file_size
        if source.position < end:
            await source.skip(end - source.position)
            if source.position < end:
                last = header.tensors[-1]
                raise TruncatedStreamError(
                    f"tensor {last.name!r}",
                    name=last.name,
                    offset=source.position,
                    expected=end,
                    source=source.name,
                )
        if source.whole_object and not await source.at_end():
            raise TrailingDataError(f"{source.name}: bytes follow the last tensor at byte {end}")
        source.message_read()


READ_CHUNK = 4 << 20
"""A verified tensor is read in chunks of this size, each hashed while the next one is read.
4 MiB measured best of 1, 2, 4 and 16 MiB and whole tensors (on a 2 GiB file of 32 MiB tensors,
paired against an unverified read, on a loaded 2-core machine): the chunk is still in the CPU's
caches when it is hashed."""


async def read_hashing(
    source: Source, offset: int, view: memoryview, *, hashers: Iterable[Hasher]
) -> int:
    """``source.read_into_at(offset, view)``, feeding every byte read to each of ``hashers``.

    A read of one chunk (:data:`READ_CHUNK`) or less is hashed once read (on the loop's thread
    when small). A bigger one goes in chunks, each hashed while the next one is read: by the
    source's own worker threads right after each read where it can (a local file:
    :meth:`~stream_st.sources.Source.read_feeding`, no thread hop per chunk), else in a worker
    thread fed chunk by chunk. Either way the bytes are hashed while still in the CPU's caches.
    Returns the bytes read (fewer if the source ended).
    """
    hashers = list(hashers)

    def update(piece: memoryview) -> None:
        for hasher in hashers:
            update_sliced(hasher, piece)

    total = len(view)
    if total <= READ_CHUNK:
        got = await source.read_into_at(offset, view)
        if got <= HASH_INLINE:
            update(view[:got])
        else:
            await anyio.to_thread.run_sync(update, view[:got])
        return got
    fed = await source.read_feeding(offset, view, update)
    if fed is not None:
        return fed
    send, receive = anyio.create_memory_object_stream[memoryview](0)

    async def hash_chunks() -> None:
        async with receive:
            async for piece in receive:
                await anyio.to_thread.run_sync(update, piece)

    got = 0
    async with task_group() as group:
        group.start_soon(hash_chunks)
        async with send:
            while got < total:
                chunk = view[got : got + READ_CHUNK]
                n = await source.read_into_at(offset + got, chunk)
                if n:
                    await send.send(chunk[:n])
                got += n
                if n < len(chunk):
                    break
    return got

"""The narrow interfaces every transport meets: :class:`Source` (bytes in) and :class:`Sink`
(bytes out), the shared loop helpers built on them, and the turns a read gives the event loop
(``give_turn``).

A sink takes the bytes of one safetensors message. Every sink can append (:meth:`Sink.send`); a
sink with ``random_access`` (a local file) can also write at any offset (:meth:`Sink.write_at`),
which lets the writer accept tensors in any order. :meth:`Sink.aclose` commits the message: a file
appears at its destination only then. :meth:`Sink.abort` throws the message away: a file sink
removes its temporary file, a stream sink closes the stream so the peer sees an incomplete
message, never a complete wrong one.

:meth:`Sink.aclose` either commits and returns, or raises with nothing committed (a sink that
cannot tell, its final answer lost, raises :class:`~stream_st.OutcomeUnknownError`). A
cancellation keeps to this: it stops a commit only before its commit point (a file's rename),
and the sink then discards the message; past that point, ``aclose`` completes and returns, and
the caller meets the cancellation at its next checkpoint.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import anyio.lowlevel

from ..errors import TransportError, UsageError
from .options import UNLIMITED, Clock, Transport

if TYPE_CHECKING:
    from ..core.digests import ObjectDigest

__all__ = ["DISCARD_CHUNK", "AsyncReadInto", "Sink", "Source", "Waits", "give_turn"]

DISCARD_CHUNK = 1 << 20
"""Skipped bytes of a stream are read and dropped in chunks of at most this size."""


# Turns for the event loop between pieces of a read that may not wait at all. A read of local
# files in the page cache can run for a long time without awaiting anything that suspends: the
# file opens, headers and small tensors are all read on the loop's thread. give_turn(), called
# where a piece of work begins (a stream opening, its header, each tensor, each chunk a
# producer of chunks hands over), lets the loop run other tasks, and a cancellation arrive, once
# this thread's loop has gone TURN_EVERY without a turn given here, counted across every stream
# of the thread: many small files are paced as one big one. It lives with the sources, below
# the reader, for those whose producer may never wait either (an async iterator of chunks).

TURN_EVERY = 0.005
"""Seconds of the reader's work between two turns it gives the loop at most (plus one piece of
work: one inline read of at most 4 MiB, or one header parsed on the loop): well under the 50 ms
the loop may be held, and a turn (``anyio.lowlevel.checkpoint``, a few microseconds) costs
under 0.1 % of that."""


TURN_CHECKPOINTS = 3
"""Checkpoints in one turn (see :func:`give_turn`): a few microseconds each, every
:data:`TURN_EVERY` at most."""


class _Last(threading.local):
    at: float | None = None  # time.perf_counter() of this thread's last turn given, or of its
    # first piece of work: until then no work of the reader has held the loop on this thread


_last = _Last()


async def give_turn() -> None:
    """Let the event loop run once, and a pending cancellation be raised, if this thread has
    given none for :data:`TURN_EVERY`; otherwise return at once (one clock read). A thread's
    first call only starts that count: no work of the reader held the loop before it (a
    process's first read pays no turn, 40-120 us of cold event-loop code).

    A turn is :data:`TURN_CHECKPOINTS` checkpoints: a task woken by a timer or a socket during
    the work (a ``sleep`` ending) is queued behind this one in two hops, the expired timer's
    callback, then the task's own step; it runs before the work goes on only if the work
    yields that many times. With one checkpoint it waited for the next stretch of work too:
    the loop's longest stall was two or three stretches, not one."""
    now = time.perf_counter()
    last = _last.at
    if last is None:  # the thread's first piece of work begins: no turn is owed yet
        _last.at = now
    elif now - last >= TURN_EVERY:
        for _ in range(TURN_CHECKPOINTS):
            await anyio.lowlevel.checkpoint()
        _last.at = time.perf_counter()


@runtime_checkable
class AsyncReadInto(Protocol):
    """A producer that fills the reader's buffer itself: ``await readinto(buffer)`` writes the
    next bytes into ``buffer`` (a writable byte ``memoryview``, often a tensor's own memory) and
    returns how many, 0 only at the end. :func:`~stream_st.open_stream` accepts any object with
    this method (an ``aiofiles`` file, a hand-written decoder, a socket wrapper) and reads it as
    one whole file, front to back; unlike chunks from an async iterator, the bytes are not
    copied a second time."""

    async def readinto(self, buffer: memoryview, /) -> int:
        """Write the next bytes into ``buffer``; how many were written, 0 only at the end."""
        ...


class Source(ABC):
    """Bytes in, read front to back.

    ``name`` describes the source in error messages (a path or URL). ``size`` is the total length
    when known up front. ``whole_object`` is True for a source that is one complete file (path,
    bytes, iterator of chunks, HTTP body): it must end exactly at the last tensor. A connection
    (``whole_object`` False) is read up to the end of the message and the rest is left unread.
    ``random_access`` is True when :meth:`read_into_at` may jump anywhere, so skipped tensors cost
    nothing. ``clock`` bounds every wait for the transport (see ``stream_st.transports.options``);
    the
    reader gives the source its operation's clock.
    """

    clock: Clock = UNLIMITED
    name: str = "<source>"
    _claimed = False
    size: int | None = None
    whole_object: bool = True
    random_access: bool = False

    def __init__(self) -> None:
        self.position = 0

    def claim(self) -> None:
        """Take this source for one read; a second is a :class:`~stream_st.UsageError` (the
        bytes a first read took are gone, and two reads at once would each get part of them)."""
        if self._claimed:
            raise UsageError(
                f"{self.name}: this source was given to another read already; a source is "
                "read once: open a new one for each read (or pass its path or URL)"
            )
        self._claimed = True

    async def start(self, *, read_all: bool = False) -> None:  # noqa: B027 - most are ready
        """Connect or send the first request; the reader calls it once, before anything else.

        ``read_all`` tells that every byte will be read (no selection, no header-only look), which
        lets a ranged transport ask for everything at once.
        """

    @abstractmethod
    async def receive_into(self, buffer: memoryview) -> int:
        """Fill some of ``buffer`` with the next bytes; return how many (0 only at the end)."""

    async def fill(self, buffer: memoryview) -> int:
        """Fill ``buffer`` completely unless the source ends first; return the bytes filled."""
        filled = 0
        total = len(buffer)
        while filled < total:
            got = await self.receive_into(buffer[filled:])
            if got == 0:
                break
            filled += got
        return filled

    async def skip(self, count: int) -> int:
        """Move ``count`` bytes ahead, discarding them in bounded chunks; return bytes skipped."""
        scratch = memoryview(bytearray(min(count, DISCARD_CHUNK)))
        skipped = 0
        while skipped < count:
            got = await self.receive_into(scratch[: min(len(scratch), count - skipped)])
            if got == 0:
                break
            skipped += got
        return skipped

    async def read_into_at(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from absolute ``offset``. Sequential sources only move forward."""
        if offset < self.position:
            raise ValueError(f"{self.name} cannot seek back from {self.position} to {offset}")
        if offset > self.position:
            await self.skip(offset - self.position)
            if self.position != offset:
                return 0
        return await self.fill(buffer)

    async def read_feeding(
        self, offset: int, buffer: memoryview, feed: Callable[[memoryview], None]
    ) -> int | None:
        """:meth:`read_into_at` that also calls ``feed`` (a hash's update, thread-safe to call
        from a worker thread) with every byte read, in order, from the thread that read it; or
        None, reading nothing, where the source has no such path (the caller hashes itself)."""
        return None

    async def read_landing(
        self, offset: int, buffer: memoryview, landed: Callable[[int, int], None]
    ) -> int | None:
        """:meth:`read_into_at` that also calls ``landed(start, end)`` (absolute offsets, on the
        event loop's thread, in order) each time the bytes ``start`` to ``end`` are in ``buffer``
        for good; or None, reading nothing, where the source has no such path. A copy of the
        bytes can then be written as they arrive."""
        return None

    async def plan_reads(self, ranges: Sequence[tuple[int, int]]) -> None:  # noqa: B027
        """Learn, once the header is parsed, the absolute byte ranges the reader will ask for:
        in order, adjacent ones merged. Ranged transports schedule their requests and read-ahead
        from it; the others have no use for it."""

    async def object_digest(self) -> ObjectDigest | None:
        """The digest of the whole object that the transport vouches for (an S3 checksum, the
        Hub's SHA-256), or None. The reader asks, after :meth:`plan_reads`, only when it will
        read every byte; a transport may spend a request to learn it."""
        return None

    async def at_end(self) -> bool:
        """True when no byte follows the current position."""
        if self.size is not None:
            return self.position >= self.size
        return await self.receive_into(memoryview(bytearray(1))) == 0

    def message_read(self) -> None:  # noqa: B027 - only a lent connection has a use for it
        """The reader consumed the whole message and will read no more: a connection lent for
        one message may go to the next one before this source is closed."""

    @property
    def home(self) -> str | None:
        """The address to find this object's neighbours (an index's shards) from, where it
        differs from the address opened (a ``hf://`` revision pinned to a commit); else None."""
        return None

    def add_transport(self, transport: Transport) -> None:  # noqa: B027 - HTTP-based only
        """Apply an operation's ``headers`` and ``ssl_context``; only transports that make HTTP
        requests have a use for them."""

    async def aclose(self) -> None:  # noqa: B027 - a source with nothing to release keeps this
        """Release the underlying file, stream or connection."""


def _closed_here(source: Source) -> TransportError:
    """The error of a read of ``source`` that its close cut short, or that came after it."""
    return TransportError(
        "receive failed: the source was closed on this side",
        url=source.name,
        position=source.position,
    )


class Waits:
    """The reads of a source that wait for a peer or producer it cannot close itself (a stream
    the caller keeps, an async iterator's next chunk), cut short by the source's close from any
    task: the read waiting then, and any read begun after, raises
    :class:`~stream_st.TransportError` ("closed on this side") at once, whether or not the peer
    ever sends again."""

    __slots__ = ("_scopes", "closed")

    def __init__(self) -> None:
        self.closed = False
        self._scopes: set[anyio.CancelScope] = set()

    @contextmanager
    def reading(self, source: Source) -> Iterator[None]:
        """A read of ``source``, cut short by :meth:`close`. A read inside another (each
        receive of a fill) is cut short with it: a source is read by one task at a time, and a
        cancel scope costs as much as a receive of a few KiB."""
        self.check(source)
        if self._scopes:
            yield
            return
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._scopes.discard(scope)
        self.check(source)  # closed during the read, or while its bytes were handed over

    def guard(self, source: Source, *, waits: bool) -> AbstractContextManager[None]:
        """:meth:`reading` for a read of ``source`` that ``waits``; :meth:`check` for one whose
        bytes are at hand, where a cancel scope would cost more than the read."""
        if waits:
            return self.reading(source)
        self.check(source)
        return nullcontext()

    def check(self, source: Source) -> None:
        """A read of ``source`` that will not wait (its bytes are at hand): refused once the
        source is closed, at the cost of one test, not a cancel scope's."""
        if self.closed:
            raise _closed_here(source)

    def close(self) -> None:
        """The source is closed: cut short the reads waiting now, and refuse later ones."""
        self.closed = True
        for scope in self._scopes:
            scope.cancel()


class Sink(ABC):
    """Bytes out.

    ``name`` describes the destination in error messages (a path or URL). ``position`` counts the
    bytes appended with :meth:`send`. A sink does not keep any reference to a buffer once the call
    that was given it returns, so the caller may reuse or change the memory afterwards.
    ``clock`` bounds every wait for the transport (see ``stream_st.transports.options``); the
    writer gives
    the sink its operation's clock.
    """

    clock: Clock = UNLIMITED
    name: str = "<sink>"
    _claimed = False
    one_message: bool = True
    """Whether this sink commits one object (a file, an upload), so that :meth:`claim` takes it
    once; False for a stream the caller keeps, which takes message after message, each holding
    the stream's turn."""
    random_access: bool = False
    kernel_copies: bool = False
    """Whether :meth:`copy_in` can write bytes of a local file here (a local file can)."""

    def __init__(self) -> None:
        self.position = 0

    def claim(self) -> None:
        """Take this sink for one message; a second is a :class:`~stream_st.UsageError` (a sink
        commits one message: two writers would each write part of it, a later one after its
        commit). A sink without :attr:`one_message` (a stream) is not taken: its messages follow
        one another on the stream."""
        if not self.one_message:
            return
        if self._claimed:
            raise UsageError(
                f"{self.name}: this sink was given to another write already; a sink takes one "
                "message: open a new one for each write (or pass its path or URL)"
            )
        self._claimed = True

    def add_transport(self, transport: Transport) -> None:  # noqa: B027 - HTTP-based only
        """Apply an operation's ``headers`` and ``ssl_context``; only transports that make HTTP
        requests have a use for them."""

    @abstractmethod
    async def send(self, buffer: memoryview) -> None:
        """Append all of ``buffer`` (a 1-D byte view) to the message."""

    async def allocate(self, size: int) -> None:  # noqa: B027 - optional for a sink
        """A hint, given before any byte: the whole message will be ``size`` bytes."""

    async def write_at(self, offset: int, buffer: memoryview) -> None:
        """Write all of ``buffer`` at absolute ``offset``; only when ``random_access`` is True."""
        raise NotImplementedError(f"{self.name} can only be written front to back")

    async def copy_in(self, source: int, at: int, offset: int, count: int) -> int:
        """Write ``count`` bytes at ``offset`` from offset ``at`` of the local file open as
        ``source``, copied by the kernel; returns how many were (fewer only where ``source``
        ends first). Only when ``kernel_copies`` is True (a local file)."""
        raise NotImplementedError(f"{self.name} takes no bytes from a file by the kernel")

    async def hold_head(self, size: int) -> bool:
        """Keep the message's first ``size`` bytes open to :meth:`patch_head` until the commit;
        False when this sink cannot (it sends bytes on for good). A random-access sink can."""
        return self.random_access

    async def patch_head(self, buffer: memoryview) -> None:
        """Rewrite the message's first ``len(buffer)`` bytes, held since :meth:`hold_head`."""
        await self.write_at(0, buffer)

    async def prepare(self) -> bool:
        """Make the complete message ready to commit, leaving :meth:`aclose` only its commit
        point, so that several messages can be committed together: True when this sink then
        holds the message unseen until :meth:`aclose` (or discards it on :meth:`abort`), False
        when it cannot (a stream, an HTTP upload: :meth:`aclose` sends it on and commits). Called
        at most once, after the last byte and any :meth:`patch_head`. A random-access sink (a
        local file) holds its message as it is."""
        return self.random_access

    @abstractmethod
    async def aclose(self) -> None:
        """Commit: the message is complete. A file is moved into place; a stream is flushed.

        Returns only once committed; raises only with nothing committed (see the module).
        """

    @abstractmethod
    async def abort(self) -> None:
        """Discard the message; safe to call more than once and from a cancelled scope.

        Implementations must not block on a peer: they run shielded from cancellation.
        """

"""The narrow interface every source meets, and the shared loop helpers built on it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .._limits import UNLIMITED, Clock

if TYPE_CHECKING:
    from ..integrity import ObjectDigest

__all__ = ["DISCARD_CHUNK", "AsyncReadInto", "Source"]

DISCARD_CHUNK = 1 << 20
"""Skipped bytes of a stream are read and dropped in chunks of at most this size."""


@runtime_checkable
class AsyncReadInto(Protocol):
    """A producer that fills the reader's buffer itself: ``await readinto(buffer)`` writes the
    next bytes into ``buffer`` (a writable byte ``memoryview``, often a tensor's own memory) and
    returns how many, 0 only at the end. :func:`~stream_st.open_stream` accepts any object with
    this method (an ``aiofiles`` file, a hand-written decoder, a socket wrapper) and reads it as
    one whole file, front to back; unlike chunks from an async iterator, the bytes are not
    copied a second time."""

    async def readinto(self, buffer: memoryview, /) -> int: ...


class Source(ABC):
    """Bytes in, read front to back.

    ``name`` describes the source in error messages (a path or URL). ``size`` is the total length
    when known up front. ``whole_object`` is True for a source that is one complete file (path,
    bytes, iterator of chunks, HTTP body): it must end exactly at the last tensor. A connection
    (``whole_object`` False) is read up to the end of the message and the rest is left unread.
    ``random_access`` is True when :meth:`read_into_at` may jump anywhere, so skipped tensors cost
    nothing. ``clock`` bounds every wait for the transport (see ``stream_st._limits``); the
    reader gives the source its operation's clock.
    """

    clock: Clock = UNLIMITED
    name: str = "<source>"
    size: int | None = None
    whole_object: bool = True
    random_access: bool = False

    def __init__(self) -> None:
        self.position = 0

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

    async def aclose(self) -> None:  # noqa: B027 - a source with nothing to release keeps this
        """Release the underlying file, stream or connection."""

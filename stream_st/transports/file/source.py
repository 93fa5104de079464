"""Local paths: a regular file, read with positioned reads (``os.preadv``) straight into the
caller's buffer; a FIFO, a pipe (``/dev/stdin``) or a character device, read front to back.

A read of at most 4 MiB is first tried on the event loop's own thread with ``RWF_NOWAIT``, which
returns only what the page cache already holds and never waits for the disk: a thread hop costs
100-350 us here, more than reading 1 MiB from the cache. The loop yields after every 8 MiB read
this way. What is not cached, and larger reads, go to worker threads; a read of 8 MiB or more is
split in two halves read by two threads at once (nearly twice the throughput on two cores).

Anything else at a path is opened with ``O_NONBLOCK``, so the ``open`` never waits for a FIFO's
writer, and read with non-blocking ``readv`` into the caller's buffer, waiting with
``anyio.wait_readable`` (bounded by the operation's limits) when nothing is there yet: the event
loop keeps running, and a writer that never comes raises :class:`~stream_st.ReadTimeoutError`.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import anyio
import anyio.lowlevel
import anyio.to_thread

from ..._util import task_group
from ...errors import (
    ArgumentTypeError,
    SourceNotFoundError,
    TransportError,
    UsageError,
    integer_at_least,
    path_string,
)
from ..base import Source
from ..nonblocking import NonBlockingEnd
from ..options import UNLIMITED, Clock
from .atomic import closed_when_dropped, detach_dropped, open_held
from .atomic import path_from_url as path_from_url  # re-exported: it was defined here
from .mmap import FileMap
from .pread import pread_fully
from .readahead import FEED_PIECE, ReadAhead, read_ahead

__all__ = ["FileSource", "PipeEnd", "PipeSource", "open_file_source", "open_path"]

SPLIT_THRESHOLD = 8 << 20
"""Reads of at least this many bytes are split between two threads."""

INLINE_MAX = 4 << 20
"""Reads of at most this many bytes are first tried on the loop thread (page cache only)."""

CHECKPOINT_BYTES = 8 << 20
"""After this many bytes read on the loop thread, let other tasks run."""

_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)

_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)


def _pread_boxed(fd: int, box: list[memoryview], offset: int) -> int:
    """:func:`pread_fully` on ``box.pop()``. A worker thread keeps its last call's arguments
    until it gets new work: passing the view in a box it empties frees the array in time."""
    return pread_fully(fd, box.pop(), offset)


def _pread_cached(fd: int, buffer: memoryview, offset: int) -> int:
    """Read what the page cache already holds, without ever blocking; returns the bytes read."""
    filled = 0
    total = len(buffer)
    while filled < total:
        try:
            got = os.preadv(fd, [buffer[filled:]], offset + filled, _RWF_NOWAIT)
        except BlockingIOError:  # EAGAIN: the next byte is not cached
            break
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                break  # no RWF_NOWAIT on this file system: the thread does it all
            raise
        if got == 0:
            break
        filled += got
    return filled


def open_path(name: str, flags: int, opened: list[int]) -> int:
    """``os.open(name, flags | O_CLOEXEC)``; its failures raise SafetensorsError subclasses. The
    descriptor is appended to ``opened`` too, for the caller's cleanup to close, also where a
    signal handler raises as the open returns (see :func:`~.atomic.open_held`): the caller
    closes what is in it on any failure, an interrupt included, until something holds it."""
    try:
        return open_held(opened, name, flags | _CLOEXEC)
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"no such file: {name or repr(name)}", url=name) from exc
    except OSError as exc:
        raise TransportError(f"cannot open: {exc.strerror}", url=name) from exc
    except ValueError as exc:  # a NUL byte: no path the OS takes
        raise UsageError(f"invalid path {name!r}: {exc}") from None


def open_file_source(path: str | os.PathLike[str], clock: Clock = UNLIMITED) -> Source:
    """The source for a local path: a :class:`FileSource` for a regular file, a
    :class:`PipeSource` for a FIFO, a pipe or a character device. Never blocks: a FIFO is opened
    before its writer comes. On any failure, an interrupt included (a signal handler's
    exception, wherever Python runs it), the file is closed before the exception leaves."""
    try:
        name = os.fspath(path)
    except TypeError as exc:  # a PathLike whose __fspath__ gives neither str nor bytes
        raise ArgumentTypeError(f"not a path: {exc}") from None
    opened: list[int] = []  # the descriptor, until the source made holds it
    try:
        fd = open_path(name, os.O_RDONLY | os.O_NONBLOCK, opened)
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise TransportError("cannot read a directory", url=name)
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            return FileSource(name, fd=fd, opened=opened)
        return PipeSource(fd, name, fifo=stat.S_ISFIFO(mode), clock=clock, opened=opened)
    except BaseException:
        for unheld in opened:
            os.close(unheld)
        raise


def _given_back(owner: object, fd: int, opened: list[int] | None) -> None:
    """Undo ``owner``'s hold on ``fd``, which a failure stopped as ``owner`` took it over (an
    interrupt included: a signal handler's exception): a finalizer made for it is detached
    (:func:`~.atomic.detach_dropped`), and ``fd`` is listed in ``opened`` again (where given:
    see :class:`FileSource`), for the caller's cleanup to close."""
    detach_dropped(owner, (fd,))
    if opened is not None and fd not in opened:
        opened.append(fd)


class FileSource(Source):
    """A local regular file; ``size`` is known, so truncation and trailing bytes show before any
    data. ``fd``, when given, is the file already open: the source takes it over, and on any
    failure as it is made (an interrupt included: a signal handler's exception) leaves it the
    caller's. ``opened``, where given, is a list the caller's cleanup closes, ``fd`` in it: the
    source takes ``fd`` out of it once it holds it. A file it opens itself is closed on any
    failure as it is made."""

    random_access = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fd: int | None = None,
        opened: list[int] | None = None,
    ) -> None:
        super().__init__()
        self._inline_bytes = 0
        self.name = path_string("path", path)
        mine: list[int] = []  # a file opened here, until the source holds it
        if fd is None:
            opened = mine
        else:
            fd = integer_at_least("fd", fd, 0)
        try:
            if fd is None:
                fd = open_path(self.name, os.O_RDONLY, mine)
            try:
                self.size = os.fstat(fd).st_size
            except (OSError, OverflowError) as exc:
                if not mine:  # a descriptor given that is not open (or none there can be)
                    raise UsageError(f"{self.name}: fd={fd} is no open file descriptor") from None
                raise TransportError(f"cannot stat: {exc}", url=self.name) from exc
            self._unclosed = closed_when_dropped(self, fd, self.name)
            self._fd = fd
            if opened is not None:
                opened.remove(fd)  # held
        except BaseException:
            if fd is not None:
                _given_back(self, fd, opened)
            for unheld in mine:
                os.close(unheld)
            raise

    def fileno(self) -> int:
        """The open file's descriptor (the source keeps it, and closes it with itself)."""
        return self._fd

    async def receive_into(self, buffer: memoryview) -> int:
        return await self.read_into_at(self.position, buffer)

    async def fill(self, buffer: memoryview) -> int:
        return await self.read_into_at(self.position, buffer)

    async def skip(self, count: int) -> int:
        assert self.size is not None
        skipped = max(0, min(count, self.size - self.position))
        self.position += skipped
        return skipped

    async def read_into_at(self, offset: int, buffer: memoryview) -> int:
        try:
            if _RWF_NOWAIT and len(buffer) <= INLINE_MAX:
                got = _pread_cached(self._fd, buffer, offset)
                self._inline_bytes += got
                if self._inline_bytes >= CHECKPOINT_BYTES:
                    self._inline_bytes = 0
                    await anyio.lowlevel.checkpoint()
                if got < len(buffer) and offset + got < (self.size or 0):
                    got += await anyio.to_thread.run_sync(
                        _pread_boxed, self._fd, [buffer[got:]], offset + got
                    )
            elif len(buffer) < SPLIT_THRESHOLD:
                got = await anyio.to_thread.run_sync(_pread_boxed, self._fd, [buffer], offset)
            else:
                got = await self._read_halves(offset, buffer)
        except OSError as exc:
            reason = PipeEnd.closed_here if self._fd < 0 else exc.strerror or exc
            raise TransportError(f"read failed: {reason}", url=self.name, position=offset) from exc
        self.position = offset + got
        return got

    async def read_feeding(
        self, offset: int, buffer: memoryview, feed: Callable[[memoryview], None]
    ) -> int | None:
        """:meth:`read_into_at` that calls ``feed`` with every byte read, in order, piece by
        piece as worker threads read them (a job of :meth:`reading`'s, see
        :class:`~stream_st.transports.file.readahead.InOrder`); None for a read of one piece
        (:data:`~stream_st.transports.file.readahead.FEED_PIECE`) or less (the caller does
        better on the loop's thread)."""
        if len(buffer) <= FEED_PIECE:
            return None
        async with self.reading() as ahead:
            got = await ahead.wait(ahead.add(offset, buffer, feed=feed))
        self.position = offset + got
        return got

    async def _read_halves(self, offset: int, buffer: memoryview) -> int:
        half = (len(buffer) // 2) & ~4095
        counts = [0, 0]

        async def read(index: int, start: int, part: memoryview) -> None:
            counts[index] = await anyio.to_thread.run_sync(
                _pread_boxed, self._fd, [part], offset + start
            )

        async with task_group() as group:
            group.start_soon(read, 0, 0, buffer[:half])
            group.start_soon(read, 1, half, buffer[half:])
        # A short first half means the file ended inside it: the second half read nothing.
        return counts[0] if counts[0] < half else half + counts[1]

    def reading(self) -> AbstractAsyncContextManager[ReadAhead]:
        """Reads of many ranges at once into memory that exists already, by worker threads
        kept busy across them (see :mod:`stream_st.transports.file.readahead`)."""
        return read_ahead(self._fd, self.name)

    def map(self, *, private: bool = False) -> FileMap | None:
        """The file mapped for zero-copy views (read-only; ``private``: writable, copy on
        write), or None where a view could not be handed out as it is (a big-endian host,
        where every tensor is byte-swapped)."""
        if sys.byteorder != "little":  # pragma: no cover - little-endian hosts only here
            return None
        assert self.size is not None
        return FileMap(
            self._fd,
            self.size,
            self.name,
            private=private,
            cached=self._cached,
            stop=self.clock.deadline_stop(self.name),
        )

    def _cached(self, offset: int) -> bool:
        """Whether the page cache holds the byte at ``offset``: a one-byte read that never
        blocks (False where the kernel cannot tell, or the file was closed meanwhile: the
        mapping outlives it, and the stream reports the close)."""
        return self._fd >= 0 and _pread_cached(self._fd, memoryview(bytearray(1)), offset) == 1

    async def aclose(self) -> None:
        if self._fd >= 0:
            self._unclosed.detach()
            os.close(self._fd)
            self._fd = -1


class PipeEnd(NonBlockingEnd[int]):
    """What a pipe source and a pipe sink share: the non-blocking descriptor ``fd``, the name to
    report, the waits bounded by ``clock`` (see
    :class:`~stream_st.transports.nonblocking.NonBlockingEnd`),
    and closing it. ``fd`` is taken over: on any failure as the end is made (an interrupt
    included: a signal handler's exception) it is closed before the exception leaves, but where
    ``opened`` is given, a list the caller's cleanup closes, ``fd`` in it: there it is left for
    that cleanup, and taken out of the list once the end holds it. Only an interrupt as the
    constructor is called, before any of its code runs, leaves ``fd`` open, the caller's: a
    caller that must close it then too passes ``opened``."""

    receiving = "read"
    sending = "write"
    closed_here = "the file was closed on this side"
    peer_stalled = "the reader took no data"

    def __init__(
        self, fd: int, name: str, *, clock: Clock = UNLIMITED, opened: list[int] | None = None
    ) -> None:
        unheld = [fd] if opened is None else opened  # fd, until held
        try:
            super().__init__(fd, name, clock=clock)
            self._unclosed = closed_when_dropped(self, fd, name)
            unheld.remove(fd)  # held
        except BaseException:
            self._let_go(fd, unheld, opened)
            raise

    def _let_go(self, fd: int, unheld: list[int], opened: list[int] | None) -> None:
        """Undo the hold on ``fd`` that a failure stopped as this end was made: ``fd`` is given
        back into ``unheld`` (:func:`_given_back`), which is ``opened`` where the caller gave
        one, for its cleanup to close; else ``fd`` was handed over, and is closed here."""
        _given_back(self, fd, unheld)
        if opened is None:
            os.close(fd)

    def _close(self) -> None:
        """Close the descriptor, first waking any task waiting on it; closing twice is a no-op."""
        fd, self._handle = self._handle, -1
        if fd >= 0:
            self._unclosed.detach()
            anyio.notify_closing(fd)
            os.close(fd)


class PipeSource(PipeEnd, Source):
    """A FIFO, a pipe or a character device at a path: read front to back, size unknown.

    The source takes over ``fd``, open with ``O_NONBLOCK``. ``fifo`` says that it is a FIFO or a
    pipe, which reads as ended until a writer has opened it: the first read waits for data.
    ``clock`` bounds each wait for data, the first one included: a FIFO whose writer never
    comes raises :class:`~stream_st.ReadTimeoutError` once a limit passes. A FIFO's end is its
    last writer closing.
    """

    def __init__(
        self,
        fd: int,
        name: str,
        *,
        fifo: bool = False,
        clock: Clock = UNLIMITED,
        opened: list[int] | None = None,
    ) -> None:
        self._wait_first = fifo
        unheld = [fd] if opened is None else opened  # fd, until held
        try:
            super().__init__(fd, name, clock=clock, opened=unheld)
        except BaseException:  # also an interrupt as that returned, the descriptor held
            self._let_go(fd, unheld, opened)
            raise

    async def receive_into(self, buffer: memoryview) -> int:
        if not buffer:
            return 0
        if self._wait_first:
            await self._wait(writable=False)
            self._wait_first = False
        return await self._receive(self._readv, buffer)

    def _readv(self, buffer: memoryview) -> int:
        """One non-blocking ``readv`` into ``buffer``."""
        return os.readv(self._handle, [buffer])

    async def aclose(self) -> None:
        self._close()


async def source_for(url: str, clock: Clock) -> Source:
    """The registry's factory: the source of a ``file://`` URL."""
    return open_file_source(path_from_url(url), clock)

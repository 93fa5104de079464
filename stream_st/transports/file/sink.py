"""Local paths: a regular file, written beside its destination and moved into place only when
complete (:class:`FileSink`, over :class:`~.atomic.AtomicFile`); a FIFO or a device, written
through in place (:class:`PipeSink`).

A :class:`FileSink` writes its temporary file with positioned writes (``os.pwritev``) straight
from the caller's memory in worker threads, so tensors may arrive in any order and the event loop
stays free; a write under :data:`WRITE_INLINE` bytes is made on the loop's thread, quicker than
the hop to a worker and back. Each call writes at most :data:`~.atomic.WRITE_CALL` bytes, cut at
multiples of it in the file. :meth:`FileSink.aclose` commits the file as :mod:`.atomic` says;
:meth:`FileSink.abort` deletes it. Small writes that follow each other are staged and written
together (see :class:`FileSink`); a whole message given at once is written with no event loop
(:meth:`~.atomic.AtomicFile.write_whole`, :func:`~.atomic.save_at_once`).

A destination that exists and is not a regular file (a FIFO, ``/dev/null``, a terminal) is never
replaced: :class:`PipeSink` opens it in place and writes front to back with non-blocking writes,
waiting with ``anyio.wait_writable`` when the reader is behind. A FIFO with no reader yet is
waited for without blocking the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import anyio.to_thread

from ..._util import task_group
from ...errors import (
    ReadTimeoutError,
    TransportError,
    UnsupportedSinkError,
    UsageError,
    path_string,
)
from ..base import Sink
from ..options import UNLIMITED, Clock
from . import atomic
from .atomic import (
    ALLOCATE_FROM,
    AtomicFile,
    Blocks,
    fsync_directory,
    open_held,
    path_from_url,
    replaced,
    write_blocks,
)
from .source import PipeEnd, open_path

__all__ = ["FileSink", "PipeSink", "open_file_sink"]

SPLIT_THRESHOLD: int | None = 8 << 20
"""Writes of at least this many bytes are shared by :data:`WRITERS` threads (``None``: never),
each taking the next :data:`~.atomic.WRITE_CALL` bytes in turn, so the file fills front to back.

On ext4 buffered writes to one file serialize on the inode lock, so two threads do not copy at
once; yet one thread measured as fast as two on a quiet machine and slower when other processes
compete for the two cores or for memory (0.81x at load average ~2.3).
"""

WRITERS = 2
"""Threads that share a write of at least :data:`SPLIT_THRESHOLD` bytes."""

WRITE_INLINE = 256 << 10
"""Writes shorter than this are made on the event loop's thread, then a checkpoint: a page-cache
copy of so few bytes (tens of microseconds) takes less time than handing it to a worker thread
and back, which cost 190 us a tensor on a busy 2-core machine. ``stream_st.numpy.save_file`` of
1,000 tensors of 4 KiB took 0.46 s with every write in a worker thread, 0.11 s with them here
(the reference 0.02-0.04 s: what is left is the writer's own work per tensor)."""

NOT_STAGED, STAGED, STAGED_WROTE = 0, 1, 2
"""What :meth:`FileSink.stage` did: nothing; staged a write; staged it and wrote a block."""

ALLOCATE_INLINE = 64 << 20
"""Files smaller than this are preallocated on the event loop thread (one quick syscall)."""


COPY_CALL = 8 << 20
"""Bytes per ``copy_file_range`` call (and per read and write where the kernel cannot copy): a
call is not interrupted, so a cancellation waits for one at most."""

COPY_TURN = 64 << 20
"""Bytes a worker thread copies per hand-over (about 20 ms here)."""

_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
"""``copy_file_range`` errors that mean "not between these two files" (another file system on a
kernel before 5.3, a file system without it): the bytes are then read and written."""


def copy_range(source: int, target: int, at: int, to: int, count: int) -> int:
    """Copy ``count`` bytes from offset ``at`` of the file open as ``source`` to offset ``to`` of
    the file open as ``target``, by the kernel (``copy_file_range``: page cache to page cache, no
    byte through this process) or, where it cannot, by reads and writes of :data:`COPY_CALL`
    bytes. Returns how many were copied: fewer only where ``source`` ends first. Blocking."""
    done = 0
    kernel = hasattr(os, "copy_file_range")
    buffer: bytearray | None = None
    while done < count:
        size = min(COPY_CALL, count - done)
        if kernel:
            try:
                got = os.copy_file_range(source, target, size, at + done, to + done)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                kernel = False
                continue
        else:
            buffer = buffer or bytearray(min(COPY_CALL, count))
            view = memoryview(buffer)[:size]
            got = os.preadv(source, [view], at + done)
            atomic.pwrite_fully(target, [view[:got]], to + done)
        if not got:
            if kernel:  # some file systems say 0 instead of refusing: ask by reading
                kernel = False
                continue
            break
        done += got
    return done


def _check_copy_source(source: int, target: int) -> None:
    """Raise :class:`~stream_st.UsageError` unless the descriptor ``source`` is an open regular
    file other than the one open as ``target`` (copied onto itself, a file would keep its
    zeros where the copy said it wrote the source's bytes)."""
    try:
        found = os.fstat(source)
    except OSError as exc:
        raise UsageError(
            f"cannot copy from descriptor {source}: {exc.strerror or exc} (not an open file)"
        ) from None
    if not stat.S_ISREG(found.st_mode):
        raise UsageError(
            f"cannot copy from descriptor {source}: not a regular file (copy from a local file, "
            "or write the tensor's array)"
        )
    own = os.fstat(target)
    if (found.st_dev, found.st_ino) == (own.st_dev, own.st_ino):
        raise UsageError(
            f"cannot copy from descriptor {source}: it is the file being written (was the "
            "source's descriptor closed, and its number taken by the writer?)"
        )


async def _write(fd: int, buffer: memoryview, offset: int, name: str, clock: Clock) -> None:
    """Write all of ``buffer`` at ``offset`` of the file open as ``fd``: on the event loop's
    thread when it is shorter than :data:`WRITE_INLINE`, else in worker threads, :data:`WRITERS`
    of them sharing a buffer of at least :data:`SPLIT_THRESHOLD` bytes, taking its blocks in
    turn, each block within ``clock``'s deadline (a big tensor's write takes seconds)."""
    blocks = Blocks([buffer], offset)
    if len(buffer) < WRITE_INLINE:
        write_blocks(fd, blocks, name)
        await anyio.lowlevel.checkpoint()
        return
    stop = clock.deadline_stop(name)
    if SPLIT_THRESHOLD is None or len(buffer) < SPLIT_THRESHOLD:
        await anyio.to_thread.run_sync(write_blocks, fd, blocks, name, stop)
        return
    async with task_group() as group:
        for _ in range(WRITERS):
            group.start_soon(anyio.to_thread.run_sync, write_blocks, fd, blocks, name, stop)


async def open_file_sink(
    path: str | os.PathLike[str], *, fsync: bool = False, clock: Clock = UNLIMITED
) -> Sink:
    """The sink for a local path: a :class:`PipeSink` when a FIFO or a device is there,
    written in place; else a :class:`FileSink` (:func:`~.atomic.replaced`)."""
    name = os.fspath(path)
    if replaced(name):
        return FileSink(name, fsync=fsync)
    return await PipeSink.open(name, clock)


class FileSink(AtomicFile, Sink):
    """A local regular file, new or replaced (an :class:`~.atomic.AtomicFile`), written piece by
    piece from an event loop.

    The rename is the commit point. Cancelled before it (while the data is flushed, say),
    :meth:`aclose` removes the temporary file and raises; once it is done, :meth:`aclose` finishes
    (the directory flush shielded) and returns: the cancellation reaches the caller at its next
    checkpoint, with the file in place.

    Writes shorter than :data:`WRITE_INLINE` are copied into a kept buffer while each follows
    the one before in the file (:meth:`stage`), and written (on the event loop's thread) a
    :data:`~.atomic.WRITE_CALL` block of the file at a time as they fill it, when the next would
    not follow, before any read back, and at the commit: a message of many small tensors costs
    one ``pwritev`` call per block, not one a tensor. Such a write is no checkpoint: the loop
    runs other tasks, and a cancellation is seen, when a block is written, and at the commit (a
    cancelled write of a few small tensors still commits nothing). Checking for a cancellation
    at each cost 10-15 % of ``open_writer``'s time for 10,000 tensors of 4 KiB.
    :meth:`~.atomic.AtomicFile.write_whole` writes a whole message at once, with no event loop.
    """

    random_access = True
    kernel_copies = True

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        Sink.__init__(self)
        AtomicFile.__init__(self, path_string("path", path), fsync=fsync)
        self._stage = bytearray()  # small writes that follow each other, not written yet, in
        self._staged = 0  # its first bytes: a buffer made once and kept (fresh memory faults)
        self._staged_at = 0  # where in the file they go
        self._room = 0  # bytes from there to the end of its WRITE_CALL block

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[int]:
        """The file's descriptor, for work in a worker thread that may outlast an abort made
        meanwhile: the descriptor is closed when the last such work ends, not under it."""
        self._busy += 1
        try:
            yield self._fd
        finally:
            self._busy -= 1
            if self._done and not self._busy:
                self._close_fd()

    async def allocate(self, size: int) -> None:
        """Reserve ``size`` bytes on disk; a full disk raises before any data is written."""
        if size < ALLOCATE_FROM or self._done:
            return
        if size < ALLOCATE_INLINE:
            self.reserve(size)
            return
        with self._in_use():
            await anyio.to_thread.run_sync(self.reserve, size)

    async def send(self, buffer: memoryview) -> None:
        offset = self.position
        self.position += len(buffer)
        await self.write_at(offset, buffer)

    async def write_at(self, offset: int, buffer: memoryview) -> None:
        if self._done:
            raise UsageError(f"{self.name}: the file sink is closed")
        count = len(buffer)
        if not count:
            return
        if count < WRITE_INLINE:  # staged: written with the small writes that follow it
            staged = self.stage(offset, buffer, count)
            if staged == STAGED_WROTE:
                await anyio.lowlevel.checkpoint()
            elif staged == NOT_STAGED:
                self._flush()
                await anyio.lowlevel.checkpoint()
                # Nothing is staged at a checkpoint: another task's write may have come since.
                await self.write_at(offset, buffer)
            return
        with self._in_use() as fd:
            await _write(fd, buffer, offset, self.name, self.clock)

    async def copy_in(self, source: int, at: int, offset: int, count: int) -> int:
        """Write ``count`` bytes at ``offset`` from offset ``at`` of the local file open as
        ``source``, copied by the kernel (:func:`copy_range`, in a worker thread, at most
        :data:`COPY_TURN` bytes a turn: a cancellation waits for one turn at most). Returns how
        many were copied: fewer only where ``source`` ends first. A ``source`` that is not an
        open regular file, or is this sink's own file (a descriptor closed by its owner and its
        number taken by this sink), is a :class:`~stream_st.UsageError`, nothing copied."""
        if self._done:
            raise UsageError(f"{self.name}: the file sink is closed")
        done = 0
        with self._in_use() as fd:
            _check_copy_source(source, fd)
            while done < count:
                self.clock.check(self.name, offset + done)  # a deadline passed between turns
                size = min(COPY_TURN, count - done)
                try:
                    got = await anyio.to_thread.run_sync(
                        copy_range, source, fd, at + done, offset + done, size
                    )
                except OSError as exc:
                    raise TransportError(
                        f"copying failed: {exc.strerror or exc}", url=self.name, position=offset
                    ) from exc
                done += got
                if got < size:
                    break
        return done

    def stage(self, offset: int, buffer: memoryview, count: int) -> int:
        """Stage a write of the open sink at once, with no await: ``buffer``, C-contiguous and
        ``count`` bytes long, for ``offset``. Returns :data:`STAGED` when it is shorter than
        :data:`WRITE_INLINE` and the first staged or following the staged writes;
        :data:`STAGED_WROTE` when it also filled the :data:`~.atomic.WRITE_CALL` block of the
        file they are in, which was written (on this thread: the caller then owes the event loop
        a turn);
        :data:`NOT_STAGED`, nothing done, when it is not that short or does not follow (then
        :meth:`write_at` writes the staged writes first, and lets the loop run other tasks).

        Staged writes are written a block at a time, each call filling one block of the file
        (the first from where the writes begin): a call that ends inside a block costs Linux
        smaller page-cache folios.
        """
        staged = self._staged
        if not staged:
            if count >= WRITE_INLINE:
                return NOT_STAGED
            self._staged_at = offset
            self._room = atomic.WRITE_CALL - offset % atomic.WRITE_CALL  # to the block's end
        elif offset != self._staged_at + staged or count >= WRITE_INLINE:
            return NOT_STAGED
        end = staged + count
        room = self._room
        if end < room:
            self._stage[staged:end] = buffer
            self._staged = end
            return STAGED
        data, taken = buffer.cast("B"), 0
        while end >= room:  # each block it fills is written now, the rest staged
            head = taken + room - staged
            self._stage[staged:room] = data[taken:head]
            self._staged = room
            self._flush()
            self._staged_at += room
            staged, taken, room = 0, head, atomic.WRITE_CALL
            end = count - taken
        self._stage[:end] = data[taken:]
        self._staged, self._room = end, room
        return STAGED_WROTE

    def _flush(self) -> None:
        """Write the staged small writes, on this thread."""
        if self._staged:
            staged, self._staged = self._staged, 0
            blocks = Blocks([memoryview(self._stage)[:staged]], self._staged_at)
            write_blocks(self._fd, blocks, self.name)

    async def read_at(self, offset: int, buffer: memoryview) -> int:
        """Read back what was written: up to ``len(buffer)`` bytes at ``offset`` into ``buffer``;
        returns how many (fewer only at the end of the file)."""
        if self._done:
            raise UsageError(f"{self.name}: the file sink is closed")
        self._flush()
        with self._in_use() as fd:
            try:
                return await anyio.to_thread.run_sync(os.preadv, fd, [buffer], offset)
            except OSError as exc:
                raise TransportError(
                    f"reading back failed: {exc.strerror or exc}", url=self.name, position=offset
                ) from exc

    async def prepare(self) -> bool:
        """Write what is staged and let its buffer go: a file held until its commit (the shards
        of a sharded write) keeps no memory."""
        self._flush()
        self._stage = bytearray()
        return True

    async def aclose(self) -> None:
        """Flush (with ``fsync``), close and move the temporary file to the destination."""
        if self._done:
            raise UsageError(f"{self.name}: the file sink is already closed")
        if self._busy:
            raise UsageError(f"{self.name}: cannot commit while writes are running")
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()  # a staged write is none
            self._flush()
            if self.fsync:
                await anyio.to_thread.run_sync(os.fsync, self._fd)
                await anyio.lowlevel.checkpoint_if_cancelled()  # cancelled meanwhile: no commit
            self._done = True
            self._commit()  # the commit point: nothing raises after it
        except BaseException as exc:
            await self.abort()
            self._raise_commit_error(exc)
            raise
        if self.fsync:
            # The file is in place; making the rename durable is best effort.
            with anyio.CancelScope(shield=True), contextlib.suppress(OSError):
                await anyio.to_thread.run_sync(fsync_directory, self._directory)

    async def abort(self) -> None:
        """Delete the temporary file (a nameless one goes with its descriptor); the descriptor
        closes once no write is running."""
        self._discard()

    def _discard(self) -> None:
        self._stage, self._staged = bytearray(), 0
        super()._discard()


_PIPE_FLAGS = os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

READER_POLL_MAX = 0.05
"""Longest pause, in seconds, between two tries to open a FIFO that has no reader yet."""


class PipeSink(PipeEnd, Sink):
    """An existing FIFO, character device or other non-regular path: written in place, front to
    back, never replaced or removed.

    ``clock`` bounds the wait for a FIFO's reader to open it and each wait for the reader to
    take more data (:class:`~stream_st.ReadTimeoutError`). There is no temporary file: a message
    aborted or failed half way is simply cut short, so the reader sees an incomplete message,
    never a complete wrong one. ``fsync`` has no meaning here.
    """

    @classmethod
    async def open(cls, path: str | os.PathLike[str], clock: Clock = UNLIMITED) -> PipeSink:
        """Open ``path`` for writing without blocking the event loop. On any failure, an
        interrupt included (a signal handler's exception, wherever Python runs it), the file is
        closed before the exception leaves."""
        name = os.fspath(path)
        opened: list[int] = []  # the descriptor, until the sink made holds it
        try:
            fd = await _open_for_writing(name, clock, opened)
            return cls(fd, name, clock=clock, opened=opened)
        except BaseException:
            for unheld in opened:
                os.close(unheld)
            raise

    async def send(self, buffer: memoryview) -> None:
        await self._send_all(self._write, buffer)

    def _write(self, view: memoryview) -> int:
        """One non-blocking ``write`` of ``view``."""
        return os.write(self._handle, view)

    async def aclose(self) -> None:
        """Close the file: the message is complete."""
        self._close()

    async def abort(self) -> None:
        """Close the file, the message cut short; nothing to remove."""
        self._close()


async def _open_for_writing(name: str, clock: Clock, opened: list[int]) -> int:
    """Open ``name`` for non-blocking writes, the descriptor appended to ``opened`` too, for
    the caller's cleanup to close (:func:`~.atomic.open_held`). A FIFO refuses (ENXIO) until
    a reader has it open: try again, pausing a little longer each time, within ``clock``'s
    limits."""
    pause = 0.001
    try:
        with clock.waiting(name, stalled="no reader opened the FIFO"):
            while True:
                try:
                    return open_held(opened, name, _PIPE_FLAGS)
                except OSError as exc:
                    if exc.errno != errno.ENXIO or not stat.S_ISFIFO(os.stat(name).st_mode):
                        break
                await anyio.sleep(pause)
                pause = min(2 * pause, READER_POLL_MAX)
    except ReadTimeoutError:
        raise
    except OSError:  # not a FIFO waiting for its reader: the plain open below says why
        pass
    return open_path(name, _PIPE_FLAGS, opened)


async def sink_for(url: str, clock: Clock, fsync: bool) -> Sink:
    """The registry's factory: the sink of a ``file://`` URL."""
    return await open_file_sink(path_from_url(url, UnsupportedSinkError), fsync=fsync, clock=clock)

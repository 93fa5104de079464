"""Local paths: a regular file, written beside its destination and moved into place only when
complete; a FIFO or a device, written through in place.

The message goes to a temporary file in the destination's directory, written with positioned writes
(``os.pwritev``) straight from the caller's memory in worker threads, so tensors may arrive in any
order and the event loop stays free; a write under :data:`WRITE_INLINE` bytes is made on the loop's
thread, quicker than the hop to a worker and back. Each call writes at most :data:`WRITE_CALL`
bytes, cut at multiples of it in the file: see there why. Where the file system allows it (Linux
``O_TMPFILE``) that file has no name until the commit: a process killed at any point (even by
SIGKILL) leaves nothing behind. Elsewhere it is a hidden file, ``.<name>.<random>.tmp``, or
``.<random>.tmp`` where that would pass the longest name the directory takes: any valid destination
name can be written. The blocks of a file of :data:`ALLOCATE_FROM` bytes or more are reserved up
front (Linux ``fallocate``): a full disk shows before any data is written, and the page-cache
writes ran faster (``benchmarks/bench_write.py --variants stream_st,nofalloc``: 1.24x paired at
load average ~2.3; 1.12x in an in-process A/B). A smaller file is not: there the reservation cost
more than it saved, and a full disk fails its first write instead, leaving nothing behind all the
same.
:meth:`FileSink.aclose` commits it: a nameless file is linked in at the destination's name when
nothing is there (``linkat``), else linked in under a short hidden name and renamed over the
destination (``os.replace``, atomic on POSIX); :meth:`FileSink.abort` deletes it. Until the commit,
the destination keeps its previous content. A symlink is written through: the file it points to is
replaced, the link stays. A file replaced keeps its permission bits.

Small writes that follow each other are staged and written together (see :class:`FileSink`), and
a whole message given at once (:meth:`FileSink.write_whole`, the drop-ins' ``save_file``) is
written with no event loop, consecutive small tensors gathered into one ``pwritev`` call per block.

A destination that exists and is not a regular file (a FIFO, ``/dev/null``, a terminal) is never
replaced: :class:`PipeSink` opens it in place and writes front to back with non-blocking writes,
waiting with ``anyio.wait_writable`` when the reader is behind. A FIFO with no reader yet is
waited for without blocking the event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator

import anyio
import anyio.lowlevel
import anyio.to_thread

from ..._util import task_group
from ...errors import (
    ReadTimeoutError,
    SourceNotFoundError,
    TransportError,
    UnsupportedSinkError,
    UsageError,
    WriterError,
)
from ..base import Sink
from ..options import UNLIMITED, Clock
from .source import PipeEnd, open_path, path_from_url

__all__ = ["Abandoned", "FileSink", "PipeSink", "open_file_sink"]

SPLIT_THRESHOLD: int | None = 8 << 20
"""Writes of at least this many bytes are shared by :data:`WRITERS` threads (``None``: never),
each taking the next :data:`WRITE_CALL` bytes in turn, so the file fills front to back.

On ext4 buffered writes to one file serialize on the inode lock, so two threads do not copy at
once; yet one thread measured as fast as two on a quiet machine and slower when other processes
compete for the two cores or for memory (0.81x at load average ~2.3).
"""

WRITERS = 2
"""Threads that share a write of at least :data:`SPLIT_THRESHOLD` bytes."""

WRITE_CALL = 256 << 10
"""The most bytes one ``pwritev`` call writes: a buffer is cut at multiples of it in the file.

Linux sizes the page-cache folios of a buffered write by the length of the call, up to 2 MiB: a
call of 2 MiB or more asks for 2 MiB folios, the size transparent huge pages take too. Where
memory is fragmented and the caller's arrays sit on huge pages (numpy asks for them from 4 MiB),
those allocations stall in compaction, and 32 MiB calls from fresh numpy arrays ran at 0.15x of
the same bytes written in 8 MiB calls by 2 threads, while a writer issuing 1 MiB calls kept that
pace in every round. The first write of a fresh process still paid for 1 MiB folios: writing
640 MiB of 64 KiB tensors took 1.5-2.1 s in 1 MiB calls, 0.47-0.78 s in 256 KiB ones (the
reference's ``save_file`` 0.52-0.87 s), and 512 MiB of 32 MiB tensors 0.45-1.43 s against
0.30-0.51 s (3 interleaved rounds each, a fresh process per run, load average ~6). Aligned
256 KiB calls ask for folios of that size; 2 GiB take 8,192 calls.
"""

WRITE_INLINE = 256 << 10
"""Writes shorter than this are made on the event loop's thread, then a checkpoint: a page-cache
copy of so few bytes (tens of microseconds) takes less time than handing it to a worker thread
and back, which cost 190 us a tensor on a busy 2-core machine. ``stream_st.numpy.save_file`` of
1,000 tensors of 4 KiB took 0.46 s with every write in a worker thread, 0.11 s with them here
(the reference 0.02-0.04 s: what is left is the writer's own work per tensor)."""

NOT_STAGED, STAGED, STAGED_WROTE = 0, 1, 2
"""What :meth:`FileSink.stage` did: nothing; staged a write; staged it and wrote a block."""

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | _CLOEXEC  # read back: FileSink.read_at
_TMPFILE_FLAGS = os.O_RDWR | getattr(os, "O_TMPFILE", 0) | _CLOEXEC

USE_TMPFILE = hasattr(os, "O_TMPFILE")
"""Write through a nameless file (``O_TMPFILE``) where the file system allows it; ``False``
always writes through a hidden named one (set by tests to exercise that path)."""

_NAME_MAX = 255
"""The longest file name, in bytes, where the directory does not say (Linux, macOS, Windows)."""

ALLOCATE_INLINE = 64 << 20
"""Files smaller than this are preallocated on the event loop thread (one quick syscall)."""

ALLOCATE_FROM = 4 << 20
"""Files smaller than this are not preallocated. Reserving the blocks of a small file cost more
than it saved: a file of 4 KiB took 185 us to write and commit with them reserved, 35 us
without; 400 KiB 258 against 79 us, 1 MiB 303 against 194 us; from 4 MiB on it paid (4 MiB
even, 8 MiB 2.0 against 6.1 ms; medians on an ext4 file system at load average ~7)."""


def _load_fallocate() -> Callable[[int, int], int] | None:
    """Linux ``fallocate(fd, 0, 0, size)`` without glibc's ``posix_fallocate`` fallback.

    ``os.posix_fallocate`` writes a zero into every block where the filesystem cannot reserve
    space (NFS, ZFS...), doubling the I/O; the raw call just fails there and is skipped.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.fallocate
    except (OSError, AttributeError):  # pragma: no cover - not glibc / musl
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int

    def fallocate(fd: int, size: int) -> int:
        """0, or the errno."""
        return 0 if function(fd, 0, 0, size) == 0 else ctypes.get_errno()

    return fallocate


_FALLOCATE = _load_fallocate()


_IOV_MAX = 1024
"""The most buffers one ``pwritev`` call takes (Linux's ``IOV_MAX``; POSIX allows no fewer
than 16, which no platform stream_st runs on comes near)."""


def _pwritev_fully(fd: int, views: list[memoryview], offset: int) -> None:
    """Positioned write of all of ``views``, back to back from ``offset`` (the kernel may take
    them in several calls)."""
    size = sum(map(len, views))
    while True:
        written = os.pwritev(fd, views, offset)
        if written == size:  # all of it, as a regular file takes it
            return
        offset += written
        size -= written
        done = 0
        while written >= len(views[done]):
            written -= len(views[done])
            done += 1
        views = views[done:]
        if written:
            views[0] = views[0][written:]


def _cut(pieces: Iterable[memoryview], offset: int) -> Iterator[tuple[int, list[memoryview]]]:
    """``pieces`` laid back to back from ``offset``, one block of :data:`WRITE_CALL` bytes of the
    file at a time: each block's offset and the views that fill it (a piece that crosses a
    block's end is cut there; a block takes at most :data:`_IOV_MAX` views)."""
    views: list[memoryview] = []
    at = end = offset
    room = WRITE_CALL - offset % WRITE_CALL  # bytes left before the block's end
    for piece in pieces:
        size = len(piece)
        if 0 < size < room and len(views) < _IOV_MAX - 1:  # most small pieces: no block ends
            views.append(piece)
            end += size
            room -= size
            continue
        start = 0
        while start < size:
            count = min(room, size - start)
            views.append(piece if count == size else piece[start : start + count])
            start += count
            end += count
            room -= count
            if not room or len(views) == _IOV_MAX:
                yield at, views
                views, at = [], end
                room = room or WRITE_CALL
    if views:
        yield at, views


class _Blocks:
    """The blocks of :func:`_cut`, handed out one at a time to the threads that share them."""

    def __init__(self, pieces: Iterable[memoryview], offset: int) -> None:
        self._blocks = _cut(pieces, offset)
        self._lock = threading.Lock()

    def take(self) -> tuple[int, list[memoryview]] | None:
        """The next block, or None when every one is taken."""
        with self._lock:
            return next(self._blocks, None)


class Abandoned(WriterError):
    """A write at once (:meth:`FileSink.write_whole`) called off by its ``stop``: nothing was
    committed and the temporary file is gone."""

    def __init__(self) -> None:
        super().__init__("the write was called off before its commit: nothing was written")


def _write_blocks(
    fd: int, blocks: _Blocks, name: str, stop: Callable[[], bool] | None = None
) -> None:
    """Write blocks taken from ``blocks`` (shared by the threads writing them) until none is
    left; a failure is a :class:`~stream_st.TransportError` naming ``name`` and the block.
    ``stop``, asked before each block, ends the writing with :class:`Abandoned` when true."""
    while (block := blocks.take()) is not None:
        if stop is not None and stop():
            raise Abandoned()
        offset, views = block
        try:
            _pwritev_fully(fd, views, offset)
        except OSError as exc:
            raise TransportError(
                f"write failed: {exc.strerror or exc}", url=name, position=offset
            ) from exc


async def _write(fd: int, buffer: memoryview, offset: int, name: str) -> None:
    """Write all of ``buffer`` at ``offset`` of the file open as ``fd``: on the event loop's
    thread when it is shorter than :data:`WRITE_INLINE`, else in worker threads, :data:`WRITERS`
    of them sharing a buffer of at least :data:`SPLIT_THRESHOLD` bytes, taking its blocks in
    turn."""
    blocks = _Blocks([buffer], offset)
    if len(buffer) < WRITE_INLINE:
        _write_blocks(fd, blocks, name)
        await anyio.lowlevel.checkpoint()
        return
    if SPLIT_THRESHOLD is None or len(buffer) < SPLIT_THRESHOLD:
        await anyio.to_thread.run_sync(_write_blocks, fd, blocks, name, None)
        return
    async with task_group() as group:
        for _ in range(WRITERS):
            group.start_soon(anyio.to_thread.run_sync, _write_blocks, fd, blocks, name, None)


def _existing(path: str) -> os.stat_result | None:
    """What is at ``path`` now (through symlinks), or None if nothing."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except ValueError as exc:  # a NUL byte: no path the OS takes
        raise UsageError(f"invalid path {path!r}: {exc}") from None
    except OSError as exc:
        raise TransportError(f"cannot look at the destination: {exc.strerror}", url=path) from exc


async def open_file_sink(
    path: str | os.PathLike[str], *, fsync: bool = False, clock: Clock = UNLIMITED
) -> Sink:
    """The sink for a local path: a :class:`PipeSink` when something other than a regular file
    or a directory is there (a FIFO, a device), written in place; else a :class:`FileSink`."""
    name = os.fspath(path)
    if replaced(name):
        return FileSink(name, fsync=fsync)
    return await PipeSink.open(name, clock)


def replaced(path: str) -> bool:
    """Whether a message for ``path`` goes to a :class:`FileSink` (nothing there, a regular
    file, or a directory, refused by it), not to a :class:`PipeSink`."""
    existing = _existing(path)
    return existing is None or stat.S_ISREG(existing.st_mode) or stat.S_ISDIR(existing.st_mode)


def _name_max(directory: str) -> int:
    """The longest file name ``directory`` takes, in bytes."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return _NAME_MAX


def _temp_name(directory: str, base: str) -> str:
    """A new hidden name beside ``base`` that fits the directory: ``.<base>.<random>.tmp``, or
    ``.<random>.tmp`` where a long ``base`` would make it too long."""
    token = secrets.token_hex(6)
    name = f".{base}.{token}.tmp"
    if len(os.fsencode(name)) > _name_max(directory):
        name = f".{token}.tmp"
    return os.path.join(directory, name)


def _open_nameless(directory: str) -> int | None:
    """A nameless file in ``directory`` that can be linked in later (``O_TMPFILE``), or None
    where the platform or the file system has none, or cannot link one in (the caller then makes
    a named one, which also reports any error the directory gives)."""
    if not USE_TMPFILE:
        return None
    try:
        fd = os.open(directory, _TMPFILE_FLAGS, 0o666)
    except OSError:  # EOPNOTSUPP, EISDIR on kernels without it; ENOENT, EACCES reported later
        return None
    try:
        device = os.fstat(fd).st_dev
        linkable = _LINKABLE.get(device)
        if linkable is None:  # learnt once per file system, with a file of no use
            linkable = _LINKABLE[device] = _links_in(directory)
    except OSError:
        linkable = False
    if not linkable:
        os.close(fd)
        return None
    return fd


_LINKABLE: dict[int, bool] = {}
"""Whether a nameless file can be linked in, by file system (``st_dev``)."""


def _links_in(directory: str) -> bool:
    """Whether a nameless file made in ``directory`` can be given a name there (``/proc`` may be
    missing, or the file system may refuse): tried with one that is then removed."""
    fd = os.open(directory, _TMPFILE_FLAGS, 0o600)
    try:
        name = _temp_name(directory, "link-probe")
        try:
            _link(fd, directory, os.path.basename(name))
        except OSError:
            return False
        os.unlink(name)
        return True
    finally:
        os.close(fd)


def _link(fd: int, directory: str, name: str) -> None:
    """Give the nameless file open as ``fd`` the name ``name`` in ``directory``: ``linkat`` of
    its ``/proc`` entry, followed (a link of the entry itself would cross file systems)."""
    folder = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=folder, follow_symlinks=True)
    finally:
        os.close(folder)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileSink(Sink):
    """A local regular file, new or replaced. ``fsync=True`` flushes the data (and then the
    directory entry) to stable storage before and after the rename, so a crash never leaves a
    partial file at the destination even after a power loss.

    The rename is the commit point. Cancelled before it (while the data is flushed, say),
    :meth:`aclose` removes the temporary file and raises; once it is done, :meth:`aclose` finishes
    (the directory flush shielded) and returns: the cancellation reaches the caller at its next
    checkpoint, with the file in place.

    Writes shorter than :data:`WRITE_INLINE` are copied into a kept buffer while each follows
    the one before in the file (:meth:`stage`), and written (on the event loop's thread) a
    :data:`WRITE_CALL` block of the file at a time as they fill it, when the next would not
    follow, before any read back, and at the commit: a message of many small tensors costs one
    ``pwritev`` call per block, not one a tensor. Such a write is no checkpoint: the loop runs
    other tasks, and a cancellation is seen, when a block is written, and at the commit (a
    cancelled write of a few small tensors still commits nothing). Checking for a cancellation
    at each cost 10-15 % of ``open_writer``'s time for 10,000 tensors of 4 KiB.
    :meth:`write_whole` writes a whole message at once, with no event loop.
    """

    random_access = True

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        super().__init__()
        self.name = os.fspath(path)
        self.fsync = fsync
        if not self.name:  # realpath would make it the working directory
            raise UsageError("the destination is an empty path: name a file")
        try:
            self._target = os.path.realpath(self.name)  # a symlink is written through
        except ValueError as exc:  # a NUL byte: no path the OS takes
            raise UsageError(f"invalid path {self.name!r}: {exc}") from None
        existing = _existing(self._target)
        directory, base = os.path.split(self._target)
        if not base or (existing is not None and stat.S_ISDIR(existing.st_mode)):
            raise TransportError("the destination is a directory", url=self.name)
        self._directory = directory
        self._fd = -1
        self._busy = 0  # positioned writes running in worker threads
        self._done = False
        self._stage = bytearray()  # small writes that follow each other, not written yet, in
        self._staged = 0  # its first bytes: a buffer made once and kept (fresh memory faults)
        self._staged_at = 0  # where in the file they go
        self._room = 0  # bytes from there to the end of its WRITE_CALL block
        self.temp_path: str | None = None  # the temporary's name; None while it has none
        fd = _open_nameless(directory)
        while fd is None:
            self.temp_path = _temp_name(directory, base)
            try:
                fd = os.open(self.temp_path, _OPEN_FLAGS, 0o666)
            except FileExistsError:  # pragma: no cover - 48 random bits collided
                continue
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"no such directory: {directory}", url=self.name) from exc
            except OSError as exc:
                raise TransportError(
                    f"cannot create a file in {directory}: {exc.strerror}", url=self.name
                ) from exc
            except BaseException:  # an interrupt as the file was made: no sink owns it yet
                with contextlib.suppress(OSError):
                    os.unlink(self.temp_path)
                raise
        self._fd = fd
        if existing is not None:  # the new file takes the old one's permission bits
            with contextlib.suppress(OSError):  # a file system without them: keep the default
                os.fchmod(self._fd, stat.S_IMODE(existing.st_mode))

    async def allocate(self, size: int) -> None:
        """Reserve ``size`` bytes on disk; a full disk raises before any data is written."""
        if _FALLOCATE is None or size < ALLOCATE_FROM or self._done:
            return
        if size < ALLOCATE_INLINE:
            error = _FALLOCATE(self._fd, size)
        else:
            self._busy += 1
            try:
                error = await anyio.to_thread.run_sync(_FALLOCATE, self._fd, size)
            finally:
                self._busy -= 1
                if self._done and not self._busy:
                    self._close_fd()
        self._reserved(size, error)

    def _reserved(self, size: int, error: int) -> None:
        """:class:`~stream_st.TransportError` if reserving ``size`` bytes failed with ``error``
        for want of room."""
        if error in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise TransportError(
                f"cannot reserve {size} bytes: {os.strerror(error)}", url=self.name, position=0
            )
        # Any other failure (EOPNOTSUPP on filesystems without it...) only costs the speed-up.

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
        self._busy += 1
        try:
            await _write(self._fd, buffer, offset, self.name)
        finally:
            self._busy -= 1
            if self._done and not self._busy:
                self._close_fd()

    def stage(self, offset: int, buffer: memoryview, count: int) -> int:
        """Stage a write of the open sink at once, with no await: ``buffer``, C-contiguous and
        ``count`` bytes long, for ``offset``. Returns :data:`STAGED` when it is shorter than
        :data:`WRITE_INLINE` and the first staged or following the staged writes;
        :data:`STAGED_WROTE` when it also filled the :data:`WRITE_CALL` block of the file they
        are in, which was written (on this thread: the caller then owes the event loop a turn);
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
            self._room = WRITE_CALL - offset % WRITE_CALL  # bytes to the block's end
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
            staged, taken, room = 0, head, WRITE_CALL
            end = count - taken
        self._stage[:end] = data[taken:]
        self._staged, self._room = end, room
        return STAGED_WROTE

    def _flush(self) -> None:
        """Write the staged small writes, on this thread."""
        if self._staged:
            staged, self._staged = self._staged, 0
            blocks = _Blocks([memoryview(self._stage)[:staged]], self._staged_at)
            _write_blocks(self._fd, blocks, self.name)

    async def read_at(self, offset: int, buffer: memoryview) -> int:
        """Read back what was written: up to ``len(buffer)`` bytes at ``offset`` into ``buffer``;
        returns how many (fewer only at the end of the file)."""
        if self._done:
            raise UsageError(f"{self.name}: the file sink is closed")
        self._flush()
        self._busy += 1
        try:
            return await anyio.to_thread.run_sync(os.preadv, self._fd, [buffer], offset)
        except OSError as exc:
            raise TransportError(
                f"reading back failed: {exc.strerror or exc}", url=self.name, position=offset
            ) from exc
        finally:
            self._busy -= 1
            if self._done and not self._busy:
                self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

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
                await anyio.to_thread.run_sync(_fsync_directory, self._directory)

    def _raise_commit_error(self, exc: BaseException) -> None:
        """An OS error ``exc`` before the commit, raised as a :class:`~stream_st.TransportError`
        (the caller re-raises anything else as it is)."""
        if isinstance(exc, OSError) and not isinstance(exc, TransportError):
            raise TransportError(
                f"cannot commit the file: {exc.strerror or exc}", url=self.name
            ) from exc

    def write_whole(
        self, pieces: Iterable[memoryview], size: int, stop: Callable[[], bool] | None = None
    ) -> None:
        """Write the whole message at once and commit it, with no event loop: ``pieces`` back to
        back, ``size`` bytes in all (reserved first from :data:`ALLOCATE_FROM`), in the blocks
        :meth:`write_at` writes, consecutive small pieces gathered into one call, in the calling
        thread (one thread, whatever the size: a second one sharing the blocks, as
        :meth:`write_at` shares a large buffer's, made the writes of 640 MiB of 64 KiB pieces,
        and of 512 MiB of 32 MiB ones, take 2-3 times as long on a loaded 2-core machine); then
        flushed (with ``fsync``) and moved into place as :meth:`aclose` does. Any failure, an
        interrupt included, removes the temporary file and raises. ``stop``, asked before each
        block and once more before the commit, calls the write off (:class:`Abandoned`) when
        true: the way another thread stops it."""
        if self._done:
            raise UsageError(f"{self.name}: the file sink is closed")
        try:
            if _FALLOCATE is not None and size >= ALLOCATE_FROM:
                self._reserved(size, _FALLOCATE(self._fd, size))
            _write_blocks(self._fd, _Blocks(pieces, 0), self.name, stop)
            if self.fsync:
                os.fsync(self._fd)
            if stop is not None and stop():
                raise Abandoned()
            self._done = True
            self._commit()  # the commit point: nothing raises after it
        except BaseException as exc:
            self._discard()
            self._raise_commit_error(exc)
            raise
        if self.fsync:
            with contextlib.suppress(OSError):  # in place: making the rename durable is best effort
                _fsync_directory(self._directory)

    def _commit(self) -> None:
        """Put the complete file at the destination and close it. A nameless file is linked in
        at the destination's name when nothing is there (the commit, with no name left behind
        at any moment), else under a new hidden name first; a named one is renamed over it."""
        directory, base = os.path.split(self._target)
        if self.temp_path is None:
            try:
                _link(self._fd, directory, base)
            except FileExistsError:  # a file to replace: rename over it, atomically
                pass
            else:
                with contextlib.suppress(OSError):  # in place: nothing raises after the commit
                    self._close_fd()
                return
            while self.temp_path is None:
                # Named before the link: an interrupt (a signal's exception) raised as the link
                # returns still finds the name to remove.
                self.temp_path = _temp_name(directory, base)
                try:
                    _link(self._fd, directory, os.path.basename(self.temp_path))
                except FileExistsError:  # 48 random bits collided: that name is not ours
                    self.temp_path = None
        self._close_fd()
        os.replace(self.temp_path, self._target)

    async def abort(self) -> None:
        """Delete the temporary file (a nameless one goes with its descriptor); the descriptor
        closes once no write is running."""
        self._discard()

    def _discard(self) -> None:
        self._done = True
        self._stage, self._staged = bytearray(), 0
        if self.temp_path is not None:
            with contextlib.suppress(OSError):  # already gone, or nothing better to do
                os.unlink(self.temp_path)
        if not self._busy:
            self._close_fd()


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
        """Open ``path`` for writing without blocking the event loop."""
        name = os.fspath(path)
        return cls(await _open_for_writing(name, clock), name, clock=clock)

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


async def _open_for_writing(name: str, clock: Clock) -> int:
    """Open ``name`` for non-blocking writes. A FIFO refuses (ENXIO) until a reader has it
    open: try again, pausing a little longer each time, within ``clock``'s limits."""
    pause = 0.001
    try:
        with clock.waiting(name, stalled="no reader opened the FIFO"):
            while True:
                try:
                    return os.open(name, _PIPE_FLAGS)
                except OSError as exc:
                    if exc.errno != errno.ENXIO or not stat.S_ISFIFO(os.stat(name).st_mode):
                        break
                await anyio.sleep(pause)
                pause = min(2 * pause, READER_POLL_MAX)
    except ReadTimeoutError:
        raise
    except OSError:  # not a FIFO waiting for its reader: the plain open below says why
        pass
    return open_path(name, _PIPE_FLAGS)


async def sink_for(url: str, clock: Clock, fsync: bool) -> Sink:
    """The registry's factory: the sink of a ``file://`` URL."""
    return await open_file_sink(path_from_url(url, UnsupportedSinkError), fsync=fsync, clock=clock)

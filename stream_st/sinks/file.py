"""A local file, written beside its destination and moved into place only when complete.

The message goes to a hidden temporary file in the destination's directory
(``.<name>.<random>.tmp``), written with positioned writes (``os.pwritev``) straight from the
caller's memory in worker threads, so tensors may arrive in any order and the event loop stays
free. The file's blocks are reserved up front (Linux ``fallocate``): a full disk shows before any
data is written, and the page-cache writes ran faster (``benchmarks/bench_write.py --variants
stream_st,nofalloc``: 1.24x paired at load average ~2.3; 1.12x in an in-process A/B).
:meth:`FileSink.aclose` renames it over the destination (``os.replace``, atomic on POSIX);
:meth:`FileSink.abort` deletes it. Until the rename, the destination keeps its previous content.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import sys
from collections.abc import Callable

import anyio
import anyio.to_thread

from .._util import task_group
from ..errors import SourceNotFoundError, TransportError, UsageError
from .base import Sink

__all__ = ["FileSink"]

SPLIT_THRESHOLD: int | None = 8 << 20
"""Writes of at least this many bytes are split between two threads (``None``: never).

On ext4 buffered writes to one file serialize on the inode lock, so two threads do not copy at
once; yet ``benchmarks/bench_write.py`` (``--variants stream_st,single``) measured the split as
fast as one thread on a quiet machine and faster when other processes compete for the two cores
or for memory: one thread ran at 0.81x of the split (paired median 1.28x for the split) at load
average ~2.3.
"""

_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)

ALLOCATE_INLINE = 64 << 20
"""Files smaller than this are preallocated on the event loop thread (one quick syscall)."""


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


def _pwrite_fully(fd: int, buffer: memoryview, offset: int) -> None:
    """Positioned write of all of ``buffer`` (the kernel may take it in several calls)."""
    while buffer:
        written = os.pwritev(fd, [buffer], offset)
        buffer = buffer[written:]
        offset += written


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileSink(Sink):
    """A local file path. ``fsync=True`` flushes the data (and then the directory entry) to
    stable storage before and after the rename, so a crash never leaves a partial file at the
    destination even after a power loss."""

    random_access = True

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        super().__init__()
        self.name = os.fspath(path)
        self.fsync = fsync
        directory, base = os.path.split(os.path.abspath(self.name))
        if not base or os.path.isdir(self.name):
            raise TransportError("the destination is a directory", url=self.name)
        self._directory = directory
        self._fd = -1
        self._busy = 0  # positioned writes running in worker threads
        self._done = False
        while True:
            self.temp_path = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
            try:
                self._fd = os.open(self.temp_path, _OPEN_FLAGS, 0o666)
                break
            except FileExistsError:  # pragma: no cover - 48 random bits collided
                continue
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"no such directory: {directory}", url=self.name) from exc
            except OSError as exc:
                raise TransportError(
                    f"cannot create a file in {directory}: {exc.strerror}", url=self.name
                ) from exc
            except ValueError as exc:  # a NUL byte: no path the OS takes
                raise UsageError(f"invalid path {self.name!r}: {exc}") from None

    async def allocate(self, size: int) -> None:
        """Reserve ``size`` bytes on disk; a full disk raises before any data is written."""
        if _FALLOCATE is None or size <= 0 or self._done:
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
        if not buffer:
            return
        self._busy += 1
        try:
            if SPLIT_THRESHOLD is None or len(buffer) < SPLIT_THRESHOLD:
                await anyio.to_thread.run_sync(_pwrite_fully, self._fd, buffer, offset)
            else:
                await self._write_halves(offset, buffer)
        except OSError as exc:
            raise TransportError(
                f"write failed: {exc.strerror or exc!r}", url=self.name, position=offset
            ) from exc
        finally:
            self._busy -= 1
            if self._done and not self._busy:
                self._close_fd()

    async def _write_halves(self, offset: int, buffer: memoryview) -> None:
        half = (len(buffer) // 2) & ~4095
        async with task_group() as group:
            for part, at in ((buffer[:half], offset), (buffer[half:], offset + half)):
                group.start_soon(anyio.to_thread.run_sync, _pwrite_fully, self._fd, part, at)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    async def aclose(self) -> None:
        """Flush (with ``fsync``), close and rename the temporary file over the destination."""
        if self._done:
            raise UsageError(f"{self.name}: the file sink is already closed")
        if self._busy:
            raise UsageError(f"{self.name}: cannot commit while writes are running")
        try:
            if self.fsync:
                await anyio.to_thread.run_sync(os.fsync, self._fd)
            self._done = True
            self._close_fd()
            os.replace(self.temp_path, self.name)
        except BaseException as exc:
            await self.abort()
            if isinstance(exc, OSError):
                raise TransportError(
                    f"cannot commit the file: {exc.strerror or exc!r}", url=self.name
                ) from exc
            raise
        if self.fsync:
            # The file is in place; making the rename durable is best effort.
            with contextlib.suppress(OSError):
                await anyio.to_thread.run_sync(_fsync_directory, self._directory)

    async def abort(self) -> None:
        """Delete the temporary file; the descriptor closes once no write is running."""
        self._done = True
        with contextlib.suppress(OSError):  # already gone, or nothing better to do
            os.unlink(self.temp_path)
        if not self._busy:
            self._close_fd()

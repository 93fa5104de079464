"""A local file, read with positioned reads (``os.preadv``) straight into the caller's buffer.

Reads run in worker threads so the event loop stays free. A large read is split in two halves
read by two threads at once: on the page cache that nearly doubles throughput on two cores.
"""

from __future__ import annotations

import os

import anyio
import anyio.to_thread

from ..errors import SourceNotFoundError, TransportError
from .base import Source

__all__ = ["FileSource"]

SPLIT_THRESHOLD = 8 << 20
"""Reads of at least this many bytes are split between two threads."""


def _pread_fully(fd: int, buffer: memoryview, offset: int) -> int:
    """Positioned read until ``buffer`` is full or the file ends; returns the bytes read."""
    filled = 0
    total = len(buffer)
    while filled < total:
        got = os.preadv(fd, [buffer[filled:]], offset + filled)
        if got == 0:
            break
        filled += got
    return filled


class FileSource(Source):
    """A local file; ``size`` is known, so truncation and trailing bytes show before any data."""

    random_access = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.name = os.fspath(path)
        try:
            self._fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:
            raise SourceNotFoundError(f"no such file: {self.name}", url=self.name) from exc
        except OSError as exc:
            raise TransportError(f"cannot open: {exc.strerror}", url=self.name) from exc
        try:
            self.size = os.fstat(self._fd).st_size
        except OSError as exc:  # pragma: no cover - fstat on an open fd does not fail in practice
            os.close(self._fd)
            raise TransportError(f"cannot stat: {exc.strerror}", url=self.name) from exc

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
            if len(buffer) < SPLIT_THRESHOLD:
                got = await anyio.to_thread.run_sync(_pread_fully, self._fd, buffer, offset)
            else:
                got = await self._read_halves(offset, buffer)
        except OSError as exc:
            raise TransportError(
                f"read failed: {exc.strerror or exc!r}", url=self.name, position=offset
            ) from exc
        self.position = offset + got
        return got

    async def _read_halves(self, offset: int, buffer: memoryview) -> int:
        half = (len(buffer) // 2) & ~4095
        counts = [0, 0]

        async def read(index: int, start: int, part: memoryview) -> None:
            counts[index] = await anyio.to_thread.run_sync(
                _pread_fully, self._fd, part, offset + start
            )

        async with anyio.create_task_group() as group:
            group.start_soon(read, 0, 0, buffer[:half])
            group.start_soon(read, 1, half, buffer[half:])
        # A short first half means the file ended inside it: the second half read nothing.
        return counts[0] if counts[0] < half else half + counts[1]

    async def aclose(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

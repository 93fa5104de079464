"""Zero-copy reading of a local file: tensors handed out as read-only views of one mapping.

The file is mapped once, read-only and shared (``MAP_SHARED``, ``PROT_READ``), as the reference
does; each tensor is a numpy view of its bytes, which keeps the mapping alive after the stream
closes. Beyond the reference, the wanted ranges are populated ahead of the consumer, one window
of :data:`WINDOW` bytes per call, with ``madvise(MADV_POPULATE_READ)`` (Linux 5.14+) in a worker
thread: the kernel maps (and, for a file not in the page cache, reads) a whole window at once
instead of taking one fault per page when the consumer first touches it, and an I/O error there
is an exception rather than a ``SIGBUS``. Where the kernel lacks it the views fault in as usual.

A ``private`` mapping (``MAP_PRIVATE``, ``PROT_READ | PROT_WRITE``) gives writable views, as the
reference's torch tensors are: a page stays the file's own (in the page cache) until it is
written, then the kernel copies it for this process alone, so writes never reach the file.
"""

from __future__ import annotations

import errno
import mmap
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio.to_thread
import numpy as np

from .errors import TransportError
from .header import TensorInfo

__all__ = ["WINDOW", "FileMap"]

WINDOW = 64 << 20
"""Bytes populated per call (at least the tensor asked for)."""

MADV_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)
"""Linux's value; Python names it only from 3.13 on."""

_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


class FileMap:
    """The mapping of an open file of ``size`` bytes (``name`` for errors); the caller keeps the
    descriptor, which may be closed at once. ``private``: writable copy-on-write views."""

    def __init__(self, fd: int, size: int, name: str, *, private: bool = False) -> None:
        self.name = name
        flags, prot = (
            (mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            if private
            else (mmap.MAP_SHARED, mmap.PROT_READ)
        )
        try:
            self._map = mmap.mmap(fd, size, flags=flags, prot=prot)
        except OSError as exc:
            raise TransportError(f"cannot map: {exc.strerror or exc}", url=name) from exc
        self._pending: deque[tuple[int, int]] = deque()
        self._populated = 0
        self._populate = hasattr(self._map, "madvise")

    def plan(self, ranges: Sequence[tuple[int, int]]) -> None:
        """The absolute byte ranges that will be viewed, ascending: only those get populated."""
        self._pending = deque(ranges)

    async def view(self, info: TensorInfo, base: int) -> np.ndarray[Any, Any]:
        """The array of ``info`` (read-only unless the mapping is private), whose data start at
        byte ``base`` of the file."""
        start = base + info.start
        end = start + info.nbytes
        if end > self._populated:
            await self._populate_to(end)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=start)
        return raw.view(info.array_dtype).reshape(info.array_shape)

    async def _populate_to(self, end: int) -> None:
        """Populate the pending ranges up to ``end`` and at least one window past their head."""
        pieces: list[tuple[int, int]] = []
        limit = max(end, self._pending[0][0] + WINDOW) if self._pending else end
        while self._pending and self._pending[0][0] < limit:
            start, stop = self._pending.popleft()
            if stop > limit:
                self._pending.appendleft((limit, stop))
                stop = limit
            pieces.append((start, stop))
        self._populated = pieces[-1][1] if pieces else end
        if self._populate and pieces:
            await anyio.to_thread.run_sync(self._advise, pieces)

    def _advise(self, pieces: list[tuple[int, int]]) -> None:
        """``MADV_POPULATE_READ`` over ``pieces``; an unsupported advice turns itself off."""
        for start, stop in pieces:
            aligned = start - start % mmap.PAGESIZE
            try:
                self._map.madvise(MADV_POPULATE_READ, aligned, stop - aligned)
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    self._populate = False
                    return
                raise TransportError(
                    f"read failed: {exc.strerror or exc}", url=self.name, position=start
                ) from exc

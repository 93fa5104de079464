"""Zero-copy reading of a local file: tensors handed out as read-only views of one mapping.

The file is mapped once, read-only and shared (``MAP_SHARED``, ``PROT_READ``), as the reference
does; each tensor is a numpy view of its bytes, which keeps the mapping alive after the stream
closes. Beyond the reference, the wanted ranges are populated ahead of the consumer, one window
of :data:`WINDOW` bytes per call, with ``madvise(MADV_POPULATE_READ)`` (Linux 5.14+): the kernel
maps (and, for a file not in the page cache, reads) a whole window at once instead of taking one
fault per page when the consumer first touches it, and an I/O error there is an exception rather
than a ``SIGBUS``. Where the kernel lacks it the views fault in as usual.

What the page cache holds is populated on the event loop's own thread, :data:`INLINE_STEP` bytes
at a time, the loop yielding between steps (a step took 0.3-1.4 ms here): a worker thread would
cost a hop per window and, in a fresh process, 4 ms to start, more than a small file's whole
load (the 44 MiB KV file spent 17 ms where the reference took 7). What is not cached goes to a
worker thread in one call per window, so the event loop never waits for the disk. Asking the
kernel to read the next window ahead (``MADV_WILLNEED``) as well was measured slower here, both
for the mapping and for copying reads (0.80x), so it is not done.

:func:`fresh_bytes` is the other side: the memory a copied tensor is read into.

A ``private`` mapping (``MAP_PRIVATE``, ``PROT_READ | PROT_WRITE``) gives writable views, as the
reference's torch tensors are: a page stays the file's own (in the page cache) until it is
written, then the kernel copies it for this process alone, so writes never reach the file.
"""

from __future__ import annotations

import errno
import mmap
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio.lowlevel
import anyio.to_thread
import numpy as np

from ...core.header import TensorInfo
from ...errors import TransportError

__all__ = ["INLINE_STEP", "WINDOW", "FileMap"]

WINDOW = 64 << 20
"""Bytes populated per call (at least the tensor asked for)."""

INLINE_STEP = 16 << 20
"""Cached bytes populated on the event loop's thread between two chances for other tasks."""

MADV_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)
"""Linux's value; Python names it only from 3.13 on."""

_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)

_UNTRACKED: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
"""Python 3.13 and later map without keeping a duplicate of the file's descriptor; before,
``mmap`` holds one for as long as the mapping (so any view of it) lives."""


class FileMap:
    """The mapping of an open file of ``size`` bytes (``name`` for errors). ``cached(offset)``
    says, without blocking, whether the page cache holds the byte at ``offset`` (by default
    nothing is taken as cached); the caller keeps the descriptor, and must keep it open for
    ``cached`` as long as views are taken. ``private``: writable copy-on-write views."""

    def __init__(
        self,
        fd: int,
        size: int,
        name: str,
        *,
        private: bool = False,
        cached: Callable[[int], bool] = lambda _: False,
    ) -> None:
        self.name = name
        flags, prot = (
            (mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            if private
            else (mmap.MAP_SHARED, mmap.PROT_READ)
        )
        try:
            self._map = mmap.mmap(fd, size, flags=flags, prot=prot, **_UNTRACKED)
        except OSError as exc:
            raise TransportError(f"cannot map: {exc.strerror or exc}", url=name) from exc
        self._cached = cached
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
        """Populate the pending ranges up to ``end`` and at least one window past their head:
        what is cached on this thread, the rest in a worker thread."""
        pieces = self._take(end)
        self._populated = pieces[-1][1] if pieces else end
        if not (self._populate and pieces):
            return
        uncached = await self._populate_cached(pieces)
        if uncached and self._populate:
            await anyio.to_thread.run_sync(self._advise, uncached)

    def _take(self, end: int) -> list[tuple[int, int]]:
        """The pending ranges up to ``end`` and at least one window past their head, taken off
        the pending ones."""
        pieces: list[tuple[int, int]] = []
        pending = self._pending
        limit = max(end, pending[0][0] + WINDOW) if pending else end
        while pending and pending[0][0] < limit:
            start, stop = pending.popleft()
            if stop > limit:
                pending.appendleft((limit, stop))
                stop = limit
            pieces.append((start, stop))
        return pieces

    async def _populate_cached(self, pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Populate ``pieces`` here, step by step, while each step's first and last bytes are
        cached; returns what is left, from the first step that is not."""
        for index, (first, stop) in enumerate(pieces):
            for start in range(first, stop, INLINE_STEP):
                end = min(start + INLINE_STEP, stop)
                if not (self._cached(start) and self._cached(end - 1)):
                    return [(start, stop), *pieces[index + 1 :]]
                self._advise([(start, end)])
                await anyio.lowlevel.checkpoint()
        return []

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

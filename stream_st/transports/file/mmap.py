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

Once the consumer is handed a tensor beyond what was populated, the pages before it are let go of
(``madvise(MADV_DONTNEED)``): a populated page stays mapped, and so counted in the process's
resident memory, until it is unmapped, so a stream whose every view was dropped held the whole
file (768 MiB of a 768 MiB file; a window and the tensor in hand now). On a shared mapping this
only drops this process's page-table entries: the bytes stay in the page cache, and a view the
caller still holds reads them again when touched. Never on a private mapping, where it would
drop the caller's writes.

:func:`fresh_bytes` is the other side: the memory a copied tensor is read into.

A ``private`` mapping (``MAP_PRIVATE``, ``PROT_READ | PROT_WRITE``) gives writable views, as the
reference's torch tensors are: a page stays the file's own (in the page cache) until it is
written, then the kernel copies it for this process alone, so writes never reach the file.

:func:`map_file` makes the mapping (for :class:`FileMap`, and for the drop-ins' local files,
:mod:`stream_st.compat._local`) holding no descriptor: Python before 3.13 keeps a duplicate of
the descriptor for as long as an ``mmap.mmap`` lives, so the C library's ``mmap`` is called
directly (POSIX), and a thousand mapped shards take no descriptor each: by the compiled module
``stream_st/transports/file/_held.c``, which also unmaps in C (a finalizer, Python code, could
be cut short by a Ctrl-C, leaving the file mapped for the life of the process), else through
ctypes, freed by a finalizer. The event loop's
modules are imported only by the methods that wait, so the drop-ins' synchronous load imports
none of them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import numpy as np

from ...core.header import TensorInfo
from ...errors import TransportError

__all__ = ["INLINE_STEP", "WINDOW", "FileMap", "Held", "map_file", "open_descriptor"]

WINDOW = 64 << 20
"""Bytes populated per call (at least the tensor asked for)."""

INLINE_STEP = 16 << 20
"""Cached bytes populated on the event loop's thread between two chances for other tasks."""

MADV_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)
"""Linux's value; Python names it only from 3.13 on."""

MADV_DONTNEED: int = getattr(mmap, "MADV_DONTNEED", 4)
"""The platform's value (Python names it where the platform has ``madvise``)."""

_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)

_UNTRACKED: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
"""Python 3.13 and later map without keeping a duplicate of the file's descriptor."""


class _LibcMapping:
    """The C library's ``mmap``, ``munmap`` and ``madvise``, where there are (POSIX)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        )
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        self.madvise = libc.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def map(self, fd: int, size: int, flags: int, prot: int) -> Any:
        """``size`` bytes of ``fd`` mapped with ``flags`` and ``prot``, as a ctypes array that
        unmaps them when it is collected."""
        address = self.mmap(None, size, prot, flags, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            _raise_errno()
        region = (ctypes.c_ubyte * size).from_address(address)
        weakref.finalize(region, self.munmap, address, size)
        return region

    def advise(self, region: Any, advice: int, start: int, length: int) -> None:
        """``madvise(advice)`` over ``length`` bytes of ``region`` from ``start``."""
        if self.madvise(ctypes.addressof(region) + start, length, advice) != 0:
            _raise_errno()


def _raise_errno() -> None:
    error = ctypes.get_errno()
    raise OSError(error, os.strerror(error))


def _libc_mapping() -> _LibcMapping | None:
    if sys.version_info >= (3, 13) or os.name != "posix":
        return None
    try:
        return _LibcMapping()
    except (OSError, AttributeError):  # pragma: no cover - a libc without mmap
        return None


def _compiled() -> tuple[Callable[[int, int, int, int], Any], Callable[[int], object]] | None:
    """The compiled module's ``map`` and ``descriptor`` (:mod:`stream_st.transports.file._held`:
    a mapping that holds no descriptor and is unmapped in C, a descriptor closed in C, where no
    interrupt can cut the release short); None where the package was built without it, or off
    POSIX."""
    if os.name != "posix":  # pragma: no cover - Windows
        return None
    try:
        from ._held import descriptor, map
    except ImportError:  # built without a C compiler: ctypes, or mmap.mmap, maps every file
        return None
    return map, descriptor


_COMPILED = _compiled()
_LIBC = None if _COMPILED is not None else _libc_mapping()


class Held(Protocol):
    """A descriptor held, closed when this is gone or by :meth:`close`."""

    def fileno(self) -> int:
        """The descriptor (-1 once closed)."""

    def close(self) -> None:
        """Close it now (once)."""


class _Held:
    """A descriptor closed when this is gone, by a finalizer (where the compiled module was not
    built: a Ctrl-C as the finalizer begins leaves the descriptor open)."""

    __slots__ = ("__weakref__", "_close", "_fd")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    def fileno(self) -> int:
        """The descriptor (-1 once closed)."""
        return self._fd if self._close.alive else -1

    def close(self) -> None:
        """Close it now (once)."""
        self._close()


def open_descriptor(path: str, flags: int) -> Held:
    """``os.open(path, flags)``, held: closed when the object returned is gone, or by its
    ``close()``. Where the compiled module was built, C code opens and holds it, with no Python
    step between where an interrupt could leave the descriptor to no one."""
    if _COMPILED is not None:
        return cast(Held, next(map(_COMPILED[1], map(os.open, (path,), (flags,)))))
    return _Held(os.open(path, flags))


def map_file(fd: int, size: int, *, private: bool = False) -> Any:
    """The file ``fd`` of ``size`` bytes mapped whole, shared and read-only, or copy-on-write
    (``private``), holding no descriptor where the platform allows: a buffer (the compiled
    module's ``Mapping``, else an ``mmap.mmap`` or a ctypes array) that unmaps when it and every
    view of it are gone. A shared mapping made by ctypes is a writable buffer: read-only views
    are for the caller to make (``memoryview(...).toreadonly()``)."""
    if os.name == "posix":
        flags, prot = (
            (mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            if private
            else (mmap.MAP_SHARED, mmap.PROT_READ)
        )
        if _COMPILED is not None:
            return _COMPILED[0](fd, size, flags, prot)
        if _LIBC is not None:
            return _LIBC.map(fd, size, flags, prot)
        return mmap.mmap(fd, size, flags=flags, prot=prot, **_UNTRACKED)
    access = mmap.ACCESS_COPY if private else mmap.ACCESS_READ  # pragma: no cover - Windows
    return mmap.mmap(fd, size, access=access, **_UNTRACKED)  # pragma: no cover


def _advise(region: Any, advice: int, start: int, length: int) -> None:
    """``madvise(advice)`` over ``length`` bytes of ``region`` (made by :func:`map_file`)."""
    if hasattr(region, "madvise"):  # an mmap.mmap, or the compiled module's Mapping
        region.madvise(advice, start, length)
    else:
        assert _LIBC is not None
        _LIBC.advise(region, advice, start, length)


class FileMap:
    """The mapping of an open file of ``size`` bytes (``name`` for errors). ``cached(offset)``
    says, without blocking, whether the page cache holds the byte at ``offset`` (by default
    nothing is taken as cached); the caller keeps the descriptor, and must keep it open for
    ``cached`` as long as views are taken. ``private``: writable copy-on-write views. ``stop``
    is called before each step of population (at most :data:`WINDOW` bytes), and raises to end
    it (a deadline passed). A shared mapping lets go of the pages before a view that needs
    population (see the module's notes): views are taken in ascending order (an earlier one
    taken after it still reads its bytes, faulted in again)."""

    def __init__(
        self,
        fd: int,
        size: int,
        name: str,
        *,
        private: bool = False,
        cached: Callable[[int], bool] = lambda _: False,
        stop: Callable[[], object] | None = None,
    ) -> None:
        self.name = name
        self._stop = stop
        try:
            self._map = map_file(fd, size, private=private)
        except OSError as exc:
            raise TransportError(f"cannot map: {exc.strerror or exc}", url=name) from exc
        buffer = memoryview(self._map)
        self._buffer = buffer if private else buffer.toreadonly()
        self._cached = cached
        self._pending: deque[tuple[int, int]] = deque()
        self._populated = 0
        self._populate = not isinstance(self._map, mmap.mmap) or hasattr(self._map, "madvise")
        self._release = self._populate and not private
        self._released = 0  # the pages before this byte were let go of

    def plan(self, ranges: Sequence[tuple[int, int]]) -> None:
        """The absolute byte ranges that will be viewed, ascending: only those get populated."""
        self._pending = deque(ranges)

    async def view(self, info: TensorInfo, base: int) -> np.ndarray[Any, Any]:
        """The array of ``info`` (read-only unless the mapping is private), whose data start at
        byte ``base`` of the file."""
        start = base + info.start
        end = start + info.nbytes
        if end > self._populated:
            self._let_go(start)
            await self._populate_to(end)
        raw = np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=start)
        return raw.view(info.array_dtype).reshape(info.array_shape)

    def _let_go(self, end: int) -> None:
        """``MADV_DONTNEED`` over the whole pages before byte ``end`` not let go of yet; a
        mapping the advice fails on (locked pages: ``EINVAL``) keeps its pages, as it would
        without it, and is not advised again."""
        end -= end % mmap.PAGESIZE
        if not self._release or end <= self._released:
            return
        try:
            _advise(self._map, MADV_DONTNEED, self._released, end - self._released)
        except OSError:
            self._release = False
            return
        self._released = end

    async def _populate_to(self, end: int) -> None:
        """Populate the pending ranges up to ``end`` and at least one window past their head:
        what is cached on this thread, the rest in a worker thread."""
        pieces = self._take(end)
        self._populated = pieces[-1][1] if pieces else end
        if not (self._populate and pieces):
            return
        uncached = await self._populate_cached(pieces)
        if uncached and self._populate:
            import anyio.to_thread

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
        import anyio.lowlevel

        for index, (first, stop) in enumerate(pieces):
            for start in range(first, stop, INLINE_STEP):
                end = min(start + INLINE_STEP, stop)
                if not (self._cached(start) and self._cached(end - 1)):
                    return [(start, stop), *pieces[index + 1 :]]
                self._advise([(start, end)])
                await anyio.lowlevel.checkpoint()
        return []

    def _advise(self, pieces: list[tuple[int, int]]) -> None:
        """``MADV_POPULATE_READ`` over ``pieces``, :data:`WINDOW` bytes at a time; an
        unsupported advice turns itself off."""
        for first, last in pieces:
            for start in range(first, last, WINDOW):
                if self._stop is not None:
                    self._stop()
                if not self._populate_step(start, min(start + WINDOW, last)):
                    return

    def _populate_step(self, start: int, end: int) -> bool:
        """``MADV_POPULATE_READ`` from ``start`` to ``end``; False where the advice is
        unsupported (population is then off)."""
        aligned = start - start % mmap.PAGESIZE
        try:
            _advise(self._map, MADV_POPULATE_READ, aligned, end - aligned)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                self._populate = False
                return False
            raise TransportError(
                f"read failed: {exc.strerror or exc}", url=self.name, position=start
            ) from exc
        return True

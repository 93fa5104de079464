"""Reading the parts of a local file that the page cache does not hold straight from the disk
(``O_DIRECT``), as the read-ahead threads of :mod:`stream_st.transports.file.readahead` do.

A buffered read of a file that is not cached makes the kernel find and map fresh page-cache
pages, read the disk into them, then copy them into the caller's memory; on the two-core
virtual machine measured here that capped a cold 1 GiB file at 1.1-1.2 GB/s, where reading it
with ``O_DIRECT`` (the disk writes into memory that is already mapped) reached 1.3-1.7 GB/s in
the same runs. Such reads must start and end on a block boundary and land in aligned memory. A
fresh array is therefore placed in its own mapping as its bytes lie in the file's blocks, with a
block to spare either side (:meth:`~stream_st.memory.recycle.Recycler.take_framed`), and read into
straight (:meth:`Direct.read_framed`); other memory (the caller's, small arrays) is read into a
bounce buffer of the thread's and copied out (:meth:`Direct.read_bounced`).

Which parts are cached is asked of the kernel with ``cachestat`` (Linux 6.5 and later), which
only counts pages: it starts no read, unlike a probe read with ``RWF_NOWAIT``, which kicks off
the kernel's own read-ahead. Where ``cachestat`` or ``O_DIRECT`` is missing (other systems,
older kernels, file systems such as tmpfs), every read goes through the page cache as before.

Bytes read this way are not left in the page cache: a second read of the file is as cold as the
first, where a buffered read would find it cached (10 GB/s against the disk's 1-1.6 here). So
by default (``STREAM_ST_DIRECT_IO`` unset or ``auto``) direct reads are used only for a file
larger than half the memory the system has available (``MemAvailable``), which the page cache
could not keep anyway and whose buffered read would push out everything else cached while the
arrays take the same memory again. ``STREAM_ST_DIRECT_IO=1`` uses them for every file's uncached
parts (a load-and-keep of a 1 GiB file evicted first: 1.08-1.11x the buffered read, paired, in 5
of 6 fresh processes here; streaming it with memory reused: no faster, 0.96x), ``0`` never.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from collections.abc import Callable
from typing import Final

import numpy as np

from ...memory.fresh import ALIGN
from .pread import pread_fully

__all__ = ["BOUNCE", "WORKERS", "Direct", "NotDirect", "Residency", "bounce_size", "enabled"]


BOUNCE = 2 << 20
"""The most one thread reads into its bounce buffer in one call (memory per thread)."""

WORKERS = 8
"""Threads reading at once once a read goes to the disk directly: two copy from the page cache
best, but the disk gave more the more was asked of it at once, measured here reading a 1 GiB
file evicted before each round straight into memory: 4 threads of 2 MiB 1.52 GB/s, 8 of 8 MiB
1.68, 16-64 threads 1.61-1.66 (medians of 5 interleaved rounds)."""

_CACHESTAT: Final = 451
"""``cachestat``'s number in Linux's common system call table (x86-64, arm64, riscv, ...)."""

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def enabled(size: int) -> bool:
    """Whether direct reads may be used for a file of ``size`` bytes: on Linux with
    ``O_DIRECT``, as ``STREAM_ST_DIRECT_IO`` says (see the module; a value other than the
    documented ones counts as ``auto``)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "O_DIRECT"):
        return False
    setting = os.environ.get("STREAM_ST_DIRECT_IO", "auto").strip().lower()
    if setting in _OFF:
        return False
    if setting in _ON:
        return True
    available = _available_memory()
    return available is not None and size > available // 2


@functools.cache
def _syscall() -> Callable[..., int] | None:
    """libc's ``syscall()``, looked up once, or None."""
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has syscall()
        return None
    syscall.restype = ctypes.c_long
    return syscall


def _available_memory() -> int | None:
    """The bytes of memory the system has available (``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


class NotDirect(Exception):
    """The file system refused a direct read (alignment it does not take): read buffered."""


class Residency:
    """What the page cache holds of the file open as ``fd``, asked of the kernel with
    ``cachestat`` (see the module). :meth:`of` gives None where the kernel cannot say."""

    def __init__(self, fd: int, syscall: Callable[..., int]) -> None:
        self._fd = fd
        self._syscall = syscall

    @classmethod
    def of(cls, fd: int) -> Residency | None:
        """A :class:`Residency` of the file open as ``fd`` (kept open by the caller), or None."""
        syscall = _syscall() if sys.platform.startswith("linux") else None
        if syscall is None:
            return None
        found = cls(fd, syscall)
        return found if found._answers(fd) else None

    def _answers(self, buffered: int) -> bool:
        """Whether the kernel says what it caches of the file, truly: its first byte, read
        through ``buffered`` (the file's ordinary descriptor) right before, must count as
        cached. ``cachestat`` fails for a file the caller may not write (Linux 6.10 and later)
        and, on an overlay file system (a container's), counts the pages of the overlay's own
        file, which never holds any: every piece would look uncached."""
        try:
            os.pread(buffered, 1, 0)
        except OSError:
            return False
        pages = self._cached(0, 1)
        return pages is not None and pages > 0

    def uncached(self, offset: int, length: int) -> bool:
        """Whether the page cache holds less than half of ``length`` bytes at ``offset``."""
        pages = self._cached(offset, length)
        if pages is None:
            return False
        first = offset // ALIGN
        total = (offset + length + ALIGN - 1) // ALIGN - first
        return pages * 2 < total

    def _cached(self, offset: int, length: int) -> int | None:
        """The pages of the range in the page cache, or None where the kernel cannot say."""
        stat = _Stat()
        area = _Range(offset, length)
        if self._syscall(_CACHESTAT, self._fd, ctypes.byref(area), ctypes.byref(stat), 0) < 0:
            return None
        return int(stat.nr_cache)


class Direct(Residency):
    """A second descriptor of an open file, with ``O_DIRECT``, and what the page cache holds of
    it. :meth:`open` gives None where direct reads are not possible."""

    @classmethod
    def open(cls, fd: int) -> Direct | None:
        """A :class:`Direct` for the file open as ``fd``, or None (see the module). ``fd`` is
        left with the kernel's read-ahead off (``POSIX_FADV_RANDOM``)."""
        try:
            size = os.fstat(fd).st_size
        except OSError:  # pragma: no cover - fstat on an open descriptor does not fail
            return None
        if not enabled(size):
            return None
        syscall = _syscall()
        if syscall is None:  # pragma: no cover - every Linux libc has syscall()
            return None
        try:  # the same file (not whatever its path names now), opened again
            direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:  # no /proc, or no O_DIRECT on this file system (tmpfs: EINVAL)
            return None
        found = cls(direct, syscall)
        try:
            same = os.path.samestat(os.fstat(fd), os.fstat(direct))
        except OSError:  # pragma: no cover - fstat on open descriptors does not fail
            same = False
        if not same or not found._answers(fd):
            found.close()
            return None
        # What is still read through the page cache (tails, pieces it mostly holds) is read as
        # asked and no further: the kernel's read-ahead would pull the parts after into the
        # cache, where they would look cached and be read through it, setting off more.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return found

    def close(self) -> None:
        """Close the second descriptor."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read_framed(self, buffered: int, frame: memoryview, offset: int, length: int) -> int:
        """Read ``length`` bytes at ``offset`` into ``frame``, which starts at the file offset of
        the block ``offset`` is in and runs at least to the block boundary after the range, and
        whose memory is aligned: straight from the disk, the whole blocks. The bytes read of the
        range (fewer where the file ends)."""
        start = offset - offset % ALIGN
        got = self._read(buffered, frame[: _blocks(offset + length - start)], start, offset)
        return min(length, got)

    def read_bounced(
        self, buffered: int, views: list[memoryview], offset: int, bounce: memoryview
    ) -> list[int]:
        """Read the adjacent ``views`` from ``offset`` (:data:`BOUNCE` bytes together at most)
        into ``bounce`` (:func:`bounce_size` bytes, aligned) straight from the disk, then copy
        them out: for memory that is not aligned as the file's blocks are. Bytes per view."""
        start = offset - offset % ALIGN
        wanted = offset + sum(len(view) for view in views) - start
        got = self._read(buffered, bounce[: _blocks(wanted)], start, offset) + offset - start
        source = np.frombuffer(bounce, dtype=np.uint8)
        counts = []
        position = offset - start
        for view in views:
            count = max(0, min(len(view), got - position))
            if count:  # numpy copies without holding the GIL
                np.copyto(np.frombuffer(view, dtype=np.uint8)[:count], source[position:][:count])
            counts.append(count)
            position += len(view)
        return counts

    def _read(self, buffered: int, area: memoryview, start: int, offset: int) -> int:
        """Fill ``area`` (whole blocks) from file offset ``start`` directly; where the file ends
        off a block boundary, or a direct read comes back short for any other reason, the rest
        up to the last block's end is read from ``buffered`` (the file's ordinary descriptor).
        The bytes read from ``offset`` on."""
        got = 0
        while got < len(area) and got % ALIGN == 0:
            try:
                count = os.preadv(self._fd, [area[got:]], start + got)
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # alignment this file system does not take
                    raise NotDirect from exc
                raise
            if count == 0:
                break
            got += count
        got += pread_fully(buffered, area[got:], start + got)
        return max(0, got - (offset - start))


def _blocks(nbytes: int) -> int:
    """``nbytes`` rounded up to whole blocks."""
    return -(-nbytes // ALIGN) * ALIGN


def bounce_size() -> int:
    """Bytes of a bounce buffer: :data:`BOUNCE` and a block either side."""
    return BOUNCE + 2 * ALIGN

"""Fresh memory for tensors to be read into: anonymous mappings of their own for large arrays, and
the block alignment direct reads need (:data:`ALIGN`).

See :func:`fresh_mapping` for the pages large arrays get.
"""

from __future__ import annotations

import _thread
import ctypes
import errno
import functools
import mmap
import sys
import weakref
from collections.abc import Callable
from typing import Any, Final

import numpy as np

__all__ = [
    "ALIGN",
    "HUGE_PAGES_HELD",
    "OWN_MAPPING_FROM",
    "fresh_bytes",
    "fresh_mapping",
    "populate",
]


OWN_MAPPING_FROM = 4 << 20
"""Fresh arrays of at least this many bytes get an anonymous mapping of their own."""


def fresh_bytes(nbytes: int) -> np.ndarray[Any, Any]:
    """A fresh, writable ``uint8`` array of ``nbytes``, for a tensor to be read into.

    From :data:`OWN_MAPPING_FROM` up it is an anonymous private mapping of its own (see
    :func:`fresh_mapping`), unmapped when the last view of it goes. An ``OSError`` (no memory
    left to map) is raised as is.
    """
    if nbytes < OWN_MAPPING_FROM:
        return np.empty(nbytes, dtype=np.uint8)
    return np.frombuffer(fresh_mapping(nbytes), dtype=np.uint8)


def fresh_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of ``nbytes``; from :data:`OWN_MAPPING_FROM` up advised to
    be backed by transparent huge pages (``MADV_HUGEPAGE``, where the system has them: many give
    them only where asked) while the mappings so advised and still in use hold less than
    :data:`HUGE_PAGES_HELD` bytes.

    A read into fresh memory spends most of its time faulting its pages in: 4 KiB pages cost one
    fault each, 8,192 for a 32 MiB tensor, and a warm 64 MiB file streamed at 0.33x a one-thread
    ``preadv`` loop into ``np.empty`` arrays (which numpy advises so); 0.85x with the advice
    (see ``docs/benchmarks.md``). But on a virtual machine that hands free 2 MiB blocks back to
    its host, a huge page carved from memory not used lately waits for the host at its first
    touch: loading and keeping 2 GiB in a fresh process took 1.8x as long with every mapping
    advised. Memory freed a moment ago (a stream's earlier tensors) is still backed, so the
    advice stops where much fresh memory is kept."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= OWN_MAPPING_FROM and _HUGE_PAGES and _huge_held.take(nbytes):
        try:
            mapping.madvise(_HUGE_PAGES)
        except OSError:  # a kernel without transparent huge pages
            _huge_held.give_back(nbytes)
        else:
            weakref.finalize(mapping, _huge_held.give_back, nbytes)
    return mapping


HUGE_PAGES_HELD = 256 << 20
"""The most bytes of mappings advised for huge pages in use at once (see :func:`fresh_mapping`):
a fresh process loading and keeping 256 MiB took 108-175 ms with the advice against 234-595
without; 1 GiB about as long either way; 2 GiB 1.8x as long with it."""


class _Held:
    """The bytes of mappings advised for huge pages still in use (any thread allocates)."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._bytes = 0

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more if they stay within :data:`HUGE_PAGES_HELD`; whether they did."""
        with self._lock:
            if self._bytes + nbytes > HUGE_PAGES_HELD:
                return False
            self._bytes += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        """A mapping of ``nbytes`` counted by :meth:`take` is unmapped, or was never advised."""
        with self._lock:
            self._bytes -= nbytes


_huge_held = _Held()

_HUGE_PAGES: Final[int] = getattr(mmap, "MADV_HUGEPAGE", 0)
"""``madvise`` advice for transparent huge pages (0 where Python has none)."""

ALIGN: Final = 4096
"""File offsets, lengths and memory of a direct read are multiples of this: the largest logical
block size in common use (most disks need 512)."""


_MADV_POPULATE_WRITE: Final = 23
"""``madvise`` advice that faults a range's pages in, writable, without writing them (Linux 5.14
and later)."""

_PAGE: Final = mmap.PAGESIZE


def populate(view: memoryview) -> bool:
    """Fault in the pages of fresh memory that a read is about to fill (``view``: writable), in
    one call, without changing a byte: the pages wholly inside ``view``; the one or two it shares
    with other memory are left to the read. A read into fresh memory spends most of its time in
    those faults (44 MiB of new 1 MiB arrays, measured here: 24 ms read, 6 ms once populated,
    the populating 16 ms), so another thread can take them off the read while it waits for
    the disk (:class:`~stream_st.transports.file.readahead.ReadAhead`). Does nothing where the
    system cannot be asked (not Linux, a kernel before 5.14); whether it was asked."""
    advise = _madvise()
    if advise is None or _refused:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = -(-address // _PAGE) * _PAGE
    end = (address + len(view)) // _PAGE * _PAGE
    if end <= start:
        return True
    if advise(start, end - start, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
        _refused.add(_MADV_POPULATE_WRITE)  # advice this kernel does not know: ask no more
        return False
    return True  # any other failure (no memory to fault in now) is left to the read


_refused: set[int] = set()
"""The advice the kernel refused as unknown (see :func:`populate`)."""


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (called without the GIL), or None where :func:`populate` cannot
    work."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has madvise()
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    advise: Callable[[int, int, int], int] = function
    return advise

"""Memory for a stream's fresh arrays, used again once the caller has dropped every array over it.

A tensor read into fresh memory pays for that memory's first touch: the kernel zeroes each new
page and maps it, one fault at a time, which here runs at about 2 GB/s whatever the thread count
(measured: 44 MiB of 1 MiB tensors kept, one or two threads, 18-30 ms), slower than copying
from the page cache (4-10 GB/s). A streaming caller drops each array before long, so the
memory of tensor i can take tensor i + 2: it is mapped already. Arrays of at least
:data:`RECYCLE_FROM` bytes each get a mapping of their own (see
:func:`~stream_st.memory.fresh.fresh_mapping`), which :class:`Recycler` keeps after the last array
over
it is gone, up to :data:`IDLE_BYTES` of such mappings per stream, and hands out again for a
tensor of the same size. A caller that keeps
every array (a load) never frees one, and costs the recycler little (:data:`KEPT_BYTES`).

:meth:`Recycler.take_framed` places an array in its mapping at a chosen distance from a block
boundary, with a block to spare either side, so that a tensor can be read from the disk straight
into it with ``O_DIRECT`` (whole blocks, at aligned addresses: see
:mod:`stream_st.transports.file.direct`).
"""

from __future__ import annotations

import mmap
import weakref
from typing import Any

import numpy as np

from .fresh import ALIGN, fresh_bytes, fresh_mapping

__all__ = ["IDLE_BYTES", "KEPT_BYTES", "RECYCLE_FROM", "Recycler"]

IDLE_BYTES = 32 << 20
"""The most memory a stream keeps for reuse that no array of the caller's uses (counted as the
arrays' bytes: a frame's two spare blocks do not count)."""

RECYCLE_FROM = 256 << 10
"""Arrays of at least this many bytes get a mapping of their own, kept for reuse; smaller ones
come from ``malloc``. (``malloc`` gives the memory of a freed 1 MiB block back to the system
as often as not: 44 MiB streamed as 1 MiB tensors ran no faster when they came from it.)"""


KEPT_BYTES = 3 * IDLE_BYTES
"""The most memory of arrays handed out a recycler keeps track of, in use or idle: a streaming
caller's recent arrays (the one it holds and those read ahead of it: 64 MiB at most) and the
idle ones. Older arrays the caller keeps are forgotten (their memory goes with them), so a
caller that keeps every array costs a look at a few hundred entries per tensor at most, and one
that drops a batch of arrays at once leaves at most this much idle until the next tensor."""


class Recycler:
    """Fresh ``uint8`` arrays for one stream (:meth:`take`), on memory used before where some is
    free. The array handed out is the one the mapping's buffer was taken by; numpy makes every
    array derived from it (views, reshapes, a torch tensor over it) keep it alive, so once a weak
    reference to it is dead, nothing uses the mapping any more."""

    def __init__(self) -> None:
        # (mapping, a weak reference to the array over it, the array's bytes)
        self._kept: list[tuple[mmap.mmap, weakref.ref[np.ndarray[Any, Any]], int]] = []
        self._dropped = False

    @property
    def dropped(self) -> bool:
        """Whether the caller has let go of an array of its own mapping this recycler handed
        out: a streaming caller, rather than one that keeps every array."""
        if not self._dropped:
            self._dropped = any(alive() is None for _, alive, _ in self._kept)
        return self._dropped

    def take(self, nbytes: int) -> np.ndarray[Any, Any]:
        """A writable ``uint8`` array of ``nbytes``; its former contents are undefined."""
        if nbytes < RECYCLE_FROM:
            return fresh_bytes(nbytes)
        return self._array(nbytes, nbytes, 0)[0]

    def take_framed(
        self, nbytes: int, phase: int
    ) -> tuple[np.ndarray[Any, Any], memoryview | None]:
        """:meth:`take`, and for an array of a mapping of its own that mapping (its *frame*):
        the array starts ``phase`` bytes (< :data:`~stream_st.memory.fresh.ALIGN`) into it
        and the frame runs on to the next block boundary after the array's end or further."""
        if nbytes < RECYCLE_FROM:
            return fresh_bytes(nbytes), None
        return self._array(nbytes + 2 * ALIGN, nbytes, phase)

    def _array(self, length: int, nbytes: int, at: int) -> tuple[np.ndarray[Any, Any], memoryview]:
        """An array of ``nbytes`` at ``at`` into a mapping of ``length`` bytes (one let go of,
        else a new one), and the mapping."""
        for index, (mapping, alive, _) in enumerate(self._kept):
            if alive() is None:
                self._dropped = True
                if len(mapping) == length:
                    array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=at)
                    self._kept[index] = (mapping, weakref.ref(array), nbytes)
                    return array, memoryview(mapping)
        mapping = fresh_mapping(length)
        array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=at)
        if nbytes <= IDLE_BYTES:
            self._make_room(nbytes)
            self._kept.append((mapping, weakref.ref(array), nbytes))
        return array, memoryview(mapping)

    def _make_room(self, nbytes: int) -> None:
        """Forget mappings, oldest first, for one of ``nbytes`` more: idle ones while the idle
        ones and it would hold more than :data:`IDLE_BYTES` (room for it, once it is let go),
        any while all and it would hold more than :data:`KEPT_BYTES`."""
        entries = [(entry, entry[1]() is None) for entry in self._kept]
        idle = sum(entry[2] for entry, free in entries if free)
        total = sum(entry[2] for entry, _ in entries)
        self._kept = []
        for entry, free in entries:
            if (free and idle + nbytes > IDLE_BYTES) or total + nbytes > KEPT_BYTES:
                idle -= entry[2] if free else 0
                total -= entry[2]
            else:
                self._kept.append(entry)

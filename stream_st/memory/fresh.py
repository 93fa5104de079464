"""Fresh memory for tensors to be read into: anonymous mappings of their own for large arrays, and
the block alignment direct reads need (:data:`ALIGN`).

See :func:`fresh_bytes` for why large arrays get a mapping of their own rather than ``np.empty``.
"""

from __future__ import annotations

import mmap
from typing import Any, Final

import numpy as np

__all__ = ["ALIGN", "OWN_MAPPING_FROM", "fresh_bytes", "fresh_mapping"]


OWN_MAPPING_FROM = 4 << 20
"""Fresh arrays of at least this many bytes get an anonymous mapping of their own."""


def fresh_bytes(nbytes: int) -> np.ndarray[Any, Any]:
    """A fresh, writable ``uint8`` array of ``nbytes``, for a tensor to be read into.

    From :data:`OWN_MAPPING_FROM` up it is an anonymous private mapping of its own, under the
    system's page-size policy, unmapped when the last view of it goes. ``np.empty`` asks for
    transparent huge pages (``MADV_HUGEPAGE``) from that size on, and on a virtual machine
    whose free memory goes back to the host, a huge page is carved from exactly those blocks:
    its first touch waits for the host to back 2 MiB, and a fresh process filling huge pages
    spent most of its time zeroing them (``clear_page``), several times what small pages from
    memory the guest already uses cost. An ``OSError`` (no memory left to map) is raised as is.
    """
    if nbytes < OWN_MAPPING_FROM:
        return np.empty(nbytes, dtype=np.uint8)
    return np.frombuffer(fresh_mapping(nbytes), dtype=np.uint8)


def fresh_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of ``nbytes``, under the system's page-size policy (see
    :func:`fresh_bytes`)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


ALIGN: Final = 4096
"""File offsets, lengths and memory of a direct read are multiples of this: the largest logical
block size in common use (most disks need 512)."""

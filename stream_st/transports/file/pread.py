"""Positioned reads of a local file that go on until the buffer is full or the file ends: one
loop for the file source (:mod:`stream_st.transports.file.source`) and the direct reads' tail
(:mod:`stream_st.transports.file.direct`), and its async form for reads of a cache's copy."""

from __future__ import annotations

import os

import anyio.to_thread

__all__ = ["PREAD_INLINE", "pread_fully", "pread_soon"]

PREAD_INLINE = 256 << 10
""":func:`pread_soon` reads up to this many bytes on the event loop's thread."""


def pread_fully(fd: int, buffer: memoryview, offset: int) -> int:
    """Positioned read until ``buffer`` is full or the file ends; returns the bytes read."""
    filled = 0
    total = len(buffer)
    while filled < total:
        got = os.preadv(fd, [buffer[filled:]], offset + filled)
        if got == 0:
            break
        filled += got
    return filled


async def pread_soon(fd: int, buffer: memoryview, offset: int) -> int:
    """:func:`pread_fully` from async code: on the event loop's thread for a read of at most
    :data:`PREAD_INLINE` bytes (cheaper than a thread hop), else in a worker thread."""
    if len(buffer) <= PREAD_INLINE:
        return pread_fully(fd, buffer, offset)
    return await anyio.to_thread.run_sync(pread_fully, fd, buffer, offset)

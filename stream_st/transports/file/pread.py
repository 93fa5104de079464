"""Positioned reads of a local file that go on until the buffer is full or the file ends: one
loop for the file source (:mod:`stream_st.transports.file.source`) and the direct reads' tail
(:mod:`stream_st.transports.file.direct`)."""

from __future__ import annotations

import os

__all__ = ["pread_fully"]


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

"""Positioned reads of a local file that go on until the buffer is full or the file ends: one
loop for the file source (:mod:`stream_st.transports.file.source`) and the direct reads' tail
(:mod:`stream_st.transports.file.direct`); and reads of what the page cache holds that never
wait for the disk, for the event loop's own thread (the source, the read-ahead)."""

from __future__ import annotations

import errno
import os

__all__ = ["RWF_NOWAIT", "pread_cached", "pread_fully"]

RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)
"""The flag for a read that only takes what the page cache holds (0 where the OS lacks it)."""


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


def pread_cached(fd: int, buffer: memoryview, offset: int) -> int:
    """Read what the page cache already holds, without ever blocking; returns the bytes read."""
    filled = 0
    total = len(buffer)
    while filled < total:
        try:
            got = os.preadv(fd, [buffer[filled:]], offset + filled, RWF_NOWAIT)
        except BlockingIOError:  # EAGAIN: the next byte is not cached
            break
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                break  # no RWF_NOWAIT on this file system: the thread does it all
            raise
        if got == 0:
            break
        filled += got
    return filled

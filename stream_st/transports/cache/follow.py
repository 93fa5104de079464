"""Two processes reading the same object at once fetch it once: the second reads the copy the
first is writing, as it grows.

The writer (the entry's lock holder, :class:`~.tee.CopyWriter`) publishes in the entry's
``.growing`` file (:class:`Growing`; JSON, replaced by a rename) the copy's version, its size and
how many bytes from the first are written, every :data:`PUBLISH_STEP` bytes (and at least every
:data:`PUBLISH_EVERY` seconds while it writes, on a slower link); it removes the file once it
stops writing (after the copy is committed, or given up). A reader that finds the lock held
and a ``.growing`` file of a live writer reads the partial copy through a :class:`FollowSource`:
each read waits until the bytes it asks for are written (polling the file every :data:`POLL`
seconds, within the read's deadline) and reads them from the partial copy. The last byte is
read only once the writer has committed the copy (it is then checked), so a follower, like the
writer, never ends a read of bytes that did not check out.

A writer that stops without committing (killed: its lock is released by the kernel; or its read
ended early, or its copy was given up) leaves the follower to read the rest from the server
itself, as a read without a cache would, for the same version of the object
(:class:`~stream_st.SourceChangedError` otherwise); one killed leaves leftovers that the
follower, taking the lock, removes. So does a writer that has written nothing for
:data:`STALL` seconds (its link stalled; the read's ``timeout`` where shorter), or for
:data:`HERE_STALL` seconds where it is in the follower's own process: the follower goes on by
itself. A byte written counts, published or not (the partial copy's modification time tells):
a slow link is no stall.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ..._util import process_running
from ...errors import SourceChangedError
from ..base import Source
from .layout import ObjectEntry
from .store import (
    HERE_STALL,
    STALL,
    EntryLock,
    Record,
    pread_soon,
    read_json,
    remove_quietly,
    stall_limit,
    write_json,
)

__all__ = [
    "HERE_STALL",
    "POLL",
    "PUBLISH_EVERY",
    "PUBLISH_STEP",
    "STALL",
    "FollowSource",
    "Growing",
    "follow",
]

PUBLISH_STEP = 1 << 20
"""The writer publishes its progress each time this many more bytes are written (and at the
end): a rename per step, and followers at most this far behind."""

PUBLISH_EVERY = HERE_STALL / 4
"""Seconds after which the writer publishes the bytes written since, fewer than
:data:`PUBLISH_STEP` (a link slower than a step in this time): followers are not held a step
behind."""

POLL = 0.01
"""Seconds between two looks of a follower at the writer's progress."""


class Growing:
    """The writer's side: the ``.growing`` file at ``path`` (see the module)."""

    def __init__(self, path: Path, state: dict[str, Any]) -> None:
        self.path = path
        self._state = state
        self._published = -1
        self._published_at = -math.inf  # monotonic time of the last publication

    @classmethod
    def start(cls, path: Path, version: str, record: Record) -> Growing:
        state = {
            "id": uuid.uuid4().hex,
            "pid": os.getpid(),
            "shown": record.shown,  # for cache ls, should the writer be killed
            "version": version,
            "size": record.size,
            "etag": record.etag,
            "last_modified": record.last_modified,
            "written": 0,
        }
        return cls(path, state)

    def publish(self, written: int) -> None:
        """``written`` bytes from the first are in the copy (published every
        :data:`PUBLISH_STEP`, at least every :data:`PUBLISH_EVERY` seconds while bytes are
        written, and when all are)."""
        now = time.monotonic()
        due = (
            written >= self._published + PUBLISH_STEP
            or written == self._state["size"]
            or now - self._published_at >= PUBLISH_EVERY
        )
        if written == self._published or not due:
            return
        self._state["written"] = written
        with contextlib.suppress(OSError):  # followers then wait, or read by themselves
            write_json(self.path, self._state)
        self._published, self._published_at = written, now

    def end(self) -> None:
        remove_quietly(self.path)


async def follow(
    entry: ObjectEntry, inner: Source, lock: EntryLock, shown: str
) -> FollowSource | None:
    """A source reading the copy another process is writing into ``entry``, when it is (the
    lock is held by a live writer that published its progress); None otherwise. ``inner`` is
    the object's remote source, not started: the follower's own, should the writer stop."""
    state = read_json(entry.growing)
    if not isinstance(state, dict) or not process_running(state.get("pid")):
        return None
    try:
        version = entry.at(str(state["version"]))
        size = int(state["size"])
        fd = os.open(version.part, os.O_RDONLY | os.O_CLOEXEC)
    except (KeyError, TypeError, ValueError, OSError):
        return None
    return FollowSource(inner, entry, version, lock, state, size, fd, shown)


class FollowSource(Source):
    """The copy another process is writing, read as it grows (see the module); the rest from
    ``inner`` should the writer stop first. ``fd``: the partial copy, opened (a commit renames
    it; the descriptor still reads it)."""

    def __init__(
        self,
        inner: Source,
        entry: ObjectEntry,
        version: ObjectEntry,
        lock: EntryLock,
        state: dict[str, Any],
        size: int,
        fd: int,
        shown: str,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.clock = inner.clock
        self.name = inner.name
        self.size = self._size = size
        self.random_access = True
        self.whole_object = True
        self._entry = entry
        self._version = version
        self._lock = lock
        self._id = state["id"]
        self._validators = (str(state.get("etag", "")), str(state.get("last_modified", "")))
        self._shown = shown
        self._fd: int | None = fd
        self._written = int(state.get("written", 0))
        self._committed = False
        self._stall = stall_limit(self.clock, lock.held_here)
        self._remote: Source | None = None  # the server, once the writer stopped first
        self._plan: list[tuple[int, int]] = []

    @property
    def by_itself(self) -> bool:
        """Whether the writer stopped first: the rest is read from the server, nothing kept."""
        return self._remote is not None

    # -- the writer's progress

    def _commit_seen(self) -> bool:
        """Whether the writer committed the copy this source reads (checked, in place)."""
        record = Record.load(self._version.record)
        if record is None or record.size != self._size or self._fd is None:
            return False
        if (record.etag, record.last_modified) != self._validators:
            return False
        try:
            return os.stat(self._version.data).st_ino == os.fstat(self._fd).st_ino
        except OSError:
            return False

    def _available(self) -> int:
        """Bytes from the first that may be read from the copy now: all once committed, else
        those written but the last byte."""
        if self._committed:
            return self._size
        return min(self._written, self._size - 1)

    def _touched(self) -> int:
        """When the partial copy was last written to (its modification time, in ns): the
        writer's progress between two publications, such as one long read of a big tensor."""
        fd = self._fd
        assert fd is not None  # open until the rest is read from the server
        return os.fstat(fd).st_mtime_ns

    async def _wait(self, end: int) -> None:
        """Wait until the copy holds the bytes up to ``end`` (:meth:`_available`), or the
        writer stopped (then :attr:`_remote` reads the rest)."""
        stalled, touched = time.monotonic(), self._touched()
        while self._available() < end and self._remote is None:
            state = read_json(self._entry.growing)
            if isinstance(state, dict) and state.get("id") == self._id:
                written = int(state.get("written", 0))
                if written > self._written:
                    self._written, stalled = written, time.monotonic()
                    continue
            elif self._commit_seen():
                self._committed = True
                continue
            else:  # the writer stopped without a copy
                await self._read_by_itself()
                return
            if self._lock.try_acquire():  # the writer is gone, its lock released
                try:
                    if self._commit_seen():
                        self._committed = True
                        continue
                    self._entry.clean()  # what a writer killed part way left
                finally:
                    self._lock.release()
                await self._read_by_itself()
                return
            mark = self._touched()
            if mark != touched:  # bytes written since, not yet published
                stalled, touched = time.monotonic(), mark
            elif time.monotonic() - stalled > self._stall:
                await self._read_by_itself()
                return
            self.clock.check(self.name, self.position)
            await anyio.sleep(POLL)

    async def _read_by_itself(self) -> None:
        """The writer stopped first: read the rest from the server, the same version."""
        inner = self.inner
        await inner.start(read_all=False)
        seen = getattr(inner, "validators", None)
        if inner.size != self._size or (isinstance(seen, tuple) and seen != self._validators):
            raise SourceChangedError(
                f"{self._shown} changed on the server while it was read "
                f"(from the copy another process was writing, which stopped at byte "
                f"{self._written})",
                url=self._shown,
                position=self.position,
            )
        await inner.plan_reads([(max(a, self.position), b) for a, b in self._plan if b > a])
        self._remote = inner
        self._close_copy()

    # -- reads

    async def read_into_at(self, offset: int, buffer: memoryview) -> int:
        end = min(offset + len(buffer), self._size)
        filled = 0
        while offset + filled < end:
            at = offset + filled
            if self._remote is not None:
                filled += await self._remote.read_into_at(at, buffer[filled : end - offset])
                break
            if self._available() <= at:
                await self._wait(at + 1)
                continue
            view = buffer[filled : min(end, self._available()) - offset]
            fd = self._fd
            assert fd is not None
            got = await pread_soon(fd, view, at)
            if got < len(view):  # the copy is shorter than the writer said
                await self._read_by_itself()
            filled += got
        self.position = offset + filled
        return filled

    async def receive_into(self, buffer: memoryview) -> int:
        return await self.read_into_at(self.position, buffer)

    async def fill(self, buffer: memoryview) -> int:
        return await self.read_into_at(self.position, buffer)

    async def skip(self, count: int) -> int:
        target = min(self.position + count, self._size)
        skipped, self.position = target - self.position, target
        return skipped

    async def plan_reads(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._plan = list(ranges)
        if self._remote is not None:
            await self._remote.plan_reads(ranges)

    def _close_copy(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    async def aclose(self) -> None:
        self._close_copy()
        await self.inner.aclose()

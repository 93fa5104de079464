"""A remote source whose bytes are also written to a local copy: :class:`TeeSource`.

Every byte the reader asks for passes through :class:`CopyWriter`: written at its offset into
the partial copy (a file beside where the copy goes, never under its final name) and hashed
while still in memory when it is the next byte in order. Bytes the partial copy already holds
(from an earlier read with ``include=``) are read from it instead of the network, and the remote
source is told to plan only the missing ranges. Once every byte of the object is held, the
copy's digest is completed (reading back only what arrived out of order), checked against what
the transport vouches for (the Hub's SHA-256, an S3 checksum), and the copy is moved into place
and recorded: before the reader hands out the last tensor. A copy that does not match raises
:class:`~stream_st.IntegrityError` and is thrown away.

Writing the copy never costs a copy of the bytes in memory: each piece is written from the
buffer it was received into (the tensor's own memory), by a worker thread, while the next piece
is received. A copy that cannot be written (a full disk) is given up with a warning; the read
goes on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread

from ..._util import task_group
from ...core.digests import Hasher, ObjectDigest, update_sliced
from ...errors import IntegrityError
from ..base import DISCARD_CHUNK, Source
from ..file.pread import pread_fully
from ..options import Transport
from .store import EntryLock, RangeSet, Record, hash_file, new_hasher, now, remove_quietly

__all__ = ["CHUNK", "CopyWriter", "Destination", "TeeSource"]

CHUNK = 4 << 20
"""A large read is received in pieces of this size, each written and hashed by a worker thread
while the next one arrives."""

INLINE = 256 << 10
"""Pieces up to this size are written and hashed on the event loop's thread."""


@dataclass
class Destination:
    """Where a copy is written and where it goes once complete.

    ``part``: the file written while bytes arrive; ``part_record``: where the ranges it holds
    are kept between reads (None: it is thrown away when the read stops short); ``commit``:
    moves the finished file into place and writes its records (blocking; given the part file
    and the record). ``expected``: the digest (hex, of ``algorithm``) the copy must have, when
    known ahead (a Hub file's SHA-256).
    """

    part: Path
    part_record: Path | None
    record: Record
    commit: Callable[[Path, Record], None]
    expected: str | None = None
    on_committed: Callable[[], None] | None = None
    held: RangeSet = field(default_factory=RangeSet)


def _allocate(fd: int, size: int) -> None:
    """Give the file ``size`` bytes, its blocks reserved up front where the file system can
    (writing into reserved blocks measured twice as fast as into a sparse file, and a full disk
    shows before the first byte); a sparse file elsewhere."""
    os.ftruncate(fd, 0)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


class CopyWriter:
    """The copy being written for one read (see the module). ``lock`` is held until the copy
    is committed or the read ends; ``check`` is the transport's digest of the object, checked
    too when it can be."""

    def __init__(
        self, destination: Destination, lock: EntryLock, name: str, check: ObjectDigest | None
    ) -> None:
        self.destination = destination
        self.lock = lock
        self.name = name
        record = destination.record
        self.size: int | None = record.size if record.size >= 0 else None
        self.held = destination.held
        part = destination.part
        part.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.given_up: str | None = None  # why no copy is kept
        if self.size is not None and os.fstat(self._fd).st_size != self.size:
            try:
                _allocate(self._fd, self.size)
            except OSError as exc:
                os.close(self._fd)
                self._fd = None
                remove_quietly(part)
                self.given_up = f"no room for the copy: {exc}"
                warnings.warn(f"{name}: not keeping a copy: {self.given_up}", RuntimeWarning, 2)
        self._hashers: list[Hasher] = [new_hasher(record.algorithm, self.size)]
        self._check = check if check is not None and check.new is not None else None
        if self._check is not None and self._check.new is not None:
            self._hashers.append(self._check.new())
        self._hashed = 0  # bytes fed to the hashers, from the first
        self.committed = False

    @property
    def active(self) -> bool:
        return self._fd is not None

    def pieces(self, start: int, end: int) -> list[tuple[int, int, bool]]:
        """``[start, end)`` cut into pieces the copy holds or not (see :meth:`RangeSet.pieces`)."""
        if not self.active:
            return [(start, end, False)]
        return list(self.held.pieces(start, end))

    def missing(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return self.held.missing(ranges) if self.active else list(ranges)

    # -- bytes in

    def _feed(self, offset: int, view: memoryview) -> None:
        """Hash the part of ``view`` (bytes at ``offset``) that comes next in order."""
        if offset <= self._hashed < offset + len(view):
            piece = view[self._hashed - offset :]
            for hasher in self._hashers:
                update_sliced(hasher, piece)
            self._hashed += len(piece)

    def _write(self, offset: int, view: memoryview, fresh: bool) -> None:
        """Write (when ``fresh``) and hash ``view``; blocking."""
        fd = self._fd
        if fd is None:
            return
        if fresh:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        self._feed(offset, view)

    async def took(self, offset: int, view: memoryview, *, fresh: bool = True) -> None:
        """Bytes at ``offset`` passed to the reader: keep them (``fresh``: they came from the
        network) and commit the copy when it is complete."""
        if not view or not self.active:
            return
        try:
            if len(view) <= INLINE:
                self._write(offset, view, fresh)
            else:
                await anyio.to_thread.run_sync(self._write, offset, view, fresh)
        except OSError as exc:
            await self.give_up(f"writing the copy failed: {exc}")
            return
        self.held.add(offset, offset + len(view))
        if self.size is not None and self.held.covers(0, self.size):
            await self.complete()

    async def read_copy(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from the partial copy (bytes it holds) at ``offset``."""
        fd = self._fd
        assert fd is not None
        if len(view) <= INLINE:
            got = pread_fully(fd, view, offset)
        else:
            got = await anyio.to_thread.run_sync(pread_fully, fd, view, offset)
        await self.took(offset, view[:got], fresh=False)
        return got

    async def ended(self, end: int) -> None:
        """The object, of unknown size until now, ended at ``end`` after a read of every byte."""
        if self.active and self.size is None:
            self.size = end
            self.destination.record.size = end
            if self.held.covers(0, end) or end == 0:
                await self.complete()

    # -- the end of the copy

    async def complete(self) -> None:
        """Every byte is held: finish the digest, check it, move the copy into place."""
        fd = self._fd
        assert fd is not None and self.size is not None
        destination = self.destination
        record = destination.record
        part = destination.part
        if self._hashed < self.size:
            for hasher in self._hashers:
                await anyio.to_thread.run_sync(hash_file, part, hasher, self._hashed, self.size)
            self._hashed = self.size
        digest = bytes(self._hashers[0].digest()).hex()
        problem = None
        if destination.expected is not None and digest != destination.expected:
            problem = (
                f"{self.name}: the bytes received do not match the {record.algorithm} the server "
                f"gave (expected {destination.expected}, got {digest}); no copy was kept"
            )
        elif self._check is not None:
            try:
                self._check.check(self._hashers[1], self.name)
            except IntegrityError as exc:
                problem = f"{exc}; no copy was kept"
        if problem is not None:
            await self._discard()
            raise IntegrityError(problem, source=self.name)
        record.digest = digest
        record.created = now()
        self._fd = None
        os.close(fd)
        try:
            await anyio.to_thread.run_sync(destination.commit, part, record)
        except OSError as exc:
            remove_quietly(part)
            self._forget_part()
            self.lock.release()
            self.given_up = f"keeping the copy failed: {exc}"
            warnings.warn(f"{self.name}: {self.given_up}", RuntimeWarning, stacklevel=2)
            return
        self._forget_part()
        self.committed = True
        self.lock.release()
        if destination.on_committed is not None:
            with contextlib.suppress(OSError):
                await anyio.to_thread.run_sync(destination.on_committed)

    def _forget_part(self) -> None:
        if self.destination.part_record is not None:
            remove_quietly(self.destination.part_record)

    async def give_up(self, reason: str) -> None:
        """Keep no copy of this read (the read itself goes on)."""
        if self.given_up is None:
            self.given_up = reason
            warnings.warn(
                f"{self.name}: not keeping a copy: {reason}", RuntimeWarning, stacklevel=3
            )
        await self._discard()

    async def _discard(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            remove_quietly(self.destination.part)
            self._forget_part()
        self.lock.release()

    async def close(self) -> None:
        """The read is over. An incomplete copy of known size is kept as a partial copy for a
        later read (its data flushed before the ranges are recorded), else thrown away."""
        fd = self._fd
        if fd is None:
            self.lock.release()
            return
        destination = self.destination
        keep = destination.part_record is not None and self.size is not None and self.held.ranges
        if not keep:
            await self._discard()
            return
        self._fd = None
        try:
            await anyio.to_thread.run_sync(os.fsync, fd)
            os.close(fd)
            fd = -1
            record = destination.record
            state = {
                "ranges": self.held.ranges,
                "size": self.size,
                "etag": record.etag,
                "last_modified": record.last_modified,
            }
            from .store import write_json

            assert destination.part_record is not None
            write_json(destination.part_record, state)
        except OSError:
            if fd >= 0:
                os.close(fd)
            remove_quietly(destination.part)
            self._forget_part()
        finally:
            self.lock.release()


class TeeSource(Source):
    """``inner`` (a remote source, already started) with every byte read also kept by
    ``writer`` (see the module); reads of bytes the partial copy holds go to it instead."""

    def __init__(self, inner: Source, writer: CopyWriter) -> None:
        super().__init__()
        self.inner = inner
        self.writer = writer
        self.name = inner.name
        self.size = inner.size
        self.whole_object = True
        self.random_access = inner.random_access
        self.clock = inner.clock
        self.position = inner.position

    async def receive_into(self, buffer: memoryview) -> int:
        return await self.read_into_at(self.position, buffer[:DISCARD_CHUNK])

    async def fill(self, buffer: memoryview) -> int:
        return await self.read_into_at(self.position, buffer)

    async def skip(self, count: int) -> int:
        if self.random_access:
            target = self.position + count
            if self.size is not None:
                target = min(target, self.size)
            skipped = target - self.position
            self.position = target
            return skipped
        return await super().skip(count)  # through receive_into: the bytes are kept

    async def read_into_at(self, offset: int, buffer: memoryview) -> int:
        if offset != self.position and not self.random_access:
            if offset < self.position:
                raise ValueError(f"{self.name} cannot seek back from {self.position} to {offset}")
            await self.skip(offset - self.position)
            if self.position != offset:
                return 0
        filled = 0
        for start, end, held in self.writer.pieces(offset, offset + len(buffer)):
            view = buffer[start - offset : end - offset]
            if held and self.writer.active:
                got = await self.writer.read_copy(start, view)
            else:
                got = await self._fetch(start, view)
            filled += got
            if got < end - start:
                break
        self.position = offset + filled
        return filled

    async def _fetch(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from the remote source at ``offset``, keeping the bytes: piece by
        piece, each written while the next is received."""
        writer = self.writer
        if len(view) <= CHUNK or not writer.active:
            got = await self.inner.read_into_at(offset, view)
            await writer.took(offset, view[:got])
            return got
        send, receive = anyio.create_memory_object_stream[tuple[int, memoryview]](1)

        async def keep() -> None:
            async with receive:
                async for at, piece in receive:
                    await writer.took(at, piece)

        got = 0
        async with task_group() as group:
            group.start_soon(keep)
            async with send:
                while got < len(view):
                    piece = view[got : got + CHUNK]
                    count = await self.inner.read_into_at(offset + got, piece)
                    if count:
                        await send.send((offset + got, piece[:count]))
                    got += count
                    if count < len(piece):
                        break
        return got

    async def plan_reads(self, ranges: Sequence[tuple[int, int]]) -> None:
        await self.inner.plan_reads(self.writer.missing(ranges))

    async def object_digest(self) -> ObjectDigest | None:
        """None: the copy's writer checks the transport's digest itself, once, for the copy
        and the read together."""
        return None

    async def at_end(self) -> bool:
        if self.size is not None:
            return self.position >= self.size
        probe = memoryview(bytearray(1))
        got = await self.inner.read_into_at(self.position, probe)
        if got:
            await self.writer.took(self.position, probe[:got])
            self.position += got
            return False
        await self.writer.ended(self.position)
        return True

    def message_read(self) -> None:
        self.inner.message_read()

    @property
    def home(self) -> str | None:
        return self.inner.home

    def add_transport(self, transport: Transport) -> None:
        """The remote source was given the operation's options when it was opened."""

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            await self.writer.close()

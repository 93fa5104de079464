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
buffer it was received into (the tensor's own memory). A large read is passed to the remote
source whole, which tells as its bytes land (:meth:`~stream_st.transports.base.Source.
read_landing`); one thread of the copy's own writes and hashes them in pieces (while the bytes
are still in the CPU's caches) as the rest arrives; the event loop only hands pieces over and,
once the read's last piece is in, waits for that one to be written: the caller's memory is
never used again while the copy still reads it. Other processes reading the same object read
the copy as it grows (see :mod:`.follow`). A copy that cannot be written (a full disk) is given
up with a warning; the read goes on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread

from ..._util import call_soon_from_thread, lock_and_condition, seen_through
from ...core.digests import Hasher, ObjectDigest, update_sliced
from ...errors import CacheWarning, IntegrityError, redact
from ..base import DISCARD_CHUNK, Source
from ..options import Transport
from .follow import PUBLISH_EVERY, Growing
from .store import (
    EntryLock,
    RangeSet,
    Record,
    hash_file,
    new_hasher,
    now,
    pread_soon,
    record_partial,
    remove_quietly,
)

__all__ = ["PIECE", "CopyWriter", "Destination", "TeeSource"]

PIECE = 1 << 20
"""The bytes of a large read are handed to the copy's thread in pieces of this size as they land,
each written and hashed while the rest arrives: small enough to be hashed from the CPU's caches
right after it is written, and for the wait on a read's last piece to be short."""

INLINE = 256 << 10
"""Reads up to this size are written and hashed on the event loop's thread (cheaper than
waking the copy's thread and waiting for it)."""


@dataclass
class Destination:
    """Where a copy is written and where it goes once complete.

    ``part``: the file written while bytes arrive; ``part_record``: where the ranges it holds
    are kept between reads (None: it is thrown away when the read stops short); ``commit``:
    moves the finished file into place and writes its records (blocking; given the part file
    and the record). ``expected``: the digest (hex, of ``algorithm``) the copy must have, when
    known ahead (a Hub file's SHA-256). ``growing``: where the bytes written so far are
    published for other processes reading the same object (see :mod:`.follow`), with
    ``version``, the copy's version name. ``reserve``: the read takes every byte, so the
    copy's blocks are reserved up front (see :func:`_allocate`); a read of part of the object
    (``include=``, a header) keeps a sparse file, which takes only the room of what it holds.
    ``kept``: the files a commit leaves, removed if the copy is found wrong afterwards (see
    :meth:`CopyWriter.refuted`). ``link``: makes the committed copy found by name (a Hub blob's
    snapshot link and ref; blocking); where it fails, the copy is kept all the same, with a
    warning.
    """

    part: Path
    part_record: Path | None
    record: Record
    commit: Callable[[Path, Record], None]
    expected: str | None = None
    on_committed: Callable[[], None] | None = None
    held: RangeSet = field(default_factory=RangeSet)
    growing: Path | None = None
    version: str = ""
    reserve: bool = True
    kept: tuple[Path, ...] = ()
    link: Callable[[], None] | None = None


def _allocate(fd: int, size: int, reserve: bool) -> None:
    """Give the file ``size`` bytes, its blocks reserved up front where the file system can and
    ``reserve`` asks (writing into reserved blocks measured twice as fast as into a sparse file,
    and a full disk shows before the first byte); a sparse file elsewhere."""
    os.ftruncate(fd, 0)
    if not reserve:
        os.ftruncate(fd, size)
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


class _Keeper:
    """The thread that writes and hashes one copy's pieces (``work``: offset, view, whether to
    write it) in the order they are handed over; started with the first piece, ended by
    :meth:`stop`. The event loop hands pieces over without waiting and waits only in
    :meth:`drained`, woken once by the thread when the last piece is done."""

    def __init__(self, work: Callable[[int, memoryview, bool], None]) -> None:
        self._work = work
        self._lock, self._cond = lock_and_condition()  # taken as self._lock (see there)
        self._pieces: deque[tuple[int, memoryview, bool]] = deque()
        self._busy = False  # the thread is working on a piece it took
        self._done: list[tuple[int, int]] = []  # ranges written since the last drained()
        self._error: OSError | None = None
        self._stopped = False
        self._waiting: anyio.Event | None = None
        self._thread: threading.Thread | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None

    @property
    def idle(self) -> bool:
        """Nothing handed over is left to do."""
        with self._lock:
            return not self._pieces and not self._busy

    def hand(self, offset: int, view: memoryview, fresh: bool) -> None:
        """Queue a piece: the thread is started (the first time) and woken before the piece is
        queued, so that a KeyboardInterrupt raised in either (see the lock) leaves no piece
        that no thread will take, which :meth:`settled` would wait for for ever."""
        with self._lock:
            if self._stopped or self._error is not None:
                return
            if self._thread is None:
                self._start()
            self._cond.notify()  # the thread takes the piece once the lock is let go
            self._pieces.append((offset, view, fresh))

    def _start(self) -> None:
        """Start the thread (called holding the lock). A start interrupted stops the keeper:
        the thread, if it runs, ends at once, and no piece is queued for it."""
        self._token = anyio.lowlevel.current_token()
        self._thread = threading.Thread(target=self._run, name="stream_st cache copy", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._stopped = True
            raise

    async def settled(self) -> None:
        """Return once nothing handed over is left to do (the thread reads no piece's memory)."""
        event = self._wait()
        if event is not None:
            await event.wait()

    async def drained(self) -> tuple[list[tuple[int, int]], OSError | None]:
        """Once nothing handed over is left to do: the ranges written since the last call, and
        the error that stopped the writing, if any (the pieces after it are dropped)."""
        await self.settled()
        with self._lock:
            done, self._done = self._done, []
            return done, self._error

    async def stop(self) -> None:
        """Drop the pieces not started and return once the thread does nothing more (it ends):
        the copy's file may be closed then. Not cancellable: a piece takes milliseconds."""
        with self._lock:
            self._stopped = True
            self._pieces.clear()
            self._cond.notify()
        event = self._wait()
        if event is not None:
            with anyio.CancelScope(shield=True):
                await event.wait()

    def _wait(self) -> anyio.Event | None:
        """An event the thread sets once it is idle; None when it is idle already."""
        with self._lock:
            if not self._pieces and not self._busy:
                return None
            if self._waiting is None:
                self._waiting = anyio.Event()
            return self._waiting

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pieces and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                offset, view, fresh = self._pieces.popleft()
                self._busy = True
            end = offset + len(view)
            error = None
            try:
                self._work(offset, view, fresh)
            except OSError as exc:
                error = exc
            del view  # hold none of the caller's memory while waiting for work
            with self._lock:
                self._busy = False
                if error is not None:
                    self._error = error
                    self._pieces.clear()
                else:
                    self._done.append((offset, end))
                if not self._pieces and self._waiting is not None:
                    assert self._token is not None
                    call_soon_from_thread(self._token, self._waiting.set)
                    self._waiting = None


class CopyWriter:
    """The copy being written for one read (see the module). ``lock`` is held until the copy
    is committed or the read ends; ``check`` is the transport's digest of the object, checked
    too when it can be. ``name``, the object's address, is kept masked (see
    :func:`~stream_st.errors.redact`): every warning and error of the copy begins with it."""

    def __init__(
        self, destination: Destination, lock: EntryLock, name: str, check: ObjectDigest | None
    ) -> None:
        self.destination = destination
        self.lock = lock
        self.name = redact(name)
        record = destination.record
        self.size: int | None = record.size if record.size >= 0 else None
        self.held = destination.held
        part = destination.part
        part.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.given_up: str | None = None  # why no copy is kept
        if self.size is not None and os.fstat(self._fd).st_size != self.size:
            try:
                _allocate(self._fd, self.size, destination.reserve)
            except OSError as exc:
                os.close(self._fd)
                self._fd = None
                remove_quietly(part)
                lock.release()  # no copy to write: another reader may fetch it meanwhile
                self.given_up = f"no room for the copy: {exc}"
                warnings.warn(f"{self.name}: not keeping a copy: {self.given_up}", CacheWarning, 2)
        self._hashers: list[Hasher] = [new_hasher(record.algorithm, self.size)]
        self._check = check if check is not None and check.new is not None else None
        if self._check is not None and self._check.new is not None:
            self._hashers.append(self._check.new())
        self._hashed = 0  # bytes fed to the hashers, from the first
        self._keeper = _Keeper(self._write)
        self.committed = False
        self._growing: Growing | None = None
        if destination.growing is not None and self.size is not None and self.active:
            self._growing = Growing.start(destination.growing, destination.version, record)
            self._publish()

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
        """Write (when ``fresh``) and hash ``view``; blocking. Never two at once: on the loop's
        thread only while the copy's thread is idle."""
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
        network) and commit the copy when it is complete. Returns once they are written."""
        if not view or not self.active:
            return
        if len(view) <= INLINE and self._keeper.idle:
            try:
                self._write(offset, view, fresh)
            except OSError as exc:
                await self.give_up(f"writing the copy failed: {exc}")
                return
            await self._kept([(offset, offset + len(view))])
            return
        for start in range(0, len(view), PIECE):
            self.hand(offset + start, view[start : start + PIECE], fresh=fresh)
        await self.written()

    def hand(self, offset: int, view: memoryview, *, fresh: bool = True) -> None:
        """Give ``view`` (bytes at ``offset``) to the copy's thread; :meth:`written` waits for
        it and every piece handed before. ``view`` must not change until then."""
        if view and self.active:
            self._keeper.hand(offset, view, fresh)

    async def settled(self) -> None:
        """Wait until every piece handed over is written (their memory is the caller's again),
        seen through whatever cancellation comes meanwhile, then raise it (see
        :func:`~stream_st._util.seen_through`; a piece takes milliseconds): a read returning
        earlier hands the caller its memory while the thread still reads it, and what the
        caller puts in it next goes into the copy as the object's bytes. The next
        :meth:`written` accounts for the pieces."""
        if not self._keeper.idle:
            await seen_through(self._keeper.settled)

    async def written(self) -> None:
        """Wait until every piece handed over is written (see :meth:`settled`), then account
        for them (and commit the copy when it is complete)."""
        await self.settled()
        done, error = await self._keeper.drained()
        if error is not None:
            await self.give_up(f"writing the copy failed: {error}")
            return
        await self._kept(done)

    async def _kept(self, ranges: list[tuple[int, int]]) -> None:
        for start, end in ranges:
            self.held.add(start, end)
        if ranges and self.size is not None and self.held.covers(0, self.size):
            await self.complete()
        elif ranges:
            self._publish()

    def _publish(self) -> None:
        """Tell other readers how many bytes from the first are written (see :mod:`.follow`)."""
        if self._growing is not None:
            ranges = self.held.ranges
            self._growing.publish(ranges[0][1] if ranges and ranges[0][0] == 0 else 0)

    def _unpublish(self) -> None:
        """No more bytes will be written: followers see the copy committed, or read on
        themselves."""
        growing, self._growing = self._growing, None
        if growing is not None:
            growing.end()

    async def read_copy(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from the partial copy (bytes it holds) at ``offset``."""
        fd = self._fd
        assert fd is not None
        got = await pread_soon(fd, view, offset)
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
        assert self._fd is not None and self.size is not None
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
        await seen_through(self._commit)
        if self.committed and destination.on_committed is not None:  # none to keep otherwise
            with contextlib.suppress(OSError):
                await anyio.to_thread.run_sync(destination.on_committed)

    async def _commit(self) -> None:
        """Close the copy, move it into place and link it (see :class:`Destination`); the
        read's cancellation, asyncio's own too, waits for the end (see
        :func:`~stream_st._util.seen_through`): these take a moment, and one cut short
        (asyncio's own cancellation goes through anyio's shields) left the whole object as a
        partial copy whose ranges no one recorded, or a Hub blob no snapshot links to. A copy
        that cannot be moved into place is thrown away, one that cannot be linked kept: each
        with a warning."""
        destination = self.destination
        fd = self._fd
        assert fd is not None
        await self._keeper.stop()
        self._fd = None
        os.close(fd)
        try:
            await anyio.to_thread.run_sync(destination.commit, destination.part, destination.record)
        except OSError as exc:
            remove_quietly(destination.part)
            self._forget_part()
            self._unpublish()
            self.lock.release()
            self.given_up = f"keeping the copy failed: {exc}"
            warnings.warn(f"{self.name}: {self.given_up}", CacheWarning, stacklevel=2)
            return
        unlinked = None
        if destination.link is not None:
            try:
                await anyio.to_thread.run_sync(destination.link)
            except OSError as exc:
                unlinked = exc
        self._forget_part()
        self.committed = True
        self._unpublish()
        self.lock.release()
        if unlinked is not None:  # its reason masked: the link is named by the file's path
            warnings.warn(
                f"{self.name}: the copy is kept, but linking it to its revision failed: "
                f"{redact(str(unlinked))}",
                CacheWarning,
                stacklevel=2,
            )

    def _forget_part(self) -> None:
        if self.destination.part_record is not None:
            remove_quietly(self.destination.part_record)

    async def give_up(self, reason: str) -> None:
        """Keep no copy of this read (the read itself goes on)."""
        if self.given_up is None:
            self.given_up = reason
            warnings.warn(f"{self.name}: not keeping a copy: {reason}", CacheWarning, stacklevel=3)
        await self._discard()

    async def _discard(self) -> None:
        await self._keeper.stop()
        self._unpublish()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            remove_quietly(self.destination.part)
            self._forget_part()
        self.lock.release()

    async def refuted(self) -> None:
        """The reader found bytes of this read that fail the file's own digests (a tensor's):
        nothing of them is kept, neither a partial copy nor one committed already (once every
        byte was held: :attr:`Destination.kept`)."""
        if self.committed:
            remove_quietly(*self.destination.kept)
        elif self.active:
            await self._discard()

    async def close(self) -> None:
        """The read is over. An incomplete copy of known size is kept as a partial copy for a
        later read (its data flushed before the ranges are recorded), else thrown away. Seen to
        its end, whatever cancellation comes (:func:`~stream_st._util.seen_through`; a read
        cancelled closes in a cancelled scope): a flush cut short left the copy's file open and
        its preallocated blocks unrecorded, as a killed writer's."""
        await seen_through(self._close)

    async def _close(self) -> None:
        await self._keeper.stop()
        self._unpublish()
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
            try:
                await anyio.to_thread.run_sync(os.fsync, fd)
            finally:
                os.close(fd)
            record = destination.record
            state = {
                "shown": record.shown,  # for cache ls and rm
                "ranges": self.held.ranges,
                "size": self.size,
                "etag": record.etag,
                "last_modified": record.last_modified,
            }
            assert destination.part_record is not None
            record_partial(destination.part, destination.part_record, state)
        except OSError:
            remove_quietly(destination.part)
            self._forget_part()
        finally:
            self.lock.release()


class TeeSource(Source):
    """``inner`` (a remote source, already started) with every byte read also kept by
    ``writer`` (see the module); reads of bytes the partial copy holds go to it instead. Its
    ``name`` is ``inner``'s masked (see :func:`~stream_st.errors.redact`), as errors show it."""

    def __init__(self, inner: Source, writer: CopyWriter) -> None:
        super().__init__()
        self.inner = inner
        self.writer = writer
        self.name = redact(inner.name)
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
        """Fill ``view`` from the remote source at ``offset``, keeping the bytes: the read is
        passed on whole (its parts, when several connections are at work, land straight in
        ``view``), and the bytes are handed to the copy's thread in pieces as the source tells
        they have landed (:meth:`~stream_st.transports.base.Source.read_landing`), written and
        hashed while the rest arrives: each :data:`PIECE`, and what landed in
        :data:`~.follow.PUBLISH_EVERY` seconds on a slower link, so that readers following the
        copy see it grow (see :mod:`.follow`). Returns once all are written (the caller may use
        ``view`` again)."""
        writer = self.writer
        if not writer.active:
            return await self.inner.read_into_at(offset, view)
        handed = 0  # bytes of ``view`` handed to the copy's thread
        handed_at = time.monotonic()

        def hand(end: int) -> None:
            nonlocal handed, handed_at
            for start in range(handed, end, PIECE):
                writer.hand(offset + start, view[start : min(end, start + PIECE)])
            handed, handed_at = end, time.monotonic()

        def landed(start: int, end: int) -> None:
            end -= offset
            if end - handed >= PIECE:
                hand(end - (end - handed) % PIECE)
            elif end > handed and time.monotonic() - handed_at >= PUBLISH_EVERY:
                hand(end)

        try:
            landing = await self.inner.read_landing(offset, view, landed)
            # None: the source cannot tell, the bytes are kept once all are in
            got = await self.inner.read_into_at(offset, view) if landing is None else landing
            if handed:
                hand(got)
        except BaseException:
            # the copy's thread may still read pieces of ``view``: a read cancelled or failed
            # waits for it (see CopyWriter.settled); the next read accounts for those pieces
            await writer.settled()
            raise
        if handed:
            await writer.written()
        else:  # all landed at once: kept as a whole (see CopyWriter.took)
            await writer.took(offset, view[:got])
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

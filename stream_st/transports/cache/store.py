"""The cache on disk: records, locks, digests of copies, and the ranges a partial copy holds.

A copy is trusted only as its record describes it. The record (JSON, beside the copy) holds the
object's version (ETag, Last-Modified, size), the digest of the copy's bytes and the copy's
fingerprint on disk (size, modification and change times, inode) as it was when the digest was
taken. A copy whose fingerprint still matches is used as it is; one whose size differs is
thrown away; one otherwise changed (written to, touched, copied) is hashed again and thrown
away unless its digest still matches. Records and copies are replaced by renames only, so a
reader never sees half of one.

A partial copy's record (:func:`record_partial`) holds the ranges it holds, written once its
bytes are flushed to disk, with the partial copy's fingerprint and a seal (a digest of the
record itself): a partial copy changed since, or a record damaged into another valid one (a
range's digit changed), is thrown away (:func:`partial_ranges`), never taken as holding bytes
it was not given.

A lock file beside each entry (``flock``, released by the kernel when its holder dies) makes one
process the writer of an entry; the others wait for it. The lock holder removes what a dead
writer left.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ...core.digests import Hasher, update_sliced
from ...core.strict_json import decode_json
from ...errors import SafetensorsError, UsageError
from ..file.pread import pread_fully
from ..http.framing import sendable
from ..options import Clock

__all__ = [
    "HERE_STALL",
    "LOCK_POLL",
    "STALL",
    "EntryLock",
    "RangeSet",
    "Record",
    "checked_copy",
    "fingerprint",
    "hash_file",
    "new_hasher",
    "now",
    "partial_ranges",
    "pread_soon",
    "put_in_place",
    "read_json",
    "record_partial",
    "remove_quietly",
    "stall_limit",
    "touch",
    "write_json",
]

LOCK_POLL = 0.05
"""Seconds between two tries at a lock another process holds."""

HASH_READ = 4 << 20
"""A copy is hashed again in reads of this size."""


def new_hasher(algorithm: str, size: int | None = None) -> Hasher:
    """A hasher of ``algorithm``: ``xxh3-128`` (stream_st's own copies), ``sha256`` (the Hub's
    LFS files) or ``git-sha1`` (the Hub's other files: git's blob id, which needs ``size``)."""
    if algorithm == "xxh3-128":
        import xxhash

        hasher: Hasher = xxhash.xxh3_128()
        return hasher
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "git-sha1" and size is not None:
        git = hashlib.sha1(usedforsecurity=False)
        git.update(b"blob %d\0" % size)
        return git
    raise UsageError(f"the cache knows no digest {algorithm!r}")


def fingerprint(path: Path) -> list[int]:
    """What changes when a file is written to, replaced or touched: size, modification and
    change times (ns) and inode."""
    info = os.stat(path)
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]


def hash_file(path: Path, hasher: Hasher, start: int = 0, end: int | None = None) -> Hasher:
    """Feed ``hasher`` bytes ``start`` to ``end`` (default: the end) of the file at ``path``;
    blocking (call it in a worker thread)."""
    buffer = memoryview(bytearray(HASH_READ))
    with open(path, "rb", buffering=0) as file:
        file.seek(start)
        left = None if end is None else end - start
        while left is None or left > 0:
            want = HASH_READ if left is None else min(HASH_READ, left)
            got = file.readinto(buffer[:want])
            if not got:
                break
            update_sliced(hasher, buffer[:got])
            if left is not None:
                left -= got
    return hasher


@dataclass
class Record:
    """What the cache knows of one copy (see the module). ``shown``: the address as shown
    (no secret); ``etag`` and ``last_modified``: the version's validators ("" when the server
    gave none); ``algorithm`` and ``digest`` (hex): of the copy's bytes; ``fingerprint``: of
    the copy on disk when its digest was last taken; ``extra``: what the Hub layout adds
    (repository, path, commit)."""

    shown: str
    size: int
    algorithm: str
    digest: str
    etag: str = ""
    last_modified: str = ""
    fingerprint: list[int] = field(default_factory=list)
    created: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Record | None:
        """The record at ``path``; None when there is none, or it is unreadable or malformed
        (a field missing, unknown or of the wrong type: a damaged record)."""
        data = read_json(path)
        if not isinstance(data, dict):
            return None
        try:
            record = cls(**data)
        except TypeError:
            return None
        return record if record._well_formed() else None

    def _well_formed(self) -> bool:
        """Whether every field has its type (as JSON gives it), the size is one, and the
        validators can be sent back in a request header (``If-None-Match``)."""
        texts = (self.shown, self.algorithm, self.digest, self.etag, self.last_modified)
        return (
            all(isinstance(text, str) for text in texts)
            and sendable(self.etag)
            and sendable(self.last_modified)
            and _integer(self.size)
            and self.size >= 0
            and isinstance(self.fingerprint, list)
            and all(_integer(part) for part in self.fingerprint)
            and isinstance(self.created, (int, float))
            and not isinstance(self.created, bool)
            and isinstance(self.extra, dict)
            and all(isinstance(v, str) for v in self.extra.values())
        )

    def save(self, path: Path) -> None:
        write_json(path, asdict(self))


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_json(path: Path) -> Any:
    """The JSON document at ``path``; None when missing or unreadable."""
    try:
        return decode_json(path.read_bytes(), os.fspath(path))
    except (OSError, SafetensorsError):
        return None


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` as JSON, through a temporary file and a rename."""
    put_in_place(path, lambda temp: temp.write_text(json.dumps(value, sort_keys=True)))


def put_in_place(path: Path, make: Callable[[Path], object]) -> None:
    """Make the file ``path`` at once: ``make`` makes it under a temporary name beside it
    (given that path; one a process of the same id left is removed first), which is renamed
    to ``path``. Where either fails, the temporary file is removed."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        remove_quietly(temp)
        make(temp)
        os.replace(temp, path)
    except BaseException:
        remove_quietly(temp)
        raise


def remove_quietly(*paths: Path) -> None:
    """Remove each file of ``paths`` that exists; one that cannot be removed (a folder made
    read-only, or replaced by a file) is left: what is not trusted is checked again."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _rehash(path: Path, record: Record) -> bool:
    """Whether the bytes at ``path`` still have the record's digest; blocking."""
    try:
        hasher = hash_file(path, new_hasher(record.algorithm, record.size))
    except (OSError, UsageError):  # a damaged record (an algorithm it cannot name)
        return False
    return bytes(hasher.digest()).hex() == record.digest


async def checked_copy(path: Path, record: Record | None, record_path: Path) -> bool:
    """Whether the copy at ``path`` may be used as the object ``record`` describes (see the
    module): the fingerprint matches, or the copy is hashed again and matches (its record then
    takes the new fingerprint). A copy that does not is removed, with its record."""
    if record is None:
        return False
    try:
        seen = fingerprint(path)
    except OSError:
        return False
    if seen[0] == record.size and seen == record.fingerprint:
        return True
    if seen[0] == record.size and await anyio.to_thread.run_sync(_rehash, path, record):
        record.fingerprint = fingerprint(path)
        with contextlib.suppress(OSError):
            record.save(record_path)
        return True
    remove_quietly(path, record_path)
    return False


def record_partial(part: Path, record_path: Path, state: dict[str, Any]) -> None:
    """Record at ``record_path`` what the partial copy at ``part`` holds (``state``: its
    ``ranges``, the object's ``size`` and what else :func:`partial_ranges` is to match), with
    the copy's fingerprint and the record's seal (see the module). Call it once the copy's
    bytes are flushed to disk (``fsync``): a record never names bytes a crash lost."""
    state = {**state, "fingerprint": fingerprint(part)}
    write_json(record_path, {**state, "seal": _seal(state)})


def partial_ranges(part: Path, record_path: Path, size: int | None, **expected: str) -> RangeSet:
    """The ranges the partial copy at ``part`` holds, as its record at ``record_path`` (see
    :func:`record_partial`) says, where the record is sealed, of an object of ``size`` with
    the ``expected`` fields (its validators), and the copy's fingerprint is the one recorded.
    Else (no record, a damaged one, another version, a copy written to, touched or replaced
    since) both files are removed and nothing is held: the reader fetches those bytes."""
    state = read_json(record_path)
    sealed = isinstance(state, dict) and state.pop("seal", None) == _seal(state)
    if (
        sealed
        and size is not None
        and state.get("size") == size
        and all(state.get(name) == value for name, value in expected.items())
    ):
        try:
            seen = fingerprint(part)
        except OSError:
            seen = []
        held = RangeSet.recorded(state.get("ranges"), size)
        if held is not None and seen[:1] == [size] and seen == state.get("fingerprint"):
            return held
    remove_quietly(part, record_path)
    return RangeSet()


def _seal(state: dict[str, Any]) -> str:
    """The digest (xxh3-128, hex) of a partial copy's record ``state``, its seal aside."""
    hasher = new_hasher("xxh3-128")
    hasher.update(json.dumps(state, sort_keys=True).encode())
    return bytes(hasher.digest()).hex()


def touch(path: Path) -> None:
    """Mark ``path`` (a record) used now: the least recently used copies go first."""
    with contextlib.suppress(OSError):
        os.utime(path)


STALL = 30.0
"""Seconds without progress by the process that writes a copy after which a reader waiting for
it stops waiting and reads the object itself (see :meth:`EntryLock.acquire` and
:mod:`.follow`)."""

HERE_STALL = 1.0
""":data:`STALL` for a writer in the reader's own process: that writer may be a handle that
reads nothing until this one is done with (two ``safe_open`` handles on one address), where a
writer streaming makes progress all along."""


def stall_limit(clock: Clock, here: bool) -> float:
    """Seconds without progress by a copy's writer after which a reader waiting for it reads
    the object itself: :data:`HERE_STALL` for a writer in this process (``here``), else
    :data:`STALL`; at most ``clock``'s ``timeout`` (the longest any one wait may last)."""
    limit = HERE_STALL if here else STALL
    timeout = clock.limits.timeout
    return limit if timeout is None else min(limit, timeout)


_HELD_HERE: set[tuple[int, int]] = set()
"""The entries' lock files this process holds, by device and inode (however their path is
spelled): a second reader in the process would wait for itself, and reads by itself instead."""


class EntryLock:
    """An exclusive ``flock`` on the file at ``path``: one writer per entry, across processes
    and within one. The file stays (removing a lock file races with its next user)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._identity = (0, 0)  # the lock file's device and inode, while held

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def held_here(self) -> bool:
        """Whether another reader in this process holds the lock."""
        if self._fd is not None or not _HELD_HERE:
            return False
        try:
            info = os.stat(self.path)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) in _HELD_HERE

    def try_acquire(self) -> bool:
        """Take the lock if it is free; True when taken."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)  # flock: no write
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise
        self._fd = fd
        info = os.fstat(fd)
        self._identity = (info.st_dev, info.st_ino)
        _HELD_HERE.add(self._identity)
        return True

    async def acquire(
        self,
        clock: Clock,
        name: str,
        progress: Callable[[], object],
        give_way: Callable[[], Awaitable[bool]] | None = None,
    ) -> bool:
        """Take the lock, waiting while its holder makes progress (what ``progress()`` returns
        changes at least every :func:`stall_limit` seconds), within ``clock``'s deadline.
        False, without the lock, where the holder stalled, or where ``give_way()``, asked at
        each look, is True (the reader found another way to the bytes: the copy the holder is
        writing, followed). A try never blocks (``LOCK_NB``): it is made on the event loop's
        thread."""
        seen, since = progress(), time.monotonic()
        while not self.try_acquire():
            if give_way is not None and await give_way():
                return False
            clock.check(name)
            await anyio.sleep(LOCK_POLL)
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > stall_limit(clock, self.held_here):
                return False
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _HELD_HERE.discard(self._identity)
            os.close(fd)  # closing the descriptor releases the flock


class RangeSet:
    """Sorted, disjoint ``[start, end)`` ranges of bytes a partial copy holds (touching ranges
    merged). Found by bisection: a copy made of many small reads (one row each) stays cheap."""

    def __init__(self, ranges: Iterable[Iterable[int]] = ()) -> None:
        self.ranges: list[tuple[int, int]] = []
        for start, end in ranges:
            self.add(int(start), int(end))

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        ranges = self.ranges
        low = bisect.bisect_left(ranges, start, key=lambda each: each[1])  # first reaching it
        high = bisect.bisect_right(ranges, end, key=lambda each: each[0])  # first past it
        if low < high:
            start, end = min(start, ranges[low][0]), max(end, ranges[high - 1][1])
        ranges[low:high] = [(start, end)]

    @classmethod
    def recorded(cls, ranges: object, size: int) -> RangeSet | None:
        """The ranges a partial copy's record lists, when they are pairs of integers that lie
        in ``[0, size)``; None for any other value (a damaged record)."""
        try:
            held = cls(ranges)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        spans = held.ranges
        return held if not spans or (spans[0][0] >= 0 and spans[-1][1] <= size) else None

    def total(self) -> int:
        return sum(end - start for start, end in self.ranges)

    def covers(self, start: int, end: int) -> bool:
        at = bisect.bisect_right(self.ranges, start, key=lambda each: each[0]) - 1
        return at >= 0 and self.ranges[at][1] >= end

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, int, bool]]:
        """``[start, end)`` cut at the ranges' edges: ``(start, end, held)`` in order."""
        at = start
        ranges = self.ranges
        first = bisect.bisect_right(ranges, start, key=lambda each: each[1])
        for index in range(first, len(ranges)):
            low, high = ranges[index]
            if low >= end:
                break
            if low > at:
                yield at, low, False
            yield max(at, low), min(high, end), True
            at = min(high, end)
        if at < end:
            yield at, end, False

    def missing(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The parts of ``ranges`` not held, in order."""
        return [
            (a, b) for start, end in ranges for a, b, held in self.pieces(start, end) if not held
        ]


def now() -> float:
    return time.time()


PREAD_INLINE = 256 << 10
""":func:`pread_soon` reads up to this many bytes of a copy on the event loop's thread."""


async def pread_soon(fd: int, buffer: memoryview, offset: int) -> int:
    """:func:`~stream_st.transports.file.pread.pread_fully` of a copy from async code: on the
    event loop's thread for a read of at most :data:`PREAD_INLINE` bytes (cheaper than a thread
    hop), else in a worker thread."""
    if len(buffer) <= PREAD_INLINE:
        return pread_fully(fd, buffer, offset)
    return await anyio.to_thread.run_sync(pread_fully, fd, buffer, offset)

"""Many ranges of a local file read into memory that already exists, by worker threads that never
wait for the event loop.

Reading a file tensor by tensor costs two thread hops per tensor: the loop hands the read to the
threads, then sleeps until they hand it back, and meanwhile the threads have nothing to do. On a
virtual machine waking an idle CPU is slow (measured here: 1.2 ms per hand-over for a 16 MiB
tensor read by two threads, where the copy itself takes 1.6 ms), so a 256 MiB model of 16 MiB
tensors loaded at 5.5 GB/s instead of the 10 GB/s two threads reach when kept busy.
:class:`ReadAhead` takes every read the caller knows of (:meth:`ReadAhead.add`), cut into pieces
of at most :data:`PIECE` bytes; two threads take the pieces in file order, adjacent pieces in
one ``preadv`` call (so many small tensors cost one system call), and tell the loop only when the
job it waits for (:meth:`ReadAhead.wait`) is complete. The loop meanwhile hands out finished
tensors and queues more.

A job may also be fed to a function as it lands (a hash: ``feed=`` of :meth:`ReadAhead.add`):
it is then cut into pieces of :data:`FEED_PIECE`, each read alone and fed at once, while its
bytes are still in the CPU's cache. While a later job waits, one thread takes the fed job's
pieces still in line (as far as the page cache holds them as it holds the first) and reads them
in order (the other threads take the later jobs); else the pieces are shared, and the thread
that reads the piece next in order feeds it, then any later piece another thread has read
meanwhile (:class:`InOrder`); no thread waits for another's turn. The job is complete once every
piece is fed.

Parts of the file the page cache does not hold are read straight from the disk, in smaller
pieces by more threads (:mod:`stream_st.transports.file.direct`): the threads ask the kernel,
piece by piece, which way to read. Where reads go through the page cache (by default, for files
up to half the memory available), the file is advised ``POSIX_FADV_SEQUENTIAL``: the kernel then
reads ahead of the threads twice as far as by default, so the disk has more to do while a thread
copies or waits to be scheduled (a cold 1 GiB file of 32 MiB tensors, each read in a fresh
process, paired per round: streamed 1.23x as fast, twice, loaded and kept 1.14x, on 2 loaded
cores). Where the kernel says what it caches (``cachestat``, for a file the caller may write,
not through an overlay file system), pieces it lacks are read by one thread at a time: two
threads reading cold pieces at once break the one sequential read the kernel reads ahead of
(measured here: 0.76x one thread). The other thread meanwhile faults in
the fresh memory of the pieces after (:func:`~stream_st.memory.fresh.populate`), work a read
into new memory otherwise does itself, page by page: a cold 44 MiB KV cache of 1 MiB tensors,
each read in a fresh process, paired per round, loaded and kept 1.47x as fast as before and
streamed 1.74x.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel

from ..._util import call_soon_from_thread, let_go, lock_and_condition
from ...errors import TransportError
from ...memory.fresh import ALIGN, populate
from . import direct as _direct
from .direct import Direct, NotDirect, Residency

__all__ = ["FEED_PIECE", "PIECE", "InOrder", "ReadAhead", "read_ahead"]

PIECE = 8 << 20
"""The most one thread reads in one call: 8 MiB measured best of 1 to 16 MiB (a 256 MiB file of
16 MiB tensors into existing memory, page cache warm, 2 cores)."""

FEED_PIECE = 1 << 20
"""The pieces a fed job is cut into (see the module). 1 MiB fits the L2 cache with room to
spare, and a verified read measured no slower with it than with 256 or 512 KiB (more system
calls) and faster than with 2 to 8 MiB (the piece leaves the cache before it is hashed)."""

WORKERS = 2
"""Threads reading at once: two cores copy from the page cache twice as fast as one (and 4
threads 0.94x as fast as 2). Once a piece is read from the disk directly, more threads start
(:data:`stream_st.transports.file.direct.WORKERS`)."""

JOIN_WAIT = 0.5
"""The most seconds :meth:`ReadAhead.close` blocks waiting for the threads to end."""

_IOV_MAX = 512
"""The most adjacent pieces one ``preadv`` call takes (Linux allows 1024 buffers)."""

_POPULATE_LOOK = 64
"""The most pieces waiting in line a thread looks through for fresh memory to populate."""

_BUFFERED, _DIRECT, _COLD, _POPULATE = range(4)
"""What a worker does with the pieces it takes (:meth:`ReadAhead._take`): read them through the
page cache, read them from the disk directly, read them through the page cache while it lacks
them (one thread at a time), or fault in their memory."""


def _preadv_fully(fd: int, views: list[memoryview], offset: int) -> list[int]:
    """Read the adjacent ``views`` from ``offset`` until full or the file ends; bytes per view."""
    counts = [0] * len(views)
    index = 0
    position = offset
    while index < len(views):
        got = os.preadv(fd, [views[index][counts[index] :], *views[index + 1 :]], position)
        if got == 0:
            break
        position += got
        while got and index < len(views):
            take = min(got, len(views[index]) - counts[index])
            counts[index] += take
            got -= take
            if counts[index] == len(views[index]):
                index += 1
    return counts


class InOrder:
    """Feeds the pieces of one range of a file to ``feed`` in file order, whatever order threads
    finish them in, never making a thread wait for another: the thread that finishes the piece
    next in order (:meth:`done`) feeds it, then every later piece already finished, while the
    other threads go on reading (so the thread that feeds reads fewer). A piece that came back
    short (the file ended in it) is fed as far as it was filled and ends the feeding: later
    pieces are only counted. ``fed`` is called, holding no lock, with each piece's size once it
    is fed (or passed over); :meth:`stop` (a thread failed) ends the feeding."""

    def __init__(
        self, feed: Callable[[memoryview], None], start: int, fed: Callable[[int], None]
    ) -> None:
        self._feed = feed
        self._fed = fed
        self._lock = threading.Lock()
        self._ready: dict[int, tuple[memoryview, int]] = {}  # by file offset: (view, bytes read)
        self._next = start  # the file offset of the next piece to feed
        self._feeding = False  # a thread is feeding: pieces finished meanwhile are left to it
        self._ended = False  # a short piece was fed: the file ended
        self._stopped = False

    def done(self, offset: int, view: memoryview, count: int) -> None:
        """The piece at file ``offset`` is read, ``count`` bytes of ``view``: feed it (and those
        after it) now, or leave it to the thread feeding."""
        with self._lock:
            self._ready[offset] = (view, count)
            if self._feeding:
                return
            self._feeding = True
        while True:
            with self._lock:
                if self._stopped or self._next not in self._ready:
                    self._feeding = False
                    return
                view, count = self._ready.pop(self._next)
                self._next += len(view)
                feeding = not self._ended
                self._ended |= count < len(view)
            try:
                if feeding:
                    self._feed(view[:count])
            except BaseException:
                self.stop()
                raise
            del view
            self._fed(count)

    def stop(self) -> None:
        """Feed nothing more."""
        with self._lock:
            self._stopped = True
            self._ready.clear()


_Piece = tuple[int, int, memoryview, memoryview | None]
"""A piece of a job: the job's number, the file offset, the view to fill and its frame (memory
around it from the file offset's block on, aligned, for a direct read; or None)."""


class ReadAhead:
    """Reads of ``fd`` into caller-given views, done by worker threads (see the module).

    Jobs are numbered in the order they are added; :meth:`wait` returns a job's byte count once
    every piece of it is read (fewer than asked where the file ended). A failed read stops all
    work and is raised, as :class:`~stream_st.TransportError`, by every later :meth:`wait`; so is
    a job left unread by :meth:`stop` (the reader closed from another task while it waits).
    """

    def __init__(
        self,
        fd: int,
        name: str,
        direct: Direct | None = None,
        residency: Residency | None = None,
    ) -> None:
        self._fd = fd
        self._name = name
        self._direct = direct
        self._residency = residency  # what the page cache holds, where the kernel can say
        self._cold_reading = False  # a thread reads pieces the page cache lacks
        self._fresh: set[int] = set()  # jobs of fresh memory, not yet complete
        self._populated_to = 0  # the file offset fresh memory has been populated up to
        self._lock, self._cond = lock_and_condition()  # taken as self._lock (see there)
        self._pieces: deque[_Piece] = deque()
        self._left: list[int] = []  # pieces of each job not yet read
        self._got: list[int] = []  # bytes each job received
        self._feeds: dict[int, InOrder] = {}  # of the fed jobs not yet complete
        self._stopped = False
        self._error: BaseException | None = None
        self._waiting: tuple[int, anyio.Event] | None = None
        self._threads: list[threading.Thread] = []  # worker threads started
        # The threads that have ended, each adding itself, rather than a count of those
        # running: a KeyboardInterrupt raised (see the lock) as a thread.start() returned,
        # before the count, made the close wait for ever. A thread so started but never
        # listed is waited for by nobody: it comes before any job, and ends at the stop.
        self._ended: set[threading.Thread] = set()
        self._all_ended: anyio.Event | None = None
        self._token = anyio.lowlevel.current_token()

    def add(
        self,
        offset: int,
        view: memoryview,
        frame: memoryview | None = None,
        feed: Callable[[memoryview], None] | None = None,
        fresh: bool = False,
    ) -> int:
        """Queue a read of ``len(view)`` bytes at ``offset`` into ``view``; the job's number.
        ``frame``: the memory around ``view`` from the start of the block ``offset`` is in to
        the block boundary after its end, aligned, where the view may be read into directly
        (see :meth:`stream_st.transports.file.direct.Direct.read_framed`). ``feed``: called in
        a worker thread with every byte read, in order, piece by piece as they land (see the
        module); the job is complete once all are fed. ``fresh``: ``view`` is memory never
        touched, which a thread with nothing to read may fault in ahead of the read (see
        the module)."""
        step = PIECE if feed is None else FEED_PIECE
        first = offset - offset % ALIGN  # pieces end on block boundaries: frames never overlap
        cuts = [offset, *range(first + step, offset + len(view), step), offset + len(view)]
        with self._lock:
            job = len(self._got)
            self._got.append(0)
            self._left.append(len(cuts) - 1)
            if feed is not None:
                self._feeds[job] = InOrder(feed, offset, functools.partial(self._fed, job))
            if fresh:
                self._fresh.add(job)
            for start, end in itertools.pairwise(cuts):
                at = start - offset
                piece = view[at : at + end - start]
                around = None if frame is None else frame[start - start % ALIGN - first :]
                self._pieces.append((job, start, piece, around))
            self._cond.notify()
        return job

    async def wait(self, job: int) -> int:
        """The bytes job ``job`` received, once all of them are in; after :meth:`stop`, a
        :class:`~stream_st.TransportError` whether or not they are (the reader was closed)."""
        with self._lock:
            ready = self._left[job] == 0 or self._error is not None or self._stopped
            if not ready:
                event = anyio.Event()
                self._waiting = (job, event)
        if not ready:
            await event.wait()
        with self._lock:
            self._waiting = None
            if self._error is not None:
                reason = getattr(self._error, "strerror", None) or self._error
                raise TransportError(f"read failed: {reason}", url=self._name) from self._error
            if self._stopped:  # before the wait or under it
                raise TransportError(
                    "read stopped: the file was closed on this side", url=self._name
                )
            return self._got[job]

    def stop(self) -> None:
        """End the work: threads finish the read they are in and take no more; a waiting
        :meth:`wait` is woken (and raises, its job unread)."""
        with self._lock:
            self._stopped = True
            self._pieces.clear()
            for feed in self._feeds.values():
                feed.stop()
            self._feeds.clear()
            self._cond.notify_all()
            self._wake()

    async def close(self) -> None:
        """:meth:`stop`, then return once every worker thread has ended, even if cancelled: no
        thread writes into a view afterwards.

        The threads are first waited for blocking, up to :data:`JOIN_WAIT` seconds in all (each
        ends after the read it is in: milliseconds): a close that does not suspend lets an
        iteration left by a ``break`` end in the one step the event loop gives the task that
        closes it, also when the loop is shutting down right after (``asyncio.run`` does not
        wait for that task, and would close the loop under it). Threads still reading after
        that (a hung disk) are waited for without blocking."""
        self.stop()
        deadline = time.monotonic() + JOIN_WAIT
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with anyio.CancelScope(shield=True):
            await self._finished()

    def start(self) -> None:
        """Start the worker threads."""
        with self._lock:
            self._add_workers(WORKERS)

    def _add_workers(self, count: int) -> None:
        """Start worker threads until ``count`` have been started (called holding the lock)."""
        while len(self._threads) < count and not self._stopped:
            thread = threading.Thread(target=self._work, name="stream_st read-ahead", daemon=True)
            try:
                thread.start()  # a thread the system refuses is neither joined nor waited for
            except RuntimeError as exc:  # a limit on threads
                raise TransportError(
                    f"cannot start a thread to read: {exc}", url=self._name
                ) from exc
            self._threads.append(thread)

    async def _finished(self) -> None:
        """Return once every worker thread has ended (after :meth:`stop`)."""
        with self._lock:
            if self._ended.issuperset(self._threads):
                return
            if self._all_ended is None:  # one event for every task that waits
                self._all_ended = anyio.Event()
            event = self._all_ended
        await event.wait()

    def _work(self) -> None:
        """A worker thread: take the next pieces, read them, account for them, until stopped."""
        bounce: memoryview | None = None  # this thread's, for direct reads; unmapped when the
        # thread ends
        try:
            while True:
                batch, how = self._take()
                if not batch:
                    break
                if how == _POPULATE:
                    populate(batch[0][2])
                else:
                    if how == _DIRECT and bounce is None and batch[0][3] is None:
                        bounce = memoryview(mmap.mmap(-1, _direct.bounce_size()))
                    self._serve(batch, how, bounce)
                del batch  # hold no view while waiting for work: the caller may free its memory
        except BaseException as exc:  # a read failed (OSError), a feed, or the choice of the
            # next pieces (starting more threads, asking the kernel what it caches): the waiter
            # is woken and raises it (a thread's SystemExit ends nothing else either). The error
            # outlives the read: it keeps no view of the caller's memory (the frames it went
            # through let go of theirs).
            batch, bounce = [], None
            let_go(exc)
            with self._lock:
                self._error = exc
            self.stop()
        finally:
            with self._lock:
                self._ended.add(threading.current_thread())
                if self._all_ended is not None and self._ended.issuperset(self._threads):
                    self._call_soon(self._all_ended.set)

    def _serve(self, batch: list[_Piece], how: int, bounce: memoryview | None) -> None:
        """Read ``batch`` (see :meth:`_read`), then account for each piece, or feed it: a fed
        job's pieces one at a time, each fed as soon as it is read (see :meth:`_batch`), until
        the reading is stopped."""
        with self._lock:
            stopped, feed = self._stopped, self._feeds.get(batch[0][0])
        try:
            if stopped:  # since the pieces were taken: nobody waits for them
                return
            if feed is None:
                counts = self._read(batch, how == _DIRECT, bounce)
                with self._lock:
                    for (job, _, _, _), count in zip(batch, counts, strict=True):
                        self._settle(job, count)
                return
            for piece in batch:
                if self._stopped:  # the pieces left are nobody's to wait for
                    break
                (count,) = self._read([piece], how == _DIRECT, bounce)
                feed.done(piece[1], piece[2], count)
        finally:
            if how == _COLD:  # the next cold read may start
                with self._lock:
                    self._cold_reading = False
                    self._cond.notify_all()

    def _fed(self, job: int, count: int) -> None:
        """A piece of fed job ``job`` is fed (see :class:`InOrder`), ``count`` bytes of it."""
        with self._lock:
            self._settle(job, count)

    def _settle(self, job: int, count: int) -> None:
        """A piece of job ``job`` is done, ``count`` bytes of it: wake the loop if the job is
        complete and awaited (called holding the lock)."""
        self._got[job] += count
        self._left[job] -= 1
        if self._left[job] == 0:
            self._feeds.pop(job, None)
            self._fresh.discard(job)
            if self._waiting and self._waiting[0] == job:
                self._wake()

    def _read(self, batch: list[_Piece], direct: bool, bounce: memoryview | None) -> list[int]:
        """Read ``batch`` (adjacent pieces): directly (into the frame of a single piece, else
        through ``bounce``) where ``direct`` says and the file system lets us, else through the
        page cache; bytes per piece."""
        views = [view for _, _, view, _ in batch]
        offset = batch[0][1]
        direct_io = self._direct
        if direct and direct_io is not None:
            frame = batch[0][3]
            try:
                if frame is not None:
                    return [direct_io.read_framed(self._fd, frame, offset, len(views[0]))]
                assert bounce is not None
                return direct_io.read_bounced(self._fd, views, offset, bounce)
            except NotDirect:
                self._direct = None  # read through the page cache from now on
        return _preadv_fully(self._fd, views, offset)

    def _take(self) -> tuple[list[_Piece], int]:
        """The next piece and those adjacent to it in the file, up to :data:`PIECE` bytes, and
        how to read them (see :data:`_DIRECT`): from the disk directly where the page cache
        holds too little of them and direct reads are open; through the page cache otherwise,
        but pieces it lacks one thread at a time (the kernel then sees one sequential read and
        reads ahead of it: two threads' reads of cold 8 MiB pieces at once ran at 0.76x one's
        here), while another thread faults in fresh memory of the pieces after
        (:data:`_POPULATE`, a single piece) or waits. A fed job's pieces go to one thread
        together (:meth:`_run`); read directly, where the disk's pace is what counts, one by
        one to every thread (fed in order by :class:`InOrder`), as does a piece with a frame;
        others up to :data:`stream_st.transports.file.direct.BOUNCE` bytes together. Empty
        once stopped."""
        with self._lock:
            while True:
                while not self._pieces and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return [], _BUFFERED
                job, offset, view, frame = self._pieces[0]
                direct_io = self._direct
                if not self._uncached(offset, len(view), direct_io):
                    return self._batch(PIECE), _BUFFERED
                if direct_io is not None:
                    self._add_workers(_direct.WORKERS)
                    if frame is not None or job in self._feeds:  # the disk's pace: shared
                        return [self._pieces.popleft()], _DIRECT
                    return self._batch(_direct.BOUNCE), _DIRECT
                if not self._cold_reading:
                    self._cold_reading = True
                    return self._batch(PIECE, cold=True), _COLD
                fresh = self._next_fresh()
                if fresh is not None:
                    return [fresh], _POPULATE
                self._cond.wait()

    def _batch(self, limit: int, cold: bool = False) -> list[_Piece]:
        """The next piece and those adjacent to it, up to ``limit`` bytes (see :meth:`_take`;
        called holding the lock, with a piece waiting); for a fed job, :meth:`_run` (``cold``:
        the first piece is read as the page cache lacks it)."""
        job, offset, view, _ = self._pieces[0]
        if job in self._feeds:
            return self._run(job, cold)
        if len(view) > limit:  # the rest stays first in line
            self._pieces[0] = (job, offset + limit, view[limit:], None)
            self._left[job] += 1
            batch: list[_Piece] = [(job, offset, view[:limit], None)]
        else:
            batch = [self._pieces.popleft()]
        size = len(batch[0][2])
        while self._pieces and len(batch) < _IOV_MAX:
            following, offset, view, _ = self._pieces[0]
            if (
                offset != batch[-1][1] + len(batch[-1][2])
                or size + len(view) > limit
                or following in self._feeds
            ):
                break
            batch.append(self._pieces.popleft())
            size += len(view)
        return batch

    def _run(self, job: int, cold: bool) -> list[_Piece]:
        """The pieces of fed job ``job`` first in line, while another job waits behind them:
        those the page cache holds as it holds the first (lacks them all where ``cold``, else
        holds them all, as :meth:`_take` judges a piece); else the first alone (called holding
        the lock). A thread given them reads and feeds them in order, each piece hashed while
        its bytes are still in the CPU's cache, and the other threads take the jobs after;
        shared piece by piece, a job's pieces finish out of order, and most were fed
        milliseconds after their read, by another thread, from memory (512 MiB of 32 MiB
        tensors: 77 % of the pieces, hashed at 12.7 GB/s against 18 GB/s fed at once). A piece
        the page cache holds otherwise stays in line, to be read as :meth:`_take` decides."""
        batch = [self._pieces.popleft()]
        if self._pieces and self._pieces[-1][0] != job:  # a later job waits
            while self._pieces and self._pieces[0][0] == job:
                _, offset, view, _ = self._pieces[0]
                if self._uncached(offset, len(view), self._direct) != cold:
                    break
                batch.append(self._pieces.popleft())
        return batch

    def _uncached(self, offset: int, size: int, direct_io: Direct | None) -> bool:
        """Whether the page cache lacks what ``size`` bytes at ``offset`` need, as :meth:`_take`
        judges a piece: where direct reads are open (``direct_io``), their judgement (such a
        piece is read directly); else, where the kernel says what it caches, of the first
        :data:`PIECE` bytes (such a piece is read one thread at a time); else never."""
        if direct_io is not None:
            return direct_io.uncached(offset, size)
        return self._residency is not None and self._residency.uncached(offset, min(size, PIECE))

    def _next_fresh(self) -> _Piece | None:
        """The first piece waiting in line (of the first :data:`_POPULATE_LOOK`) with fresh
        memory not yet populated, as far as it is not, marked populated; or None (called
        holding the lock)."""
        for job, offset, view, _ in itertools.islice(self._pieces, _POPULATE_LOOK):
            end = offset + len(view)
            if job in self._fresh and end > self._populated_to:
                skip = max(0, self._populated_to - offset)
                self._populated_to = end
                return job, offset + skip, view[skip:], None
        return None

    def _wake(self) -> None:
        """Wake the waiting loop (called holding the lock)."""
        if self._waiting is not None:
            self._call_soon(self._waiting[1].set)
            self._waiting = None

    def _call_soon(self, function: Callable[[], object]) -> None:
        """Have the event loop call ``function`` soon, from a worker thread, without waiting."""
        call_soon_from_thread(self._token, function)


def _advise_sequential(fd: int) -> None:
    """Ask the kernel to read ``fd`` ahead further (see the module); where it cannot be asked
    (no ``posix_fadvise``, a file system that refuses), reads go on as they would."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


@asynccontextmanager
async def read_ahead(fd: int, name: str) -> AsyncIterator[ReadAhead]:
    """A :class:`ReadAhead` on ``fd`` with its worker threads running for the block's duration;
    on the way out (even cancelled) they are stopped and waited for, so no thread writes into a
    view afterwards. The threads are plain threads, not a task group's: the block may hold a
    generator's ``yield``, and that generator may be closed from another task."""
    direct = Direct.open(fd)
    residency = None
    if direct is None:
        _advise_sequential(fd)
        residency = Residency.of(fd)
    ahead = ReadAhead(fd, name, direct, residency)
    try:
        ahead.start()
        yield ahead
    finally:
        await ahead.close()
        if direct is not None:
            direct.close()

"""The window of parallel ranged parts an :class:`~stream_st.HttpSource` reads through when its
``concurrency`` K is above 1, or adaptive.

The next K parts of the plan from the read position are requested, each on its own connection,
and received as they come, straight into the read that holds them or into part buffers; the next
part is requested as soon as the reads have passed one. K is at most :data:`MOST_PARTS`, and a
part at least :data:`SMALLEST_PART` (or the ``part_size`` asked for, where that is smaller): a
huge ``concurrency`` neither opens a connection for every few bytes nor holds thousands. Tasks
run only inside a read (no task outlives the call that started it): a read that is done stops
them where nothing is lost, in a body (the bytes wait in the socket for the next read) or in a
back-off, never within a request.

Adaptive (``limit`` above ``concurrency``): the window starts with one part, the first answer,
streamed as one connection would; its bytes per second are the rate to beat (at
:data:`FAST_STREAM` or more, nothing is tried: one stream it stays). Then K is
``concurrency``, and each time K parts have arrived since K last changed, their rate is compared
with the one before: at least as fast as the one stream, then grown by a quarter or more
(:data:`GROWTH`), K doubles (up to ``limit``); else K goes back to what it was and stays there.
Back at one part, the window adds no more (:attr:`PartWindow.single`) and the reads go on as one
stream from where its parts end. A link that one connection fills, or a reader slower than the
link, stops the growth at once; an object store's link, where each connection is held to its
own rate (and pays a round trip per request), takes more.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import numpy as np
from anyio.abc import TaskGroup

from ..._util import let_go, task_group
from ...errors import HTTPProtocolError, ReadTimeoutError, TransportError
from .framing import Response

__all__ = ["MOST_PARTS", "SMALLEST_PART", "PartWindow"]

Fetch = Callable[[int, int], Awaitable[Response | None]]
"""A GET for bytes ``start`` to ``end`` whose answer is checked to be that range (None: the
object is empty)."""

GROWTH = 1.25
"""How much faster (received bytes per second) K parts must have arrived than before the last
change of K for an adaptive window to add connections again. The first K parts, tried after one
stream, need only be as fast as it was: its rate leaves the reader's own time out, theirs not."""

FAST_STREAM = 500e6
"""Bytes per second of the first answer, one stream, at which an adaptive window tries no more
parts: a local link, which one connection fills (an object store's connection is slower)."""

SMALLEST_PART = 64 << 10
"""Bytes a part spread from the planned bytes is at least (the ``part_size`` asked for, where
that is smaller): a request and a connection for fewer bytes would cost more than they bring,
and a huge ``concurrency`` would open a connection for every few bytes."""

MOST_PARTS = 64
"""Parts at once a window holds at most, whatever ``concurrency`` it is given: connections
(and part buffers) in flight, 512 MiB of the default ``part_size``."""

BackOff = Callable[[int, int], Awaitable[None]]
"""The wait before the next attempt, after ``failures`` failed ones, at a ``position``."""


@dataclass(eq=False)
class _Part:
    """Bytes ``start`` to ``end`` of the object, asked for by one ranged request of the window.
    ``got`` bytes have arrived: in ``data`` (a part buffer, ``buffer`` the whole of it), or
    straight into the read's buffer (``direct``)."""

    start: int
    end: int
    response: Response | None = None  # the answer being received
    buffer: memoryview | None = None
    data: memoryview | None = None
    direct: bool = False
    got: int = 0
    done: bool = False
    failures: int = 0  # breaks so far, each resumed by a new request
    running: bool = False  # a task of the running read drives it

    def drop_buffer(self) -> memoryview | None:
        """The part buffer, if any, no longer the part's."""
        buffer, self.buffer, self.data = self.buffer, None, None
        return buffer


class PartWindow:
    """The next K parts of a plan of ranges, each requested with ``fetch`` on its own
    connection; a break is resumed from the byte it reached, ``retries`` times per part, after
    ``back_off``. Reads (:meth:`read`) come out in offset order whatever order parts arrive in.
    With ``limit`` above ``concurrency``, K grows while throughput does (see the module); K is
    never above :data:`MOST_PARTS`.
    """

    def __init__(
        self,
        fetch: Fetch,
        back_off: BackOff,
        *,
        retries: int,
        concurrency: int,
        part_size: int,
        limit: int | None = None,
    ) -> None:
        self._fetch = fetch
        self._back_off = back_off
        self._retries = retries
        self._limit = min(MOST_PARTS, max(concurrency, limit or concurrency))  # K grows to it
        self._first = min(concurrency, self._limit)  # K after the first part, when adaptive
        self._concurrency = 1 if self._limit > self._first else self._first
        self._before = 1  # K before its last change
        self._received = 0  # bytes received by every part so far
        self._since: tuple[float, int] | None = None  # time and bytes received at K's last change
        self._arrived = 0  # parts finished since then
        self._rate = 0.0  # bytes per second before K's last change
        self.single = False  # adaptive, settled on one part: no more parts (see the module)
        self._opened: tuple[Response, int] | None = None  # the answer it opened with, its end
        self.rest: tuple[Response, int, int] | None = None  # it, open past its part: from, to
        self._part_size = part_size
        self._plan: list[tuple[int, int]] = []
        self.data_end: int | None = None  # where a short part showed the object to end
        self._window: deque[_Part] = deque()  # the next parts, in order, at most K
        self._next_at = 0  # where the next part starts
        self._run = 0  # the planned run that holds it
        self._step = part_size  # bytes per part
        self._spare: list[memoryview] = []  # part buffers of parts read past, for new parts
        self._group: TaskGroup | None = None  # the running read's tasks, inside a read only
        self._stops: set[anyio.CancelScope] = set()  # its running tasks' own scopes (_drive)
        self._target: tuple[int, memoryview] | None = None  # the running read: offset, buffer
        self._requesting = 0  # parts waiting for the answer to their request
        self._stopping = False  # the read is done: its tasks stop where nothing is lost
        self._change: anyio.Event | None = None  # set when a part arrives or a request is answered

    def open(
        self, plan: list[tuple[int, int]], response: Response | None, at: int, end: int
    ) -> None:
        """Start on ``plan``: ``response``, if any, an open answer delivering bytes ``at`` to
        ``end``, becomes the first part (at most ``part_size`` of it: when the window settles on
        one stream there, the rest of the answer goes on as :attr:`rest`); the bytes left to plan
        are spread over the other K - 1 parts, at most ``part_size`` each and at least
        :data:`SMALLEST_PART` (or ``part_size``, where that is smaller)."""
        self._plan = plan
        self._opened = None if response is None else (response, end)
        if response is not None and at < end:
            self._next_at = min(end, at + self._part_size)
            self._window.append(_Part(at, self._next_at, response))
        elif response is not None:
            self._next_at = at
        rest = sum(max(0, stop - max(start, self._next_at)) for start, stop in plan)
        others = max(1, self._first - len(self._window))
        least = min(SMALLEST_PART, self._part_size)
        self._step = max(least, min(self._part_size, -(-rest // others)))
        self._extend()

    def replan(self, plan: list[tuple[int, int]]) -> None:
        """Follow the reader's ``plan`` from now on (parts already in the window stay)."""
        self._plan = plan
        self._run = 0

    def _next_span(self) -> tuple[int, int] | None:
        """The bytes of the next part to request: up to ``_step`` of the plan from ``_next_at``."""
        plan = self._plan
        while self._run < len(plan) and plan[self._run][1] <= self._next_at:
            self._run += 1
        if self._run == len(plan):
            return None
        run_start, run_end = plan[self._run]
        start = max(run_start, self._next_at)
        self._next_at = min(run_end, start + self._step)
        return start, self._next_at

    def _extend(self) -> None:
        """Add parts up to K; inside a read they are requested at once."""
        while len(self._window) < self._concurrency and not self.single:
            span = self._next_span()
            if span is None:
                return
            part = _Part(*span)
            self._window.append(part)
            if self._group is not None:
                self._run_part(part)

    async def _slide(self, at: int) -> None:
        """Drop the parts wholly before ``at`` (their buffers kept for new parts, responses of
        skipped ones closed), then extend the window from there."""
        window = self._window
        while window and window[0].end <= at:
            part = window.popleft()
            buffer = part.drop_buffer()  # a cancelled read's error may keep the part (_drive)
            if buffer is not None and len(self._spare) < self._concurrency:
                self._spare.append(buffer)
            if part.response is not None:
                await part.response.aclose()
        if not window:
            self._next_at = max(self._next_at, at)
        self._extend()

    @property
    def concurrency(self) -> int:
        """K: the parts in the window, at most, now."""
        return self._concurrency

    def _run_part(self, part: _Part) -> None:
        assert self._group is not None
        if self._since is None:
            self._since = (time.monotonic(), self._received)
        part.running = True
        stop = anyio.CancelScope()
        self._stops.add(stop)
        self._group.start_soon(self._drive, part, stop)

    def _changed(self) -> None:
        """Wake the read waiting in :meth:`_wait`: a part arrived or a request was answered."""
        if self._change is not None:
            self._change.set()

    async def _wait(self) -> None:
        self._change = anyio.Event()
        await self._change.wait()

    async def read(
        self,
        offset: int,
        buffer: memoryview,
        *,
        partial: bool,
        landed: Callable[[int, int], None] | None = None,
    ) -> tuple[int, bool]:
        """Fill ``buffer`` from ``offset`` with the window's parts, in order, running their
        requests and bodies until it is full (or, ``partial``, has some bytes); ``landed(start,
        end)`` is told of each run of bytes filled, in order. Returns the bytes filled and
        whether the read stopped at a byte no part holds (outside the plan)."""
        stop = offset + len(buffer)
        filled = 0
        outside = False
        self._target = None if partial else (offset, buffer)  # a partial read may end early
        try:
            async with task_group() as group:
                while filled < len(buffer):
                    at = offset + filled
                    await self._slide(at)
                    part = self._window[0] if self._window else None
                    if self.data_end is not None and at >= self.data_end:
                        break  # a part came back short: the object ends there
                    if part is None or part.start > at:
                        outside = True
                        break
                    if not part.done:
                        if self._group is None:
                            self._group = group
                            for waiting in self._window:
                                if not (waiting.done or waiting.running):
                                    self._run_part(waiting)
                        await self._wait()
                        continue
                    count = min(part.start + part.got, stop) - at
                    if count <= 0:
                        break
                    if part.data is not None:
                        begin = at - part.start
                        buffer[filled : filled + count] = part.data[begin : begin + count]
                    filled += count
                    if landed is not None:
                        landed(at, at + count)
                    if partial:
                        break
                if self._group is not None:
                    self._stopping = True
                    while self._requesting:  # a request is never cut: its answer may be used
                        await self._wait()
                    for scope in list(self._stops):  # each leaves the set as its task ends
                        scope.cancel()
        finally:
            await self._stopped()
        return filled, outside

    async def _stopped(self) -> None:
        """After a read: no task runs, no part is received into its buffer any more. A part
        left unfinished there (the read failed) starts again."""
        self._group = None
        self._target = None
        self._stopping = False
        for part in self._window:
            part.running = False
            if part.direct and not part.done:
                part.direct = False
                part.got = 0
                response, part.response = part.response, None
                if response is not None:
                    await response.aclose()

    async def _drive(self, part: _Part, stop: anyio.CancelScope) -> None:
        """Request ``part`` (again, from the byte it reached, after a break) and receive it;
        ``stop`` is cancelled when the read is done, and let go when the task ends: a long read
        holds the scopes of the parts running only, not one for every part it started.

        The task ends without an error then (``stop`` catches its cancellation): anyio's task
        group keeps the error a task ends with in a reference cycle, with the frames it came
        through and those of the loop, until the cyclic collector runs; they hold the bytes
        being received (a part buffer, or the tensor's own memory) and the caller's results.
        Cancelled from outside (the read failed, or its caller gave up), it clears the frames
        below it, those holding the bytes."""
        try:
            with stop:
                while not part.done:
                    if part.response is None:
                        if self._stopping:
                            return
                        self._requesting += 1
                        try:
                            part.response = await self._fetch(part.start + part.got, part.end)
                        finally:
                            self._requesting -= 1
                            self._changed()
                        if part.response is None:
                            self._finish(part)
                            return
                        if self._stopping:
                            return
                    await self._receive(part, part.response)
        except anyio.get_cancelled_exc_class() as cancelled:
            let_go(cancelled)
            raise
        finally:
            part.running = False
            self._stops.discard(stop)

    async def _receive(self, part: _Part, response: Response) -> None:
        """Receive ``part``'s body from ``response``; a break is retried (``retries``, with
        back-off) by the next request, an answer that ends early makes it short."""
        view = self._view(part)
        before = part.got
        try:
            while part.got < len(view):
                count = await response.receive_into(view[part.got :])
                if count == 0:
                    if part.got > before:  # a whole answer for less than asked (a server
                        # capping its ranges): the rest is asked for next, as one stream does
                        part.response = None
                        await response.aclose()
                        return
                    break  # nothing at all: the object is shorter than planned
                part.got += count
                self._received += count
        except HTTPProtocolError:
            raise
        except TransportError as exc:
            part.response = None
            await response.aclose()
            part.failures += 1
            if part.failures > self._retries:
                if isinstance(exc, ReadTimeoutError):
                    raise
                self._finish(part)  # the read reports the truncation
                return
            await self._back_off(part.failures, part.start + part.got)
            return
        part.response = None
        self._finish(part)
        if self.single and self._opened is not None and response is self._opened[0]:
            self.rest = (response, part.end, self._opened[1])  # the one stream goes on
        else:
            await response.aclose()

    def _view(self, part: _Part) -> memoryview:
        """Where ``part``'s bytes go: the read's buffer when the part lies inside it (the
        tensor's own memory), else a part buffer (np.empty: a bytearray would zero-fill it)."""
        if part.data is not None:
            return part.data
        target = self._target
        if target is not None and (part.direct or part.got == 0):
            offset, buffer = target
            if offset <= part.start and part.end <= offset + len(buffer):
                part.direct = True
                return buffer[part.start - offset : part.end - offset]
        size = part.end - part.start
        spare = next((b for b in self._spare if len(b) >= size), None)
        if spare is None:
            spare = np.empty(max(size, self._step), np.uint8).data
        else:
            self._spare.remove(spare)
        part.buffer = spare
        part.data = spare[:size]
        return part.data

    def _finish(self, part: _Part) -> None:
        part.done = True
        if part.got < part.end - part.start:
            end = part.start + part.got
            self.data_end = end if self.data_end is None else min(self.data_end, end)
        self._arrived += 1
        if self._concurrency < self._limit and self._arrived >= self._concurrency:
            self._grow()
        self._changed()

    def _grow(self) -> None:
        """K parts arrived since K last changed: after the first part (one stream), K becomes
        ``concurrency``; later, K doubles if they came faster than before by :data:`GROWTH`
        (the next read's slide adds the parts), else it goes back and stays (see the module)."""
        assert self._since is not None
        began, received = self._since
        now = time.monotonic()
        self._since = (now, self._received)
        self._arrived = 0
        rate = (self._received - received) / max(now - began, 1e-9)
        first = self._concurrency == 1  # the one stream, whose rate the parts must beat
        if rate >= self._rate * (1 if first else GROWTH) and not (first and rate >= FAST_STREAM):
            self._rate = rate
            self._before = self._concurrency
            grown = self._first if self._concurrency == 1 else 2 * self._concurrency
            self._concurrency = min(self._limit, grown)
        else:
            self._concurrency = self._limit = self._before
            self.single = self._concurrency == 1

    @property
    def drained(self) -> bool:
        """Settled on one part (:attr:`single`) and every part read past: the reads go on as one
        stream."""
        return self.single and not self._window

    async def aclose(self) -> None:
        """Close the answers of parts still open, and :attr:`rest`; let the part buffers go:
        the window may be kept until the cyclic collector runs (by its source, whose methods it
        holds, or by a cancelled read's error, see :meth:`_drive`)."""
        window, self._window = self._window, deque()
        self._spare.clear()
        rest, self.rest = self.rest, None
        if rest is not None:
            await rest[0].aclose()
        for part in window:
            part.drop_buffer()
            if part.response is not None:
                await part.response.aclose()

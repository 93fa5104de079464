"""``http://`` and ``https://`` sources, with Range requests where the server has them.

The first request asks for the first 64 KiB (``Range: bytes=0-65535``). Its answer tells
everything needed: the total size (``Content-Range``) and whether ranges work (206) or not (200).

* Header only: that one request serves the prefix and a header up to 64 KiB - 8; a larger header
  costs one more ranged request. At most 2 requests and header + 64 KiB of transfer.
* Every tensor: the rest of the file in one more ranged request, read straight into the arrays.
* ``include=``: one ranged request per run of adjacent selected tensors (the reader's plan).
* No Range support (200): the answer is the whole body, streamed; skipped bytes are discarded.
  A server that honours the first range but answers a later one with anything but that range
  (a 200 with the whole body, another start) raises :class:`~stream_st.TransportError`.
* ``concurrency=K`` (K > 1): the data is fetched in parts of at most ``part_size`` bytes (the
  planned bytes spread over K parts when that is less), each on its own connection, through a
  window of the next K parts from the read position: as soon as the reads pass a part, the
  next one is requested, while the others are still arriving, across tensors. A part inside
  the tensor being read lands straight in its array, one beyond it in a part buffer (at most
  K, reused). Tensors still come out in offset order. When everything is read, the window
  opens as soon as the first answer's head tells the size, before the header has arrived.
  Worth it where each connection is slow or far (object stores); on a fast local link one
  stream is as quick. ``open_stream(url, concurrency=K)`` sets it for any remote source.

A ranged read that breaks (connection reset, closed mid-body, 5xx) is resumed from the byte it
reached, up to ``retries`` times per read (one tensor, or the header) with exponential backoff.
A 429 or 503 with a ``Retry-After`` (seconds or a date) is retried after that delay instead,
unless it would pass the ``deadline`` (:class:`~stream_st.ReadTimeoutError` at once) or, with no
deadline, exceeds 5 minutes (the status error at once). A body that still ends early is reported
by the reader as a :class:`~stream_st.TruncatedStreamError` naming the URL and the offset; a
server that stops sending raises :class:`~stream_st.ReadTimeoutError` after ``timeout`` seconds.
An answer that breaks HTTP (garbled status line, length or chunks, a body compressed although
asked for as it is, a refused redirect) raises a :class:`~stream_st.TransportError` at once,
with no retry; so does an error status other than those retried (one line: an S3 error's code
and message, an excerpt of any other body).

Every request of a read gets the version of the object the first answer had: its validator (a
strong ``ETag``, else ``Last-Modified``) goes with each later request (``If-Match``, else
``If-Unmodified-Since``: ranges, parallel parts and resumptions alike), and each answer's
``ETag``, ``Last-Modified`` and size are compared with the first's. An object replaced on the
server during the read raises :class:`~stream_st.SourceChangedError`: a tensor is never made of
bytes from two versions.
"""

from __future__ import annotations

import math
import ssl
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Unpack

import anyio
import numpy as np
from anyio.abc import TaskGroup

from ..._util import task_group
from ...errors import (
    CertificateError,
    RangeIgnoredWarning,
    ReadTimeoutError,
    SourceChangedError,
    TransportError,
    UsageError,
)
from ..base import Source
from ..options import Clock, LimitOptions, Transport
from . import (
    ClientUser,
    HTTPClient,
    HTTPProtocolError,
    Response,
    content_range,
    raise_for_status,
    retry_after,
)

__all__ = ["FIRST_RANGE", "HttpSource"]

FIRST_RANGE = 64 << 10
"""Bytes asked for by the first request: the prefix, the header (usually) and some data."""

_RANGE_IGNORED = (
    "{}: the server ignores Range requests (200, not 206): every read goes through the object "
    "from its first byte, so a slice or a selection costs all the bytes before it"
)

_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_ASKS_TO_WAIT = frozenset({429, 503})  # statuses whose Retry-After is honoured
_MAX_RETRY_AFTER = 300.0  # seconds a Retry-After may ask for when no deadline bounds the read


@dataclass(eq=False)
class _Part:
    """Bytes ``start`` to ``end`` of the object, asked for by one ranged request of the window
    (see :meth:`HttpSource._open_window`). ``got`` bytes have arrived: in ``data`` (a part
    buffer, ``buffer`` the whole of it), or straight into the read's buffer (``direct``)."""

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


class HttpSource(ClientUser, Source):
    """An object at an ``http(s)://`` URL; a whole object, random access when ranges work.
    ``headers`` go with every request; ``ssl_context`` decides which certificates https trusts
    (default: the system's). ``limits`` (``timeout``, ``deadline``, ``speed_limit``,
    ``speed_time``) are used unless the reader is given its own, also with a ``client`` (which
    may be shared: it keeps no limits of any one read)."""

    def __init__(
        self,
        url: str,
        *,
        client: HTTPClient | None = None,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        retries: int = 3,
        backoff: float = 0.25,
        concurrency: int = 1,
        part_size: int = 8 << 20,
        name: str | None = None,
        **limits: Unpack[LimitOptions],
    ) -> None:
        super().__init__()
        if concurrency < 1 or part_size < 1 or retries < 0:
            raise UsageError(
                f"HttpSource({url!r}): concurrency ({concurrency}) and part_size ({part_size}) "
                f"must be positive, retries ({retries}) at least 0"
            )
        self._concurrency = concurrency
        self._part_size = part_size
        self._data_end: int | None = None  # where a short part showed the object to end
        self._windowed = False  # reads go through the window of parts (see _open_window)
        self._window: deque[_Part] = deque()  # the next parts, in order, at most K
        self._next_at = 0  # where the next part starts
        self._run = 0  # the planned run that holds it
        self._step = part_size  # bytes per part
        self._spare: list[memoryview] = []  # part buffers of parts read past, for new parts
        self._group: TaskGroup | None = None  # the running read's tasks, inside a read only
        self._target: tuple[int, memoryview] | None = None  # the running read: offset, buffer
        self._requesting = 0  # parts waiting for the answer to their request
        self._stopping = False  # the read is done: its tasks stop where nothing is lost
        self._change: anyio.Event | None = None  # set when a part arrives or a request is answered
        self.url = url
        self.name = name or url
        self._use_client(client, headers, ssl_context, limits)
        self._retries = retries
        self._backoff = backoff
        self._response: Response | None = None
        self._response_at = 0  # absolute offset of the next byte the open response delivers
        self._response_end = 0  # absolute offset where the open response's body ends
        self._plan: list[tuple[int, int]] = []
        self._version: tuple[str, str] | None = None  # the first answer's ETag, Last-Modified

    async def start(self, *, read_all: bool = False) -> None:
        """Send the first request and learn the size and whether ranges work.

        It asks for the first 64 KiB, unless the reader will read everything (``read_all``) with
        one stream: then for all of it (``bytes=0-``), so the header and the data come in one
        response. With ``concurrency`` K > 1 and ``read_all``, the window of parts opens as soon
        as that answer's head tells the size, before its body (the safetensors header) has been
        read: the next K - 1 parts are requested by the first read (speculative first parts). A
        later jump closes the open response and sends a ranged request from there.
        """
        speculate = read_all and self._concurrency > 1
        end = None if read_all and not speculate else FIRST_RANGE
        with self._reported():
            response = await self._get(0, end)
            if response is None:  # an empty object
                self.size = 0
                self.random_access = True
                return
            await self._adopt(response, 0)
            if end is not None and response.status == 200:  # ranges asked for, none given
                warnings.warn(RangeIgnoredWarning(_RANGE_IGNORED.format(self.name)), stacklevel=2)
            if speculate and self.random_access and self.size is not None:
                self._plan = [(0, self.size)]  # until the reader's plan: everything
                self._open_window()

    async def _adopt(self, response: Response, start: int) -> None:
        """Make ``response``, the answer to a GET from ``start``, the open one."""
        self._response_end, size = await self._body_range(response, start)
        if size is not None:
            self.size = size
        self.random_access = response.status == 206
        self._response = response
        self._response_at = start

    async def _body_range(self, response: Response, start: int) -> tuple[int, int | None]:
        """Check that ``response`` delivers the object from byte ``start``: a 206 for that
        range, or a 200 (the whole body) when ``start`` is 0. Returns the absolute offset where
        its body ends and the object's size if the answer tells it; otherwise closes ``response``
        and raises :class:`HTTPProtocolError`."""
        if response.status == 206:
            parsed = content_range(response.headers)
            if parsed is not None:
                first, last, size = parsed
                end = last + 1
                if (
                    first == start < end
                    and (size is None or end <= size)
                    and response.content_length in (None, end - start)
                ):
                    await self._check_size(response, size, start)
                    return end, size
            shown = response.headers.get("content-range", "")
            problem = f"unusable Content-Range {shown!r} for the range asked"
        elif response.status == 200 and start == 0:
            size = response.content_length
            await self._check_size(response, size, start)
            return (1 << 62 if size is None else size), size
        elif response.status == 200:
            problem = "the server ignored the Range header (200 with the whole body from byte 0)"
        else:
            problem = f"unexpected answer HTTP {response.status} {response.reason}".rstrip()
        await response.aclose()
        raise HTTPProtocolError(problem, url=self.name, position=start)

    async def _check_size(self, response: Response, size: int | None, position: int) -> None:
        """Raise :class:`SourceChangedError` (closing ``response``) if its object is ``size``
        bytes long where an earlier answer of this read had another size."""
        if size is not None and self.size is not None and size != self.size:
            await response.aclose()
            raise SourceChangedError(
                f"the object changed on the server during the read: {self.size} bytes, then {size}",
                url=self.name,
                position=position,
            )

    def _preconditions(self) -> dict[str, str]:
        """The headers that make a later request of this read answer for the version of the
        first answer only: ``If-Match`` with its strong ETag, else ``If-Unmodified-Since`` with
        its Last-Modified (a weak ETag does not vouch for bytes)."""
        if self._version is None:
            return {}
        etag, modified = self._version
        if etag and not etag.startswith("W/"):
            return {"If-Match": etag}
        return {"If-Unmodified-Since": modified} if modified else {}

    async def _check_version(self, response: Response, position: int) -> None:
        """Pin the object's version on the first successful answer; on a later one, raise
        :class:`SourceChangedError` (closing ``response``) if it serves another version."""
        seen = (response.headers.get("etag", ""), response.headers.get("last-modified", ""))
        if self._version is None:
            if response.status < 300:
                self._version = seen
            return
        if response.status == 412:
            asked = ", ".join(f"{name}: {value}" for name, value in self._preconditions().items())
            change = f"412 Precondition Failed to {asked}"
        else:
            names = ("ETag", "Last-Modified")
            changes = [
                f"{name} {old!r}, then {new!r}"
                for name, old, new in zip(names, self._version, seen, strict=True)
                if old and new and old != new
            ]
            if not changes:
                return
            change = "; ".join(changes)
        await response.aclose()
        raise SourceChangedError(
            f"the object changed on the server during the read: {change}",
            url=self.name,
            position=position,
        )

    async def _get(self, start: int, end: int | None) -> Response | None:
        """GET from ``start`` (to ``end``, exclusive, or the end), retrying retryable failures;
        every answer after the first must be for the same version of the object."""
        headers = dict(self._headers)
        headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        headers.update(self._preconditions())
        for attempt in range(self._retries + 1):
            wait = None
            try:
                response = await self._request(
                    "GET", self.url, self.prepare_headers("GET", self.url, headers)
                )
            except (HTTPProtocolError, CertificateError):
                raise  # the same request would get the same answer, or the same certificate
            except TransportError:
                if attempt == self._retries:
                    raise
            else:
                if response.status == 416 and start == 0:  # an empty object
                    await response.aclose()
                    return None
                retrying = response.status in _RETRYABLE_STATUS and attempt < self._retries
                if retrying:
                    wait = await self._retry_wait(response, start)
                if not retrying or wait == math.inf:
                    return await self._accept(response, start)
                await response.discard()
            await self._back_off(attempt + 1, start, wait)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _accept(self, response: Response, position: int) -> Response:
        """``response`` as the answer to a request of this read: of the same version of the
        object as the first (:class:`SourceChangedError`), not an error status (raised)."""
        await self._check_version(response, position)
        await raise_for_status(response, name=self.name)
        return response

    async def _retry_wait(self, response: Response, position: int) -> float | None:
        """The seconds to wait before retrying the request ``response`` failed: what its server
        asks (``Retry-After`` on a 429 or 503), else None (the usual back-off). ``inf`` when it
        asks for more than 5 minutes and no deadline says the read may wait that long: no retry.
        Past the deadline: :class:`ReadTimeoutError` at once (closing ``response``)."""
        asked = retry_after(response.headers) if response.status in _ASKS_TO_WAIT else None
        if asked is None:
            return None
        if asked > self.clock.remaining():
            await response.aclose()
            raise ReadTimeoutError(
                f"the server asked to retry after {round(asked, 1):g} s (Retry-After), past the "
                f"deadline of {self.clock.limits.deadline:g} s",
                url=self.name,
                position=position,
            )
        if asked > _MAX_RETRY_AFTER and self.clock.limits.deadline is None:
            return math.inf
        return asked

    async def _back_off(self, failures: int, position: int, wait: float | None = None) -> None:
        """Wait before the next attempt after ``failures`` failed ones: ``wait`` seconds when
        the server said, else an exponential back-off; a deadline that passes first ends the
        read instead."""
        if wait is None:
            wait = self._backoff * 2 ** (failures - 1)
        await self.clock.pause(wait, self.name, position)

    def prepare_headers(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        """The headers to send with a request; object stores sign them here."""
        return headers

    def add_transport(self, transport: Transport) -> None:
        """Apply an operation's options; its ``concurrency``, when given, replaces this one's."""
        super().add_transport(transport)
        if transport.concurrency is not None:
            self._concurrency = transport.concurrency

    async def plan_reads(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._plan = list(ranges)
        self._run = 0
        if self._concurrency > 1 and self.random_access and not self._windowed:
            self._open_window()

    def _planned_end(self, offset: int, minimum: int) -> int:
        """Where a request from ``offset`` should end: the end of the planned run it falls in,
        and at least ``minimum`` (the bytes asked for now)."""
        for start, end in self._plan:
            if start <= offset < end:
                return max(end, minimum)
        return minimum

    @contextmanager
    def _reported(self) -> Iterator[None]:
        """Errors raised inside name this source as its caller did (``name``), never the URL a
        request went to: one redirected to may be signed, and a message is no place for that."""
        try:
            yield
        except TransportError as exc:
            exc.report_as(self.name)
            raise

    async def receive_into(self, buffer: memoryview) -> int:
        with self._reported():
            return await self._read(self.position, buffer, partial=True)

    async def fill(self, buffer: memoryview) -> int:
        with self._reported():
            return await self._read(self.position, buffer, partial=False)

    async def read_into_at(self, offset: int, buffer: memoryview) -> int:
        with self._reported():
            return await self._read(offset, buffer, partial=False)

    async def _read(self, offset: int, buffer: memoryview, *, partial: bool) -> int:
        """Fill ``buffer`` from ``offset``: through the window of parts once it is open, else
        through the one open response."""
        if self._windowed and buffer:
            return await self._read_windowed(offset, buffer, partial=partial)
        return await self._read_at(offset, buffer, partial=partial)

    # The window of parts (``concurrency`` K > 1): the next K parts of the plan from the read
    # position are requested, each on its own connection, and received as they come, straight
    # into the read that holds them or into part buffers; the next part is requested as soon as
    # the reads have passed one. Tasks run only inside a read (no task outlives the call that
    # started it): a read that is done stops them where nothing is lost, in a body (the bytes
    # wait in the socket for the next read) or in a back-off, never within a request.

    def _open_window(self) -> None:
        """Start reading through parts: the open response, if any, becomes the first part; the
        bytes left to plan are spread over the other K - 1, at most ``part_size`` each."""
        response = self._response
        if response is not None and self._response_at < self._response_end:
            self._window.append(_Part(self._response_at, self._response_end, response))
            self._next_at = self._response_end
        elif response is not None:
            self._next_at = self._response_at
        self._response = None
        rest = sum(max(0, end - max(start, self._next_at)) for start, end in self._plan)
        others = self._concurrency - len(self._window)
        self._step = max(1, min(self._part_size, -(-rest // others)))
        self._windowed = True
        self._extend_window()

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

    def _extend_window(self) -> None:
        """Add parts up to K; inside a read they are requested at once."""
        while len(self._window) < self._concurrency:
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
            if part.buffer is not None:
                self._spare.append(part.buffer)
            if part.response is not None:
                await part.response.aclose()
        if not window:
            self._next_at = max(self._next_at, at)
        self._extend_window()

    def _run_part(self, part: _Part) -> None:
        assert self._group is not None
        part.running = True
        self._group.start_soon(self._drive, part)

    def _changed(self) -> None:
        """Wake the read waiting in :meth:`_wait`: a part arrived or a request was answered."""
        if self._change is not None:
            self._change.set()

    async def _wait(self) -> None:
        self._change = anyio.Event()
        await self._change.wait()

    async def _read_windowed(self, offset: int, buffer: memoryview, *, partial: bool) -> int:
        """Fill ``buffer`` from ``offset`` with the window's parts, in order, running their
        requests and bodies until it is full (or, ``partial``, has some bytes)."""
        stop = offset + len(buffer)
        filled = 0
        outside = False  # a byte no part holds: outside the plan
        self._target = None if partial else (offset, buffer)  # a partial read may end early
        try:
            async with task_group() as group:
                while filled < len(buffer):
                    at = offset + filled
                    await self._slide(at)
                    part = self._window[0] if self._window else None
                    if self._data_end is not None and at >= self._data_end:
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
                    if partial:
                        break
                if self._group is not None:
                    self._stopping = True
                    while self._requesting:  # a request is never cut: its answer may be used
                        await self._wait()
                    group.cancel_scope.cancel()
        finally:
            await self._stopped()
        self.position = offset + filled
        if outside:
            filled += await self._read_at(offset + filled, buffer[filled:], partial=partial)
        return filled

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

    async def _drive(self, part: _Part) -> None:
        """Request ``part`` (again, from the byte it reached, after a break) and receive it."""
        try:
            while not part.done:
                if part.response is None:
                    if self._stopping:
                        return
                    self._requesting += 1
                    try:
                        part.response = await self._open_range(part.start + part.got, part.end)
                    finally:
                        self._requesting -= 1
                        self._changed()
                    if part.response is None:
                        self._finish(part)
                        return
                    if self._stopping:
                        return
                await self._receive_part(part, part.response)
        finally:
            part.running = False

    async def _open_range(self, start: int, end: int) -> Response | None:
        """A GET for bytes ``start`` to ``end`` whose answer is checked to be that range."""
        response = await self._get(start, end)
        if response is not None:
            await self._body_range(response, start)
        return response

    async def _receive_part(self, part: _Part, response: Response) -> None:
        """Receive ``part``'s body from ``response``; a break is retried (``retries``, with
        back-off) by the next request, an answer that ends early makes it short."""
        view = self._part_view(part)
        try:
            while part.got < len(view):
                count = await response.receive_into(view[part.got :])
                if count == 0:
                    break  # the server sent less than asked: the object is shorter
                part.got += count
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
        await response.aclose()
        self._finish(part)

    def _part_view(self, part: _Part) -> memoryview:
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
            self._data_end = end if self._data_end is None else min(self._data_end, end)
        self._changed()

    async def skip(self, count: int) -> int:
        if self.random_access:
            target = self.position + count
            if self.size is not None:
                target = min(target, self.size)
            skipped = target - self.position
            self.position = target
            return skipped
        return await super().skip(count)

    async def _read_at(self, offset: int, buffer: memoryview, *, partial: bool) -> int:
        if offset != self.position:
            if not self.random_access and offset > self.position:
                await super().skip(offset - self.position)
                if self.position != offset:
                    return 0
            else:
                self.position = offset
        filled = 0
        failures = 0
        while filled < len(buffer):
            at = offset + filled
            if self.size is not None and at >= self.size:
                break
            response = self._response
            if response is None or self._response_at != at or at >= self._response_end:
                if not self.random_access and response is not None:
                    break  # a 200 stream cannot jump: the body ended
                await self._close_response()
                end = self._planned_end(at, at + len(buffer) - filled)
                if self.size is not None:
                    end = min(end, self.size)
                fresh = await self._get(at, end)
                if fresh is None:
                    break
                await self._adopt(fresh, at)
                response = fresh
            try:
                got = await response.receive_into(buffer[filled:])
            except HTTPProtocolError:
                raise
            except TransportError as exc:
                await self._close_response()
                failures += 1
                if not self.random_access or failures > self._retries:
                    if isinstance(exc, ReadTimeoutError):
                        raise
                    break  # the body ended early: the reader reports the truncation
                await self._back_off(failures, at)
                continue
            if got == 0:
                await self._close_response()
                break
            filled += got
            self._response_at += got
            if partial:
                break
        self.position = offset + filled
        return filled

    async def _close_response(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            await response.aclose()

    async def aclose(self) -> None:
        window, self._window = self._window, deque()
        for part in window:
            if part.response is not None:
                await part.response.aclose()
        await self._close_response()
        await self._close_client()


async def source_for(url: str, clock: Clock) -> Source:
    """The registry's factory: an ``http(s)://`` object."""
    return HttpSource(url)

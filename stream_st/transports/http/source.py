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
  planned bytes spread over K parts when that is less, though no part under 64 KiB unless
  ``part_size`` is; K at most 64: :data:`~stream_st.transports.http.parts.MOST_PARTS`), each on its
  own connection, through a window of the next K parts from the read position: as soon as the reads
  pass a part, the next one is requested, while the others are still arriving, across tensors. A
  part inside the tensor being read lands straight in its array, one beyond it in a part buffer (at
  most K, reused). Tensors still come out in offset order. When everything is read, the window opens
  as soon as the first answer's head tells the size, before the header has arrived.
  ``open_stream(url, concurrency=K)`` sets it for any remote source; ``concurrency=1`` keeps one
  connection.
* The default (``concurrency=None``) is adaptive: a window opens where more connections could
  pay: the server honours ranges, names the version with a strong ``ETag`` (each part is pinned
  to it with ``If-Match``) and more than ``part_size`` bytes are to be read. Its first part is
  the first answer, one stream; then :data:`ADAPTIVE_START` parts at once are tried, and K
  doubles while the bytes arrive faster for it, up to :data:`ADAPTIVE_LIMIT` (see
  :mod:`.parts`). Where :data:`ADAPTIVE_START` parts are no faster than the one stream was (a
  fast local link, which one stream fills), the window closes and the rest is read as one stream
  (one ranged request to the planned end), as with K = 1; on an object store, where each
  connection has its own rate, K grows. Everything else stays on one connection: a small object
  (one request, as with K = 1, reading everything asks for its first ``part_size`` bytes, which
  is all of a small one), a server that ignores ranges or gives no strong ``ETag``, a small
  selection.

A ranged read that breaks (connection reset, closed mid-body, 5xx) is resumed from the byte it
reached, up to ``retries`` times per read (one tensor, or the header) with exponential backoff.
A 429 or 503 with a ``Retry-After`` (seconds or a date) is retried after that delay instead,
unless it would pass the ``deadline`` (:class:`~stream_st.ReadTimeoutError` at once) or, with no
deadline, exceeds 5 minutes (the status error at once). A body that still ends early is reported
by the reader as a :class:`~stream_st.TruncatedStreamError` naming the URL and the offset; a
server that stops sending raises :class:`~stream_st.ReadTimeoutError` after ``timeout`` seconds.
An answer that breaks HTTP (garbled status line, length or chunks, a body compressed although
asked for as it is, a refused redirect, a proxy's refusal) raises a
:class:`~stream_st.TransportError` at once, with no retry; so does an error status other than
those retried (one line: an S3 error's code and message, an excerpt of any other body).

Every request of a read gets the version of the object the first answer had: its validator (a
strong ``ETag``, else ``Last-Modified``) goes with each later request (``If-Match``, else
``If-Unmodified-Since``: ranges, parallel parts and resumptions alike), and each answer's
``ETag``, ``Last-Modified`` and size are compared with the first's. An object replaced on the
server during the read raises :class:`~stream_st.SourceChangedError`: a tensor is never made of
bytes from two versions.
"""

from __future__ import annotations

import bisect
import math
import ssl
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from numbers import Real
from operator import itemgetter
from typing import Unpack

from ...errors import (
    ArgumentTypeError,
    CertificateError,
    HTTPProtocolError,
    RangeIgnoredWarning,
    ReadTimeoutError,
    SourceChangedError,
    TransportError,
    integer_at_least,
    redact,
    string,
)
from ..base import Source, Waits
from ..options import Clock, LimitOptions, Transport, checked_number
from .client import ClientUser, HTTPClient
from .framing import Response, content_range
from .parts import PartWindow
from .retry import Retries, VersionPin
from .status import ascii_number, raise_for_status

__all__ = ["ADAPTIVE_LIMIT", "ADAPTIVE_START", "FIRST_RANGE", "HttpSource"]

FIRST_RANGE = 64 << 10
"""Bytes asked for by the first request: the prefix, the header (usually) and some data."""

ADAPTIVE_START = 4
"""Parts at once an adaptive window (``concurrency=None``) tries after its first part, one
stream, whose rate they must beat."""

ADAPTIVE_LIMIT = 8
"""Parts at once an adaptive window grows to at most (part buffers: at most this many, 64 MiB of
the default ``part_size``)."""

_RANGE_IGNORED = (
    "{}: the server ignores Range requests (200, not 206): every read goes through the object "
    "from its first byte, so a slice or a selection costs all the bytes before it"
)


class HttpSource(ClientUser, Source):
    """An object at an ``http(s)://`` URL; a whole object, random access when ranges work.
    ``headers`` go with every request; ``ssl_context`` decides which certificates https trusts
    (default: the system's). ``limits`` (``timeout``, ``deadline``, ``speed_limit``,
    ``speed_time``) are used unless the reader is given its own, also with a ``client`` (which
    may be shared: it keeps no limits of any one read).

    ``url`` is the object's address; ``name`` is what error messages call it (default: ``url``;
    shown without a password or signature). A read that breaks, or an answer worth asking again
    for (408, 429, most 5xx), is tried again up to ``retries`` times, from the byte it reached,
    after ``backoff`` seconds doubled each time (or the server's ``Retry-After``). With
    ``concurrency`` K above 1 the data comes in parts of at most ``part_size`` bytes, K at once,
    each on its own connection; ``1`` keeps one connection, and the default (None) opens more
    only where they pay. ``docs/remote.md`` ("HTTP(S) and S3") says more."""

    def __init__(
        self,
        url: str,
        *,
        client: HTTPClient | None = None,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        retries: int = 3,
        backoff: float = 0.25,
        concurrency: int | None = None,
        part_size: int = 8 << 20,
        name: str | None = None,
        **limits: Unpack[LimitOptions],
    ) -> None:
        super().__init__()
        self.url = string("url", url)
        if name is not None:
            string("name", name)
        self.name = redact(name or url)  # what errors show: no password, no signature
        kind = type(self).__name__  # each message names the source it refuses an option of
        if concurrency is not None:
            concurrency = integer_at_least(f"{kind} concurrency", concurrency, 1)
        self._concurrency = concurrency
        self._part_size = integer_at_least(f"{kind} part_size", part_size, 1, " (bytes)")
        given: object = backoff  # as the caller gave it: any type
        if given is None or isinstance(given, bool) or not isinstance(given, Real):
            raise ArgumentTypeError(
                f"{kind} backoff must be a number of seconds >= 0, got "
                f"{type(given).__name__} {given!r:.80}"
            )
        delay = checked_number(f"{kind} backoff", given, infinite=False) or 0.0  # None: never
        self._parts: PartWindow | None = None  # reads go through it once open (see the module)
        self._single = False  # adaptive and settled on one stream: no window any more
        self._use_client(client, headers, ssl_context, limits)
        self._retry = Retries(integer_at_least(f"{kind} retries", retries, 0), delay)
        self._response: Response | None = None
        self._response_at = 0  # absolute offset of the next byte the open response delivers
        self._response_end = 0  # absolute offset where the open response's body ends
        self._plan: list[tuple[int, int]] = []
        self._pin = VersionPin()  # the first answer's ETag, Last-Modified
        self._waits = Waits()  # the reads in progress (see _reported)

    @property
    def validators(self) -> tuple[str, str]:
        """The ``ETag`` and ``Last-Modified`` of this read's first successful answer (empty
        strings where the server gave none, or before it answered): the object's version."""
        return self._pin.seen or ("", "")

    async def start(self, *, read_all: bool = False) -> None:
        """Send the first request and learn the size and whether ranges work.

        It asks for the first 64 KiB, unless the reader will read everything (``read_all``):
        then, with one stream (``concurrency=1``) or adaptive (the default), for all of it
        (``bytes=0-``), so the header and the data come in one response. With ``concurrency``
        K > 1 (or adaptive, for a big enough object) and ``read_all``, the window of parts
        opens as soon as that answer's head tells the size, before its body (the safetensors
        header) has been read: the next parts are requested by the first read (speculative first
        parts; adaptive: its first part is this answer's first ``part_size`` bytes, and the
        answer goes on as the one stream if no more parts pay). A later jump closes the open
        response and sends a ranged request from there.
        """
        adaptive = read_all and self._concurrency is None
        speculate = read_all and (self._concurrency or 1) > 1
        end = None if read_all and not speculate else FIRST_RANGE
        with self._reported():
            response = await self._get(0, end)
            if response is None:  # an empty object
                self.size = 0
                self.random_access = True
                return
            await self._adopt(response, 0)
            if end is not None and response.status == 200:  # no ranges given
                warnings.warn(RangeIgnoredWarning(_RANGE_IGNORED.format(self.name)), stacklevel=2)
            if (speculate or adaptive) and self.random_access and self.size is not None:
                self._plan = [(0, self.size)]  # until the reader's plan: everything
                if self._parallel():
                    self._open_window()

    @property
    def concurrency(self) -> int:
        """The ranged requests at once this read makes now: 1 until a window of parts opens,
        then its K (which grows, when adaptive)."""
        return 1 if self._parts is None else self._parts.concurrency

    def _parallel(self) -> bool:
        """Whether the planned bytes are to be read through a window of parts: ``concurrency``
        K > 1; adaptive, where the server honours ranges and names the version with a strong
        ETag and more than ``part_size`` bytes are planned (see the module)."""
        if not self.random_access or self._concurrency == 1 or self._single:
            return False
        if self._concurrency is not None:
            return True
        etag, _ = self.validators
        planned = sum(end - start for start, end in self._plan)
        return bool(etag) and not etag.startswith("W/") and planned > self._part_size

    async def _adopt(self, response: Response, start: int) -> None:
        """Make ``response``, the answer to a GET from ``start``, the open one."""
        self._response_end, size = await _body_range(response, start, self.size, self.name)
        if size is not None:
            self.size = size
        self.random_access = response.status == 206
        self._response = response
        self._response_at = start

    async def _get(self, start: int, end: int | None) -> Response | None:
        """GET from ``start`` (to ``end``, exclusive, or the end), retrying retryable failures;
        every answer after the first must be for the same version of the object."""
        headers = dict(self._headers)
        headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        headers.update(self._pin.preconditions())
        for attempt in range(self._retry.count + 1):
            wait = None
            try:
                response = await self._request(
                    "GET", self.url, self.prepare_headers("GET", self.url, headers)
                )
            except (HTTPProtocolError, CertificateError):
                raise  # the same request would get the same answer, or the same certificate
            except TransportError:
                if attempt == self._retry.count:
                    raise
            else:
                if response.status == 416 and start == 0:  # an empty object
                    await response.aclose()
                    unsatisfied = response.headers.get("content-range", "").strip()
                    total = unsatisfied.removeprefix("bytes */")
                    size = ascii_number(total) if total != unsatisfied else None
                    if size:
                        raise HTTPProtocolError(
                            f"the server refused the object's first bytes (416) while saying it "
                            f"holds {size} bytes",
                            url=self.name,
                            position=0,
                        )
                    return None
                retrying = self._retry.retryable(response.status) and attempt < self._retry.count
                if retrying:
                    wait = await self._retry.server_wait(response, self.clock, self.name, start)
                if not retrying or wait == math.inf:
                    return await self._accept(response, start)
                await response.discard()
            await self._back_off(attempt + 1, start, wait)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _accept(self, response: Response, position: int) -> Response:
        """``response`` as the answer to a request of this read: of the same version of the
        object as the first (:class:`SourceChangedError`), not an error status (raised)."""
        await self._pin.check(response, self.name, position)
        await raise_for_status(response, name=self.name)
        return response

    async def _back_off(self, failures: int, position: int, wait: float | None = None) -> None:
        """Wait before the next attempt after ``failures`` failed ones: ``wait`` seconds when
        the server said, else an exponential back-off; a deadline that passes first ends the
        read instead."""
        await self._retry.back_off(self.clock, failures, self.name, position, wait)

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
        if self._parts is not None:
            self._parts.replan(self._plan)
        elif self._parallel():
            self._open_window()

    def _planned_end(self, offset: int, minimum: int) -> int:
        """Where a request from ``offset`` should end: the end of the planned run it falls in,
        and at least ``minimum`` (the bytes asked for now). The plan is in order: a binary
        search, where a scan of a plan of many runs per request was quadratic."""
        plan = self._plan
        index = bisect.bisect_right(plan, offset, key=itemgetter(0)) - 1
        if index >= 0 and offset < plan[index][1]:
            return max(plan[index][1], minimum)
        return minimum

    @contextmanager
    def _reported(self) -> Iterator[None]:
        """Errors raised inside name this source as its caller did (``name``), never the URL a
        request went to: one redirected to may be signed, and a message is no place for that.
        :meth:`aclose` from another task cuts the work inside short (a wait for bytes, a
        request, a back-off), and refuses work begun after it: it raises
        :class:`TransportError` ("closed on this side")."""
        try:
            with self._waits.reading(self):
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

    async def read_landing(
        self, offset: int, buffer: memoryview, landed: Callable[[int, int], None]
    ) -> int:
        with self._reported():
            return await self._read(offset, buffer, partial=False, landed=landed)

    async def _read(
        self,
        offset: int,
        buffer: memoryview,
        *,
        partial: bool,
        landed: Callable[[int, int], None] | None = None,
    ) -> int:
        """Fill ``buffer`` from ``offset``: through the window of parts once it is open, else
        through the one open response (``landed``: see :meth:`read_landing`)."""
        if self._parts is None or not buffer:
            return await self._read_at(offset, buffer, partial=partial, landed=landed)
        filled, outside = await self._parts.read(offset, buffer, partial=partial, landed=landed)
        self.position = offset + filled
        if self._parts.drained:  # one stream is as fast: the rest is read as one
            rest = self._parts.rest
            self._parts, self._single = None, True
            if rest is not None:  # the answer the window opened with goes on
                await self._close_response()
                self._response, self._response_at, self._response_end = rest
        if outside:
            filled += await self._read_at(
                offset + filled, buffer[filled:], partial=partial, landed=landed
            )
        return filled

    def _open_window(self) -> None:
        """Start reading through a window of parts (see :mod:`.parts`): the open response, if
        any, becomes its first part."""
        adaptive = self._concurrency is None
        self._parts = PartWindow(
            self._open_range,
            self._back_off,
            retries=self._retry.count,
            concurrency=ADAPTIVE_START if adaptive else self._concurrency or 1,
            part_size=self._part_size,
            limit=ADAPTIVE_LIMIT if adaptive else None,
        )
        self._parts.open(self._plan, self._response, self._response_at, self._response_end)
        self._response = None

    async def _open_range(self, start: int, end: int) -> Response | None:
        """A GET for bytes ``start`` to ``end`` whose answer is checked to be that range."""
        response = await self._get(start, end)
        if response is not None:
            await _body_range(response, start, self.size, self.name)
        return response

    async def skip(self, count: int) -> int:
        if self.random_access:
            target = self.position + count
            if self.size is not None:
                target = min(target, self.size)
            skipped = target - self.position
            self.position = target
            return skipped
        return await super().skip(count)

    async def _read_at(
        self,
        offset: int,
        buffer: memoryview,
        *,
        partial: bool,
        landed: Callable[[int, int], None] | None = None,
    ) -> int:
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
            broken: TransportError | None = None
            try:  # never past the range the answer is for: a longer body is not the object's
                got = await response.receive_into(buffer[filled : filled + self._response_end - at])
            except HTTPProtocolError:
                raise
            except TransportError as exc:
                got, broken = 0, exc
            if got == 0:
                # The answer broke, or ended (a chunked body's last chunk) before its range did.
                cut = broken is not None or (
                    self.random_access and self._response_at < self._response_end
                )
                await self._close_response()
                if not cut:
                    break
                failures += 1
                if not self.random_access or failures > self._retry.count:
                    if isinstance(broken, ReadTimeoutError):
                        raise broken
                    break  # the body ended early: the reader reports the truncation
                await self._back_off(failures, at)
                continue
            filled += got
            self._response_at += got
            if landed is not None:
                landed(at, at + got)
            if partial:
                break
        self.position = offset + filled
        return filled

    async def _close_response(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            await response.aclose()

    async def aclose(self) -> None:
        self._waits.close()  # another task's read: it ends, its connection closed here
        if self._parts is not None:
            await self._parts.aclose()
        await self._close_response()
        await self._close_client()


async def _body_range(
    response: Response, start: int, known: int | None, name: str
) -> tuple[int, int | None]:
    """Check that ``response`` delivers the object from byte ``start``: a 206 for that
    range, or a 200 (the whole body) when ``start`` is 0. Returns the absolute offset where
    its body ends and the object's size if the answer tells it; otherwise closes ``response``
    and raises :class:`HTTPProtocolError`. ``known`` is the size an earlier answer told, ``name``
    the address errors report."""
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
                await _check_size(response, known, size, start, name)
                return end, size
        shown = response.headers.get("content-range", "")
        problem = f"unusable Content-Range {shown!r} for the range asked"
    elif response.status == 200 and start == 0:
        size = response.content_length
        await _check_size(response, known, size, start, name)
        return (1 << 62 if size is None else size), size
    elif response.status == 200:
        problem = "the server ignored the Range header (200 with the whole body from byte 0)"
    else:
        problem = f"unexpected answer HTTP {response.status} {response.reason}".rstrip()
    await response.aclose()
    raise HTTPProtocolError(problem, url=name, position=start)


async def _check_size(
    response: Response, known: int | None, size: int | None, position: int, name: str
) -> None:
    """Raise :class:`SourceChangedError` (closing ``response``) if its object is ``size``
    bytes long where an earlier answer of this read had another size (``known``)."""
    if size is not None and known is not None and size != known:
        await response.aclose()
        raise SourceChangedError(
            f"the object changed on the server during the read: {known} bytes, then {size}",
            url=name,
            position=position,
        )


async def source_for(url: str, clock: Clock) -> Source:
    """The registry's factory: an ``http(s)://`` object."""
    return HttpSource(url)

"""HTTP/1.1 messages on a connection: request heads, response heads, and bodies framed by
``Content-Length``, chunks or the connection closing; chunked uploads."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping

import anyio

from ..._util import AsyncClosing
from ...errors import (
    HTTPProtocolError,
    HTTPStatusError,
    ReadTimeoutError,
    TransportError,
    UsageError,
)
from ..options import HEADER_BREAKS
from .status import ascii_number, outcome_unknown, raise_for_status
from .target import Target
from .wire import Connection, receive_error

__all__ = [
    "Response",
    "Upload",
    "content_length",
    "content_range",
    "receive_response",
    "request_head",
    "sendable",
]

_HEAD_LIMIT = 64 << 10
_MAX_INTERIM = 32  # interim (1xx) answers accepted before the final one
_USER_AGENT = "stream_st"
_STATUS_LINE = re.compile(r"HTTP/1\.[0-9] ([1-5][0-9]{2})(?: (.*))?")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DISCARD_LIMIT = 64 << 10  # an unwanted body up to this size is read to keep its connection
_HEAD_END = re.compile(rb"\n\r?\n")  # a line end, LF or CRLF, then an empty line (RFC 9112 2.2)

Release = Callable[[Connection], None]
"""Takes back a connection whose answer was read to the end (a client's idle pool)."""


_BREAKS = re.compile(f"[{HEADER_BREAKS}]")


def sendable(value: str) -> bool:
    """Whether ``value`` can go in a request header as it is: Latin-1, with no line break or NUL
    (:func:`request_head` refuses a request carrying any other)."""
    return _BREAKS.search(value) is None and all(ord(c) < 256 for c in value)


def request_head(
    method: str, target: Target, headers: Mapping[str, str], extra: list[str]
) -> bytes:
    """The request line and headers of a request to ``target``, encoded. Bodies are asked for
    as they are (``Accept-Encoding: identity``, whatever ``headers`` say): the bytes of a
    tensor are received straight into its array, so a compressed answer would be unusable."""
    lines = [f"{method} {target.path} HTTP/1.1", f"Host: {target.authority}"]
    if "user-agent" not in {k.lower() for k in headers}:
        lines.append(f"User-Agent: {_USER_AGENT}")
    lines.extend(f"{k}: {v}" for k, v in headers.items() if k.lower() != "accept-encoding")
    lines.append("Accept-Encoding: identity")
    lines.extend(extra)
    for line in lines[1:]:
        if _BREAKS.search(line):  # would end the line early: a header of the value's choosing
            name = line.partition(":")[0][:64]
            raise UsageError(  # the value may be a credential (a session token): never shown
                f"request header {name!r} for {target.url} holds a line break or a NUL: not sent"
            )
    try:
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise UsageError(
            f"request headers for {target.url} must be Latin-1 text, got {bad!r}"
        ) from exc


async def _read_head(connection: Connection, target: Target) -> tuple[int, str, dict[str, str]]:
    """Status, reason and headers of the answer, past any interim (1xx) answers."""
    buffer = connection.leftover
    for _ in range(_MAX_INTERIM + 1):
        while (end_match := _HEAD_END.search(buffer)) is None:
            if len(buffer) > _HEAD_LIMIT:
                raise HTTPProtocolError("response head too large", url=target.url)
            more = bytearray(65536)
            try:
                count = await connection.wire.recv_into(memoryview(more))
            except OSError as exc:
                raise receive_error(exc, target.url) from exc
            if count == 0:
                raise TransportError("connection closed before a response", url=target.url)
            buffer += more[:count]
        head = bytes(buffer[: end_match.start()]).removesuffix(b"\r").decode("latin-1")
        del buffer[: end_match.end()]
        # Lines end in CRLF, or a bare LF (which recipients may take as one, the empty line
        # ending the head too): a line break is never part of a value, so no message quoting
        # one runs onto a second line.
        status_line, *header_lines = head.replace("\r\n", "\n").replace("\r", " ").split("\n")
        match = _STATUS_LINE.fullmatch(status_line)
        if match is None:
            raise HTTPProtocolError(f"malformed status line {status_line[:100]!r}", url=target.url)
        status = int(match[1])
        if status >= 200:
            headers: dict[str, str] = {}
            for line in header_lines:
                name, _, value = line.partition(":")
                key = name.strip().lower()
                value = value.strip()
                headers[key] = f"{headers[key]}, {value}" if key in headers else value
            return status, match[2] or "", headers
    raise HTTPProtocolError(
        f"more than {_MAX_INTERIM} interim (1xx) answers before the response", url=target.url
    )


async def receive_response(
    release: Release,
    method: str,
    target: Target,
    connection: Connection,
    *,
    keep_alive: bool = True,
) -> Response:
    """Read the head of the answer to a ``method`` request on ``connection``; without
    ``keep_alive`` (the request asked for ``Connection: close``, or was cut short) the connection
    is closed after the answer, whatever the answer says."""
    status, reason, headers = await _read_head(connection, target)
    has_body = method != "HEAD" and status not in (204, 304) and status >= 200
    return Response(
        release,
        connection,
        target.url,
        status,
        reason,
        headers,
        has_body=has_body,
        keep_alive=keep_alive,
    )


def content_length(headers: Mapping[str, str], url: str) -> int | None:
    """The ``Content-Length`` header's value; :class:`HTTPProtocolError` if it is not a number."""
    value = headers.get("content-length")
    if value is None:
        return None
    number = ascii_number(value)
    if number is None:
        raise HTTPProtocolError(f"malformed Content-Length {value[:40]!r}", url=url)
    return number


_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)")


def content_range(headers: Mapping[str, str]) -> tuple[int, int, int | None] | None:
    """A ``Content-Range`` header's first and last byte and the object's size (None for ``*``);
    None when there is none or it is malformed."""
    match = _CONTENT_RANGE.fullmatch(headers.get("content-range", ""))
    if match is None:
        return None
    first, last, total = (ascii_number(text) for text in match.groups())
    if first is None or last is None or (total is None and match[3] != "*"):
        return None  # more digits than any size has
    return first, last, total


class Response(AsyncClosing):
    """Status, headers and a body read into caller buffers with :meth:`receive_into`.

    Use as ``async with``: leaving it returns the connection to the pool when the body was read
    to the end (unless ``keep_alive`` is false, the answer said ``Connection: close`` or bytes
    past its end came with it), and closes it otherwise.
    """

    def __init__(
        self,
        release: Release,
        connection: Connection,
        url: str,
        status: int,
        reason: str,
        headers: dict[str, str],
        *,
        has_body: bool,
        keep_alive: bool = True,
    ) -> None:
        self._release = release
        self._connection: Connection | None = connection
        self.url = url
        self.status = status
        self.reason = reason
        self.headers = headers
        self.received = 0
        parsed = content_range(headers) if status == 206 else None
        self.offset = 0 if parsed is None else parsed[0]  # where in the object the body starts
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._reusable = keep_alive and headers.get("connection", "").lower() != "close"
        self.content_length: int | None
        if not has_body:
            self.content_length = 0
        else:
            self.content_length = None if self._chunked else content_length(headers, url)
        if self.content_length is None and not self._chunked and parsed and parsed[1] >= parsed[0]:
            # A 206 delimited by the connection closing (HTTP/1.0): its Content-Range says how
            # many bytes are due, so a close before them is a break, resumed as any other.
            self.content_length = parsed[1] - parsed[0] + 1
            self._reusable = False
        self._remaining = self.content_length  # None: until the connection closes or last chunk
        self._chunk_left = 0
        self._done = self._remaining == 0

    @property
    def position(self) -> int:
        """Where in the object the next body byte is: what errors report."""
        return self.offset + self.received

    @property
    def complete(self) -> bool:
        """True once the whole body was received."""
        return self._done

    async def receive_into(self, buffer: memoryview) -> int:
        """Receive the next body bytes into ``buffer``; 0 once the body is complete.

        Raises :class:`TransportError` if the connection fails or ends before the body does.
        """
        if self._done or not buffer:
            return 0
        try:  # failures translated here, once: the hot path gains no call for it
            if self._chunked:
                return await self._receive_chunked(buffer)
            if self._remaining is not None:
                buffer = buffer[: self._remaining]
            count = await self._raw_into(buffer)
        except TransportError:
            raise
        except OSError as exc:
            raise receive_error(exc, self.url, self.position) from exc
        if count == 0:
            if self._remaining is None:  # body delimited by the connection closing
                self._done = True
                self._reusable = False
                return 0
            raise TransportError(
                f"connection closed with {self._remaining} body bytes still to come",
                url=self.url,
                position=self.position,
            )
        self.received += count
        if self._remaining is not None:
            self._remaining -= count
            self._done = self._remaining == 0
        return count

    async def _receive_chunked(self, buffer: memoryview) -> int:
        if self._chunk_left == 0:
            line = await self._read_line()
            digits = line.split(b";")[0].strip()
            if not _CHUNK_SIZE.fullmatch(digits):
                raise HTTPProtocolError(
                    f"malformed chunk size line {line[:40]!r}", url=self.url, position=self.position
                )
            size = int(digits, 16)
            if size == 0:
                trailers = 0  # the trailer section's bytes: capped as a response head is
                while line := await self._read_line():  # trailers end with an empty line
                    trailers += len(line)
                    if trailers > _HEAD_LIMIT:
                        raise HTTPProtocolError(
                            "response trailers too large", url=self.url, position=self.position
                        )
                self._done = True
                return 0
            self._chunk_left = size
        count = await self._raw_into(buffer[: self._chunk_left])
        if count == 0:
            raise TransportError(
                "connection closed inside a chunk", url=self.url, position=self.position
            )
        self._chunk_left -= count
        self.received += count
        if self._chunk_left == 0 and await self._read_line() != b"":
            raise HTTPProtocolError(
                "malformed chunked body: no line end after a chunk",
                url=self.url,
                position=self.position,
            )
        return count

    async def _raw_into(self, buffer: memoryview) -> int:
        connection = self._connection
        if connection is None:
            raise TransportError("response already closed", url=self.url)
        if connection.leftover:
            count = min(len(buffer), len(connection.leftover))
            buffer[:count] = connection.leftover[:count]
            del connection.leftover[:count]
            return count
        return await connection.wire.recv_into(buffer)

    async def _read_line(self) -> bytes:
        connection = self._connection
        assert connection is not None
        while b"\n" not in connection.leftover:  # CRLF, or a bare LF as in a head
            if len(connection.leftover) > _HEAD_LIMIT:
                raise HTTPProtocolError("chunk header line too long", url=self.url)
            more = bytearray(4096)
            count = await connection.wire.recv_into(memoryview(more))
            if count == 0:
                raise TransportError(
                    "connection closed inside a chunked body", url=self.url, position=self.position
                )
            connection.leftover += more[:count]
        line, _, rest = bytes(connection.leftover).partition(b"\n")
        connection.leftover[:] = rest
        return line.removesuffix(b"\r")

    async def read_all(self, limit: int = 1 << 20) -> bytes:
        """The rest of the body as bytes (for small answers: errors, XML); at most ``limit``."""
        out = bytearray()
        chunk = bytearray(65536)
        while len(out) <= limit:
            count = await self.receive_into(memoryview(chunk))
            if count == 0:
                break
            out += chunk[:count]
        return bytes(out[:limit])

    async def discard(self) -> None:
        """Close an answer whose body is not wanted; a short one is read to the end first, so
        that its connection can serve the next request."""
        if self.content_length is not None and self.content_length <= _DISCARD_LIMIT:
            with contextlib.suppress(TransportError):
                await self.read_all(_DISCARD_LIMIT)
        await self.aclose()

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._done and self._reusable and not connection.leftover:
            self._release(connection)
        else:
            await connection.wire.aclose()


class Upload:
    """A request being sent: body pieces with :meth:`send`, then :meth:`finish` for the answer.

    :meth:`abort` drops the connection mid-body, so the server sees an incomplete request.
    """

    def __init__(
        self,
        release: Release,
        method: str,
        target: Target,
        connection: Connection,
        *,
        chunked: bool,
    ) -> None:
        self._release = release
        self._method = method
        self._target = target
        self._connection: Connection | None = connection
        self._chunked = chunked
        self.sent = 0

    async def _send_raw(self, data: bytes | memoryview) -> None:
        connection = self._connection
        if connection is None:
            raise TransportError("the upload is closed", url=self._target.url)
        try:
            await connection.wire.send(data)
        except OSError as exc:
            await self._fail(exc)

    async def _fail(self, exc: OSError) -> None:
        """The server stopped taking the body: report its answer if it sent one."""
        connection, self._connection = self._connection, None
        assert connection is not None
        try:
            with anyio.move_on_after(1):
                # The body was cut short: never reuse this connection.
                response = await receive_response(
                    self._release, self._method, self._target, connection, keep_alive=False
                )
                await raise_for_status(response)
        except HTTPStatusError:
            raise
        except TransportError:
            pass  # no answer to report: the send error below says what happened
        finally:
            await connection.wire.aclose()
        kind = ReadTimeoutError if isinstance(exc, TimeoutError) else TransportError
        detail = exc.strerror or str(exc) or "timed out"
        raise kind(
            f"upload failed after {self.sent} body bytes: {detail}", url=self._target.url
        ) from exc

    async def send(self, data: memoryview) -> None:
        """Send the next body bytes; returns once the connection has taken them all."""
        if not len(data):
            return
        if self._chunked:
            await self._send_raw(f"{len(data):x}\r\n".encode())
            await self._send_raw(data)
            await self._send_raw(b"\r\n")
        else:
            await self._send_raw(data)
        self.sent += len(data)

    async def finish(self) -> Response:
        """End the body and read the answer's head (its status is not checked here).

        Raises :class:`OutcomeUnknownError` when the whole request went out but no answer came.
        """
        if self._chunked:
            await self._send_raw(b"0\r\n\r\n")
        connection, self._connection = self._connection, None
        if connection is None:
            raise TransportError("the upload is closed", url=self._target.url)
        try:
            return await receive_response(self._release, self._method, self._target, connection)
        except BaseException as exc:
            await connection.wire.aclose()
            if isinstance(exc, TransportError) and not isinstance(exc, HTTPProtocolError):
                # The whole request went out: the server may have acted on it.
                raise outcome_unknown(f"{self._method} upload", exc, self._target.url) from exc
            raise

    async def abort(self) -> None:
        """Drop the connection: the request ends incomplete."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.wire.aclose()

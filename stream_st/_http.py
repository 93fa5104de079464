"""A small HTTP/1.1 client built for throughput: bodies are received straight into the caller's
buffers (``recv_into`` on plain sockets), so a tensor's bytes are copied once, by the kernel.

It does what the transports need and no more: keep-alive connections, ``Content-Length`` and
chunked bodies, chunked uploads, redirects for GET, timeouts, and TLS (through anyio's TLS stream,
which copies: decryption costs more than the copy). Not public API.
"""

from __future__ import annotations

import errno
import re
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote, urljoin, urlsplit

import anyio
import anyio.abc

from ._limits import UNLIMITED, Clock
from ._util import AsyncClosing
from .errors import (
    HTTPNotFoundError,
    HTTPProtocolError,
    HTTPStatusError,
    OutcomeUnknownError,
    ReadTimeoutError,
    SafetensorsError,
    TransportError,
    UnsupportedSourceError,
    UsageError,
)
from .sources.tcp import connect_socket

__all__ = [
    "ClientClock",
    "HTTPClient",
    "HTTPNotFoundError",
    "HTTPProtocolError",
    "HTTPStatusError",
    "Response",
    "Target",
    "Upload",
    "outcome_unknown",
]

_HEAD_LIMIT = 64 << 10
_MAX_INTERIM = 32  # interim (1xx) answers accepted before the final one
_USER_AGENT = "stream_st"
_URL_SAFE = "!#$%&'()*+,/:;=?@[]~"  # kept as is in a request target; the rest is percent-encoded
_STATUS_LINE = re.compile(r"HTTP/1\.[0-9] ([1-5][0-9]{2})(?: (.*))?", re.DOTALL)
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_STALLED = "the server took no data"


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed ``http(s)://`` address."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, as sent on the request line

    @classmethod
    def parse(cls, url: str) -> Target:
        """Split ``url``; characters not allowed on a request line (spaces, non-ASCII) in its path
        and query are percent-encoded (UTF-8), a non-ASCII host name is IDNA-encoded."""
        try:
            parts = urlsplit(url)
            scheme = parts.scheme.lower()
            if scheme not in ("http", "https") or not parts.hostname:
                raise UnsupportedSourceError(f"expected an http:// or https:// URL, got {url!r}")
            port = parts.port
            host = parts.hostname
            if not host.isascii():
                host = host.encode("idna").decode("ascii")
            path = quote(parts.path or "/", safe=_URL_SAFE)
            if parts.query:
                path += "?" + quote(parts.query, safe=_URL_SAFE)
        except ValueError as exc:  # a bad port, bracket, host name or lone surrogate
            raise UsageError(f"invalid URL {url!r}: {exc}") from exc
        if port is None:
            port = 443 if scheme == "https" else 80
        return cls(scheme, host, port, path)

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.authority}{self.path}"


class _Wire(Protocol):
    async def recv_into(self, buffer: memoryview) -> int: ...
    async def send(self, data: bytes | memoryview) -> None: ...
    async def aclose(self) -> None: ...


class _PlainWire:
    """A non-blocking socket: ``recv_into`` straight into the destination. Waits obey ``clock``
    and raise a plain :class:`TimeoutError` when a limit passes (see :class:`_Wire` users)."""

    def __init__(self, sock: socket.socket, clock: Clock) -> None:
        self._sock = sock
        self._clock = clock

    async def recv_into(self, buffer: memoryview) -> int:
        while True:
            try:
                count = self._sock.recv_into(buffer)
            except BlockingIOError:
                with self._clock.waiting():
                    await anyio.wait_readable(self._sock)
                continue
            self._clock.moved(count)
            return count

    async def send(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                with self._clock.waiting(stalled=_STALLED):
                    await anyio.wait_writable(self._sock)
                continue
            view = view[sent:]
            self._clock.moved(sent)

    async def aclose(self) -> None:
        self._sock.close()


class _StreamWire:
    """An anyio byte stream (TLS): received bytes are copied into the destination.

    Like a socket, it reports a broken or closed connection as :class:`OSError`; a peer that
    closes without the TLS closing handshake (common in HTTP) reads as the end of the stream.
    """

    def __init__(self, stream: anyio.abc.ByteStream, clock: Clock) -> None:
        self._stream = stream
        self._clock = clock
        self._pending = memoryview(b"")

    async def recv_into(self, buffer: memoryview) -> int:
        if not self._pending:
            try:
                with self._clock.waiting():
                    self._pending = memoryview(await self._stream.receive(max(len(buffer), 65536)))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return 0
            except anyio.ClosedResourceError as exc:
                raise _closed() from exc
            self._clock.moved(len(self._pending))
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    async def send(self, data: bytes | memoryview) -> None:
        try:
            with self._clock.waiting(stalled=_STALLED):
                await self._stream.send(bytes(data))
        except anyio.BrokenResourceError as exc:
            raise ConnectionResetError(errno.ECONNRESET, "connection lost while sending") from exc
        except anyio.ClosedResourceError as exc:
            raise _closed() from exc
        self._clock.moved(len(data))

    async def aclose(self) -> None:
        # No TLS closing handshake: it would wait on a peer that may be gone or still sending.
        await anyio.aclose_forcefully(self._stream)


def _closed() -> OSError:
    """The error for using a connection already closed here (what a closed socket raises)."""
    return OSError(errno.EBADF, "the connection is closed")


@dataclass
class _Connection:
    target_key: tuple[str, str, int]
    wire: _Wire
    leftover: bytearray = field(default_factory=bytearray)


def _receive_error(exc: OSError, url: str, position: int | None = None) -> TransportError:
    """What a failed receive raises: :class:`ReadTimeoutError` when a time limit passed (the
    message says which), else :class:`TransportError`."""
    if isinstance(exc, TimeoutError):
        return ReadTimeoutError(str(exc) or "timed out", url=url, position=position)
    return TransportError(f"receive failed: {exc.strerror or exc}", url=url, position=position)


def _content_length(headers: Mapping[str, str], url: str) -> int | None:
    """The ``Content-Length`` header's value; :class:`HTTPProtocolError` if it is not a number."""
    value = headers.get("content-length")
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise HTTPProtocolError(f"malformed Content-Length {value[:40]!r}", url=url)
    return int(value)


class Response(AsyncClosing):
    """Status, headers and a body read into caller buffers with :meth:`receive_into`.

    Use as ``async with``: leaving it returns the connection to the pool when the body was read
    to the end, and closes it otherwise.
    """

    def __init__(
        self,
        client: HTTPClient,
        connection: _Connection,
        url: str,
        status: int,
        reason: str,
        headers: dict[str, str],
        *,
        has_body: bool,
    ) -> None:
        self._client = client
        self._connection: _Connection | None = connection
        self.url = url
        self.status = status
        self.reason = reason
        self.headers = headers
        self.received = 0
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.content_length: int | None
        if not has_body:
            self.content_length = 0
        else:
            self.content_length = None if self._chunked else _content_length(headers, url)
        self._remaining = self.content_length  # None: until the connection closes or last chunk
        self._chunk_left = 0
        self._done = self._remaining == 0
        self._reusable = headers.get("connection", "").lower() != "close"

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
            raise _receive_error(exc, self.url, self.received) from exc
        if count == 0:
            if self._remaining is None:  # body delimited by the connection closing
                self._done = True
                self._reusable = False
                return 0
            raise TransportError(
                f"connection closed with {self._remaining} body bytes still to come",
                url=self.url,
                position=self.received,
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
                    f"malformed chunk size line {line[:40]!r}", url=self.url, position=self.received
                )
            size = int(digits, 16)
            if size == 0:
                while await self._read_line():  # trailers end with an empty line
                    pass
                self._done = True
                return 0
            self._chunk_left = size
        count = await self._raw_into(buffer[: self._chunk_left])
        if count == 0:
            raise TransportError(
                "connection closed inside a chunk", url=self.url, position=self.received
            )
        self._chunk_left -= count
        self.received += count
        if self._chunk_left == 0 and await self._read_line() != b"":
            raise HTTPProtocolError(
                "malformed chunked body: no line end after a chunk",
                url=self.url,
                position=self.received,
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
        while b"\r\n" not in connection.leftover:
            if len(connection.leftover) > _HEAD_LIMIT:
                raise HTTPProtocolError("chunk header line too long", url=self.url)
            more = bytearray(4096)
            count = await connection.wire.recv_into(memoryview(more))
            if count == 0:
                raise TransportError(
                    "connection closed inside a chunked body", url=self.url, position=self.received
                )
            connection.leftover += more[:count]
        line, _, rest = bytes(connection.leftover).partition(b"\r\n")
        connection.leftover[:] = rest
        return line

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

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._done and self._reusable:
            self._client._release(connection)
        else:
            await connection.wire.aclose()


class Upload:
    """A request being sent: body pieces with :meth:`send`, then :meth:`finish` for the answer.

    :meth:`abort` drops the connection mid-body, so the server sees an incomplete request.
    """

    def __init__(
        self,
        client: HTTPClient,
        method: str,
        target: Target,
        connection: _Connection,
        *,
        chunked: bool,
    ) -> None:
        self._client = client
        self._method = method
        self._target = target
        self._connection: _Connection | None = connection
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
                status, reason, headers = await self._client._read_head(connection, self._target)
                response = self._client._response(
                    self._method, self._target, connection, status, reason, headers
                )
                response._reusable = False  # the body was cut short: never reuse this connection
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
            status, reason, headers = await self._client._read_head(connection, self._target)
            return self._client._response(
                self._method, self._target, connection, status, reason, headers
            )
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


class HTTPClient(AsyncClosing):
    """Keep-alive HTTP/1.1 connections to any number of hosts.

    ``clock`` bounds connecting and every wait (see ``stream_st._limits``): a transport that owns
    its client gives it its operation's clock. ``ssl_context`` is used for https (default: the
    system's trusted roots).
    """

    def __init__(
        self,
        *,
        clock: Clock = UNLIMITED,
        ssl_context: ssl.SSLContext | None = None,
        max_redirects: int = 5,
    ) -> None:
        self.clock = clock
        self._ssl_context = ssl_context
        self._max_redirects = max_redirects
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._closed = False

    async def _connect(self, target: Target) -> tuple[_Connection, bool]:
        """A connection to ``target``, and whether it was reused from the pool."""
        key = (target.scheme, target.host, target.port)
        idle = self._idle.get(key)
        if idle:
            return idle.pop(), True
        clock = self.clock
        wire: _Wire
        if target.scheme == "https":
            context = self._ssl_context or ssl.create_default_context()
            try:
                with clock.waiting(target.url, stalled="no answer to connect"):
                    stream = await anyio.connect_tcp(
                        target.host, target.port, tls=True, ssl_context=context
                    )
            except TransportError:
                raise
            except (OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
                detail = str(exc) or "connection lost during the TLS handshake"
                raise TransportError(f"cannot connect: {detail}", url=target.url) from exc
            wire = _StreamWire(stream, clock)
        else:
            try:
                sock = await connect_socket(target.host, target.port, clock)
            except TransportError as exc:
                raise type(exc)(f"cannot connect to {target.authority}", url=target.url) from exc
            wire = _PlainWire(sock, clock)
        return _Connection(key, wire), False

    def _release(self, connection: _Connection) -> None:
        if self._closed:
            return
        self._idle.setdefault(connection.target_key, []).append(connection)

    async def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        *,
        follow_redirects: bool = True,
    ) -> Response:
        """Send a request and read the response head; the body is read from the Response.

        A stale keep-alive connection is replaced transparently. Bodies to stream go through
        :meth:`upload` instead.
        """
        for _ in range(self._max_redirects + 1):
            response = await self._request_once(method, url, headers, body)
            location = response.headers.get("location")
            if (
                follow_redirects
                and response.status in (301, 302, 303, 307, 308)
                and location
                and method in ("GET", "HEAD")
            ):
                await response.aclose()
                url = urljoin(url, location)
                continue
            return response
        raise TransportError(f"more than {self._max_redirects} redirects", url=url)

    @staticmethod
    def _head(method: str, target: Target, headers: Mapping[str, str], extra: list[str]) -> bytes:
        lines = [f"{method} {target.path} HTTP/1.1", f"Host: {target.authority}"]
        if "user-agent" not in {k.lower() for k in headers}:
            lines.append(f"User-Agent: {_USER_AGENT}")
        lines.extend(f"{k}: {v}" for k, v in headers.items())
        lines.extend(extra)
        try:
            return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            raise UsageError(
                f"request headers for {target.url} must be Latin-1 text, got {bad!r}"
            ) from exc

    async def _request_once(
        self, method: str, url: str, headers: Mapping[str, str] | None, body: bytes | None
    ) -> Response:
        target = Target.parse(url)
        given = dict(headers or {})
        extra = [] if body is None else [f"Content-Length: {len(body)}"]
        head = self._head(method, target, given, extra)
        for attempt in range(2):
            connection, reused = await self._connect(target)
            try:
                await connection.wire.send(head)
                if body:
                    await connection.wire.send(body)
                status, reason, response_headers = await self._read_head(connection, target)
                return self._response(method, target, connection, status, reason, response_headers)
            except (OSError, TransportError) as exc:
                await connection.wire.aclose()
                # A keep-alive connection the server closed meanwhile: retry once, fresh.
                if reused and attempt == 0:
                    continue
                if isinstance(exc, SafetensorsError):
                    raise
                kind = ReadTimeoutError if isinstance(exc, TimeoutError) else TransportError
                raise kind(f"request failed: {exc}", url=target.url) from exc
            except BaseException:
                await connection.wire.aclose()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _response(
        self,
        method: str,
        target: Target,
        connection: _Connection,
        status: int,
        reason: str,
        headers: dict[str, str],
    ) -> Response:
        has_body = method != "HEAD" and status not in (204, 304) and status >= 200
        return Response(self, connection, target.url, status, reason, headers, has_body=has_body)

    async def upload(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> Upload:
        """Start a request whose body is sent piece by piece with :meth:`Upload.send`.

        With ``content_length`` the body is sent as is, else with chunked transfer encoding.
        """
        target = Target.parse(url)
        extra = (
            [f"Content-Length: {content_length}"]
            if content_length is not None
            else ["Transfer-Encoding: chunked"]
        )
        head = self._head(method, target, dict(headers or {}), extra)
        connection, _ = await self._connect(target)
        upload = Upload(self, method, target, connection, chunked=content_length is None)
        await upload._send_raw(head)
        return upload

    async def _read_head(
        self, connection: _Connection, target: Target
    ) -> tuple[int, str, dict[str, str]]:
        """Status, reason and headers of the answer, past any interim (1xx) answers."""
        buffer = connection.leftover
        for _ in range(_MAX_INTERIM + 1):
            while (end := buffer.find(b"\r\n\r\n")) < 0:
                if len(buffer) > _HEAD_LIMIT:
                    raise HTTPProtocolError("response head too large", url=target.url)
                more = bytearray(65536)
                try:
                    count = await connection.wire.recv_into(memoryview(more))
                except OSError as exc:
                    raise _receive_error(exc, target.url) from exc
                if count == 0:
                    raise TransportError("connection closed before a response", url=target.url)
                buffer += more[:count]
            head = bytes(buffer[:end]).decode("latin-1")
            del buffer[: end + 4]
            status_line, *header_lines = head.split("\r\n")
            match = _STATUS_LINE.fullmatch(status_line)
            if match is None:
                raise HTTPProtocolError(
                    f"malformed status line {status_line[:100]!r}", url=target.url
                )
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

    async def aclose(self) -> None:
        """Close every idle connection."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await connection.wire.aclose()


class ClientClock:
    """For a transport whose every wait is its HTTP client's: its ``clock`` is the client's."""

    _client: HTTPClient

    @property
    def clock(self) -> Clock:
        return self._client.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._client.clock = clock


async def raise_for_status(response: Response, *, name: str | None = None) -> None:
    """Turn an error status into :class:`HTTPStatusError` (404: :class:`HTTPNotFoundError`).

    ``name`` is the address to report (e.g. ``s3://bucket/key``), by default the HTTP URL.
    """
    if response.status < 400:
        return
    try:
        detail = (await response.read_all(2048)).decode("utf-8", "replace").strip()
    except TransportError:
        detail = ""
    finally:
        await response.aclose()
    kind = HTTPNotFoundError if response.status == 404 else HTTPStatusError
    raise kind(response.status, response.reason, url=name or response.url, detail=detail[:300])


def outcome_unknown(
    request: str, failure: BaseException, url: str, more: str = ""
) -> OutcomeUnknownError:
    """The error for a final ``request`` whose answer was lost to ``failure`` (or unclear): the
    object may or may not have been stored at ``url``. ``more`` is added to the message."""
    reason = str(failure).split(", url=", 1)[0] or type(failure).__name__
    return OutcomeUnknownError(
        f"no clear answer to the {request} ({reason}): the object may or may not have been "
        f"stored{more}",
        url=url,
    )

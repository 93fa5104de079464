"""The client: keep-alive connections to any number of hosts, requests, redirects, uploads."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from urllib.parse import urljoin

from .._limits import UNLIMITED, Clock
from .._util import AsyncClosing
from ..errors import ReadTimeoutError, SafetensorsError, TransportError
from .framing import Response, Upload, receive_response, request_head
from .target import Target
from .wire import Connection, connect

__all__ = ["ClientClock", "HTTPClient"]


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
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._closed = False

    async def _connect(self, target: Target) -> tuple[Connection, bool]:
        """A connection to ``target``, and whether it was reused from the pool."""
        idle = self._idle.get(target.origin)
        if idle:
            return idle.pop(), True
        return await connect(target, self.clock, self._ssl_context), False

    def _release(self, connection: Connection) -> None:
        if self._closed:
            return
        self._idle.setdefault(connection.origin, []).append(connection)

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

    async def _request_once(
        self, method: str, url: str, headers: Mapping[str, str] | None, body: bytes | None
    ) -> Response:
        target = Target.parse(url)
        given = dict(headers or {})
        extra = [] if body is None else [f"Content-Length: {len(body)}"]
        head = request_head(method, target, given, extra)
        for attempt in range(2):
            connection, reused = await self._connect(target)
            try:
                await connection.wire.send(head)
                if body:
                    await connection.wire.send(body)
                return await receive_response(self._release, method, target, connection)
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
        head = request_head(method, target, dict(headers or {}), extra)
        connection, _ = await self._connect(target)
        upload = Upload(self._release, method, target, connection, chunked=content_length is None)
        await upload._send_raw(head)
        return upload

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

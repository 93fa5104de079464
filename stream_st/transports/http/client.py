"""The client: keep-alive connections to any number of hosts, requests, redirects, uploads."""

from __future__ import annotations

import ssl
from collections.abc import Hashable, Mapping
from dataclasses import replace

from ..._util import AsyncClosing
from ...errors import (
    ArgumentTypeError,
    HTTPProtocolError,
    ReadTimeoutError,
    SafetensorsError,
    TransportError,
)
from ..options import UNLIMITED, Clock, LimitOptions, Limits, Transport
from .framing import Response, Upload, receive_response, request_head
from .proxy import Proxy, proxy_for
from .redirect import REDIRECTS, redirected, url_credentials
from .status import unreadable_coding
from .target import Target
from .wire import Connection, connect

__all__ = ["ClientUser", "HTTPClient"]


class HTTPClient(AsyncClosing):
    """Keep-alive HTTP/1.1 connections to any number of hosts.

    ``clock`` bounds connecting and every wait (see ``stream_st.transports.options``): a transport
    that owns
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
        self._idle: dict[Hashable, list[Connection]] = {}
        self._closed = False
        self.sending = 0
        """Requests :meth:`request` began to send so far: one that fails with this unchanged
        never reached a server (no connection, or credentials not ready)."""

    async def _connect(
        self,
        target: Target,
        proxy: Proxy | None,
        clock: Clock,
        context: ssl.SSLContext | None,
        *,
        pooled: bool = True,
    ) -> tuple[Connection, bool]:
        """A connection to ``target`` (through ``proxy``) whose waits obey ``clock``, and whether
        it was reused from the pool (unless ``pooled`` is false): only one reached the same way,
        with the same TLS context, and to which nothing came while it sat idle (bytes a server
        sent past its last answer, or its end: such a one is closed, never sent a request)."""
        context = context or self._ssl_context
        route = (target.origin, proxy, context)
        idle = self._idle.get(route)
        while idle and pooled:
            connection = idle.pop()
            if connection.wire.stirred():
                await connection.wire.aclose()
                continue
            connection.wire.clock = clock
            return connection, True
        connection = await connect(target, clock, context, proxy)
        connection.route = route
        return connection, False

    def _release(self, connection: Connection) -> None:
        if self._closed:
            return
        self._idle.setdefault(connection.route, []).append(connection)

    async def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        *,
        follow_redirects: bool = True,
        clock: Clock | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Response:
        """Send a request and read the response head; the body is read from the Response.

        A keep-alive connection the server closed or reset while it sat idle (before any byte
        of an answer), or whose answer cannot be read as one (bytes a server sent past its last
        answer), is replaced transparently and the request sent again, once; never after a
        time limit passed. A request that is not idempotent (POST) is never sent twice: it goes
        on a new connection, closed after its answer. GET and HEAD follow redirects
        (unless ``follow_redirects`` is false) by the policy of
        ``stream_st.transports.http.redirect``. A
        successful answer whose body is encoded (``Content-Encoding: gzip``) raises
        :class:`HTTPProtocolError`: it is never taken for the bytes asked for. Bodies to stream
        go through :meth:`upload` instead. ``clock`` and ``ssl_context``, when given, replace the
        client's for this request; a proxy is chosen from the environment
        (``stream_st.transports.http.proxy``).
        """
        via = (clock or self.clock, ssl_context)
        target = Target.parse(url)
        sent = url_credentials(url, headers or {})
        follow = follow_redirects and method in ("GET", "HEAD")
        for _ in range(self._max_redirects + 1):
            response = await self._request_once(method, target, sent, body, *via)
            location = response.headers.get("location")
            if not (follow and location and response.status in REDIRECTS):
                coding = unreadable_coding(response.headers)
                if coding is not None and 200 <= response.status < 300:
                    await response.aclose()
                    raise HTTPProtocolError(
                        f"the body is encoded ({coding}) although it was asked for as it is "
                        "(Accept-Encoding: identity); serve this file without compression",
                        url=target.url,
                    )
                return response
            await response.discard()
            target, sent = redirected(target, location, sent)
        raise HTTPProtocolError(f"more than {self._max_redirects} redirects", url=target.url)

    async def _request_once(
        self,
        method: str,
        target: Target,
        headers: Mapping[str, str],
        body: bytes | None,
        clock: Clock,
        context: ssl.SSLContext | None,
    ) -> Response:
        proxy = proxy_for(target)
        idempotent = method in _IDEMPOTENT
        extra = [] if body is None else [f"Content-Length: {len(body)}"]
        extra += [] if idempotent else ["Connection: close"]
        head = _head(method, target, dict(headers), extra, proxy)
        for attempt in range(2):
            connection, reused = await self._connect(
                target, proxy, clock, context, pooled=idempotent
            )
            received = len(connection.leftover)
            self.sending += 1
            try:
                await connection.wire.send(head)
                if body:
                    await connection.wire.send(body)
                response = await receive_response(
                    self._release, method, target, connection, keep_alive=idempotent
                )
                break
            except (OSError, TransportError) as exc:
                await connection.wire.aclose()
                # A keep-alive connection the server closed meanwhile, or one whose answer is no
                # answer (bytes a server sent past its last one): once more, on a new one.
                stale = isinstance(exc, HTTPProtocolError) or (
                    _dropped(exc) and len(connection.leftover) == received
                )
                if reused and attempt == 0 and stale:
                    continue
                if isinstance(exc, SafetensorsError):
                    raise
                kind = ReadTimeoutError if isinstance(exc, TimeoutError) else TransportError
                raise kind(f"request failed: {exc}", url=target.url) from exc
            except BaseException:
                await connection.wire.aclose()
                raise
        else:  # pragma: no cover
            raise AssertionError("unreachable")
        if proxy is not None and response.status == 407:
            await response.aclose()
            raise proxy.refused(f"{method} {target.url}", 407, response.reason, target.url)
        return response

    async def upload(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
        clock: Clock | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Upload:
        """Start a request whose body is sent piece by piece with :meth:`Upload.send`.

        With ``content_length`` the body is sent as is, else with chunked transfer encoding.
        ``clock``, ``ssl_context`` and proxies as in :meth:`request`. A pooled connection to
        which bytes or its end came while it sat idle is closed, not used (on https, those the
        TLS layer holds are not seen); the request is never sent twice.
        """
        target = Target.parse(url)
        headers = url_credentials(url, headers or {})
        proxy = proxy_for(target)
        extra = (
            [f"Content-Length: {content_length}"]
            if content_length is not None
            else ["Transfer-Encoding: chunked"]
        )
        head = _head(method, target, headers, extra, proxy)
        connection, _ = await self._connect(target, proxy, clock or self.clock, ssl_context)
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


_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
"""The methods whose request sent twice does what it does once (RFC 9110 9.2.2)."""

_DROPPED = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


def _dropped(exc: OSError) -> bool:
    """Whether ``exc``, raised by a request on a connection, is the server having closed or reset
    the connection: the end of it where an answer was due, or a reset or broken pipe, sending or
    receiving. Never a time limit, nor an answer that could not be read."""
    if type(exc) is TransportError:  # from reading the answer's head: its end, or a receive's
        return exc.__cause__ is None or isinstance(exc.__cause__, _DROPPED)
    return isinstance(exc, _DROPPED)


def _head(
    method: str, target: Target, headers: dict[str, str], extra: list[str], proxy: Proxy | None
) -> bytes:
    """The head of a request to ``target``; a plain http request through ``proxy`` names the
    whole URL (absolute form) and carries the proxy's credentials."""
    if proxy is None or target.scheme != "http":
        return request_head(method, target, headers, extra)
    return request_head(method, replace(target, path=target.url), headers, extra + proxy.headers())


class ClientUser:
    """For a transport whose requests go through an :class:`HTTPClient`, its own or one given
    (which may be shared). Its ``clock``, ``headers`` and ``ssl_context`` are its own and go with
    each request: a shared client keeps nothing of any one operation."""

    clock: Clock

    def _use_client(
        self,
        client: HTTPClient | None,
        headers: Mapping[str, str] | None,
        ssl_context: ssl.SSLContext | None,
        limits: LimitOptions,
    ) -> None:
        """Set up, from the constructor's arguments; every one checked."""
        if client is not None and not isinstance(client, HTTPClient):
            raise ArgumentTypeError(f"client must be an HTTPClient, got {type(client).__name__}")
        transport = Transport.of(headers, ssl_context)
        self.clock = Clock(Limits.of(limits))
        self._owns_client = client is None
        self._client = client or HTTPClient()
        self._headers = dict(transport.headers)
        self._ssl_context = transport.ssl_context

    def add_transport(self, transport: Transport) -> None:
        """Apply an operation's ``headers`` and ``ssl_context`` on top of this transport's."""
        self._headers = transport.over(self._headers)
        self._ssl_context = transport.ssl_context or self._ssl_context

    async def _request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
        *,
        follow_redirects: bool = True,
    ) -> Response:
        """:meth:`HTTPClient.request` under this transport's clock and TLS context."""
        return await self._client.request(
            method,
            url,
            headers,
            body,
            follow_redirects=follow_redirects,
            clock=self.clock,
            ssl_context=self._ssl_context,
        )

    async def _start_upload(
        self, method: str, url: str, headers: Mapping[str, str], content_length: int | None
    ) -> Upload:
        """:meth:`HTTPClient.upload` under this transport's clock and TLS context."""
        return await self._client.upload(
            method,
            url,
            headers,
            content_length=content_length,
            clock=self.clock,
            ssl_context=self._ssl_context,
        )

    async def _close_client(self) -> None:
        """Close the client if it is this transport's own."""
        if self._owns_client:
            await self._client.aclose()

"""The HTTP server: aiohttp answering GET and HEAD of the served object (see ``served``).

Every request aiohttp parses comes to :meth:`Server._answer` (no router: a target that is not a
path, ``CONNECT host:port`` or ``OPTIONS *``, is answered as any other), checked in this order:
the bearer token (401), the path (404; ``CONNECT`` names none), the method (405), the files
still the ones planned (409), then the conditions and the range (``conditions``: 304, 412, 416,
200 or 206). A client gone before or while its answer goes out is dropped without a word; a
request aiohttp cannot parse gets aiohttp's 400 and one line in its log, both naming the kind
of failure, neither repeating a byte of the request (see :func:`_malformed`). The files a body
comes from are opened before the status goes out: no descriptor free is a 503
(``Retry-After``), a file no longer the one planned a 409. A body is sent piece by piece: a
file's bytes with ``sendfile`` (zero-copy), bytes in memory in slices of :data:`SLICE`. Its
last byte is held back until the files are found unchanged once more: a file changed (another
inode, size or modification time) while it was being sent ends its answer one byte short (the
connection is closed), never complete with a mix of two versions. ``sendfile`` queues the
file's pages, not copies: a write in place after that check still reaches a client that has not
read those bytes yet (``docs/serve.md``: served files are replaced by rename).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import io
import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import anyio

from ..errors import ArgumentTypeError, SourceChangedError, TransportError, UsageError, string
from .conditions import answer
from .served import ServedObject, SourceFile, Tensors, served_object

if TYPE_CHECKING:
    from aiohttp import web
    from multidict import CIMultiDictProxy

    from ..core.header import Header

__all__ = ["DEFAULT_PORT", "GRACE", "SLICE", "TOKEN_ENV", "Server", "serve", "serving"]

log = logging.getLogger("stream_st.serve")

DEFAULT_PORT = 8000
"""The port :func:`serve` and ``stream-st serve`` listen on unless told another."""

TOKEN_ENV = "STREAM_ST_SERVE_TOKEN"
"""The environment variable ``stream-st serve`` takes its bearer token from (``--token`` wins)."""

SLICE = 4 << 20
"""Bytes in memory go out in slices of this size, each taken by the socket before the next."""

GRACE = 2.0
"""Seconds the answers still being sent when a server stops get to finish, in all; then their
connections are closed."""

_LATE = 0.25
"""What aiohttp's own shutdown gives (twice: to finish, then once cancelled) a request that came
on a kept-alive connection after the answers being sent were dealt with: a race of a few turns
of the event loop."""

_ALLOW = "GET, HEAD"

_RETRY_AFTER = {"Retry-After": "1"}
"""What a 503 says: ask again in a second (stream_st's reader waits as told, then retries)."""


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a bearer token, never showing it; None when it can be one. A
    token is visible ASCII (letters, digits, punctuation; no space), as RFC 6750's tokens are:
    a client sends a header's other characters as bytes of its own choosing (Latin-1, UTF-8),
    which would match the token for one client and not another."""
    if not token:
        return "empty"
    if not all("!" <= character <= "~" for character in token):
        return "not visible ASCII (letters, digits, punctuation; no space or other character)"
    return None


def host_problem(host: str) -> str | None:
    """Why ``host`` is refused as the address to listen on; None when it is not. An empty
    host listens on every interface, and the server's ``url`` (``http://:PORT/...``) names no
    host a reader can load from: every interface is asked for by name."""
    if not host:
        return "empty: it would listen on every interface (name 0.0.0.0 for that)"
    return None


def port_problem(port: object) -> str | None:
    """Why ``port`` is refused as the port to listen on; None when it is not."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        return f"must be in 0-65535 (0: any free port), got {port!r}"
    return None


class _Token:
    """A bearer token, compared in constant time and never shown."""

    __slots__ = ("_digest",)

    def __init__(self, token: str) -> None:
        if not isinstance(token, str):
            raise ArgumentTypeError(f"token must be a string, got {type(token).__name__}")
        problem = token_problem(token)
        if problem is not None:
            raise UsageError(f"the bearer token is {problem}")
        self._digest = hashlib.sha256(token.encode()).digest()

    def admits(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries this token."""
        scheme, _, given = (authorization or "").partition(" ")
        offered = hashlib.sha256(given.strip().encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(offered, self._digest) and scheme.lower() == "bearer"

    def __repr__(self) -> str:
        return "<token>"


def _malformed(exc: BaseException) -> str:
    """What is said of a request aiohttp cannot parse, in its 400's body and in the log: the
    kind of failure, aiohttp's exception's name (``LineTooLong`` for a request line or header
    over 8190 bytes). Never aiohttp's reason: it quotes the request's bytes (the start of an
    ``Authorization`` line too long: a client's credential, or the server's own token)."""
    return f"malformed request ({type(exc).__name__})"


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log (``aiohttp.server``), where a request aiohttp cannot parse (a
    client's, answered 400) is one line at INFO at most, not a traceback at ERROR: anyone who
    reaches the port could fill the log (``stream-st serve``'s standard error) with those. Every
    other record, an error of the server's own included, goes as aiohttp logs it."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        """Log as aiohttp asks, a request it cannot parse (``exc_info`` an
        ``HttpProcessingError``) in one line: the status and :func:`_malformed`'s words,
        without the traceback (whose exception quotes the request)."""
        from aiohttp.http_exceptions import HttpProcessingError

        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            del kwargs["exc_info"]
            level = min(level, logging.INFO)
            msg = f"{msg}: answered %d to a %s"
            args = (*args, exc.code, _malformed(exc))
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # aiohttp's line, not this one
        super().log(level, msg, *args, **kwargs)


@functools.cache
def _web_server() -> type[web.Server]:
    """aiohttp's low-level ``web.Server`` (no access log, its log through :class:`_ServerLog`)
    whose connections answer a request aiohttp cannot parse with :func:`_malformed`'s words,
    where aiohttp's 400 gave its reason, quoting the request's bytes back."""
    from aiohttp import web
    from aiohttp.http_exceptions import HttpProcessingError
    from aiohttp.log import server_logger

    # aiohttp takes None for no access log and any logger-like object, as web.Server's
    # keywords pass them on; its annotations say Logger for both
    options: dict[str, Any] = {"access_log": None, "logger": _ServerLog(server_logger)}

    class Connection(web.RequestHandler):
        """aiohttp's handler of one connection, its 400s said in fixed words."""

        def handle_error(
            self,
            request: web.BaseRequest,
            status: int = 500,
            exc: BaseException | None = None,
            message: str | None = None,
        ) -> web.StreamResponse:
            """aiohttp's answer to an error, a request it cannot parse said as
            :func:`_malformed` says it."""
            if isinstance(exc, HttpProcessingError):
                message = _malformed(exc) + "\n"
            return super().handle_error(request, status, exc, message)

    class WebServer(web.Server):
        """aiohttp's ``web.Server``, its connections handled by ``Connection``."""

        def __call__(self) -> web.RequestHandler:
            """A new connection's handler (aiohttp's ``web.Server`` is its protocol factory)."""
            return Connection(self, loop=asyncio.get_running_loop(), **options)

    return WebServer


class Server:
    """A running server (from :func:`serving`): ``url`` is the address a reader loads from;
    ``host`` and ``port`` where it listens."""

    def __init__(self, served: ServedObject, host: str, port: int, token: _Token | None) -> None:
        self._served = served
        self._token = token
        self.host = host
        self.port = port
        self._answering: dict[asyncio.Task[object], web.BaseRequest] = {}  # by its task

    @property
    def path(self) -> str:
        """The path the object is served at: ``/<name>.safetensors``."""
        return f"/{self._served.name}.safetensors"

    @property
    def url(self) -> str:
        """``http://host:port/<name>.safetensors``, the name percent-encoded (a ``#``, ``?``
        or ``%`` in it is part of the path)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{quote(self.path)}"

    @property
    def size(self) -> int:
        """The object's size in bytes."""
        return self._served.size

    @property
    def etag(self) -> str:
        """The object's strong ETag, with its quotes."""
        return self._served.etag

    @property
    def header(self) -> Header:
        """The object's :class:`~stream_st.Header`."""
        return self._served.header

    def __repr__(self) -> str:
        token = ", token required" if self._token is not None else ""
        return f"<Server {self.url} ({self.size} bytes{token})>"

    # ------------------------------------------------------------------ answering

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request, known as being answered until done (see :meth:`_stop`)."""
        task = asyncio.current_task()
        assert task is not None
        self._answering[task] = request
        try:
            return await self._answer(request)
        finally:
            del self._answering[task]

    async def _stop(self, runner: web.BaseRunner) -> None:
        """Stop: stop listening, give the answers being sent :data:`GRACE` seconds in all to
        finish, then end those still going (their tasks cancelled, their connections aborted)
        and clean up.

        aiohttp's own shutdown spends its timeout twice on an answer that does not end (waiting
        for it, then for the handler once its request is cancelled, which an answer blocked on
        a slow client never notices): stopping with ``shutdown_timeout=2`` took 4 s."""
        for site in runner.sites:
            await site.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GRACE
        while self._answering and (left := deadline - loop.time()) > 0:
            await asyncio.wait(list(self._answering), timeout=left)
        stuck = list(self._answering.items())
        for task, request in stuck:
            transport = request.transport  # before the cancellation lets aiohttp drop it
            task.cancel()
            if transport is not None:
                transport.abort()  # its buffer would never drain to a stalled client
        if stuck:
            await asyncio.wait([task for task, _ in stuck], timeout=_LATE)
        await runner.cleanup()

    async def _answer(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request (see the module)."""
        from aiohttp import web

        if self._token is not None and not self._token.admits(request.headers.get("Authorization")):
            return _plain(401, "a bearer token is required", {"WWW-Authenticate": "Bearer"})
        if request.path != self.path and request.method != "CONNECT":  # a host, not a path
            return _plain(404, f"not found: this server serves {self.path}")
        if request.method not in ("GET", "HEAD"):
            return _plain(405, "only GET and HEAD", {"Allow": _ALLOW})
        change = self._served.change()
        if change is not None:
            return self._changed(change)
        served = self._served
        headers = request.headers
        decided = answer(
            request.method,
            served.size,
            served.etag,
            range_=_combined(headers, "Range"),
            if_match=_combined(headers, "If-Match"),
            if_none_match=_combined(headers, "If-None-Match"),
            if_range=_combined(headers, "If-Range"),
        )
        common = {"ETag": served.etag, "Accept-Ranges": "bytes"}
        if decided.status == 412:
            return _plain(412, "the object does not match If-Match", common)
        if decided.status == 416:
            return _plain(
                416, "no such bytes", {**common, "Content-Range": f"bytes */{served.size}"}
            )
        if decided.status == 304:
            return web.Response(status=304, headers=common)
        sending = request.method == "GET" and decided.end > decided.start
        opened: dict[SourceFile, io.FileIO] = {}
        try:
            if sending:  # before the status goes out: a file that cannot be opened gets its own
                refused = self._open_files(decided.start, decided.end, opened)
                if refused is not None:
                    return refused
            response = web.StreamResponse(status=decided.status, headers=common)
            response.content_type = "application/octet-stream"
            response.content_length = decided.end - decided.start
            if decided.status == 206:
                response.headers["Content-Range"] = (
                    f"bytes {decided.start}-{decided.end - 1}/{served.size}"
                )
            try:
                await response.prepare(request)
                if sending:
                    await self._send(request, response, decided.start, decided.end, opened)
                await response.write_eof()
            except ConnectionError:  # the client went away
                pass
            return response
        finally:
            for handle in opened.values():
                handle.close()

    def _changed(self, change: str) -> web.StreamResponse:
        log.warning("refusing to serve: %s since serving began", change)
        return _plain(409, "a file served changed on disk since serving began: serve it again")

    def _open_files(
        self, start: int, end: int, opened: dict[SourceFile, io.FileIO]
    ) -> web.StreamResponse | None:
        """Open every file bytes ``start`` to ``end`` of the object come from (into ``opened``);
        None when all are, else the answer: 503 with ``Retry-After`` when the process or the
        system has no file descriptor free (``EMFILE``, ``ENFILE``: the request may be asked
        again), 409 when a file is no longer the one planned (gone, replaced)."""
        try:
            for piece, _, _ in self._served.pieces_in(start, end):
                if piece.file is not None and piece.file not in opened:
                    opened[piece.file] = piece.file.open()  # checked to be the one planned
        except SourceChangedError as exc:
            return self._changed(str(exc))
        except TransportError as exc:
            log.warning("answering 503: %s", exc)
            busy = _plain(
                503, "the server cannot open the files served now: try again", _RETRY_AFTER
            )
            busy.force_close()  # the connection's own descriptor goes back too
            return busy
        return None

    async def _send(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        start: int,
        end: int,
        opened: dict[SourceFile, io.FileIO],
    ) -> None:
        """Send bytes ``start`` to ``end`` of the object, from the files ``opened`` (the caller
        closes them); the last one only once every file sent from is found unchanged (else the
        connection is closed one byte short). A client gone raises a ``ConnectionError``."""
        transport = request.transport
        for piece, low, high in self._served.pieces_in(start, end - 1):
            if piece.file is None:
                assert piece.data is not None
                view = piece.data[low - piece.start : high - piece.start]
                for at in range(0, len(view), SLICE):
                    await response.write(view[at : at + SLICE])
                continue
            if transport is None or transport.is_closing():
                return
            position = piece.offset + low - piece.start
            await asyncio.get_running_loop().sendfile(
                transport, opened[piece.file], position, high - low
            )
        last = self._last_byte(end - 1, opened)
        problem = next(filter(None, (file.change() for file in opened)), None)
        if problem is not None:
            log.warning("closing an answer one byte short: %s", problem)
            if transport is not None:
                transport.abort()
            return
        await response.write(last)

    def _last_byte(self, position: int, opened: dict[SourceFile, io.FileIO]) -> bytes:
        """Byte ``position`` of the object (from its file among ``opened``)."""
        piece, _, _ = next(self._served.pieces_in(position, position + 1))
        if piece.file is None:
            assert piece.data is not None
            return bytes(piece.data[position - piece.start : position - piece.start + 1])
        return os.pread(opened[piece.file].fileno(), 1, piece.offset + position - piece.start)


def _plain(status: int, text: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """A short text answer; like every answer, it says byte ranges are taken."""
    from aiohttp import web

    headers = {"Accept-Ranges": "bytes", **(headers or {})}
    return web.Response(status=status, text=text + "\n", headers=headers)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``; :class:`~stream_st.TransportError` if it cannot."""
    problem = host_problem(string("host", host))
    if problem is not None:
        raise UsageError(f"host is {problem}")
    problem = port_problem(port)
    if problem is not None:
        raise UsageError(f"port {problem}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise TransportError(
            f"cannot listen on {where}: {exc.strerror or exc}", url=f"http://{where}/"
        ) from None


@asynccontextmanager
async def serving(
    source: str | os.PathLike[str] | Tensors,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    name: str | None = None,
    metadata: Mapping[str, str] | None = None,
    checksums: bool | str | None = None,
) -> AsyncIterator[Server]:
    """Serve ``source`` over HTTP while the block runs: ``async with serving(src) as server``,
    then load from ``server.url`` (see :func:`serve` for the arguments). ``port=0`` (the
    default here) picks a free port. Needs asyncio (aiohttp's event loop), not trio.

    Leaving the block stops the server: it stops listening, and answers still being sent get
    two seconds (:data:`GRACE`) in all to finish before their connections are closed.
    """
    try:
        from aiohttp import web
    except ImportError:
        raise UsageError("serving needs aiohttp: pip install 'stream-st[serve]'") from None
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise UsageError("serving() runs on asyncio (aiohttp's event loop), not trio") from None
    checked = None if token is None else _Token(token)
    # name= is checked first thing (served.checked_name), the file's own name likewise
    served = await served_object(source, name=name, metadata=metadata, checksums=checksums)
    sock = _listening_socket(host, port)
    server = Server(served, host, sock.getsockname()[1], checked)
    handler = _web_server()(server._handle)
    runner = web.ServerRunner(handler, handle_signals=False, shutdown_timeout=_LATE)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        yield server
    finally:
        with anyio.CancelScope(shield=True):
            await server._stop(runner)
        with suppress(OSError):
            sock.close()


def serve(
    source: str | os.PathLike[str] | Tensors,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    name: str | None = None,
    metadata: Mapping[str, str] | None = None,
    checksums: bool | str | None = None,
) -> None:
    """Serve ``source`` over HTTP as one safetensors object until interrupted (Ctrl-C).

    ``source``: a safetensors file, a sharded checkpoint's ``*.index.json`` (or a model
    directory holding one), or tensors in memory (``{name: array}``: numpy arrays, torch
    tensors, a ``state_dict``; they must not change while served). The object is at
    ``http://host:port/<name>.safetensors`` (``name``: the file's, else ``model``; given with
    its ``.safetensors``, it is not added twice; a string without ``/``, surrounding spaces or
    control characters, in UTF-8, else a :class:`~stream_st.UsageError`, as is a file whose own
    name is not one); any reader
    loads it, ``stream_st.load(url)`` included. ``host`` is 127.0.0.1 unless told otherwise.
    ``token`` asks every request for ``Authorization: Bearer <token>`` (a reader passes
    ``headers={"Authorization": "Bearer <token>"}``); it is never logged or shown.

    ``checksums``: None (default) keeps the digests a file records and computes xxh3-128
    digests of tensors in memory; True or an algorithm's name makes every tensor carry one
    (computed now where the source has none of that algorithm); False serves none. Readers
    verify them. ``metadata`` goes in a tensors-in-memory object's ``__metadata__``.

    A missing path is a :class:`~stream_st.SourceNotFoundError`, a file that is not
    safetensors a :class:`~stream_st.HeaderError`, a port in use a
    :class:`~stream_st.TransportError`. Inside an event loop use :func:`serving`.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise UsageError("serve() blocks: inside an event loop use 'async with serving(...)'")

    async def forever() -> None:
        async with serving(
            source,
            host=host,
            port=port,
            token=token,
            name=name,
            metadata=metadata,
            checksums=checksums,
        ) as server:
            log.info("serving %s", server.url)
            await anyio.sleep_forever()

    with suppress(KeyboardInterrupt):
        anyio.run(forever)


def _combined(headers: CIMultiDictProxy[str], name: str) -> str | None:
    """The field ``name`` of a request's ``headers`` (a multidict), its lines joined as RFC 9110
    combines a field sent more than once: two ``Range`` lines ask for several ranges (answered
    whole), where the first line alone gave a 206 for it, dropping the other unsaid."""
    lines = headers.getall(name, [])
    return ", ".join(lines) if lines else None

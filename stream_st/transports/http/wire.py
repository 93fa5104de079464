"""Connections: the bytes on the wire, plain (``recv_into`` straight into the destination) or
TLS (through anyio's TLS stream, which copies: decryption costs more than the copy)."""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from ...errors import CertificateError, ReadTimeoutError, TransportError
from ..options import Clock
from ..tcp import connect_socket
from .proxy import Proxy, tunnel
from .target import Target

__all__ = ["Connection", "PlainWire", "StreamWire", "Wire", "connect", "receive_error"]

_STALLED = "the server took no data"


class Wire(Protocol):
    clock: Clock  # every wait obeys it: a pooled connection takes its next request's

    async def recv_into(self, buffer: memoryview) -> int: ...
    async def send(self, data: bytes | memoryview) -> None: ...
    async def aclose(self) -> None: ...

    def stirred(self) -> bool:
        """Whether bytes not yet read, or the connection's end, arrived (as far as can be seen
        without waiting): a connection idle between answers should have nothing."""
        ...


class PlainWire:
    """A non-blocking socket: ``recv_into`` straight into the destination. Waits obey ``clock``
    and raise a plain :class:`TimeoutError` when a limit passes (see :class:`Wire` users)."""

    def __init__(self, sock: socket.socket, clock: Clock) -> None:
        self._sock = sock
        self.clock = clock

    async def recv_into(self, buffer: memoryview) -> int:
        while True:
            try:
                count = self._sock.recv_into(buffer)
            except BlockingIOError:
                with self.clock.waiting():
                    await _wait(anyio.wait_readable, self._sock)
                continue
            self.clock.moved(count)
            return count

    async def send(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                with self.clock.waiting(stalled=_STALLED):
                    await _wait(anyio.wait_writable, self._sock)
                continue
            view = view[sent:]
            self.clock.moved(sent)

    def stirred(self) -> bool:
        return _stirred(self._sock)

    async def aclose(self) -> None:
        if self._sock.fileno() >= 0:  # a task waiting on it (another one's read) wakes
            anyio.notify_closing(self._sock)
        self._sock.close()


async def _wait(wait: Callable[[socket.socket], Awaitable[None]], sock: socket.socket) -> None:
    """``wait(sock)``: the socket closed meanwhile (by another task) is the error a closed
    socket raises."""
    try:
        await wait(sock)
    except anyio.ClosedResourceError as exc:
        raise _closed() from exc


class StreamWire:
    """An anyio byte stream (TLS): received bytes are copied into the destination.

    Like a socket, it reports a broken or closed connection as :class:`OSError`; a peer that
    closes without the TLS closing handshake (common in HTTP) reads as the end of the stream.
    """

    def __init__(self, stream: anyio.abc.ByteStream, clock: Clock) -> None:
        self._stream = stream
        self.clock = clock
        self._pending = memoryview(b"")

    async def recv_into(self, buffer: memoryview) -> int:
        if not self._pending:
            try:
                with self.clock.waiting():
                    self._pending = memoryview(await self._stream.receive(max(len(buffer), 65536)))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return 0
            except anyio.ClosedResourceError as exc:
                raise _closed() from exc
            self.clock.moved(len(self._pending))
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    async def send(self, data: bytes | memoryview) -> None:
        try:
            with self.clock.waiting(stalled=_STALLED):
                await self._stream.send(bytes(data))
        except anyio.BrokenResourceError as exc:
            raise ConnectionResetError(errno.ECONNRESET, "connection lost while sending") from exc
        except anyio.ClosedResourceError as exc:
            raise _closed() from exc
        self.clock.moved(len(data))

    def stirred(self) -> bool:
        # Only bytes received here: those the event loop or the TLS layer holds cannot be seen
        # without waiting (asyncio reads a socket as soon as bytes arrive).
        return bool(self._pending)

    async def aclose(self) -> None:
        # No TLS closing handshake: it would wait on a peer that may be gone or still sending.
        await anyio.aclose_forcefully(self._stream)


def _stirred(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes to read, or its end or an error arrived: without waiting."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:  # reset, or closed here
        pass
    return True


def _closed() -> OSError:
    """The error for using a connection already closed here (what a closed socket raises)."""
    return OSError(errno.EBADF, "the connection is closed")


@dataclass
class Connection:
    """A connection for requests to ``origin`` and the bytes received past the last answer read.
    ``route`` is what a pool keys it by: the origin, and how it was reached."""

    origin: tuple[str, str, int]
    wire: Wire
    leftover: bytearray = field(default_factory=bytearray)
    route: Hashable = None


async def connect(
    target: Target, clock: Clock, ssl_context: ssl.SSLContext | None, proxy: Proxy | None = None
) -> Connection:
    """A new connection to ``target``'s origin, within ``clock``'s limits, through ``proxy``
    when given (a ``CONNECT`` tunnel for https); TLS for https with ``ssl_context`` (default:
    the system's trusted roots)."""
    wire: Wire
    if target.scheme == "https":
        context = ssl_context or ssl.create_default_context()
        try:
            with clock.waiting(target.url, stalled="no answer to connect"):
                stream = await _tls_stream(target, context, proxy)
        except TransportError:
            raise
        except ssl.SSLCertVerificationError as exc:
            raise CertificateError(
                f"the server's certificate failed verification: {exc.verify_message}",
                url=target.url,
            ) from exc
        except (OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            detail = str(exc) or "connection lost during the TLS handshake"
            where = "" if proxy is None else f" through the proxy {proxy.name}"
            raise TransportError(f"cannot connect{where}: {detail}", url=target.url) from exc
        wire = StreamWire(stream, clock)
    else:
        host, port = (target.host, target.port) if proxy is None else (proxy.host, proxy.port)
        try:
            sock = await connect_socket(host, port, clock)
        except TransportError as exc:
            where = target.authority if proxy is None else f"the proxy {proxy.name}"
            why = exc.reason.removeprefix("cannot connect: ")  # refused, a limit passed...
            raise type(exc)(f"cannot connect to {where}: {why}", url=target.url) from exc
        wire = PlainWire(sock, clock)
    return Connection(target.origin, wire)


async def _tls_stream(
    target: Target, context: ssl.SSLContext, proxy: Proxy | None
) -> anyio.abc.ByteStream:
    """A TLS stream to ``target``: straight, or inside a tunnel through ``proxy``."""
    if proxy is None:
        return await anyio.connect_tcp(target.host, target.port, tls=True, ssl_context=context)
    raw = await anyio.connect_tcp(proxy.host, proxy.port)
    try:
        await tunnel(raw, proxy, target)
        return await TLSStream.wrap(raw, hostname=target.host, ssl_context=context)
    except BaseException:
        await anyio.aclose_forcefully(raw)
        raise


def receive_error(exc: OSError, url: str, position: int | None = None) -> TransportError:
    """What a failed receive raises: :class:`ReadTimeoutError` when a time limit passed (the
    message says which), else :class:`TransportError`."""
    if isinstance(exc, TimeoutError):
        return ReadTimeoutError(str(exc) or "timed out", url=url, position=position)
    return TransportError(f"receive failed: {exc.strerror or exc}", url=url, position=position)

"""TCP peers: ``tcp://host:port`` sources, and connections that carry many messages.

Bytes are received with non-blocking ``recv_into`` straight into each array's memory, waiting with
``anyio.wait_readable`` only when the socket is empty: no per-chunk ``bytes`` objects, and it runs
on asyncio and trio alike.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import socket
from typing import Any
from urllib.parse import urlsplit

import anyio

from ..errors import ReadTimeoutError, TransportError, UnsupportedSourceError
from .base import Source

__all__ = ["SocketEnd", "SocketSource", "connect_socket", "parse_tcp_url"]


def parse_tcp_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``; IPv6 hosts in brackets."""
    parts = urlsplit(url)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise UnsupportedSourceError(f"expected tcp://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise UnsupportedSourceError(f"a tcp:// URL takes no path or query: {url!r}")
    return parts.hostname, parts.port


async def connect_socket(host: str, port: int, *, timeout: float | None = None) -> socket.socket:
    """Open a non-blocking TCP socket to ``host:port`` (TCP_NODELAY set)."""
    url = f"tcp://{host}:{port}"
    last_error: OSError | None = None
    try:
        with anyio.fail_after(timeout if timeout is not None else math.inf):
            addresses = await _addresses(host, port)
            for family, kind, proto, _, address in addresses:
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                try:
                    await _connect(sock, address)
                except OSError as exc:
                    sock.close()
                    last_error = exc
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
    except TimeoutError as exc:
        raise ReadTimeoutError(f"connecting timed out after {timeout} s", url=url) from exc
    except OSError as exc:
        last_error = exc
    detail = last_error.strerror or str(last_error) if last_error else "no address"
    raise TransportError(f"cannot connect: {detail}", url=url) from last_error


async def _addresses(host: str, port: int) -> list[tuple[Any, ...]]:
    """``getaddrinfo`` results; an IP literal needs no lookup (a worker-thread hop each time)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        found = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return [tuple(entry) for entry in found]
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]


async def _connect(sock: socket.socket, address: tuple[Any, ...]) -> None:
    """Non-blocking connect, waiting for writability; raises the socket's error."""
    code = sock.connect_ex(address)
    if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
        raise OSError(code, os.strerror(code))
    if code:
        await anyio.wait_writable(sock)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise OSError(code, os.strerror(code))


class SocketEnd:
    """What a socket source and a socket sink share: the socket, the name to report, the wait
    for the socket bounded by ``timeout``, and whether closing is theirs (``owns_socket``)."""

    name: str
    position: int

    def __init__(
        self,
        sock: socket.socket,
        name: str,
        *,
        timeout: float | None = None,
        owns_socket: bool = True,
    ) -> None:
        super().__init__()
        self._sock = sock
        self.name = name
        self._timeout = math.inf if timeout is None else timeout
        self._owns = owns_socket

    async def _wait(self, *, writable: bool) -> None:
        try:
            with anyio.fail_after(self._timeout):
                if writable:
                    await anyio.wait_writable(self._sock)
                else:
                    await anyio.wait_readable(self._sock)
        except TimeoutError as exc:
            what = "the peer took no data" if writable else "no data"
            raise ReadTimeoutError(
                f"{what} for {self._timeout} s", url=self.name, position=self.position
            ) from exc

    async def aclose(self) -> None:
        if self._owns:
            self._sock.close()


class SocketSource(SocketEnd, Source):
    """One TCP socket read with ``recv_into``; a connection, so only one message is consumed.

    ``timeout`` bounds the wait for each next byte (a peer that stops sending raises
    :class:`~stream_st.ReadTimeoutError`). ``owns_socket`` decides whether :meth:`aclose` closes
    the socket: a :class:`~stream_st.Connection` lends it to one message at a time.
    """

    whole_object = False

    async def receive_into(self, buffer: memoryview) -> int:
        if not buffer:
            return 0
        while True:
            try:
                count = self._sock.recv_into(buffer)
            except BlockingIOError:
                await self.wait_readable()
                continue
            except OSError as exc:
                raise TransportError(
                    f"receive failed: {exc.strerror or exc}", url=self.name, position=self.position
                ) from exc
            self.position += count
            return count

    async def wait_readable(self) -> None:
        """Wait until the socket has data or was closed by the peer, up to the timeout."""
        await self._wait(writable=False)

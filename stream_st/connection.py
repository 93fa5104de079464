"""TCP connections that carry safetensors messages back to back: ``connect`` and ``listen``.

A message is one complete safetensors file. On a connection the reader stops exactly at the end of
each message, so a session of many transfers runs over one socket::

    async with stream_st.listen("127.0.0.1", 0) as listener:       # the receiving side
        port = listener.port
        async for connection in listener:
            async with connection:
                async for stream in connection.messages():
                    async for name, array in stream:
                        ...

    async with await stream_st.connect("tcp://127.0.0.1:9000") as connection:
        async with connection.open_stream() as stream:             # one message
            ...
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager

import anyio

from ._util import AsyncClosing
from .errors import UsageError
from .header import DEFAULT_MAX_HEADER_SIZE, TensorSpec
from .reader import Include, TensorStream
from .sinks.tcp import SocketSink
from .sources.tcp import SocketSource, connect_socket, parse_tcp_url
from .writer import Order, TensorWriter

__all__ = ["Connection", "Listener", "connect", "listen"]


class Connection(AsyncClosing):
    """One TCP connection; read (and write) any number of safetensors messages on it in turn.

    ``timeout`` bounds each wait for data from the peer. Close it with ``async with`` or
    :meth:`aclose`.
    """

    def __init__(self, sock: socket.socket, name: str, *, timeout: float | None = None) -> None:
        self._sock = sock
        self.name = name
        self.timeout = timeout
        self._closed = False

    def open_stream(
        self, *, include: Include = None, max_header_size: int = DEFAULT_MAX_HEADER_SIZE
    ) -> TensorStream:
        """The next message on this connection, as a :class:`~stream_st.TensorStream`.

        Closing that stream leaves the connection open for the next message.
        """
        if self._closed:
            raise UsageError(f"{self.name}: the connection is closed")
        source = SocketSource(self._sock, self.name, timeout=self.timeout, owns_socket=False)
        return TensorStream(source, include=include, max_header_size=max_header_size)

    def open_writer(
        self,
        plan: Iterable[TensorSpec],
        *,
        metadata: Mapping[str, str] | None = None,
        order: Order = "plan",
    ) -> TensorWriter:
        """Write the next message on this connection (see :func:`~stream_st.open_writer`).

        A message that fails closes the connection, so the peer sees it end early.
        """
        if self._closed:
            raise UsageError(f"{self.name}: the connection is closed")
        sink = SocketSink(self._sock, self.name, timeout=self.timeout, owns_socket=False)
        return TensorWriter(sink, plan, metadata=metadata, order=order)

    async def messages(
        self, *, include: Include = None, max_header_size: int = DEFAULT_MAX_HEADER_SIZE
    ) -> AsyncIterator[TensorStream]:
        """Every message until the peer closes the connection between two messages.

        Each stream is opened (header read) before it is handed out; read it before asking for
        the next one.
        """
        while True:
            if await self._peer_closed():
                return
            stream = self.open_stream(include=include, max_header_size=max_header_size)
            async with stream:
                yield stream

    async def _peer_closed(self) -> bool:
        """Wait for the next byte; True if the peer closed the connection cleanly instead."""
        probe = SocketSource(self._sock, self.name, timeout=self.timeout, owns_socket=False)
        await probe.wait_readable()
        try:
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:  # pragma: no cover - readable means recv will not block
            return False

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()


async def connect(url: str, *, timeout: float | None = None) -> Connection:
    """Connect to ``tcp://host:port``; ``timeout`` bounds the connect and each wait for data."""
    host, port = parse_tcp_url(url)
    sock = await connect_socket(host, port, timeout=timeout)
    return Connection(sock, f"tcp://{host}:{port}", timeout=timeout)


class Listener:
    """Accepts TCP connections; iterate it for :class:`Connection` objects."""

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self._sock = sock
        self._timeout = timeout
        self.host: str = sock.getsockname()[0]
        self.port: int = sock.getsockname()[1]

    @property
    def url(self) -> str:
        """``tcp://host:port`` to give to the peer."""
        return f"tcp://{self.host}:{self.port}"

    async def accept(self) -> Connection:
        """Wait for the next connection."""
        while True:
            try:
                sock, address = self._sock.accept()
                break
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
        host, port = address[:2]
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(sock, f"tcp://{host}:{port}", timeout=self._timeout)

    def __aiter__(self) -> AsyncIterator[Connection]:
        return self._connections()

    async def _connections(self) -> AsyncIterator[Connection]:
        while True:
            yield await self.accept()


@asynccontextmanager
async def listen(
    host: str = "127.0.0.1", port: int = 0, *, timeout: float | None = None
) -> AsyncIterator[Listener]:
    """Listen for TCP peers on ``host:port`` (port 0 picks a free one: see ``listener.port``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    sock.setblocking(False)
    try:
        yield Listener(sock, timeout)
    finally:
        sock.close()

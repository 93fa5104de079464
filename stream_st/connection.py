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

import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Generic, Self, TypeVar, Unpack

import anyio

from ._util import AsyncClosing
from .core.digests import Digests
from .core.header import DEFAULT_MAX_HEADER_SIZE
from .core.layout import TensorSpec
from .errors import TransportError, TruncatedStreamError, UsageError, integer_at_least
from .reader import Include, TensorStream
from .transports.options import NO_LIMITS, Clock, LimitOptions, Limits
from .transports.registry import SinkLender
from .transports.tcp import (
    SocketSink,
    SocketSource,
    Turn,
    close_socket,
    connect_socket,
    parse_tcp_url,
    tcp_url,
)
from .writer import Order, TensorWriter, open_writer

__all__ = ["Connection", "Listener", "connect", "listen"]

T = TypeVar("T")


class Connection(AsyncClosing, SinkLender):
    """One TCP connection; read (and write) any number of safetensors messages on it in turn.

    One message at a time is read, and one written (a second one started meanwhile raises
    :class:`~stream_st.UsageError`); reading and writing may go on at once in two tasks.
    ``limits`` (from :func:`connect` or :func:`listen`) apply to each message, unless the call
    that starts one gives its own: its deadline runs from its opening (waiting for a message to
    begin counts only against the timeout). Close it with ``async with`` or :meth:`aclose`, from
    any task: a task waiting on the connection then fails with
    :class:`~stream_st.TransportError`. A message read only part way (a ``break``, a refused
    message) leaves the next one's start unknown: later reads raise
    :class:`~stream_st.UsageError`.

    A connection is also a destination of :func:`~stream_st.open_writer` and
    :func:`~stream_st.save`: each call writes the next message, as :meth:`open_writer` does.
    """

    not_a_source = (
        "it carries any number of messages: read the next one with connection.open_stream(), "
        "or each in turn with connection.messages()"
    )
    """Why a connection given where a source is asked for is refused (see
    :attr:`Listener.not_a_source`)."""

    def __init__(self, sock: socket.socket, name: str, *, limits: Limits = NO_LIMITS) -> None:
        self._sock = sock
        self.name = name
        self.limits = limits
        self._closed = False
        self._reading = Turn("read")
        self._writing = Turn("written")

    def _check_open(self) -> None:
        if self._closed or self._sock.fileno() < 0:  # closed here, or by a failed message
            raise UsageError(f"{self.name}: the connection is closed")

    def _clock(self, limits: LimitOptions) -> Clock:
        """The clock of one message: the call's ``limits`` if it gives any, else the
        connection's."""
        return Clock(Limits.of(limits, transport=False) if limits else self.limits)

    def _source(
        self, limits: LimitOptions, kind: type[SocketSource] = SocketSource
    ) -> SocketSource:
        """The socket lent to the next message read, as a ``kind``."""
        self._check_open()
        clock = self._clock(limits)
        return kind(self._sock, self.name, clock=clock, turn=self._reading)

    def open_stream(
        self,
        *,
        include: Include = None,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        max_tensor_bytes: int | None = None,
        max_total_bytes: int | None = None,
        **limits: Unpack[LimitOptions],
    ) -> TensorStream:
        """The next message on this connection, as a :class:`~stream_st.TensorStream`.

        Closing that stream leaves the connection open for the next message. ``include``
        selects the tensors to read; ``max_header_size``, ``max_tensor_bytes`` and
        ``max_total_bytes`` cap what the peer's message may make the reader allocate (all as
        for :func:`~stream_st.open_stream`). A peer that closed the connection
        instead of sending a message makes opening the stream raise
        :class:`~stream_st.TruncatedStreamError` (:meth:`messages` ends there instead).
        """
        stream_of = _streams(include, max_header_size, max_tensor_bytes, max_total_bytes)
        return stream_of(self._source(limits, _NextMessage))

    def lend_sink(self) -> SocketSink:
        """The socket lent to the next message written, under the connection's limits (a call
        that gives its own replaces them) and its writing turn."""
        self._check_open()
        return SocketSink(self._sock, self.name, clock=self._clock({}), turn=self._writing)

    def open_writer(
        self,
        plan: Iterable[TensorSpec],
        *,
        metadata: Mapping[str, str] | None = None,
        order: Order = "plan",
        checksums: bool | str | Digests = False,
        **limits: Unpack[LimitOptions],
    ) -> TensorWriter:
        """Write the next message on this connection: ``open_writer(connection, plan, ...)``
        (see :func:`~stream_st.open_writer`). A socket is written front to back, so
        ``checksums`` must be a :class:`~stream_st.Digests` (``Digests.compute(arrays)``) to
        record digests (:func:`~stream_st.save` computes them itself).

        A message that fails closes the connection, so the peer sees it end early.
        """
        self._check_open()
        return open_writer(
            self, plan, metadata=metadata, order=order, checksums=checksums, **limits
        )

    def messages(
        self,
        *,
        include: Include = None,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        max_tensor_bytes: int | None = None,
        max_total_bytes: int | None = None,
        **limits: Unpack[LimitOptions],
    ) -> _Messages:
        """Every message until the peer closes the connection between two messages;
        ``include``, ``max_header_size``, ``max_tensor_bytes`` and ``max_total_bytes`` as for
        :meth:`open_stream`, for each message.

        Each stream is opened (header read) before it is handed out; read it before asking for
        the next one, which closes it. Closing the iteration (``async with
        connection.messages() as messages``, or its ``aclose()``) closes the stream it handed
        out last; a ``break`` leaves that stream to the caller (read to its end, it frees the
        connection for the next message all the same). A peer that resets the connection
        instead of closing it raises :class:`~stream_st.TransportError`, as it does inside a
        message: a message may be lost.
        """
        stream_of = _streams(include, max_header_size, max_tensor_bytes, max_total_bytes)
        return _Messages(self, limits, stream_of)

    async def aclose(self) -> None:
        """Close the connection (closing it again does nothing); a task waiting on it fails
        with :class:`~stream_st.TransportError`."""
        self._closed = True
        close_socket(self._sock)


def _streams(
    include: Include,
    max_header_size: int,
    max_tensor_bytes: int | None,
    max_total_bytes: int | None,
) -> Callable[[SocketSource], TensorStream]:
    """How a message's stream is made over the socket lent to it, with these caps (see
    :meth:`Connection.open_stream`)."""

    def stream_of(source: SocketSource) -> TensorStream:
        return TensorStream(
            source,
            include=include,
            max_header_size=max_header_size,
            max_tensor_bytes=max_tensor_bytes,
            max_total_bytes=max_total_bytes,
        )

    return stream_of


class _NextMessage(SocketSource):
    """The socket lent to the message :meth:`Connection.open_stream` reads: a peer that closed
    the connection cleanly where that message would begin is said so, not taken for a header
    of 0 bytes."""

    async def start(self, *, read_all: bool = False) -> None:
        await super().start(read_all=read_all)
        if await self.at_end():
            raise TruncatedStreamError(
                f"{self.name}: the peer closed the connection before the next message"
            )


async def connect(url: str, **limits: Unpack[LimitOptions]) -> Connection:
    """Connect to ``tcp://host:port``. The limits (see :func:`~stream_st.open_stream`) bound the
    connect and then every message on the connection (see :class:`Connection`)."""
    checked = Limits.of(limits, transport=False)
    host, port = parse_tcp_url(url)
    clock = Clock(checked)
    clock.start()
    sock = await connect_socket(host, port, clock)
    return Connection(sock, tcp_url(host, port), limits=checked)


class Listener:
    """Accepts TCP connections; iterate it for :class:`Connection` objects.

    Several tasks may accept at once. Leaving the ``listen()`` block closes the listener: a task
    waiting in :meth:`accept` then fails with :class:`~stream_st.TransportError` (as one waiting
    on a :class:`Connection` does), and :meth:`accept` called afterwards raises
    :class:`~stream_st.UsageError`.
    """

    not_a_source = (
        "iterated, it gives connections, not bytes: accept a connection first "
        "(connection = await listener.accept()) and read from the connection"
    )
    """Why a listener given where a source is asked for (an async iterable, taken for one of
    byte chunks) is refused: the sources' registry, a layer below, asks the type for this."""

    def __init__(self, sock: socket.socket, limits: Limits) -> None:
        self._sock = sock
        self._limits = limits
        self._accepting = anyio.Lock()
        self.host: str = sock.getsockname()[0]
        self.port: int = sock.getsockname()[1]

    @property
    def url(self) -> str:
        """``tcp://host:port`` to give to the peer."""
        return tcp_url(self.host, self.port)

    async def accept(self) -> Connection:
        """Wait for the next connection (see :class:`Listener` for what closing it does)."""
        if self._sock.fileno() < 0:
            raise UsageError(f"{self.url}: the listener is closed")
        async with self._accepting:  # one task waits on the socket, the others here
            while True:
                if self._sock.fileno() < 0:  # closed while this task waited
                    raise TransportError("accept failed: the listener was closed", url=self.url)
                try:
                    sock, address = self._sock.accept()
                    break
                except BlockingIOError:
                    with contextlib.suppress(anyio.ClosedResourceError):  # closed: raised above
                        await anyio.wait_readable(self._sock)
                except OSError as exc:
                    raise TransportError(
                        f"accept failed: {exc.strerror or exc}", url=self.url
                    ) from exc
        host, port = address[:2]
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(sock, tcp_url(host, port), limits=self._limits)

    def __aiter__(self) -> _Connections:
        return _Connections(self)


class _Steps(AsyncClosing, Generic[T]):
    """An iteration that is an object, not an async generator: one left with a ``break`` holds
    nothing for the event loop to finalize (trio warns with a ``ResourceWarning`` when it has to
    close an async generator the loop dropped). As a generator, it ends after a step that raised
    and after :meth:`aclose`; ``async with`` closes it too."""

    what: str
    """What is iterated, for a message."""

    def __init__(self) -> None:
        self._over = False
        self._stepping = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        self._check_idle()
        if self._over:
            raise StopAsyncIteration
        self._stepping = True
        try:
            return await self._step()
        except BaseException:  # cancelled too, as a generator's step
            self._over = True
            raise
        finally:
            self._stepping = False

    async def _step(self) -> T:
        """The next item, or :class:`StopAsyncIteration` at the end."""
        raise NotImplementedError

    def _check_idle(self) -> None:
        """:class:`~stream_st.UsageError` while a step is under way (in another task)."""
        if self._stepping:
            raise UsageError(
                f"{self.what} was iterated from two tasks at once (or closed while another task "
                "stepped it): iterate it from one task"
            )

    async def aclose(self) -> None:
        """End the iteration: later steps end at once."""
        self._check_idle()
        self._over = True


class _Connections(_Steps[Connection]):
    """The iteration of a :class:`Listener`: :meth:`Listener.accept` at each step."""

    what = "a listener's iteration"

    def __init__(self, listener: Listener) -> None:
        super().__init__()
        self._listener = listener

    async def _step(self) -> Connection:
        return await self._listener.accept()


class _Messages(_Steps[TensorStream]):
    """The iteration of :meth:`Connection.messages`: each step closes the stream handed out
    before, waits for the next message's first byte (the connection's reading turn held from
    there) and opens its stream, or ends where the peer closed the connection instead."""

    what = "connection.messages()"

    def __init__(
        self,
        connection: Connection,
        limits: LimitOptions,
        stream_of: Callable[[SocketSource], TensorStream],
    ) -> None:
        super().__init__()
        self._connection = connection
        self._limits = limits
        self._stream_of = stream_of
        self._stream: TensorStream | None = None  # the stream handed out last, not closed yet

    async def _step(self) -> TensorStream:
        await self._close_stream()
        source = self._connection._source(self._limits)
        try:
            await source.start()  # the reading turn is held from the wait for the next byte
            if await source.at_end():
                raise StopAsyncIteration
            stream = self._stream_of(source)
            await stream.open()
        except BaseException:
            await source.aclose()
            raise
        self._stream = stream
        return stream

    async def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()

    async def aclose(self) -> None:
        """End the iteration and close the stream it handed out last."""
        await super().aclose()
        await self._close_stream()


@asynccontextmanager
async def listen(
    host: str = "127.0.0.1", port: int = 0, **limits: Unpack[LimitOptions]
) -> AsyncIterator[Listener]:
    """Listen for TCP peers on ``host:port`` (port 0 picks a free one: see ``listener.port``).
    The limits (see :func:`~stream_st.open_stream`) apply to every message on every connection
    accepted (see :class:`Connection`); waiting for a peer to connect is not bounded.

    Raises :class:`~stream_st.TransportError` if the address cannot be listened on (in use,
    unknown host).
    """
    checked = Limits.of(limits, transport=False)
    if not isinstance(host, str) or "://" in host:  # connect() takes a URL; listen() does not
        raise UsageError(
            f"listen takes a host and a port (listen('127.0.0.1', 9000)), got {host!r}"
        )
    port = integer_at_least("port", port, 0)
    if not 0 <= port <= 65535:
        raise UsageError(f"port {port} is out of range 0-65535")
    if host.startswith("[") and host.endswith("]"):  # as a tcp:// URL writes an IPv6 address
        host = host[1:-1]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        raise TransportError(
            f"cannot listen: {exc.strerror or exc}", url=tcp_url(host, port)
        ) from exc
    sock.setblocking(False)
    try:
        yield Listener(sock, checked)
    finally:
        close_socket(sock)

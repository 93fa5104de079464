"""TCP peers: ``tcp://host:port`` sources and sinks, and connections that carry many messages.

Bytes are received with non-blocking ``recv_into`` straight into each array's memory, waiting with
``anyio.wait_readable`` only when the socket is empty: no per-chunk ``bytes`` objects, and it runs
on asyncio and trio alike. Every call is non-blocking by itself (``MSG_DONTWAIT``), whatever the
socket's mode: a socket shared with other processes (standard input or output inherited from
inetd, systemd or ``socat``, the shell holding it too) is read and written without setting
``O_NONBLOCK`` on the file description they share. ``send`` returns once the kernel has taken
every byte, so no reference to the caller's memory outlives the call, with no copy. A failed
message closes the socket, so the peer sees a message that ends early; a message written in full
ends gracefully (see :data:`CLOSE_GRACE`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import termios
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel

from .._util import seen_through
from ..errors import (
    SafetensorsError,
    TransportError,
    UnsupportedSinkError,
    UnsupportedSourceError,
    UsageError,
    unreadable,
)
from .base import Sink, Source
from .nonblocking import NonBlockingEnd
from .options import UNLIMITED, Clock

YIELD_EVERY = 16 << 20
"""A tensor filled from a peer that keeps the socket full yields to the event loop at least this
often (bytes), so other tasks, deadlines and cancellation are not held up until it is whole."""

CLOSE_GRACE = 2.0
"""The longest (seconds) a sink that wrote its whole message waits for the peer to close before it
closes the socket. Closing a socket while bytes the peer sent lie unread in it (a greeting, an
acknowledgement) makes the kernel answer with a reset and drop what it still had queued to send:
the peer would lose the message's end. So the sink sends its FIN after the last byte, reads and
discards whatever the peer sends until the peer closes, and only then closes; bounded, so a peer
that keeps its side open delays the close by this much at most.

A shared socket (see :meth:`SocketSink.over_shared`) is neither read nor shut down: its sink
waits instead until the kernel has sent every byte, as long as the peer goes on taking them, and
fails if the peer takes none for this long."""

DRAIN_POLL = 0.01
"""Seconds between two looks at what a shared socket's kernel has still to send (no event
tells when its send queue empties)."""

__all__ = [
    "SocketEnd",
    "SocketSink",
    "SocketSource",
    "Turn",
    "close_socket",
    "connect_socket",
    "parse_tcp_url",
    "tcp_url",
]


def parse_tcp_url(
    url: str, unsupported: type[SafetensorsError] = UnsupportedSourceError
) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``; IPv6 hosts in brackets. ``unsupported`` is
    raised for a URL that names no peer (:class:`~stream_st.UnsupportedSinkError` for a
    destination)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port out of range or not a number, an unclosed IPv6 bracket
        raise UsageError(f"bad tcp:// URL {url!r}: {unreadable(url, exc)}") from None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise unsupported(f"expected tcp://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise unsupported(f"a tcp:// URL takes no path or query: {url!r}")
    return parts.hostname, port


def tcp_url(host: str, port: int) -> str:
    """``(host, port)`` -> ``tcp://host:port``, an IPv6 host in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def close_socket(sock: socket.socket) -> None:
    """Close ``sock``, first waking every task waiting on it (they get ClosedResourceError).

    Closing a closed socket does nothing.
    """
    if sock.fileno() >= 0:
        anyio.notify_closing(sock)
        sock.close()


async def connect_socket(host: str, port: int, clock: Clock = UNLIMITED) -> socket.socket:
    """Open a non-blocking TCP socket to ``host:port`` (TCP_NODELAY set), within ``clock``'s
    limits. A connect that fails, times out or is cancelled leaves no socket behind."""
    url = tcp_url(host, port)
    last_error: OSError | None = None
    try:
        with clock.waiting(url, stalled="no answer to connect"):
            addresses = await _addresses(host, port)
            for family, kind, proto, _, address in addresses:
                sock = socket.socket(family, kind, proto)
                try:
                    sock.setblocking(False)
                    await _connect(sock, address)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except BaseException as exc:
                    sock.close()
                    if not isinstance(exc, OSError):
                        raise
                    last_error = exc
                    continue
                return sock
    except TransportError:
        raise
    except OSError as exc:
        last_error = exc
    detail = last_error.strerror or str(last_error) if last_error else "no address"
    raise TransportError(f"cannot connect: {detail}", url=url) from last_error


async def _addresses(host: str, port: int) -> list[tuple[Any, ...]]:
    """``getaddrinfo`` results; an IP literal needs no lookup (a worker-thread hop each time).

    A host that is no valid name (a lone surrogate, an empty label: IDNA cannot encode it) is a
    :class:`~stream_st.UsageError` naming the URL.
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            found = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except UnicodeError as exc:  # idna's errors (IDNAError, InvalidCodepoint) included
            raise UsageError(
                f"bad tcp:// URL {tcp_url(host, port)!r}: the host {host!r} is not a valid host "
                f"name ({exc})"
            ) from exc
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


class _End(Protocol):
    """One end of a message: what a :class:`Turn` is given to."""

    name: str


class Turn:
    """One message at a time in one direction of a connection.

    The end carrying a message (a socket's, or a source or sink over a stream the caller keeps)
    holds the turn from its first byte until it is closed; a second end that starts meanwhile
    raises :class:`~stream_st.UsageError` rather than mixing its bytes with the first message's.
    ``doing`` names what happens to messages: "read", "written".
    """

    def __init__(self, doing: str) -> None:
        self.doing = doing
        self._holder: _End | None = None
        self._left: int | None = None  # the byte a message was left at, part way

    def claim(self, end: _End) -> None:
        """Give the turn to ``end``; UsageError if another end still holds it, or if a message
        was left part way (the next one's first byte is then unknown)."""
        if self._left is not None:
            raise UsageError(
                f"{end.name}: the previous message was left at its byte {self._left}, before its "
                "end: where the next message starts is unknown, so nothing more can be "
                f"{self.doing} on this connection; close it"
            )
        if self._holder is not None and self._holder is not end:
            raise UsageError(
                f"{end.name}: the previous message is still being {self.doing} (in another task, "
                "or its stream or writer is not closed yet): one message at a time on a connection"
            )
        self._holder = end

    def release(self, end: _End) -> None:
        """Take the turn back from ``end``, if it holds it."""
        if self._holder is end:
            self._holder = None

    def left(self, end: _End, position: int) -> None:
        """``end``, holding the turn, stops at byte ``position`` of its message, before its end
        (a reader that breaks off, or refuses the message): the turn is not given again."""
        if self._holder is end:
            self._holder = None
            self._left = position

    def held_by(self, end: _End) -> bool:
        """True while ``end`` carries the connection's current message."""
        return self._holder is end


DONTWAIT = socket.MSG_DONTWAIT
"""The flag of every ``recv`` and ``send``: the call does not block, in a socket's blocking mode
too (see the module's docstring)."""


class SocketEnd(NonBlockingEnd[socket.socket]):
    """What a socket source and a socket sink share: the socket, non-blocking or not (every call
    is, by itself: :data:`DONTWAIT`), the name to report, the waits bounded by ``clock`` (see
    :class:`~stream_st.transports.nonblocking.NonBlockingEnd`), and who closes the socket.

    Without a ``turn`` the end owns the socket and closing the end closes it. With one, the socket
    is lent by a :class:`~stream_st.Connection` for one message: the end holds the turn while it
    carries the message (see :meth:`_claim`) and closing it leaves the socket open.
    """

    def __init__(
        self,
        sock: socket.socket,
        name: str,
        *,
        clock: Clock = UNLIMITED,
        turn: Turn | None = None,
    ) -> None:
        super().__init__(sock, name, clock=clock)
        self._turn = turn

    def _claim(self) -> None:
        """The message starts: take the connection's turn (nothing to do on an owned socket)."""
        if self._turn is not None:
            self._turn.claim(self)

    async def aclose(self) -> None:
        if self._turn is None:
            close_socket(self._handle)
        else:
            self._turn.release(self)


class SocketSource(SocketEnd, Source):
    """One TCP socket read with ``recv_into``; a connection, so only one message is consumed.

    ``clock`` bounds each wait for the next bytes (a peer that stops sending raises
    :class:`~stream_st.ReadTimeoutError`). ``turn`` is given when a :class:`~stream_st.Connection`
    lends its socket to this one message (see :class:`SocketEnd`).
    """

    whole_object = False

    async def start(self, *, read_all: bool = False) -> None:
        self._claim()

    async def receive_into(self, buffer: memoryview) -> int:
        if not buffer:
            return 0
        return await self._receive(self._recv_into, buffer)

    def _recv_into(self, buffer: memoryview) -> int:
        """One ``recv_into`` of ``buffer`` that does not block."""
        return self._handle.recv_into(buffer, 0, DONTWAIT)

    async def fill(self, buffer: memoryview) -> int:
        """Fill ``buffer`` (a tensor's memory) in one tight loop of ``recv_into`` calls, waiting
        only when the socket is empty; the bytes are counted once per wait, not once per call,
        and at least every :data:`YIELD_EVERY` bytes, where the loop also lets other tasks (and
        a cancellation) in."""
        recv_into = self._recv_into
        total = len(buffer)
        filled = counted = 0
        try:
            while filled < total:
                try:
                    count = recv_into(buffer[filled:])
                except BlockingIOError:
                    self._count(filled - counted)
                    counted = filled
                    await self.wait_readable()
                    continue
                except OSError as exc:
                    self._count(filled - counted)
                    counted = filled
                    raise self._failure(self.receiving, exc) from exc
                if count == 0:
                    break
                filled += count
                if filled - counted >= YIELD_EVERY:  # a fast peer never empties the socket
                    self._count(filled - counted)
                    counted = filled
                    await anyio.lowlevel.checkpoint()
        finally:
            self._count(filled - counted)
        return filled

    def _count(self, moved: int) -> None:
        self.position += moved
        self.clock.moved(moved)

    def message_read(self) -> None:
        if self._turn is not None:
            self._turn.release(self)  # e.g. a loop over messages() left with break

    async def aclose(self) -> None:
        if self._turn is not None and self.position:  # closed part way through its message
            self._turn.left(self, self.position)  # (a message read to its end let go already)
        await super().aclose()

    async def at_end(self) -> bool:
        """Wait for the next byte without taking it; True if the peer closed cleanly instead.

        A reset (or any other failure) raises :class:`~stream_st.TransportError`: only a clean
        close tells that nothing was lost.
        """
        while True:
            try:
                return self._handle.recv(1, socket.MSG_PEEK | DONTWAIT) == b""
            except BlockingIOError:
                await self.wait_readable()
            except OSError as exc:
                raise self._failure("receive", exc) from exc

    async def wait_readable(self) -> None:
        """Wait until the socket has data or was closed by the peer, within the clock's limits."""
        await self._wait(writable=False)


class SocketSink(SocketEnd, Sink):
    """One TCP socket written front to back. ``clock`` bounds each wait for the peer to take
    bytes (a stalled receiver); ``turn`` is given when a :class:`~stream_st.Connection` lends its
    socket to this one message, which committing then leaves open (see :class:`SocketEnd`); a
    sink over a socket other processes hold too is made by :meth:`over_shared`."""

    _size: int | None = None  # the message's length, once announced by allocate
    _shared = False  # over a descriptor other processes hold too (over_shared)

    @classmethod
    def over_shared(cls, sock: socket.socket, name: str) -> SocketSink:
        """A sink over ``sock``, a duplicate of a descriptor other processes hold too (standard
        output that is a socket, which the shell shares, where a later command may write the
        next message): closing it, committed or aborted, closes the duplicate alone; it neither
        shuts the socket down nor reads what the peer sends (standard input's bytes, where it is
        the same socket). Committed, it waits until the kernel has sent every byte (see
        :meth:`_drain`)."""
        sink = cls(sock, name)
        sink._shared = True
        return sink

    async def allocate(self, size: int) -> None:
        self._claim()  # the writer announces the message before its first byte
        self._size = size

    async def send(self, buffer: memoryview) -> None:
        await self._send_all(self._send, buffer)

    def _send(self, view: memoryview) -> int:
        """One ``send`` of ``view`` that does not block."""
        return self._handle.send(view, DONTWAIT)

    async def abort(self) -> None:
        if self._turn is not None and not self._turn.held_by(self):
            return  # refused the connection's turn: sent nothing, and must not end another message
        if not self._shared:
            with contextlib.suppress(OSError):  # already gone: nothing to tell the peer
                self._handle.shutdown(socket.SHUT_RDWR)
        close_socket(self._handle)  # a lent socket too: the connection refuses further messages

    async def aclose(self) -> None:
        """Commit: an owned socket that carried its whole message is ended gracefully (see
        :meth:`_finish`) before it is closed; one left short of the length announced closes at
        once, so the peer sees the message end early. A lent socket stays open; a shared one's
        duplicate is closed once the kernel has sent the whole message (see :meth:`_drain`).

        The graceful end is past the commit point and bounded, so it is seen through whatever
        cancellation comes meanwhile (:func:`~stream_st._util.seen_through`: asyncio's own
        ``Task.cancel``, which goes through anyio's shields, included): the cancellation takes
        effect once it is over. Cut short, the close would find the peer's bytes unread and
        reset the connection under the message's end. A shared socket's wait, which lasts as
        long as the peer goes on taking bytes, ends :data:`CLOSE_GRACE` seconds after the
        cancellation at most."""
        whole = self._size is None or self.position >= self._size
        try:
            if self._turn is None and whole and not self._closed():
                if self._shared:
                    await seen_through(self._drain, _within_grace)
                else:
                    await seen_through(self._finish)
        finally:
            await super().aclose()

    async def _finish(self) -> None:
        """Send FIN after every byte queued, then read and drop what the peer sends until it
        closes, for :data:`CLOSE_GRACE` seconds at most, so that the close that follows finds
        nothing unread and cannot reset the connection under bytes still on their way. A peer
        that resets the connection meanwhile may have closed with bytes of the message unread
        in its socket (TCP does not tell): that is a :class:`~stream_st.TransportError`, not a
        delivery; its clean close is one."""
        sock = self._handle
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:  # reset already
            raise self._unread(exc) from exc
        scratch = bytearray(64 << 10)
        with anyio.move_on_after(CLOSE_GRACE):
            while True:
                try:
                    if not sock.recv_into(scratch, 0, DONTWAIT):
                        return  # the peer's clean close: it has read everything it wanted
                except BlockingIOError:
                    try:
                        await anyio.wait_readable(sock)
                    except (anyio.ClosedResourceError, OSError):  # closed meanwhile
                        return
                except OSError as exc:  # a reset
                    raise self._unread(exc) from exc
                else:
                    await anyio.lowlevel.checkpoint()  # a peer that keeps sending: let others in

    async def _drain(self) -> None:
        """Wait until the kernel has sent every byte of a shared TCP socket (``TIOCOUTQ``: the
        bytes not yet acknowledged by the peer), neither reading the peer's bytes nor shutting
        the socket down (see :meth:`over_shared`): the command may hold the socket's last
        descriptor (inetd, ``socat EXEC:``), whose close with bytes of the peer
        unread resets the connection and drops what the kernel still had to send. Polled every
        :data:`DRAIN_POLL` seconds, within the clock's deadline; a peer that takes nothing for
        :data:`CLOSE_GRACE` seconds is a :class:`~stream_st.TransportError`. Where the kernel
        does not tell (the ``ioctl`` fails), the duplicate is closed at once, as a UNIX socket's
        is: what it sent stays in the peer's queue whatever the close finds unread."""
        if self._handle.family not in (socket.AF_INET, socket.AF_INET6):
            return
        try:
            queued = self._queued()
        except OSError:
            return
        with self.clock.within_deadline(self.name, self.position):
            while queued:
                left = queued
                with anyio.move_on_after(CLOSE_GRACE) as scope:
                    while queued >= left:  # until the peer takes some
                        await anyio.sleep(DRAIN_POLL)
                        queued = self._queued()
                if scope.cancelled_caught:
                    raise self._unconfirmed(
                        f"the peer took nothing of the message's end still queued for "
                        f"{CLOSE_GRACE:g} s after it was sent",
                        "the command does not wait longer",
                    )

    def _queued(self) -> int:
        """The bytes the kernel has still to send on the socket (see :meth:`_drain`)."""
        packed = fcntl.ioctl(self._handle.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
        count: int = struct.unpack("i", packed)[0]
        return count

    def _unread(self, exc: OSError) -> TransportError:
        """The error for a reset seen after the message's last byte went out: whether the peer
        read the message to its end before it reset the connection, TCP does not tell."""
        return self._unconfirmed(
            "the peer reset the connection after the message was sent",
            f"a reset does not tell; {exc.strerror or exc}",
        )

    def _unconfirmed(self, what: str, why: str) -> TransportError:
        """The error for a message sent in full whose delivery is not confirmed: ``what``
        happened after its last byte went out, ``why`` it tells nothing more."""
        return TransportError(
            f"{what}: it may not have read it in full ({why})",
            url=self.name,
            position=self.position,
        )


def _within_grace(shield: anyio.CancelScope) -> None:
    """Bound the rest of a cancelled wait (``shield``'s) by :data:`CLOSE_GRACE` seconds."""
    shield.deadline = min(shield.deadline, anyio.current_time() + CLOSE_GRACE)


async def source_for(url: str, clock: Clock) -> Source:
    """The registry's factory: a ``tcp://host:port`` peer, connected within ``clock``."""
    host, port = parse_tcp_url(url)
    return SocketSource(await connect_socket(host, port, clock), tcp_url(host, port))


async def sink_for(url: str, clock: Clock, fsync: bool) -> Sink:
    """The registry's factory: a ``tcp://host:port`` peer, connected within ``clock``."""
    host, port = parse_tcp_url(url, UnsupportedSinkError)
    return SocketSink(await connect_socket(host, port, clock), tcp_url(host, port))

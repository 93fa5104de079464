"""Transports over streams: anyio byte streams and asyncio ``StreamReader``/``StreamWriter``
objects (connections), and producers that fill the reader's buffer themselves
(:class:`~.base.AsyncReadInto`).

Reading: a connection may carry several safetensors messages back to back, so these sources never
ask for more bytes than the reader needs: the bytes after a message stay in the connection. As on
a ``tcp://`` connection, its messages are read one at a time and written one at a time, and none
is read after one was left part way (see :class:`~.tcp.Turn`): the turns are kept for the
caller's stream object, whichever source or sink is made for it, as long as it lives.

Writing: bytes go out to a socket in chunks of :data:`CHUNK` straight from the caller's memory.
Transports may keep a reference to bytes the kernel has not taken yet (asyncio on Python 3.12+ and
uvloop queue memoryviews instead of copying them), so the last :data:`TAIL` bytes of every buffer
are sent as a copy: once ``send`` returns, whatever the transport still holds is that copy (its
queue is at most the high-water mark, 64 KiB by default), and the caller may change its array. Any
other anyio stream (a memory object stream, a batching transport) may keep the items it is given
for later, so it gets every chunk as a ``bytes`` copy. A successful message
leaves the stream open for the next one; the caller owns it. A failed one closes it at once, so the
peer sees a message that ends early.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, SocketStream
from anyio.streams.stapled import StapledByteStream
from anyio.streams.tls import TLSStream

from ..errors import TransportError, UnsupportedSourceError, UsageError
from .base import AsyncReadInto, Sink, Source, Waits, give_turn
from .inmemory import as_bytes_view
from .tcp import Turn

__all__ = [
    "CHUNK",
    "TAIL",
    "AnyioStreamSink",
    "AnyioStreamSource",
    "AsyncioStreamSink",
    "AsyncioStreamSource",
    "ReadIntoSource",
]


_TURNS: dict[str, weakref.WeakKeyDictionary[object, Turn]] = {
    "read": weakref.WeakKeyDictionary(),
    "written": weakref.WeakKeyDictionary(),
}
"""The turns of the messages read and written on each of the caller's streams."""


@dataclass(eq=False)
class _Message:
    """What holds a stream's turn for one message: the name of its source or sink (not the
    source itself, which holds the stream: a turn, kept for the stream weakly, must not keep the
    stream alive)."""

    name: str


def _turn(stream: object, doing: str) -> Turn | None:
    """The turn of the messages ``doing`` ("read", "written") on the caller's ``stream``; None
    for a stream that cannot be referenced weakly or hashed (its messages are not checked)."""
    turns = _TURNS[doing]
    try:
        turn = turns.get(stream)
        if turn is None:
            turn = turns[stream] = Turn(doing)
    except TypeError:
        return None
    return turn


class _OneMessage:
    """One message read or written on a stream the caller keeps (a connection), and the
    stream's turn it claims (see :class:`~.tcp.Turn`); none for a stream whose messages are not
    checked (see :func:`_turn`)."""

    def __init__(self, stream: object, name: str, doing: str) -> None:
        self._turn = _turn(stream, doing)
        self._message = _Message(name)

    def claim(self) -> None:
        if self._turn is not None:
            self._turn.claim(self._message)

    def release(self) -> None:
        """The message is done: the stream's next one may start."""
        if self._turn is not None:
            self._turn.release(self._message)

    def left(self, position: int) -> None:
        """The message was left part way, at ``position``: a later one is refused (see
        :meth:`~.tcp.Turn.left`); one not begun is simply done."""
        if self._turn is not None and position:
            self._turn.left(self._message, position)
        else:
            self.release()

    def refused(self) -> bool:
        """True for a message refused the stream's turn (another one holds it)."""
        return self._turn is not None and not self._turn.held_by(self._message)


class _MessageSource(Source):
    """A source reading one message from a stream the caller keeps (a connection): it holds the
    stream's turn from :meth:`start` until the message is read; closed part way, it leaves the
    turn with the byte it stopped at (see :class:`~.tcp.Turn`). Its close, from any task, cuts
    short a read waiting for the peer (see :class:`~.base.Waits`); the stream stays open."""

    whole_object = False

    def __init__(self, stream: object, name: str) -> None:
        super().__init__()
        self.name = name
        self._one = _OneMessage(stream, name, "read")
        self._waits = Waits()

    async def start(self, *, read_all: bool = False) -> None:
        self._one.claim()

    def message_read(self) -> None:
        self._one.release()

    async def aclose(self) -> None:
        self._waits.close()
        self._one.left(self.position)  # a message read whole was let go already


class AnyioStreamSource(_MessageSource):
    """An anyio ``ByteReceiveStream`` (a TCP stream, a TLS stream, a memory stream...)."""

    def __init__(self, stream: ByteReceiveStream, name: str = "<anyio stream>") -> None:
        super().__init__(stream, name)
        self._stream = stream

    async def fill(self, buffer: memoryview) -> int:
        # A stream of any kind may wait in each receive: one cancel scope for those of a tensor.
        with self._waits.reading(self):
            return await super().fill(buffer)

    async def receive_into(self, buffer: memoryview) -> int:
        if not buffer:
            return 0
        try:
            with self._waits.reading(self), self.clock.waiting(self.name, self.position):
                data = await self._stream.receive(len(buffer))
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return 0
        except TransportError:
            raise
        except (anyio.BrokenResourceError, OSError) as exc:
            raise TransportError(
                f"receive failed: {exc!r}", url=self.name, position=self.position
            ) from exc
        if not isinstance(data, bytes | bytearray | memoryview):
            raise UnsupportedSourceError(
                f"{self.name}: the stream gave {type(data).__name__}, not bytes"
            )
        if isinstance(data, memoryview):  # of any format and shape: its bytes, flat
            data = as_bytes_view(data)
        count = len(data)
        if count > len(buffer):
            raise TransportError(
                f"the stream gave {count} bytes where at most {len(buffer)} were asked for",
                url=self.name,
                position=self.position,
            )
        buffer[:count] = data
        self.position += count
        self.clock.moved(count)
        return count


def _buffered(reader: asyncio.StreamReader) -> bool:
    """Whether ``reader`` holds bytes not read yet (so that a read of it does not wait); False
    where it does not say (a reader that is not asyncio's own)."""
    return bool(getattr(reader, "_buffer", None))


def _on_its_loop(stream: asyncio.StreamReader | asyncio.StreamWriter, name: str) -> None:
    """A :class:`UsageError` unless the running event loop is the asyncio loop ``stream``
    belongs to: elsewhere (under trio, in another ``asyncio.run``) its first wait fails with
    that loop's own error, a bare ``TypeError`` or ``RuntimeError``."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    owner = getattr(stream, "_loop", None)  # asyncio's own streams say where they belong
    if running is None or (isinstance(owner, asyncio.AbstractEventLoop) and owner is not running):
        where = "under another event loop library" if running is None else "on another loop"
        raise UsageError(
            f"{name}: an asyncio {type(stream).__name__} is used on the asyncio event loop it "
            f"belongs to, not {where}: use an anyio stream, a chunk iterator or a URL there"
        )


class AsyncioStreamSource(_MessageSource):
    """An asyncio ``StreamReader`` (from ``asyncio.open_connection`` and friends), read on the
    asyncio loop it belongs to."""

    def __init__(self, reader: asyncio.StreamReader, name: str = "<asyncio stream>") -> None:
        super().__init__(reader, name)
        self._reader = reader

    async def start(self, *, read_all: bool = False) -> None:
        _on_its_loop(self._reader, self.name)
        await super().start(read_all=read_all)

    async def receive_into(self, buffer: memoryview) -> int:
        if not buffer:
            return 0
        try:
            at_hand = self._reader.at_eof() or _buffered(self._reader)  # read returns at once
            with (
                self.clock.waiting(self.name, self.position),
                self._waits.guard(self, waits=not at_hand),
            ):
                data = await self._reader.read(len(buffer))
        except TransportError:
            raise
        except OSError as exc:
            raise TransportError(
                f"receive failed: {exc!r}", url=self.name, position=self.position
            ) from exc
        count = len(data)
        buffer[:count] = data
        self.position += count
        self.clock.moved(count)
        await give_turn()  # a reader fed ahead answers without suspending
        return count


class ReadIntoSource(Source):
    """A producer with ``async def readinto(buffer) -> int`` (see :class:`~.base.AsyncReadInto`),
    together making one whole file: it writes straight into each tensor's memory."""

    def __init__(self, producer: AsyncReadInto, name: str = "<readinto producer>") -> None:
        super().__init__()
        self._producer = producer
        self.name = name

    async def receive_into(self, buffer: memoryview) -> int:
        if not buffer:
            return 0
        with self.clock.waiting(self.name, self.position):
            count = await self._producer.readinto(buffer)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(buffer):
            raise UsageError(
                f"{self.name}: readinto returned {count!r} for a buffer of {len(buffer)} bytes "
                "(expected the count of bytes written, 0 only at the end)"
            )
        self.position += count
        self.clock.moved(count)
        await give_turn()  # a producer that never suspends would hold the loop for a tensor
        return count


CHUNK = 1 << 20
"""Bytes handed to the stream per call; ~1 MiB measured best on loopback TCP."""

TAIL = 256 << 10
"""The end of each buffer sent as a copy; at least any transport's high-water mark."""

_STALLED = "the peer took no data"


def _sends_right_away(stream: ByteSendStream) -> bool:
    """True for anyio streams known to take a memoryview before ``send`` returns.

    Sockets hand bytes to the kernel or the transport's buffer (bounded by the tail copy), TLS
    encrypts them into a new buffer. Any other stream may keep what it is given: it gets every
    chunk as a ``bytes`` copy, as its type asks.
    """
    if isinstance(stream, StapledByteStream):
        return _sends_right_away(stream.send_stream)
    return isinstance(stream, SocketStream | TLSStream)


def _pieces(buffer: memoryview, tail: int) -> list[tuple[int, int, bool]]:
    """``(start, end, copy)`` spans covering ``buffer``: chunks, with the last ``tail`` copied."""
    total = len(buffer)
    split = max(0, total - tail)
    spans = [(start, min(start + CHUNK, split), False) for start in range(0, split, CHUNK)]
    spans.extend((start, min(start + CHUNK, total), True) for start in range(split, total, CHUNK))
    return spans


class _MessageSink(Sink):
    """A sink writing one message to a stream the caller keeps (a connection): it holds the
    stream's turn from :meth:`allocate`, before the first byte, until it is closed or aborted
    (see :class:`~.tcp.Turn`)."""

    one_message = False  # the stream takes message after message

    def __init__(self, stream: object, name: str) -> None:
        super().__init__()
        self.name = name
        self._one = _OneMessage(stream, name, "written")

    async def allocate(self, size: int) -> None:
        self._one.claim()

    def _refused(self) -> bool:
        """True for a sink refused the stream's turn: it sent nothing, and must not end (abort)
        the message another one is writing."""
        return self._one.refused()

    def _release(self) -> None:
        """The message is done (closed or aborted): the stream's next one may start."""
        self._one.release()


class AnyioStreamSink(_MessageSink):
    """An anyio ``ByteSendStream`` (a TCP or UNIX socket stream, a TLS stream, ...)."""

    def __init__(self, stream: ByteSendStream, name: str = "<anyio stream>") -> None:
        super().__init__(stream, name)
        self._stream = stream
        self._sends_right_away = _sends_right_away(stream)

    async def send(self, buffer: memoryview) -> None:
        stream = self._stream
        try:
            tail = TAIL if self._sends_right_away else len(buffer)  # a copy of each chunk
            for start, end, copy in _pieces(buffer, tail):
                piece: Any = bytes(buffer[start:end]) if copy else buffer[start:end]
                with self.clock.waiting(self.name, self.position, stalled=_STALLED):
                    await stream.send(piece)
                self.position += end - start
                self.clock.moved(end - start)
        except TransportError:
            raise
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise TransportError(
                f"send failed: {exc!r}", url=self.name, position=self.position
            ) from exc

    async def aclose(self) -> None:
        """Nothing to flush: ``send`` returns once the stream has taken the bytes."""
        self._release()

    async def abort(self) -> None:
        if not self._refused():
            self._release()
            await anyio.aclose_forcefully(self._stream)


class AsyncioStreamSink(_MessageSink):
    """An asyncio ``StreamWriter`` (from ``asyncio.open_connection`` and friends), written on
    the asyncio loop it belongs to."""

    def __init__(self, writer: asyncio.StreamWriter, name: str = "<asyncio stream>") -> None:
        super().__init__(writer, name)
        self._writer = writer

    async def allocate(self, size: int) -> None:
        _on_its_loop(self._writer, self.name)
        await super().allocate(size)

    def _tail(self) -> int:
        try:
            high = self._writer.transport.get_write_buffer_limits()[1]
        except (AttributeError, NotImplementedError):  # pragma: no cover - exotic transports
            return CHUNK
        return max(TAIL, high)

    async def send(self, buffer: memoryview) -> None:
        writer = self._writer
        try:
            for start, end, copy in _pieces(buffer, self._tail()):
                if writer.is_closing():
                    raise ConnectionResetError("the stream is closed")
                writer.write(bytes(buffer[start:end]) if copy else buffer[start:end])
                await self._drain()
                self.position += end - start
                self.clock.moved(end - start)
        except TransportError:
            raise
        except OSError as exc:
            raise TransportError(
                f"send failed: {exc!r}", url=self.name, position=self.position
            ) from exc

    async def _drain(self) -> None:
        """Wait, within the clock's limits, until the transport's buffer is low again."""
        with self.clock.waiting(self.name, self.position, stalled=_STALLED):
            await self._writer.drain()

    async def aclose(self) -> None:
        """Wait for the transport to take the last bytes; the stream stays open."""
        try:
            await self._drain()
        except TransportError:
            raise
        except OSError as exc:
            raise TransportError(
                f"send failed: {exc!r}", url=self.name, position=self.position
            ) from exc
        finally:
            self._release()

    async def abort(self) -> None:
        if self._refused():
            return
        self._release()
        self._writer.transport.abort()
        # The connection is being dropped: how it ends does not matter, only that it does.
        with anyio.move_on_after(1), contextlib.suppress(Exception):
            await self._writer.wait_closed()

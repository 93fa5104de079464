"""Sources over streams: anyio byte streams and asyncio ``StreamReader`` objects (connections),
and producers that fill the reader's buffer themselves (:class:`~.base.AsyncReadInto`).

A connection may carry several safetensors messages back to back, so these sources never ask for
more bytes than the reader needs: the bytes after a message stay in the connection.
"""

from __future__ import annotations

import asyncio

import anyio
from anyio.abc import ByteReceiveStream

from ..errors import TransportError, UsageError
from .base import AsyncReadInto, Source

__all__ = ["AnyioStreamSource", "AsyncioStreamSource", "ReadIntoSource"]


class AnyioStreamSource(Source):
    """An anyio ``ByteReceiveStream`` (a TCP stream, a TLS stream, a memory stream...)."""

    whole_object = False

    def __init__(self, stream: ByteReceiveStream, name: str = "<anyio stream>") -> None:
        super().__init__()
        self._stream = stream
        self.name = name

    async def receive_into(self, buffer: memoryview) -> int:
        if not buffer:
            return 0
        try:
            with self.clock.waiting(self.name, self.position):
                data = await self._stream.receive(len(buffer))
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return 0
        except TransportError:
            raise
        except (anyio.BrokenResourceError, OSError) as exc:
            raise TransportError(
                f"receive failed: {exc!r}", url=self.name, position=self.position
            ) from exc
        count = len(data)
        buffer[:count] = data
        self.position += count
        self.clock.moved(count)
        return count


class AsyncioStreamSource(Source):
    """An asyncio ``StreamReader`` (from ``asyncio.open_connection`` and friends)."""

    whole_object = False

    def __init__(self, reader: asyncio.StreamReader, name: str = "<asyncio stream>") -> None:
        super().__init__()
        self._reader = reader
        self.name = name

    async def receive_into(self, buffer: memoryview) -> int:
        if not buffer:
            return 0
        try:
            with self.clock.waiting(self.name, self.position):
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
        return count

"""Sources over connections: anyio byte streams and asyncio ``StreamReader`` objects.

A connection may carry several safetensors messages back to back, so these sources never ask for
more bytes than the reader needs: the bytes after a message stay in the connection.
"""

from __future__ import annotations

import asyncio

import anyio
from anyio.abc import ByteReceiveStream

from ..errors import TransportError
from .base import Source

__all__ = ["AnyioStreamSource", "AsyncioStreamSource"]


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

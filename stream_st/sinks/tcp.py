"""``tcp://host:port`` sinks: non-blocking ``send`` straight from each array's memory.

``send`` returns once the kernel has taken every byte, so no reference to the caller's memory
outlives the call, with no copy. A failed message closes the socket, so the peer sees a message
that ends early.
"""

from __future__ import annotations

import contextlib
import socket

from ..errors import TransportError
from ..sources.tcp import SocketEnd
from .base import Sink

__all__ = ["SocketSink"]


class SocketSink(SocketEnd, Sink):
    """One TCP socket written front to back. ``timeout`` bounds each wait for the peer to take
    bytes (a stalled receiver); ``owns_socket`` decides whether committing closes it."""

    async def send(self, buffer: memoryview) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        while view:
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                await self._wait(writable=True)
                continue
            except OSError as exc:
                raise TransportError(
                    f"send failed: {exc.strerror or exc}", url=self.name, position=self.position
                ) from exc
            view = view[sent:]
            self.position += sent

    async def abort(self) -> None:
        with contextlib.suppress(OSError):  # already gone: nothing to tell the peer
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

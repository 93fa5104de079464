"""``tcp://host:port`` sinks: non-blocking ``send`` straight from each array's memory.

``send`` returns once the kernel has taken every byte, so no reference to the caller's memory
outlives the call, with no copy. A failed message closes the socket, so the peer sees a message
that ends early.
"""

from __future__ import annotations

import contextlib
import math
import socket

import anyio

from ..errors import ReadTimeoutError, TransportError
from .base import Sink

__all__ = ["SocketSink"]


class SocketSink(Sink):
    """One TCP socket written front to back. ``timeout`` bounds each wait for the peer to take
    bytes (a stalled receiver); ``owns_socket`` decides whether committing closes it."""

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

    async def send(self, buffer: memoryview) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        while view:
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                try:
                    with anyio.fail_after(self._timeout):
                        await anyio.wait_writable(self._sock)
                except TimeoutError as exc:
                    raise ReadTimeoutError(
                        f"the peer took no data for {self._timeout} s",
                        url=self.name,
                        position=self.position,
                    ) from exc
                continue
            except OSError as exc:
                raise TransportError(
                    f"send failed: {exc.strerror or exc}", url=self.name, position=self.position
                ) from exc
            view = view[sent:]
            self.position += sent

    async def aclose(self) -> None:
        if self._owns:
            self._sock.close()

    async def abort(self) -> None:
        with contextlib.suppress(OSError):  # already gone: nothing to tell the peer
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

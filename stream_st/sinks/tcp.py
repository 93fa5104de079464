"""``tcp://host:port`` sinks: non-blocking ``send`` straight from each array's memory.

``send`` returns once the kernel has taken every byte, so no reference to the caller's memory
outlives the call, with no copy. A failed message closes the socket, so the peer sees a message
that ends early.
"""

from __future__ import annotations

import contextlib
import socket

from ..sources.tcp import SocketEnd, close_socket
from .base import Sink

__all__ = ["SocketSink"]


class SocketSink(SocketEnd, Sink):
    """One TCP socket written front to back. ``clock`` bounds each wait for the peer to take
    bytes (a stalled receiver); ``turn`` is given when a :class:`~stream_st.Connection` lends its
    socket to this one message, which committing then leaves open (see :class:`SocketEnd`)."""

    async def allocate(self, size: int) -> None:
        self._claim()  # the writer announces the message before its first byte

    async def send(self, buffer: memoryview) -> None:
        await self._send_all(self._handle.send, buffer)

    async def abort(self) -> None:
        if self._turn is not None and not self._turn.held_by(self):
            return  # refused the connection's turn: sent nothing, and must not end another message
        with contextlib.suppress(OSError):  # already gone: nothing to tell the peer
            self._handle.shutdown(socket.SHUT_RDWR)
        close_socket(self._handle)  # a lent socket too: the connection refuses further messages

"""One end of a non-blocking descriptor (a TCP socket, a pipe, a FIFO, a character device),
read or written in place: the retry loop for a call the kernel would block, the wait for the
descriptor within the operation's limits, and the failure messages. Not public API.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

import anyio

from ..errors import TransportError
from .options import UNLIMITED, Clock

__all__ = ["NonBlockingEnd"]

Handle = TypeVar("Handle", int, socket.socket)
"""What the end holds: a descriptor number (-1 once closed) or a socket."""


class NonBlockingEnd(Generic[Handle]):
    """What every source and sink over a non-blocking descriptor shares.

    ``handle`` is the descriptor, set non-blocking; ``name`` is reported in errors; ``clock``
    bounds every wait for the descriptor (a timeout raises
    :class:`~stream_st.ReadTimeoutError`). :meth:`_receive` and :meth:`_send_all` run a
    non-blocking call until it moves bytes, waiting while it would block, and count what moved
    in ``position`` and the clock. A subclass names its calls (``receiving``, ``sending``), says
    what a wait cut short by this side's own close reports (``closed_here``) and what a timeout
    waiting for the other side to take bytes saw (``peer_stalled``).
    """

    receiving: ClassVar[str] = "receive"
    sending: ClassVar[str] = "send"
    closed_here: ClassVar[str] = "the connection was closed on this side"
    peer_stalled: ClassVar[str] = "the peer took no data"

    name: str
    position: int

    def __init__(self, handle: Handle, name: str, *, clock: Clock = UNLIMITED) -> None:
        super().__init__()
        self._handle: Handle = handle
        self.name = name
        self.clock = clock

    def _closed(self) -> bool:
        """True once this side has closed the descriptor."""
        handle = self._handle
        return (handle if isinstance(handle, int) else handle.fileno()) < 0

    def _failure(self, doing: str, exc: OSError | None = None) -> TransportError:
        """The error for a failed call, or (no ``exc``) a descriptor closed meanwhile."""
        reason = self.closed_here
        if exc is not None and not self._closed():
            reason = exc.strerror or str(exc)
        return TransportError(f"{doing} failed: {reason}", url=self.name, position=self.position)

    async def _wait(self, *, writable: bool) -> None:
        """Wait until the descriptor can be written (or read), within the clock's limits."""
        doing = self.sending if writable else self.receiving
        stalled = self.peer_stalled if writable else "no data"
        with self.clock.waiting(self.name, self.position, stalled=stalled):
            try:
                if writable:
                    await anyio.wait_writable(self._handle)
                else:
                    await anyio.wait_readable(self._handle)
            except anyio.ClosedResourceError as exc:
                raise self._failure(doing) from exc
            except OSError as exc:  # EPERM: a device that cannot be waited on
                raise self._failure("waiting", exc) from exc

    async def _receive(self, call: Callable[[memoryview], int], buffer: memoryview) -> int:
        """``call(buffer)``, a non-blocking read into ``buffer``, once it has bytes (0: the end)."""
        while True:
            try:
                count = call(buffer)
            except BlockingIOError:
                await self._wait(writable=False)
                continue
            except OSError as exc:
                raise self._failure(self.receiving, exc) from exc
            self.position += count
            self.clock.moved(count)
            return count

    async def _send_all(self, call: Callable[[memoryview], int], buffer: memoryview) -> None:
        """``call(view)``, a non-blocking write of a byte view, until all of ``buffer`` went."""
        view = buffer.cast("B") if buffer.format != "B" else buffer
        while view:
            try:
                sent = call(view)
            except BlockingIOError:
                await self._wait(writable=True)
                continue
            except OSError as exc:
                raise self._failure(self.sending, exc) from exc
            view = view[sent:]
            self.position += sent
            self.clock.moved(sent)

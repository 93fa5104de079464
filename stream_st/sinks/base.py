"""The narrow interface every sink meets.

A sink takes the bytes of one safetensors message. Every sink can append (:meth:`Sink.send`); a
sink with ``random_access`` (a local file) can also write at any offset (:meth:`Sink.write_at`),
which lets the writer accept tensors in any order. :meth:`Sink.aclose` commits the message: a file
appears at its destination only then. :meth:`Sink.abort` throws the message away: a file sink
removes its temporary file, a stream sink closes the stream so the peer sees an incomplete
message, never a complete wrong one.

:meth:`Sink.aclose` either commits and returns, or raises with nothing committed (a sink that
cannot tell, its final answer lost, raises :class:`~stream_st.OutcomeUnknownError`). A
cancellation keeps to this: it stops a commit only before its commit point (a file's rename),
and the sink then discards the message; past that point, ``aclose`` completes and returns, and
the caller meets the cancellation at its next checkpoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .._limits import UNLIMITED, Clock

__all__ = ["Sink"]


class Sink(ABC):
    """Bytes out.

    ``name`` describes the destination in error messages (a path or URL). ``position`` counts the
    bytes appended with :meth:`send`. A sink does not keep any reference to a buffer once the call
    that was given it returns, so the caller may reuse or change the memory afterwards.
    ``clock`` bounds every wait for the transport (see ``stream_st._limits``); the writer gives
    the sink its operation's clock.
    """

    clock: Clock = UNLIMITED
    name: str = "<sink>"
    random_access: bool = False

    def __init__(self) -> None:
        self.position = 0

    @abstractmethod
    async def send(self, buffer: memoryview) -> None:
        """Append all of ``buffer`` (a 1-D byte view) to the message."""

    async def allocate(self, size: int) -> None:  # noqa: B027 - optional for a sink
        """A hint, given before any byte: the whole message will be ``size`` bytes."""

    async def write_at(self, offset: int, buffer: memoryview) -> None:
        """Write all of ``buffer`` at absolute ``offset``; only when ``random_access`` is True."""
        raise NotImplementedError(f"{self.name} can only be written front to back")

    async def hold_head(self, size: int) -> bool:
        """Keep the message's first ``size`` bytes open to :meth:`patch_head` until the commit;
        False when this sink cannot (it sends bytes on for good). A random-access sink can."""
        return self.random_access

    async def patch_head(self, buffer: memoryview) -> None:
        """Rewrite the message's first ``len(buffer)`` bytes, held since :meth:`hold_head`."""
        await self.write_at(0, buffer)

    @abstractmethod
    async def aclose(self) -> None:
        """Commit: the message is complete. A file is moved into place; a stream is flushed.

        Returns only once committed; raises only with nothing committed (see the module).
        """

    @abstractmethod
    async def abort(self) -> None:
        """Discard the message; safe to call more than once and from a cancelled scope.

        Implementations must not block on a peer: they run shielded from cancellation.
        """

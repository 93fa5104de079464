"""The process group as a group load uses it (see :mod:`.ranks`): collectives awaited off the
event loop, the gate where ranks agree all is well, and failures told apart (a rank that failed,
a rank that is gone).

Cancelled while it waits for a transfer, a rank stops waiting (the transfer goes on); a gate or a
gather, once begun, is finished first (:meth:`RankGroup.finish`), whatever cancels it, anyio's or
asyncio's own: a rank that left one half done would be out of step with the others, who would
then wait for it until the group's timeout."""

from __future__ import annotations

import asyncio
import functools
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
import anyio.to_thread

from .._util import process_running, seen_through
from ..core.arrays import load_torch, torch_device
from ..errors import ArgumentTypeError, RankFailedError, RankLostError, UsageError

__all__ = ["LOST_LOOKS", "LOST_PAUSE", "MESSAGE_BYTES", "Failure", "RankGroup", "describe"]

MESSAGE_BYTES = 1024
"""A failing rank's message travels to the others in this many bytes (the rank it names, then
the cause in UTF-8, cut short): each gate moves this many bytes per rank."""


@dataclass(frozen=True, slots=True)
class Failure:
    """What went wrong on this rank, to be told to the group at its next collective: ``cause``
    (what the others are told) and ``error``, raised again here once the group knows (see
    :meth:`RankGroup.fail`). ``named``: the rank the group names for it, when that is not this
    one: the rank that read bytes this rank found bad."""

    cause: str
    error: BaseException
    named: int | None = None

    @classmethod
    def of(cls, exc: BaseException, named: int | None = None) -> Failure:
        return cls(describe(exc), exc, named)


_PEERS: weakref.WeakKeyDictionary[Any, list[tuple[str, int]]] = weakref.WeakKeyDictionary()
"""Each process group's ranks as (host, process id), learnt at the first gather of a load on it
and kept as long as the group lives: a rank lost at any later collective on the group (another
load's, or :func:`~.ranks.load_model`'s last agreement) is named by its process id."""

_NAMED = 4
"""Bytes before the cause in a gate's row: the rank it names plus one (little-endian), 0 for its
own (see :meth:`RankGroup.agree`)."""


class RankGroup:
    """One process group as a load uses it: ranks, the device bytes go through, waits."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.torch = load_torch()
        if group is None:
            raise UsageError(
                "slices= (and load_model's include=) need process_group= (a torch.distributed "
                "process group)"
            )
        outside = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
        if outside is not None and group is outside:  # what new_group gives a rank left out
            raise UsageError("this process is not a member of process_group")
        kind = getattr(dist, "ProcessGroup", None)  # absent where torch has no distributed
        if kind is not None and not isinstance(group, kind):
            raise ArgumentTypeError(
                "process_group= takes a torch.distributed process group (e.g. "
                f"torch.distributed.group.WORLD), got {type(group).__name__}"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("process_group= needs torch.distributed initialised in this process")
        self.group = group
        try:
            self.world = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        except (ValueError, RuntimeError):  # torch's "Group ... is not registered"
            raise UsageError(
                "process_group= is not a live process group of this process (destroyed by "
                "torch.distributed.destroy_process_group?): make a new one (new_group)"
            ) from None
        if self.rank < 0:
            raise UsageError("this process is not a member of process_group")
        self.cuda = dist.get_backend(group) == "nccl"
        self.device = (
            self.torch.device("cuda", self.torch.cuda.current_device())
            if self.cuda
            else self.torch.device("cpu")
        )
        self.out_device: Any = None

    @property
    def peers(self) -> list[tuple[str, int]]:
        """(host, process id) of each rank, for failures: empty until a first load on this
        process group has gathered them (see :data:`_PEERS`)."""
        return _PEERS.get(self.group, [])

    @peers.setter
    def peers(self, peers: list[tuple[str, int]]) -> None:
        _PEERS[self.group] = peers

    def hand_out_on(self, device: Any) -> None:
        """Hand tensors out on ``device``, checked as a load without a group checks it (see
        :func:`~stream_st.core.arrays.torch_device`: a :class:`UsageError` if refused)."""
        self.out_device = torch_device(device)

    def global_rank(self, rank: int) -> int:
        return int(self.dist.get_global_rank(self.group, rank)) if self.group else rank

    async def wait(self, work: Any, source: int | None = None) -> None:
        """Wait for ``work`` in a worker thread (left to go on if this task is cancelled);
        :class:`RankLostError` if it failed."""
        await self._blocking(work.wait, source)

    async def _blocking(self, call: Callable[[], object], source: int | None) -> None:
        """``call()`` (a collective, or a wait for one) in a worker thread (left to go on if
        this task is cancelled); :class:`RankLostError` if it failed."""
        try:
            await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
        except RuntimeError as exc:
            raise await anyio.to_thread.run_sync(self.lost, exc, source) from None

    async def finish(self, call: Callable[[], Awaitable[object]]) -> None:
        """``await call()`` (a collective, or a gate and what goes with it) to its end, whatever
        cancellation comes meanwhile: anyio's (trio's) is held off by a shield and raised at the
        task's next checkpoint; asyncio's own (``Task.cancel``: ``asyncio.timeout``,
        ``wait_for``), which goes through shields, is taken in once the call has ended and asked
        of the task again (see :func:`_cancel_again`), to be raised at its next wait likewise:
        there a rank that fails tells the group at its next gate. The call's failure is raised
        as it is."""
        failed: list[BaseException] = []

        async def through() -> None:
            try:
                await call()
            except BaseException as exc:  # raised below: cancelled, seen_through would not
                failed.append(exc)

        try:
            # unbounded: a collective ends when every rank has joined it, or at the timeout
            await seen_through(through)
        except asyncio.CancelledError as exc:  # asyncio's own (anyio's: returned from)
            _cancel_again(exc)
        if failed:
            raise failed.pop()

    async def gather(self, value: Any, failure: Failure | None = None) -> list[Any]:
        """Every rank's ``value`` (small, picklable) and whether it failed, in rank order, the
        collective finished even if this task is cancelled meanwhile (see :meth:`finish`). If a
        rank gave a ``failure``, every rank raises (see :meth:`fail`)."""
        out: list[Any] = [None] * self.world
        told = (value, None if failure is None else (failure.cause, failure.named))
        gathering = functools.partial(self.dist.all_gather_object, out, told, group=self.group)
        await self.finish(functools.partial(self._blocking, gathering, None))
        failed = [(rank, *said) for rank, (_, said) in enumerate(out) if said is not None]
        if failed:
            self.fail(failed, failure)
        return [each for each, _ in out]

    async def agree(self, failure: Failure | None = None) -> None:
        """The gate before each stripe and at the end: every rank says whether it is well
        (``failure`` None) or why not, in one collective, finished even if this task is
        cancelled meanwhile (see :meth:`finish`); if one is not, every rank raises (see
        :meth:`fail`)."""
        torch = self.torch
        said = torch.zeros((self.world, MESSAGE_BYTES), dtype=torch.uint8, device=self.device)
        if failure is not None:
            named = 0 if failure.named is None else failure.named + 1
            raw = named.to_bytes(_NAMED, "little") + (failure.cause.encode() or b"?")
            raw = raw[:MESSAGE_BYTES]
            said[self.rank, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        work = self.dist.all_reduce(said, group=self.group, async_op=True)
        await self.finish(functools.partial(self.wait, work))
        failed = []
        for rank, row in enumerate(said.cpu().numpy()):
            named, cause = int.from_bytes(row[:_NAMED], "little"), bytes(row[_NAMED:]).rstrip(b"\0")
            if cause:
                failed.append((rank, cause.decode(errors="replace"), named - 1 if named else None))
        if failed:
            self.fail(failed, failure)

    def fail(self, failed: list[tuple[int, str, int | None]], own: Failure | None) -> NoReturn:
        """Raise, once every rank knows that some failed: ``failed`` holds each one's rank, its
        cause and the rank it names (None: itself). :class:`RankFailedError` on every rank,
        naming the rank the first of them names, for its cause. This rank's own ``failure``, if
        any, is that error's ``__cause__``; or, if it is no plain exception (a cancellation, the
        consumer leaving the stream, an interrupt), raised as itself."""
        names = [rank if named is None else named for rank, _, named in failed]
        finder, cause, _ = failed[0]
        first = names[0]
        more = sorted(set(names) - {first})
        others = f" (and ranks {more})" if more else ""
        found = f" (found by rank {finder})" if first != finder else ""
        message = f"rank {first} failed{found}{others}: {cause}"
        error = RankFailedError(message, rank=first, cause=cause)
        if own is None:
            raise error
        if not isinstance(own.error, Exception):
            raise own.error
        raise error from own.error

    def lost(self, exc: BaseException, source: int | None) -> RankLostError:
        """The error for a failed collective: the rank found gone (a process on this host that
        no longer runs), else the rank waited on, else none named."""
        cause = str(exc).split(". This is typically", 1)[0]
        here = socket.gethostname()
        local = [(rank, pid) for rank, (host, pid) in enumerate(self.peers) if host == here]
        # A killed process resets its sockets while it exits, a moment before it stops running:
        # look again for a short while before naming no one.
        for attempt in range(LOST_LOOKS):
            for rank, pid in local:
                if rank != self.rank and not process_running(pid):
                    return RankLostError(
                        f"rank {rank} (process {pid}) is gone; rank {self.rank} saw: {cause}",
                        rank=rank,
                        cause=cause,
                    )
            if attempt + 1 < LOST_LOOKS:
                time.sleep(LOST_PAUSE)
        if source is not None and source != self.rank:
            return RankLostError(
                f"rank {self.rank} waited for rank {source} in vain: {cause}",
                rank=source,
                cause=cause,
            )
        return RankLostError(
            f"a collective failed on rank {self.rank}: {cause}", rank=None, cause=cause
        )


LOST_LOOKS = 20
LOST_PAUSE = 0.05
"""After a failed collective, the ranks of this host are looked at up to :data:`LOST_LOOKS` times,
:data:`LOST_PAUSE` seconds apart, for one that has stopped (1 s at most)."""


def _cancel_again(cancelled: asyncio.CancelledError) -> None:
    """Ask asyncio's cancellation ``cancelled``, taken in once what it came in was seen through,
    of the current task again as it next waits, as anyio raises its own at the next checkpoint;
    unless it was taken back by then (``Task.uncancel``: an ``asyncio.timeout`` whose block
    ended first, the task past what it was to cancel). The count of cancellations asked of the
    task (which ``asyncio.timeout`` and task groups check as they exit) stays as it was."""
    task = asyncio.current_task()
    assert task is not None
    message = cancelled.args[0] if cancelled.args else None

    def again() -> None:
        if task.cancelling() and not task.done():
            task.uncancel()
            task.cancel(message)

    asyncio.get_running_loop().call_soon(again)


def describe(exc: BaseException) -> str:
    """How a rank's failure is told to the others: the error's type and message."""
    if isinstance(exc, GeneratorExit):
        return "it left its stream before the end"
    if not isinstance(exc, Exception) and isinstance(exc, anyio.get_cancelled_exc_class()):
        return "it was cancelled"  # (an error is told before any event loop runs)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""The process group as a group load uses it (see :mod:`.ranks`): collectives awaited off the
event loop, the gate where ranks agree all is well, and failures told apart (a rank that failed,
a rank that is gone)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread

from ..core.arrays import load_torch
from ..errors import RankFailedError, RankLostError, UsageError

__all__ = ["LOST_LOOKS", "LOST_PAUSE", "MESSAGE_BYTES", "RankGroup", "describe", "raise_first"]

MESSAGE_BYTES = 2048
"""A failing rank's message travels to the others in this many bytes (UTF-8, cut short)."""


class RankGroup:
    """One process group as a load uses it: ranks, the device bytes go through, waits."""

    def __init__(self, group: Any, device: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.torch = load_torch()
        if group is None:
            raise UsageError("slices= needs process_group= (a torch.distributed process group)")
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("process_group= needs torch.distributed initialised in this process")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise UsageError("this process is not a member of process_group")
        self.cuda = dist.get_backend(group) == "nccl"
        self.device = (
            self.torch.device("cuda", self.torch.cuda.current_device())
            if self.cuda
            else self.torch.device("cpu")
        )
        self.out_device = None if device in (None, "cpu") else self.torch.device(device)
        out = self.out_device
        if out is not None and out.type == "cuda" and not self.torch.cuda.is_available():
            raise UsageError(f"device={device!r}: this torch has no CUDA device")
        self.peers: list[tuple[str, int]] = []  # (host, pid) of each rank, for failures

    def global_rank(self, rank: int) -> int:
        return int(self.dist.get_global_rank(self.group, rank)) if self.group else rank

    async def wait(self, work: Any, source: int | None = None) -> None:
        """Wait for ``work`` in a worker thread; :class:`RankLostError` if it failed."""
        try:
            await anyio.to_thread.run_sync(work.wait, abandon_on_cancel=True)
        except RuntimeError as exc:
            raise await anyio.to_thread.run_sync(self.lost, exc, source) from None

    async def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (small, picklable), in rank order."""
        out: list[Any] = [None] * self.world
        try:
            await anyio.to_thread.run_sync(
                lambda: self.dist.all_gather_object(out, value, group=self.group),
                abandon_on_cancel=True,
            )
        except RuntimeError as exc:
            raise await anyio.to_thread.run_sync(self.lost, exc, None) from None
        return out

    async def agree(self, failure: str | None) -> None:
        """The gate before each stripe and at the end: every rank says whether it is well; if
        one is not, every rank raises :class:`RankFailedError` with the first failing rank's
        message."""
        torch = self.torch
        flags = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        if failure is not None:
            flags[self.rank] = 1
        await self.wait(self.dist.all_reduce(flags, group=self.group, async_op=True))
        failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
        if not failed:
            return
        first = failed[0]
        message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        if first == self.rank and failure is not None:
            raw = failure.encode()[:MESSAGE_BYTES]
            message[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        await self.wait(
            self.dist.broadcast(
                message, src=self.global_rank(first), group=self.group, async_op=True
            ),
            first,
        )
        cause = bytes(message.cpu().numpy()).rstrip(b"\0").decode(errors="replace")
        others = f" (and ranks {failed[1:]})" if len(failed) > 1 else ""
        raise RankFailedError(f"rank {first} failed{others}: {cause}", rank=first, cause=cause)

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
                if rank != self.rank and not _running(pid):
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


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def describe(exc: BaseException) -> str:
    """How a rank's failure is told to the others: the error's type and message."""
    return f"{type(exc).__name__}: {exc}"


def raise_first(everyone: list[Any], failure_of: Callable[[Any], str | None]) -> None:
    """:class:`RankFailedError` for the first rank whose gathered value holds a failure."""
    for rank, each in enumerate(everyone):
        cause = failure_of(each)
        if cause is not None:
            raise RankFailedError(f"rank {rank} failed: {cause}", rank=rank, cause=cause)

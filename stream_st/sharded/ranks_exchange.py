"""One safetensors file read by the group (see :mod:`.ranks`): this rank reads its own stripes
and the tensors it reads alone, ahead within a budget, while the group exchanges earlier stripes;
tensors are handed out in offset order as their last bytes arrive."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from .._util import task_group
from ..core.digests import Digests
from ..errors import SafetensorsError
from ..memory.delivery import Delivery
from ..memory.fresh import fresh_bytes
from ..reader import TensorStream, merge_ranges
from .ranks_group import RankGroup, describe
from .ranks_plan import Piece, Plan, Slice, Stripe, contiguous_span, slice_bounds, slice_shape

__all__ = ["READ_AHEAD_BYTES", "SCRATCH", "WINDOW_STRIPES", "FileExchange"]

READ_AHEAD_BYTES = 64 << 20
"""A rank reads its own stripes at most this many bytes ahead of the exchange (or one stripe)."""

WINDOW_STRIPES = 3
"""Stripes whose bytes are being exchanged at once; tensors are handed out as they complete."""


class _Budget:
    """Bytes read ahead and not yet let go: :meth:`take` waits while over ``limit`` (unless
    nothing is held, so one item larger than the limit still goes)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._freed = anyio.Event()

    async def take(self, nbytes: int) -> None:
        while self.held and self.held + nbytes > self.limit:
            self._freed = anyio.Event()
            await self._freed.wait()
        self.held += nbytes

    def give(self, nbytes: int) -> None:
        self.held -= nbytes
        self._freed.set()


@dataclass(slots=True)
class _Read:
    """Something this rank reads from the source: a stripe it owns or a tensor it reads alone.
    ``ranges``: ``(file offset, end, where the bytes land)``."""

    at: int
    ranges: list[tuple[int, int, memoryview]]
    nbytes: int
    done: anyio.Event = field(default_factory=anyio.Event)
    failure: str | None = None


@dataclass(slots=True)
class _Transfer:
    """One collective in flight; ``keep`` holds its memory alive, ``back`` (device tensor, host
    bytes) is copied to the host once it arrived (NCCL)."""

    work: Any
    keep: Any = None
    back: tuple[Any, np.ndarray[Any, Any]] | None = None


@dataclass(slots=True)
class _Pending:
    """A step handed out once its transfers are done: what it completes, and the read-ahead
    bytes it frees."""

    transfers: list[_Transfer]
    ready: list[tuple[int, Slice | None]]
    owned: int
    source: int | None


SCRATCH: Slice = (-1, -1, -1)
"""The key of a tensor's bytes its owner reads only to send on."""


class FileExchange:
    """The group's read of one safetensors file, open on this rank as ``stream``."""

    def __init__(
        self,
        group: RankGroup,
        stream: TensorStream,
        wants: dict[int, Slice | None],
        delivery: Delivery,
        verify: bool,
    ) -> None:
        self.group = group
        self.stream = stream
        self.header = stream.header
        self.tensors = list(self.header.tensors)
        self.wants = wants
        self.delivery = delivery
        self.digests = Digests.from_header(self.header) if verify else None
        self.buffers: dict[tuple[int, Slice | None], np.ndarray[Any, Any]] = {}
        self.placed: set[int] = set()
        self.failure: str | None = None

    def buffer(self, index: int, wanted: Slice | None) -> np.ndarray[Any, Any]:
        """The bytes tensor ``index`` (``wanted``: its slice; :data:`SCRATCH`: bytes only sent
        on) lands in on this rank, made on first use: the caller's memory (``into=``) if given."""
        key = (index, wanted)
        found = self.buffers.get(key)
        if found is None:
            info = self.tensors[index]
            target = self.delivery.target(info) if wanted is None else None
            if target is not None:
                found = target[0].reshape(-1).view(np.uint8)
                self.placed.add(index)
            elif wanted is None or wanted == SCRATCH:
                found = fresh_bytes(info.nbytes)
            else:
                found = fresh_bytes(
                    math.prod(slice_shape(info, wanted)) * info.array_dtype.itemsize
                )
            self.buffers[key] = found
        return found

    def own_bytes(self, index: int) -> np.ndarray[Any, Any]:
        """Where this rank, owner of tensor ``index``'s stripe, reads its bytes."""
        return self.buffer(index, None if self.wants.get(index, SCRATCH) is None else SCRATCH)

    def comm(self, raw: np.ndarray[Any, Any]) -> Any:
        """``raw`` as a tensor the collectives move: over its memory on the CPU, a copy on the
        group's device under NCCL."""
        tensor = self.group.torch.from_numpy(raw)
        return tensor.to(self.group.device) if self.group.cuda else tensor

    def plan_reads(
        self, plan: Plan
    ) -> tuple[dict[int, _Read], list[tuple[int, Slice | None, _Read]]]:
        """What this rank reads: the stripes it owns (by number), and the tensors it reads
        alone, with where each lands."""
        base = self.header.data_start
        me = self.group.rank
        owned: dict[int, _Read] = {}
        for number, stripe in enumerate(plan.stripes):
            if stripe.owner == me:
                ranges = []
                for piece in stripe.pieces:
                    start = base + self.tensors[piece.index].start
                    raw = self.own_bytes(piece.index)
                    ranges.append(
                        (start + piece.lo, start + piece.hi, raw.data[piece.lo : piece.hi])
                    )
                owned[number] = _Read(ranges[0][0], ranges, stripe.nbytes)
        alone = []
        for index, wanted in plan.direct[me]:
            info = self.tensors[index]
            span = (0, info.nbytes) if wanted is None else contiguous_span(info, wanted)
            lo, hi = span or (0, 0)
            start = base + info.start
            raw = self.buffer(index, wanted)
            alone.append(
                (index, wanted, _Read(start + lo, [(start + lo, start + hi, raw.data)], hi - lo))
            )
        return owned, alone

    async def read_all(self, reads: list[_Read], budget: _Budget) -> None:
        """Read each of ``reads`` in order, within ``budget``. A failure is kept on the read and
        every later one (told to the group at the next gate), never raised here."""
        source = self.stream.source
        failure: str | None = None
        try:
            await source.plan_reads(
                merge_ranges((start, end) for read in reads for start, end, _ in read.ranges)
            )
        except SafetensorsError as exc:
            failure = describe(exc)
        for read in reads:
            if failure is None:
                await budget.take(read.nbytes)
                try:
                    for start, end, view in read.ranges:
                        if end > start:
                            got = await source.read_into_at(start, view[: end - start])
                            if got < end - start:
                                raise SafetensorsError(
                                    f"{source.name} ended at byte {start + got}, "
                                    f"expected data up to byte {end}"
                                )
                except SafetensorsError as exc:
                    failure = describe(exc)
            read.failure = failure
            read.done.set()

    async def run(self, plan: Plan) -> AsyncGenerator[tuple[str, Any]]:
        """Every tensor this rank wants, in offset order, read or exchanged as ``plan`` says;
        :class:`DistributedError` if any rank fails."""
        group = self.group
        me = group.rank
        owned, alone = self.plan_reads(plan)
        reads = sorted([*owned.values(), *(read for _, _, read in alone)], key=lambda r: r.at)
        steps: list[tuple[int, int, int]] = []  # (offset, 0 stripe / 1 alone, which)
        for number, stripe in enumerate(plan.stripes):
            first = stripe.pieces[0]
            steps.append((self.tensors[first.index].start + first.lo, 0, number))
        for which, (index, _, _) in enumerate(alone):
            steps.append((self.tensors[index].start, 1, which))
        steps.sort()
        budget = _Budget(READ_AHEAD_BYTES)
        pending: deque[_Pending] = deque()
        async with task_group() as tasks:
            tasks.start_soon(self.read_all, reads, budget)
            try:
                for _, kind, which in steps:
                    if kind == 1:
                        index, wanted, read = alone[which]
                        while not read.done.is_set() and pending:  # free read-ahead room
                            async for item in self.complete(pending.popleft(), budget):
                                yield item
                        await read.done.wait()
                        if read.failure is not None and self.failure is None:
                            self.failure = read.failure
                        pending.append(_Pending([], [(index, wanted)], read.nbytes, None))
                    else:
                        stripe = plan.stripes[which]
                        own = owned.get(which)
                        if own is not None:
                            while not own.done.is_set() and pending:  # free read-ahead room
                                async for item in self.complete(pending.popleft(), budget):
                                    yield item
                            await own.done.wait()
                            if own.failure is not None and self.failure is None:
                                self.failure = own.failure
                        await group.agree(self.failure)
                        transfers = self.issue(stripe)
                        nbytes = 0 if own is None else own.nbytes
                        pending.append(
                            _Pending(transfers, plan.done[me][which], nbytes, stripe.owner)
                        )
                    while pending and (
                        not pending[0].transfers
                        or sum(1 for p in pending if p.transfers) > WINDOW_STRIPES
                    ):
                        async for item in self.complete(pending.popleft(), budget):
                            yield item
                while pending:
                    async for item in self.complete(pending.popleft(), budget):
                        yield item
                await group.agree(self.failure)
            finally:
                tasks.cancel_scope.cancel()

    def issue(self, stripe: Stripe) -> list[_Transfer]:
        """Start the collectives that move ``stripe``'s bytes (the group has agreed all is well)."""
        group = self.group
        dist = group.dist
        me = group.rank
        owner = group.global_rank(stripe.owner)
        transfers = []
        for piece in stripe.pieces:
            if not piece.targets:  # every rank wants it whole: broadcast from the owner
                raw = self.buffer(piece.index, None)[piece.lo : piece.hi]
                view = self.comm(raw)
                work = dist.broadcast(view, src=owner, group=group.group, async_op=True)
                back = (view, raw) if group.cuda and stripe.owner != me else None
                transfers.append(_Transfer(work, view, back))
            elif stripe.owner == me:  # sent point to point: whole or each rank's slice
                transfers.extend(self.send(piece))
            else:
                for rank, wanted in piece.targets:
                    if rank == me:
                        raw = self.buffer(piece.index, wanted)
                        view = self.comm(raw)
                        work = dist.irecv(view, src=owner, group=group.group, tag=piece.index)
                        transfers.append(_Transfer(work, view, (view, raw) if group.cuda else None))
        return transfers

    def send(self, piece: Piece) -> list[_Transfer]:
        """The owner's side of a tensor sent point to point (its own slice copied here)."""
        group = self.group
        info = self.tensors[piece.index]
        raw = self.own_bytes(piece.index)
        transfers = []
        for rank, wanted in piece.targets:
            if wanted is None:
                part = raw
            else:
                dim, number, parts = wanted
                start, stop = slice_bounds(info.shape[dim], number, parts)
                array = raw.view(info.array_dtype).reshape(info.array_shape)
                cut = np.ascontiguousarray(np.take(array, np.arange(start, stop), axis=dim))
                part = cut.reshape(-1).view(np.uint8)
                if rank == group.rank:
                    self.buffer(piece.index, wanted)[:] = part
            if rank != group.rank:
                view = self.comm(part)
                work = group.dist.isend(
                    view, dst=group.global_rank(rank), group=group.group, tag=piece.index
                )
                transfers.append(_Transfer(work, (view, part)))
        self.buffers.pop((piece.index, SCRATCH), None)  # alive in the transfers until sent
        return transfers

    async def complete(self, step: _Pending, budget: _Budget) -> AsyncGenerator[tuple[str, Any]]:
        """Wait for one step's transfers, then hand out the tensors it completed (each checked
        against its digest, if the header records one)."""
        for transfer in step.transfers:
            await self.group.wait(transfer.work, step.source)
            if transfer.back is not None:
                transfer.back[1][:] = transfer.back[0].cpu().numpy()
        budget.give(step.owned)
        for index, wanted in step.ready:
            info = self.tensors[index]
            raw = self.buffers.pop((index, wanted), None)
            if raw is None:  # an empty tensor
                raw = self.buffer(index, wanted)
                del self.buffers[(index, wanted)]
            shape = info.array_shape if wanted is None else slice_shape(info, wanted)
            array = raw.view(info.array_dtype).reshape(shape)
            if self.digests is not None and wanted is None and self.failure is None:
                try:
                    await self.digests.check_view(info.name, array, self.stream.source.name)
                except SafetensorsError as exc:
                    self.failure = describe(exc)
            if self.failure is not None:
                continue  # told to the group at the next gate; nothing more handed out
            if wanted is None:
                value = self.delivery.deliver(info, array, index in self.placed)
            else:
                value = Delivery("pt" if self.delivery.torch else "np").deliver(info, array, False)
            device = self.group.out_device
            if device is not None and self.group.torch.is_tensor(value):
                value = value.to(device)
            yield info.name, value

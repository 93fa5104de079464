"""One safetensors file read by the group (see :mod:`.ranks`): this rank reads its own stripes
and the tensors it reads alone, ahead within a budget, while the group exchanges earlier stripes;
tensors are handed out in offset order as their last bytes arrive.

No task outlives a wait of the exchange: reading ahead is done, a chunk at a time, by a task
that runs only while the exchange waits for the group (a gate, a transfer), so the consumer's
own cancel scopes around the iteration nest as they should, and nothing reads while the
consumer holds the turn."""

from __future__ import annotations

import contextlib
import functools
import math
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

from .._util import task_group
from ..core.digests import Digests, hash_view
from ..errors import DistributedError, IntegrityError, SafetensorsError
from ..memory.delivery import Delivery
from ..memory.fresh import fresh_bytes
from ..reader import TensorStream, merge_ranges
from ..transports.base import Source
from .ranks_group import Failure, RankGroup
from .ranks_plan import Piece, Plan, Slice, Stripe, contiguous_span, slice_bounds, slice_shape

__all__ = ["READ_AHEAD_BYTES", "SCRATCH", "WINDOW_STRIPES", "FileExchange"]

READ_AHEAD_BYTES = 64 << 20
"""A rank reads its own stripes at most this many bytes ahead of the exchange (or one stripe)."""

WINDOW_STRIPES = 3
"""Stripes whose bytes are being exchanged at once; tensors are handed out as they complete."""


READ_CHUNK = 2 << 20
"""Reads are made in runs of at most this many bytes: a read ahead stops at the end of one once
the wait it filled is over."""


@dataclass(slots=True)
class _Read:
    """Something this rank reads from the source: a stripe it owns or a tensor it reads alone.
    ``ranges``: ``(file offset, end, where the bytes land)``; ``left``: how many are not read
    yet; ``begun``: whether one is being read or was; ``error``: why it was not read."""

    ranges: list[tuple[int, int, memoryview]]
    nbytes: int
    left: int = 0
    begun: bool = False
    done: bool = False
    error: Exception | None = None

    def __post_init__(self) -> None:
        self.left = len(self.ranges)


class _Reader:
    """This rank's reads of one file, a chunk at a time, their ranges in offset order (a read
    may span another, as a stripe spans a tensor this rank reads alone: a sequential source is
    only read forward, each byte once): by the exchange when it needs one (:meth:`until`), and
    ahead of it, at most :data:`READ_AHEAD_BYTES` (or one read), while it waits for the group
    (:meth:`during`). A failure is kept on the read and every later one, raised where the
    exchange needs them."""

    def __init__(self, source: Source, reads: list[_Read]) -> None:
        self.source = source
        every = [(read, which) for read in reads for which in range(len(read.ranges))]
        every.sort(key=lambda each: each[0].ranges[each[1]][0])
        self.ranges = deque(every)  # (read, which of its ranges) not read yet
        self.into = 0  # bytes of the first of them read
        self.held = 0  # bytes of reads begun and not yet let go (:meth:`give`)
        self.planned = False

    def give(self, nbytes: int) -> None:
        """``nbytes`` of reads are handed on: room to read ahead again."""
        self.held -= nbytes

    async def until(self, read: _Read) -> None:
        """Read up to ``read`` (the next needed), whatever is held; its error if it failed."""
        while not read.done:
            await self._chunk()
        if read.error is not None:
            raise read.error

    async def during(self, waiting: Callable[[], Awaitable[None]]) -> None:
        """``await waiting()``, reading ahead meanwhile (until the chunk being read when it
        ends)."""
        if not self._room():
            await waiting()
            return
        over = anyio.Event()

        async def ahead() -> None:
            while not over.is_set() and self._room():
                await self._chunk()

        async with task_group() as tasks:
            tasks.start_soon(ahead)
            try:
                await waiting()
            finally:
                over.set()

    def _room(self) -> bool:
        """Whether the next read may go on now."""
        if not self.ranges:
            return False
        read = self.ranges[0][0]
        return read.begun or not self.held or self.held + read.nbytes <= READ_AHEAD_BYTES

    async def _chunk(self) -> None:
        """Read the next chunk of the first range not read."""
        read, which = self.ranges[0]
        source = self.source
        try:
            if not self.planned:
                self.planned = True
                ranges = (each.ranges[number] for each, number in self.ranges)
                await source.plan_reads(merge_ranges((a, b) for a, b, _ in ranges))
            if not read.begun:
                read.begun = True
                self.held += read.nbytes
            start, end, view = read.ranges[which]
            into = self.into
            count = min(READ_CHUNK, end - start - into)
            if count > 0:
                got = await source.read_into_at(start + into, view[into : into + count])
                if got < count:
                    raise SafetensorsError(
                        f"{source.name} ended at byte {start + into + got}, "
                        f"expected data up to byte {end}"
                    )
            self.into = into + count
            if self.into >= end - start:
                self.ranges.popleft()
                self.into = 0
                read.left -= 1
                read.done = not read.left
        except Exception as exc:
            for each, _ in self.ranges:
                each.error, each.done = exc, True
            self.ranges.clear()


@dataclass(slots=True)
class _Transfer:
    """One collective of a stripe: made ready (its memory found) before the group's gate,
    ``start`` once every rank passed it, giving ``work``. ``keep`` holds its memory alive,
    ``back`` (device tensor, host bytes) is copied to the host once it arrived (NCCL)."""

    start: Callable[[], Any]
    keep: Any = None
    back: tuple[Any, np.ndarray[Any, Any]] | None = None
    work: Any = None


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
    """The group's read of one safetensors file, open on this rank as ``stream``; each
    tensor handed out whole is checked against ``digests``, if given (its header's, this rank
    checking them). ``checking[r]``: rank ``r`` checks digests, so a tensor this rank owns and
    cuts a slice of for it is checked here before any of it is cut or sent."""

    def __init__(
        self,
        group: RankGroup,
        stream: TensorStream,
        wants: dict[int, Slice | None],
        delivery: Delivery,
        digests: Digests | None,
        checking: Sequence[bool],
    ) -> None:
        self.group = group
        self.stream = stream
        self.header = stream.header
        self.tensors = list(self.header.tensors)
        self.wants = wants
        self.delivery = delivery
        self.digests = digests
        self.checks = digests is not None  # this rank checks what it hands out whole
        self.checking = checking
        self.checked: set[int] = set()  # tensors checked whole before they were cut or sent
        self.buffers: dict[tuple[int, Slice | None], np.ndarray[Any, Any]] = {}
        self.placed: set[int] = set()
        self.pieces: dict[int, list[tuple[int, int, int]]] = {}  # tensor -> (lo, hi, reader)
        self.bad: tuple[IntegrityError, int | None] | None = None  # found here, the rank named
        # Wanted tensors not yet handed out, in offset order, and those done before an earlier
        # one: see :meth:`complete`.
        self.due = deque(sorted(wants))
        self.held: dict[int, tuple[str, Any]] = {}

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
                owned[number] = _Read(ranges, stripe.nbytes)
        alone = []
        for index, wanted in plan.direct[me]:
            info = self.tensors[index]
            span = (0, info.nbytes) if wanted is None else contiguous_span(info, wanted)
            lo, hi = span or (0, 0)
            start = base + info.start
            raw = self.buffer(index, wanted)
            alone.append((index, wanted, _Read([(start + lo, start + hi, raw.data)], hi - lo)))
        return owned, alone

    async def run(self, plan: Plan) -> AsyncGenerator[tuple[str, Any]]:
        """Every tensor this rank wants, in offset order, read or exchanged as ``plan`` says;
        :class:`DistributedError` if any rank fails.

        Whatever goes wrong on this rank (a read, memory, a digest, a hand-out, the consumer
        leaving the stream, a cancellation) is told to the group at once: this rank waits for
        the transfers it has begun, then meets the others at their next gate (outside a gate and
        the start of a stripe's transfers, every rank's next collective is a gate), where every
        rank raises (see :meth:`RankGroup.fail`). The consumer leaving ends the stream here
        quietly."""
        pending: deque[_Pending] = deque()
        for stripe in plan.stripes:
            for piece in stripe.pieces:
                self.pieces.setdefault(piece.index, []).append((piece.lo, piece.hi, stripe.owner))
        try:
            async with contextlib.aclosing(self._steps(plan, pending)) as items:
                async for item in items:
                    yield item
                    del item
        except DistributedError:
            raise
        except BaseException as exc:
            named = self.bad[1] if self.bad is not None and self.bad[0] is exc else None
            told = functools.partial(self.tell, pending, Failure.of(exc, named))
            try:
                await self.group.finish(told)
            except GeneratorExit:
                return

    async def tell(self, pending: deque[_Pending], failure: Failure) -> None:
        """Wait for the transfers this rank has begun (``pending``), then tell the group its
        ``failure`` at their next gate, where every rank raises (see :meth:`RankGroup.fail`)."""
        while pending:
            await self.settle(pending.popleft())
        await self.group.agree(failure)

    async def _steps(self, plan: Plan, pending: deque[_Pending]) -> AsyncGenerator[tuple[str, Any]]:
        """:meth:`run` without its failure handling: ``pending``, the steps whose transfers
        have begun and are not yet waited for, is kept up to date for it."""
        group = self.group
        me = group.rank
        owned, alone = self.plan_reads(plan)
        reads = [*owned.values(), *(read for _, _, read in alone)]
        steps: list[tuple[int, int, int]] = []  # (offset, 0 stripe / 1 alone, which)
        for number, stripe in enumerate(plan.stripes):
            first = stripe.pieces[0]
            steps.append((self.tensors[first.index].start + first.lo, 0, number))
        for which, (index, _, _) in enumerate(alone):
            steps.append((self.tensors[index].start, 1, which))
        steps.sort()
        reader = _Reader(self.stream.source, reads)
        for _, kind, which in steps:
            if kind == 1:
                index, wanted, read = alone[which]
                while not read.done and pending:  # hand out what is there, reading meanwhile
                    for item in await self.complete(pending, reader):
                        yield item
                await reader.until(read)
                pending.append(_Pending([], [(index, wanted)], read.nbytes, None))
            else:
                stripe = plan.stripes[which]
                own = owned.get(which)
                if own is not None:
                    while not own.done and pending:  # hand out what is there, reading meanwhile
                        for item in await self.complete(pending, reader):
                            yield item
                    await reader.until(own)
                    await self.check_cut(stripe)
                transfers = self.prepare(stripe)
                await group.finish(functools.partial(self.gate, reader, transfers, stripe.owner))
                nbytes = 0 if own is None else own.nbytes
                pending.append(_Pending(transfers, plan.done[me][which], nbytes, stripe.owner))
                await anyio.lowlevel.checkpoint()  # a cancellation, asyncio's own too, comes here
            while pending and (
                not pending[0].transfers or sum(1 for p in pending if p.transfers) > WINDOW_STRIPES
            ):
                for item in await self.complete(pending, reader):
                    yield item
        while pending:
            for item in await self.complete(pending, reader):
                yield item
        await group.agree()

    async def check_cut(self, stripe: Stripe) -> None:
        """Check each tensor of ``stripe`` (owned and read here) that this rank cuts a slice of
        for a rank that checks digests (a slice has no digest of its own), before anything is
        cut or sent: a mismatch fails the group at the stripe's gate. This rank reads the
        header's digests for it even if it does not check its own tensors."""
        for piece in stripe.pieces:
            if any(part is not None and self.checking[r] for r, part in piece.targets):
                if self.digests is None:
                    self.digests = Digests.from_header(self.header)
                if self.digests is not None:
                    await self.check(piece.index, self.own_bytes(piece.index))
                    self.checked.add(piece.index)

    def prepare(self, stripe: Stripe) -> list[_Transfer]:
        """The collectives that move ``stripe``'s bytes, their memory found (before the gate:
        what fails here is told there), none begun."""
        group = self.group
        dist = group.dist
        me = group.rank
        owner = group.global_rank(stripe.owner)
        transfers = []
        for piece in stripe.pieces:
            if not piece.targets:  # every rank wants it whole: broadcast from the owner
                raw = self.buffer(piece.index, None)[piece.lo : piece.hi]
                view = self.comm(raw)
                back = (view, raw) if group.cuda and stripe.owner != me else None
                start = functools.partial(
                    dist.broadcast, view, src=owner, group=group.group, async_op=True
                )
                transfers.append(_Transfer(start, view, back))
            elif stripe.owner == me:  # sent point to point: whole or each rank's slice
                transfers.extend(self.send(piece))
            else:
                for rank, wanted in piece.targets:
                    if rank == me:
                        raw = self.buffer(piece.index, wanted)
                        view = self.comm(raw)
                        start = functools.partial(
                            dist.irecv, view, src=owner, group=group.group, tag=piece.index
                        )
                        transfers.append(
                            _Transfer(start, view, (view, raw) if group.cuda else None)
                        )
        return transfers

    async def gate(self, reader: _Reader, transfers: list[_Transfer], owner: int) -> None:
        """Meet the group at a stripe's gate (``reader`` reading ahead meanwhile), then begin
        its ``transfers``: both or neither, whatever cancellation comes (see
        :meth:`RankGroup.finish`), as every rank's next collective after a gate is the
        stripe's."""
        await reader.during(self.group.agree)
        await self.issue(transfers, owner)

    async def issue(self, transfers: list[_Transfer], owner: int) -> None:
        """Begin ``transfers`` (every rank has passed the gate); :class:`RankLostError` if the
        group cannot take them."""
        try:
            for transfer in transfers:
                transfer.work = transfer.start()
        except RuntimeError as exc:
            raise await anyio.to_thread.run_sync(self.group.lost, exc, owner) from None

    def send(self, piece: Piece) -> list[_Transfer]:
        """The owner's side of a tensor sent point to point (its own slice copied here), none
        begun."""
        group = self.group
        info = self.tensors[piece.index]
        raw = self.own_bytes(piece.index)
        transfers = []
        for rank, wanted in piece.targets:
            if wanted is None:
                part = raw
            else:
                dim, number, parts = wanted
                lo, hi = slice_bounds(info.shape[dim], number, parts)
                array = raw.view(info.array_dtype).reshape(info.array_shape)
                cut = np.ascontiguousarray(np.take(array, np.arange(lo, hi), axis=dim))
                part = cut.reshape(-1).view(np.uint8)
                if rank == group.rank:
                    self.buffer(piece.index, wanted)[:] = part
            if rank != group.rank:
                view = self.comm(part)
                send = functools.partial(
                    group.dist.isend,
                    view,
                    dst=group.global_rank(rank),
                    group=group.group,
                    tag=piece.index,
                )
                transfers.append(_Transfer(send, (view, part)))
        self.buffers.pop((piece.index, SCRATCH), None)  # alive in the transfers until sent
        return transfers

    async def settle(self, step: _Pending) -> None:
        """Wait for ``step``'s transfers (those begun), bringing their bytes to the host."""
        for transfer in step.transfers:
            if transfer.work is not None:
                await self.group.wait(transfer.work, step.source)
                transfer.work = None
                if transfer.back is not None:
                    transfer.back[1][:] = transfer.back[0].cpu().numpy()

    async def check(self, index: int, raw: np.ndarray[Any, Any]) -> None:
        """Check tensor ``index`` (its bytes ``raw``) against its digest. On a mismatch,
        :class:`IntegrityError` naming the source at fault, and the rank whose read it was kept
        in :attr:`bad` for the group to name: this rank's source if it read every byte, the
        owner's if one other rank did; if several did, this rank reads the tensor again from
        its own source and, if that matches the digest, names the first rank whose bytes differ
        from it (else its own source, damaged too)."""
        assert self.digests is not None
        name = self.tensors[index].name
        me = self.group.rank
        readers = sorted({owner for _, _, owner in self.pieces.get(index, [(0, 0, me)])})
        try:
            await self.digests.check_view(name, raw, self.stream.source.name)
            return
        except IntegrityError as exc:
            if readers == [me]:
                self.bad = (exc, None)
                raise
        named = readers[0] if len(readers) == 1 else await self.differing(index, raw)
        where = self.stream.source.name if named in (None, me) else f"rank {named}'s source"
        try:
            await self.digests.check_view(name, raw, where)
        except IntegrityError as exc:
            self.bad = (exc, None if named == me else named)
            raise

    async def differing(self, index: int, raw: np.ndarray[Any, Any]) -> int | None:
        """The first rank whose share of tensor ``index``'s bytes differs from this rank's own
        read of them, if that read matches the tensor's digest; else None."""
        assert self.digests is not None
        info = self.tensors[index]
        source = self.stream.source
        start = self.header.data_start + info.start
        hasher = self.digests.hasher()
        chunk = fresh_bytes(min(READ_CHUNK, info.nbytes))
        differ: list[int] = []
        for lo, hi, owner in self.pieces[index]:
            for at in range(lo, hi, len(chunk)):
                count = min(len(chunk), hi - at)
                if await source.read_into_at(start + at, chunk.data[:count]) < count:
                    return None
                await hash_view(hasher, chunk.data[:count])
                if differ[-1:] != [owner] and not np.array_equal(
                    chunk[:count], raw[at : at + count]
                ):
                    differ.append(owner)
        try:
            self.digests.check(info.name, hasher)
        except IntegrityError:
            return None
        return differ[0] if differ else None

    async def complete(self, pending: deque[_Pending], reader: _Reader) -> list[tuple[str, Any]]:
        """Wait for the first pending step's transfers (``reader`` reading ahead meanwhile),
        then the tensors to hand out (each checked against its digest, if the header records
        one): those it completed, in offset order, each once every earlier wanted tensor is out.

        A stripe may span a tensor this rank reads alone (the plan, every rank's, does not cut
        stripes where some rank's own reads fall: each cut would cost the group a gate), and
        steps go in the offset order of their first bytes: such a stripe completes before that
        tensor's step, and its tensors after it are held here until it is handed out. Stripes
        do not overlap, so what is held at once is of one stripe: at most what it brought this
        rank, memory its exchange held anyway."""
        step = pending[0]
        await reader.during(functools.partial(self.settle, step))
        pending.popleft()
        reader.give(step.owned)
        for index, wanted in step.ready:
            info = self.tensors[index]
            raw = self.buffers.pop((index, wanted), None)
            if raw is None:  # an empty tensor
                raw = self.buffer(index, wanted)
                del self.buffers[(index, wanted)]
            shape = info.array_shape if wanted is None else slice_shape(info, wanted)
            array = raw.view(info.array_dtype).reshape(shape)
            if self.checks and wanted is None and index not in self.checked:
                await self.check(index, raw)
            if wanted is None:
                value = self.delivery.deliver(info, array, index in self.placed)
            else:
                part = Delivery("pt" if self.delivery.torch else "np")
                value = part.deliver(info, array, False, slice_shape(info, wanted))
            device = self.group.out_device
            if device is not None and self.group.torch.is_tensor(value):
                value = value.to(device)
            self.held[index] = (info.name, value)
        items = []
        while self.due and self.due[0] in self.held:
            items.append(self.held.pop(self.due.popleft()))
        return items

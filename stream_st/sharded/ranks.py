"""Loading over a ``torch.distributed`` process group: N ranks read each byte once.

``stream_st.torch.load_file(src, process_group=pg)``, ``load_model(model, src,
process_group=pg)`` and ``open_stream(src, framework="pt", process_group=pg)`` run here. Every
rank of ``pg`` makes the same call (same source, in the same order as its other collective
calls); each reads the header itself, then:

* **What each rank wants.** ``include=`` (names or a predicate, may differ per rank) and
  ``slices=`` (name -> ``(dim, part, parts)``, or a function of the name giving that or None:
  this rank wants part ``part`` of ``parts`` of the tensor along ``dim``, split as
  ``numpy.array_split`` / ``torch.tensor_split`` split it) are resolved against the header and
  gathered, so every rank computes the same plan (:func:`plan_exchange`).
* **Who reads what.** A tensor every rank wants whole is *shared*: its bytes are cut into
  stripes, contiguous runs of at most :data:`STRIPE_BYTES` (fewer for small files, so every rank
  gets some), dealt to the ranks in turn, balanced by bytes; each stripe's owner reads it from
  the source and broadcasts it. A tensor one rank only wants whole is read by that rank alone,
  nothing exchanged. A slice that is contiguous in the file (``dim`` 0, or every dimension before
  ``dim`` of size 1) is read by its rank alone, its bytes only. A tensor that several (but not
  all) ranks want whole, or that some rank wants a non-contiguous slice of, is read whole by its
  stripe's owner and sent point to point: the whole tensor to those who want it whole, each
  slice to the rank that wants it (a scatter of unequal parts), never the whole tensor to them.
* **Pipelined, in offset order.** Each rank reads its own stripes ahead (at most
  :data:`READ_AHEAD_BYTES`) while the group exchanges earlier ones; at most
  :data:`WINDOW_STRIPES` stripes are in flight at once, and tensors are handed out in the
  file's offset order as their last bytes arrive. Memory per rank beyond what the caller keeps:
  those stripes and the read-ahead, not the model twice.
* **Failure.** Before each stripe's bytes are exchanged, the group agrees that every rank is
  well (a small ``all_reduce``); a rank whose source failed, whose selection was wrong, or whose
  check of a digest failed says so there, and every rank raises :class:`RankFailedError` naming
  that rank and the cause. A rank that dies makes the collectives fail on the others, which raise
  :class:`RankLostError` naming it (ranks on the same host are looked up by process id), within
  the process group's timeout at most. A load (:func:`load`, :func:`load_model`) returns only
  after a last such agreement, so no rank returns a partial model.

With NCCL (the group's backend), bytes are exchanged on the current CUDA device and tensors are
handed out there; with gloo, on the CPU. A local file is read by every rank from its own file
system (each reads only its share); a sharded checkpoint's index is read by every rank and its
shards are taken one after another, each as above.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np

from .._util import task_group
from ..core.arrays import load_torch
from ..core.digests import Digests
from ..core.header import DEFAULT_MAX_HEADER_SIZE, Header, TensorInfo
from ..core.shards import is_index, shard_address
from ..errors import (
    RankFailedError,
    RankLostError,
    SafetensorsError,
    TensorNotFoundError,
    UsageError,
)
from ..memory.delivery import Delivery
from ..memory.fresh import fresh_bytes
from ..reader import Include, TensorStream, merge_ranges
from ..transports.options import Clock
from ..transports.registry import SourceLike
from .reader import ShardIndex

if TYPE_CHECKING:
    import torch

__all__ = [
    "READ_AHEAD_BYTES",
    "STRIPE_BYTES",
    "WINDOW_STRIPES",
    "DistributedStream",
    "Plan",
    "Slice",
    "Slices",
    "load",
    "load_model",
    "plan_exchange",
]

Slice = tuple[int, int, int]
"""``(dim, part, parts)``: part ``part`` of ``parts`` of a tensor along ``dim``."""

Slices = Mapping[str, Slice] | Callable[[str], Slice | None]
"""Which tensors a rank wants a slice of: a mapping of names, or a function of the name."""

STRIPE_BYTES = 16 << 20
"""Shared bytes are dealt to the ranks in runs of at most this many bytes."""

MIN_STRIPES_PER_RANK = 4
"""A small file's stripes are made smaller so that each rank owns about this many."""

READ_AHEAD_BYTES = 64 << 20
"""A rank reads its own stripes at most this many bytes ahead of the exchange (or one stripe)."""

WINDOW_STRIPES = 3
"""Stripes whose bytes are being exchanged at once; tensors are handed out as they complete."""

MESSAGE_BYTES = 2048
"""A failing rank's message travels to the others in this many bytes (UTF-8, cut short)."""


# --------------------------------------------------------------------------------------------
# The plan: pure functions over the header and every rank's wants, the same on every rank.


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[lo, hi)`` of tensor ``index`` that the stripe's owner reads. ``targets`` empty:
    broadcast to every rank (they all want the tensor whole); else the whole tensor (``lo`` 0,
    ``hi`` its size) sent to each target rank: the whole tensor (slice None) or that slice."""

    index: int
    lo: int
    hi: int
    targets: tuple[tuple[int, Slice | None], ...] = ()


@dataclass(slots=True)
class Stripe:
    """A run of pieces one rank (``owner``) reads and hands to the others, in offset order."""

    owner: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(piece.hi - piece.lo for piece in self.pieces)


@dataclass(slots=True)
class Plan:
    """Who reads what. ``stripes``: the shared bytes, in offset order, the same on every rank.
    ``direct[r]``: what rank ``r`` reads alone, ``(tensor index, slice or None)``. ``done[r]``:
    for each stripe, what rank ``r`` hands out once that stripe is exchanged."""

    stripes: list[Stripe]
    direct: list[list[tuple[int, Slice | None]]]
    done: list[list[list[tuple[int, Slice | None]]]]

    def owned_bytes(self, rank: int) -> int:
        """Bytes of shared stripes that ``rank`` reads."""
        return sum(stripe.nbytes for stripe in self.stripes if stripe.owner == rank)


def slice_bounds(length: int, part: int, parts: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``part`` of ``parts`` of ``length`` items, as
    ``numpy.array_split`` cuts them (the first ``length % parts`` parts one item longer)."""
    quotient, remainder = divmod(length, parts)
    start = part * quotient + min(part, remainder)
    return start, start + quotient + (1 if part < remainder else 0)


def check_slice(info: TensorInfo, wanted: object) -> Slice:
    """``wanted`` as a valid :data:`Slice` of ``info``; :class:`UsageError` if it is not one."""
    if not (
        isinstance(wanted, tuple)
        and len(wanted) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) for x in wanted)
    ):
        raise UsageError(
            f"slices= for {info.name!r} must be (dim, part, parts) integers, got {wanted!r}"
        )
    dim, part, parts = wanted
    if not info.shape:
        raise UsageError(f"slices= for {info.name!r}: a scalar has no dimension to split")
    if dim < 0:
        dim += len(info.shape)
    if not 0 <= dim < len(info.shape) or parts < 1 or not 0 <= part < parts:
        raise UsageError(
            f"slices= for {info.name!r}: {wanted!r} is not a part of shape {list(info.shape)}"
        )
    if info.array_shape != info.shape:
        raise UsageError(f"slices= for {info.name!r}: packed {info.dtype} cannot be sliced")
    return dim, part, parts


def slice_shape(info: TensorInfo, wanted: Slice) -> tuple[int, ...]:
    """The shape of ``wanted``'s part of ``info``."""
    dim, part, parts = wanted
    start, stop = slice_bounds(info.shape[dim], part, parts)
    return (*info.shape[:dim], stop - start, *info.shape[dim + 1 :])


def contiguous_span(info: TensorInfo, wanted: Slice) -> tuple[int, int] | None:
    """Where ``wanted``'s part of ``info`` lies in the tensor's bytes, ``[lo, hi)``, if it is one
    contiguous run (every dimension before ``dim`` of size 1); else None."""
    dim, part, parts = wanted
    if math.prod(info.shape[:dim]) != 1:
        return None
    start, stop = slice_bounds(info.shape[dim], part, parts)
    inner = math.prod(info.shape[dim + 1 :]) * info.array_dtype.itemsize
    return start * inner, stop * inner


def stripe_size(shared_bytes: int, world: int) -> int:
    """How many bytes a stripe holds at most: :data:`STRIPE_BYTES`, or less so that each rank
    owns about :data:`MIN_STRIPES_PER_RANK` of a small file's stripes."""
    return max(1, min(STRIPE_BYTES, -(-shared_bytes // (world * MIN_STRIPES_PER_RANK))))


def plan_exchange(
    tensors: Sequence[TensorInfo],
    wants: Sequence[Mapping[int, Slice | None]],
    stripe: int | None = None,
) -> Plan:
    """The plan for ``tensors`` (in offset order) when rank ``r`` wants ``wants[r]``: tensor
    index -> None (the whole tensor) or a slice. ``stripe`` overrides :func:`stripe_size`."""
    world = len(wants)
    direct: list[list[tuple[int, Slice | None]]] = [[] for _ in range(world)]
    shared: list[tuple[int, tuple[tuple[int, Slice | None], ...] | None]] = []
    for index, info in enumerate(tensors):
        asking = [(rank, want[index]) for rank, want in enumerate(wants) if index in want]
        if not asking:
            continue
        whole = [rank for rank, wanted in asking if wanted is None]
        apart = [(rank, wanted) for rank, wanted in asking if wanted is not None]
        scattered: list[tuple[int, Slice | None]] = [
            (r, w) for r, w in apart if contiguous_span(info, w) is None
        ]
        for rank, wanted in apart:
            if contiguous_span(info, wanted) is not None or info.nbytes == 0:
                direct[rank].append((index, wanted))
        if info.nbytes == 0:  # nothing to exchange: everyone makes its own empty tensor
            for rank in whole:
                direct[rank].append((index, None))
        elif world > 1 and len(whole) == world:
            shared.append((index, None))
        elif len(whole) + len(scattered) >= 2 or scattered:
            sent: list[tuple[int, Slice | None]] = [(rank, None) for rank in whole]
            shared.append((index, tuple(sorted(sent + scattered, key=lambda each: each[0]))))
        elif whole:
            direct[whole[0]].append((index, None))
    total = sum(tensors[index].nbytes for index, _ in shared)
    size = stripe or stripe_size(total, world)
    stripes: list[Stripe] = []
    done: list[list[list[tuple[int, Slice | None]]]] = [[] for _ in range(world)]

    def add(owner: int, piece: Piece) -> None:
        if not stripes or stripes[-1].owner != owner:
            stripes.append(Stripe(owner))
            for each in done:
                each.append([])
        stripes[-1].pieces.append(piece)

    counted = 0
    for index, to in shared:
        nbytes = tensors[index].nbytes
        if to is None:  # broadcast: cut at every multiple of the stripe size
            lo = 0
            while lo < nbytes:
                hi = min(nbytes, (((counted + lo) // size) + 1) * size - counted)
                add(((counted + lo) // size) % world, Piece(index, lo, hi))
                lo = hi
            for each in done:
                each[-1].append((index, None))
        else:
            add(((counted + nbytes // 2) // size) % world, Piece(index, 0, nbytes, to))
            for rank, part in to:
                done[rank][-1].append((index, part))
        counted += nbytes
    return Plan(stripes, direct, done)


# --------------------------------------------------------------------------------------------
# The group: collectives awaited off the event loop, failures told apart.


class _Group:
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


# --------------------------------------------------------------------------------------------
# One file read by the group.


def _header_digest(header: Header) -> str:
    """What every rank must agree on: the tensor table and where the data starts."""
    table = [(t.name, t.dtype, t.shape, t.start, t.end) for t in header.tensors]
    return hashlib.sha256(repr((header.data_start, table)).encode()).hexdigest()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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


class _File:
    """The group's read of one safetensors file, open on this rank as ``stream``."""

    def __init__(
        self,
        group: _Group,
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
            failure = _describe(exc)
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
                    failure = _describe(exc)
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
                    self.failure = _describe(exc)
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


# --------------------------------------------------------------------------------------------
# The stream and the loads.


def _selected(include: Include) -> Callable[[str], bool]:
    if include is None:
        return lambda name: True
    if callable(include):
        return include
    names = {include} if isinstance(include, str) else set(include)
    return names.__contains__


def _slice_of(slices: Slices | None) -> Callable[[str], object]:
    if slices is None:
        return lambda name: None
    if callable(slices):
        return slices
    if not isinstance(slices, Mapping):
        raise UsageError(f"slices= takes a mapping or a function, got {type(slices).__name__}")
    return slices.get


class DistributedStream(TensorStream):
    """A safetensors file (or a sharded checkpoint's index) read by every rank of a process
    group together; made by :func:`~stream_st.open_stream` given ``process_group=``. Use it as
    any :class:`~stream_st.TensorStream`: each rank gets ``(name, tensor)`` for what it wants, in
    offset order (shard after shard). Every rank must read its stream to the end (or leave it on
    an error): the group moves in step. See the module for who reads what."""

    def __init__(
        self,
        source: SourceLike,
        *,
        process_group: Any,
        include: Include = None,
        slices: Slices | None = None,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        verify: bool = True,
        clock: Clock | None = None,
        delivery: Delivery | None = None,
        device: Any = None,
    ) -> None:
        super().__init__(
            source,
            max_header_size=max_header_size,
            verify=verify,
            clock=clock,
            delivery=delivery,
        )
        self._group = _Group(process_group, device)
        self._selected = _selected(include)
        self._names = (
            None if include is None or callable(include) else set(self._selected_names(include))
        )
        self._slice = _slice_of(slices)
        self._slices = slices
        self._index_address = os.fspath(source) if is_index(source) else None
        self._index: ShardIndex | None = None
        self._shard: TensorStream | None = None
        self._group_opened = False
        self._found: set[str] = set()
        self.headers: dict[str, Header] = {}
        self.plan: Plan | None = None
        self.session = ""

    @staticmethod
    def _selected_names(include: Include) -> list[str]:
        if isinstance(include, str):
            return [include]
        return [] if include is None or callable(include) else list(include)

    @property
    def header(self) -> Header:
        """The header of the file (of the shard being read, for an index)."""
        if self._index_address is None:
            return super().header
        if self._shard is None or self._shard._header is None:
            raise UsageError("a sharded stream has one header per shard: see .headers")
        return self._shard._header

    def _opened(self) -> bool:
        return self._group_opened

    async def open(self, *, read_all: bool = False) -> Header:
        """Open the source and read its header (an index: read it) on every rank, and agree on
        it with the group: a rank that fails makes every rank raise :class:`RankFailedError`."""
        if self._group_opened:
            return self._header or Header.from_tensors((), {}, 0)
        if self._closed:
            raise UsageError("the stream is closed")
        self._group_opened = True
        failure: str | None = None
        try:
            if self._index_address is None:
                await super().open()
            else:
                self._clock.start()
                self._index = await ShardIndex.read(self._index_address, self._clock)
                self._check_names(set(self._index.weight_map or ()) or None)
        except SafetensorsError as exc:
            failure = _describe(exc)
        group = self._group
        hello = (socket.gethostname(), os.getpid(), secrets.token_hex(8), failure)
        try:
            everyone = await group.gather(hello)
            group.peers = [(host, pid) for host, pid, _, _ in everyone]
            self.session = everyone[0][2]
            _raise_first(everyone, lambda each: each[3])
        except BaseException:
            await self.aclose()
            raise
        return self._header or Header.from_tensors((), {}, 0)

    def _check_names(self, present: set[str] | None) -> None:
        """:class:`TensorNotFoundError` for ``include=`` or ``slices=`` names not in ``present``
        (all of a file's or an index's names; None: not known up front)."""
        if present is None:
            return
        named = set(self._names or ())
        if isinstance(self._slices, Mapping):
            named |= set(self._slices)
        missing = sorted(named - present)
        if missing:
            raise TensorNotFoundError(
                f"include= or slices= name tensors not in the source: {missing}"
            )

    def _wants(self, header: Header) -> dict[int, Slice | None]:
        """What this rank wants of ``header``'s tensors: index -> None (whole) or a slice."""
        wants: dict[int, Slice | None] = {}
        for index, info in enumerate(header.tensors):
            if self._selected(info.name):
                wanted = self._slice(info.name)
                wants[index] = None if wanted is None else check_slice(info, wanted)
        return wants

    async def _exchange(
        self, stream: TensorStream | None, failure: str | None
    ) -> AsyncGenerator[tuple[str, Any]]:
        """One file read by the group: agree on its header and who wants what, then run the
        plan. ``failure``: opening it failed on this rank."""
        group = self._group
        wants: dict[int, Slice | None] = {}
        digest = None
        if stream is not None and failure is None:
            try:
                header = stream.header
                if self._index_address is None:
                    self._check_names(set(header.names()))
                wants = self._wants(header)
                digest = _header_digest(header)
            except SafetensorsError as exc:
                failure = _describe(exc)
        everyone = await group.gather((digest, wants, failure))
        _raise_first(everyone, lambda each: each[2])
        for rank, (other, _, _) in enumerate(everyone):
            if other != everyone[0][0]:
                cause = "its header differs from rank 0's (not the same file)"
                raise RankFailedError(f"rank {rank} failed: {cause}", rank=rank, cause=cause)
        assert stream is not None
        plan = self.plan = plan_exchange(stream.header.tensors, [each[1] for each in everyone])
        file = _File(group, stream, wants, self._delivery, self._verify)
        async with contextlib.aclosing(file.run(plan)) as items:
            async for item in items:
                self._found.add(item[0])
                yield item
                del item

    async def _iterate(self) -> AsyncGenerator[tuple[str, Any]]:
        owns = not self._group_opened
        await self.open()
        try:
            if self._index_address is None:
                async with contextlib.aclosing(self._exchange(self, None)) as items:
                    async for item in items:
                        yield item
                        del item
                return
            index = self._index
            assert index is not None
            for shard in index.shards:
                address = shard_address(index.home, shard)
                stream = self._shard = TensorStream(
                    address, max_header_size=self._max_header_size, clock=self._clock
                )
                failure = None
                try:
                    self.headers[shard] = await stream.open()
                    index.check(shard, address, stream.header)
                except SafetensorsError as exc:
                    failure = _describe(exc)
                try:
                    async with contextlib.aclosing(self._exchange(stream, failure)) as items:
                        async for item in items:
                            yield item
                            del item
                finally:
                    self._shard = None
                    await stream.aclose()
        finally:
            if owns:
                self._generator = None
                await self.aclose()

    async def aclose(self) -> None:
        shard, self._shard = self._shard, None
        if shard is not None:
            await shard.aclose()
        await super().aclose()


def _raise_first(everyone: list[Any], failure_of: Callable[[Any], str | None]) -> None:
    """:class:`RankFailedError` for the first rank whose gathered value holds a failure."""
    for rank, each in enumerate(everyone):
        cause = failure_of(each)
        if cause is not None:
            raise RankFailedError(f"rank {rank} failed: {cause}", rank=rank, cause=cause)


async def load(
    source: SourceLike,
    process_group: Any,
    *,
    include: Include = None,
    slices: Slices | None = None,
    verify: bool = True,
    clock: Clock | None = None,
    device: Any = None,
    into: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every tensor this rank wants of ``source`` as ``{name: torch tensor}`` (a sliced one: its
    slice), read with the group (see the module); returned on every rank only once every rank
    has all it wants."""
    stream = DistributedStream(
        source,
        process_group=process_group,
        include=include,
        slices=slices,
        verify=verify,
        clock=clock,
        delivery=Delivery("pt", into, exact=False, writable=True),
        device=device,
    )
    return {name: tensor async for name, tensor in stream}


def load_model(
    model: torch.nn.Module,
    source: SourceLike,
    process_group: Any,
    *,
    strict: bool = True,
    include: Include = None,
    slices: Slices | None = None,
    verify: bool = True,
    clock: Clock | None = None,
    device: Any = None,
) -> tuple[set[str], list[str]]:
    """Load ``source`` into ``model`` with the group; ``(missing, unexpected)`` names as
    :func:`stream_st.torch.load_model` gives them. Tensors that fit the model's CPU memory
    (dtype, shape) are received straight into it; the others (slices among them) go through
    ``model.load_state_dict``. Names ``include=`` leaves out are not missing."""
    from ..compat._shared import remove_duplicate_names
    from ..compat._sync import run

    state = model.state_dict()
    into = {
        name: tensor
        for name, tensor in state.items()
        if tensor.device.type == "cpu" and not tensor.is_meta and tensor.is_contiguous()
    }
    loaded = run(
        functools.partial(
            load,
            source,
            process_group,
            include=include,
            slices=slices,
            verify=verify,
            clock=clock,
            device=device,
            into=into,
        )
    )
    placed = {name for name, tensor in loaded.items() if tensor is into.get(name)}
    fresh = {name: tensor for name, tensor in loaded.items() if name not in placed}
    missing_list, unexpected = model.load_state_dict(fresh, strict=False)
    selected = _selected(include)
    missing = {name for name in missing_list if name not in placed and selected(name)}
    for dropped in remove_duplicate_names(state, preferred_names=loaded).values():
        for name in dropped:
            if name in missing:  # stood for by the name kept
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        lines = [f"Error(s) in loading state_dict for {type(model).__name__}:"]
        if missing:
            lines.append(
                "    Missing key(s) in state_dict: " + ", ".join(f'"{n}"' for n in sorted(missing))
            )
        if unexpected:
            lines.append(
                "    Unexpected key(s) in state_dict: "
                + ", ".join(f'"{n}"' for n in sorted(unexpected))
            )
        raise UsageError("\n".join(lines))
    return missing, unexpected

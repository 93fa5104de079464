"""The plan of a group load (see :mod:`.ranks`): pure functions over a header's tensors and every
rank's wants, the same on every rank. No torch, no I/O."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..core.header import TensorInfo
from ..errors import UsageError

__all__ = [
    "MIN_STRIPES_PER_RANK",
    "STRIPE_BYTES",
    "Piece",
    "Plan",
    "Slice",
    "Slices",
    "Stripe",
    "check_slice",
    "contiguous_span",
    "plan_exchange",
    "slice_bounds",
    "slice_shape",
    "stripe_size",
]

Slice = tuple[int, int, int]
"""``(dim, part, parts)``: part ``part`` of ``parts`` of a tensor along ``dim``."""

Slices = Mapping[str, Slice] | Callable[[str], Slice | None]
"""Which tensors a rank wants a slice of: a mapping of names, or a function of the name."""

STRIPE_BYTES = 16 << 20
"""Shared bytes are dealt to the ranks in runs of at most this many bytes."""

MIN_STRIPES_PER_RANK = 4
"""A small file's stripes are made smaller so that each rank owns about this many."""


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
    checked: Sequence[bool] | None = None,
) -> Plan:
    """The plan for ``tensors`` (in offset order) when rank ``r`` wants ``wants[r]``: tensor
    index -> None (the whole tensor) or a slice. ``stripe`` overrides :func:`stripe_size`.
    ``checked[r]``: rank ``r`` checks digests, so its slices, contiguous ones too, are cut by an
    owner that reads (and checks) the whole tensor, never read alone (a part has no digest).
    The owner of a tensor sent point to point cuts its own contiguous slice from the whole it
    reads, rather than reading those bytes again alone."""
    world = len(wants)
    checked = checked or [False] * world
    direct: list[list[tuple[int, Slice | None]]] = [[] for _ in range(world)]
    alone: dict[tuple[int, int], Slice] = {}  # (rank, tensor): a contiguous slice read alone
    shared: list[tuple[int, tuple[tuple[int, Slice | None], ...] | None]] = []
    for index, info in enumerate(tensors):
        asking = [(rank, want[index]) for rank, want in enumerate(wants) if index in want]
        if not asking:
            continue
        whole = [rank for rank, wanted in asking if wanted is None]
        apart = [(rank, wanted) for rank, wanted in asking if wanted is not None]
        scattered: list[tuple[int, Slice | None]] = []
        for rank, wanted in apart:
            cut = checked[rank] or contiguous_span(info, wanted) is None  # by a whole's owner
            if cut:
                scattered.append((rank, wanted))
            if not cut or info.nbytes == 0:
                direct[rank].append((index, wanted))
                alone[(rank, index)] = wanted
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

    cut_by_owner: set[tuple[int, int]] = set()  # (rank, tensor) of ``alone`` it owns after all
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
            owner = ((counted + nbytes // 2) // size) % world
            own = alone.get((owner, index))
            if own is not None:  # it reads the tensor whole: its slice is cut from it
                cut_by_owner.add((owner, index))
                to = tuple(sorted(((owner, own), *to), key=lambda each: each[0]))
            add(owner, Piece(index, 0, nbytes, to))
            for rank, part in to:
                done[rank][-1].append((index, part))
        counted += nbytes
    for rank, reads in enumerate(direct):
        reads[:] = [each for each in reads if (rank, each[0]) not in cut_by_owner]
    return Plan(stripes, direct, done)

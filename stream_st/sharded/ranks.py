"""Loading over a ``torch.distributed`` process group: N ranks read each byte once.

``stream_st.torch.load_file(src, process_group=pg)``, ``load_model(model, src,
process_group=pg)`` and ``open_stream(src, framework="pt", process_group=pg)`` run here. Every
rank of ``pg`` makes the same call (same source, in the same order as its other collective
calls); each reads the header itself, then:

* **What each rank wants.** ``include=`` (names or a predicate, may differ per rank) and
  ``slices=`` (name -> ``(dim, part, parts)``, or a function of the name giving that or None:
  this rank wants part ``part`` of ``parts`` of the tensor along ``dim``, split as
  ``numpy.array_split`` / ``torch.tensor_split`` split it) are resolved against the header and
  gathered, with whether the rank checks digests, so every rank computes the same plan
  (:func:`plan_exchange`).
* **Who reads what.** A tensor every rank wants whole is *shared*: its bytes are cut into
  stripes, contiguous runs of at most :data:`STRIPE_BYTES` (fewer for small files, so every rank
  gets some), dealt to the ranks in turn, balanced by bytes; each stripe's owner reads it from
  the source and broadcasts it. A tensor one rank only wants whole is read by that rank alone,
  nothing exchanged. A slice that is contiguous in the file (``dim`` 0, or every dimension before
  ``dim`` of size 1) is read by its rank alone, its bytes only, unless that rank checks digests
  (a part cannot be checked). A tensor that several (but not all) ranks want whole, or that some
  rank wants any other slice of, is read whole by its stripe's owner and sent point to point:
  the whole tensor to those who want it whole, each slice to the rank that wants it (a scatter
  of unequal parts), never the whole tensor to them. The owner checks the whole tensor against
  its digest before cutting or sending it, if any rank it cuts a slice for checks digests.
* **Pipelined, in offset order.** Each rank reads its own stripes ahead (at most
  :data:`READ_AHEAD_BYTES`) while it waits for the group to exchange earlier ones; at most
  :data:`WINDOW_STRIPES` stripes are in flight at once, and tensors are handed out in the
  file's offset order as their last bytes arrive. Memory per rank beyond what the caller keeps:
  those stripes and the read-ahead, not the model twice.
* **Failure.** Before each stripe's bytes are exchanged, and at the end, the group agrees that
  every rank is well (one ``all_reduce`` of :data:`MESSAGE_BYTES` per rank, carrying each
  rank's word). Whatever goes wrong on one rank (its source, memory, its selection or another
  argument, its ``include=`` function, a digest, its consumer leaving the stream before the end,
  a cancellation) is told to the others at once: at the gather of headers and wants if it
  happens before any byte of the file moves (of a shard: since the last gate of the shard
  before, its closing included), else at their next gate, where this rank meets them after
  waiting for the transfers it has begun. Every rank then raises :class:`RankFailedError`
  naming that rank and the cause (on that rank, chained to its own error; a consumer that left,
  or a cancellation, gets its own exception back); bytes found bad against their digest name
  the rank that read them (see :meth:`.FileExchange.check`). A rank that dies makes the
  collectives fail on the others, which raise :class:`RankLostError` naming it (ranks on the
  same host are looked up by process id), within the process group's timeout at most. A load
  (:func:`load`, :func:`load_model`) returns only after a last such agreement, so no rank
  returns a partial model.
* **Caps.** ``max_tensor_bytes`` and ``max_total_bytes`` (or those
  :func:`~stream_st.reader.caps.using_caps` set) are gathered with the wants: each rank's wanted
  tensors (a sliced one counted whole, as it may be read whole to be cut) are checked against
  that rank's caps, on every rank alike, before anything is allocated; a file over one rank's
  caps makes every rank raise the same :class:`~stream_st.AllocationError`, naming that rank.

With NCCL (the group's backend), bytes are exchanged on the current CUDA device and tensors are
handed out there; with gloo, on the CPU. Nothing is shared but the collectives: every rank opens
the source itself (the same URL, or a path to its own copy of the file on its own host) and only
headers, wants and bytes travel between ranks, so ranks may be on different hosts; the group
checks that every rank's header is the same. A sharded checkpoint's index is read by every rank
and its shards are taken one after another, each as above.

The plan is :mod:`.ranks_plan` (pure, no torch), the group's collectives and failure checks
:mod:`.ranks_group`, one file's read and exchange :mod:`.ranks_exchange`; their public names are
importable from here too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from ..core.digests import Digests
from ..core.header import DEFAULT_MAX_HEADER_SIZE, Header
from ..core.shards import is_index, shard_address
from ..errors import (
    RankFailedError,
    SafetensorsError,
    TensorNotFoundError,
    UsageError,
    some_names,
)
from ..memory.delivery import Delivery
from ..reader import Include, TensorStream
from ..reader.caps import Caps, current_caps
from ..reader.stream import TensorT, include_names, listed, tensor_dict
from ..transports.options import Clock
from ..transports.registry import SourceLike
from .ranks_exchange import READ_AHEAD_BYTES as READ_AHEAD_BYTES
from .ranks_exchange import SCRATCH as SCRATCH
from .ranks_exchange import WINDOW_STRIPES as WINDOW_STRIPES
from .ranks_exchange import FileExchange
from .ranks_group import LOST_LOOKS as LOST_LOOKS
from .ranks_group import LOST_PAUSE as LOST_PAUSE
from .ranks_group import MESSAGE_BYTES as MESSAGE_BYTES
from .ranks_group import Failure, RankGroup
from .ranks_plan import MIN_STRIPES_PER_RANK as MIN_STRIPES_PER_RANK
from .ranks_plan import STRIPE_BYTES as STRIPE_BYTES
from .ranks_plan import Piece as Piece
from .ranks_plan import Plan as Plan
from .ranks_plan import Slice as Slice
from .ranks_plan import Slices as Slices
from .ranks_plan import Stripe as Stripe
from .ranks_plan import check_slice as check_slice
from .ranks_plan import contiguous_span as contiguous_span
from .ranks_plan import plan_exchange as plan_exchange
from .ranks_plan import slice_bounds as slice_bounds
from .ranks_plan import slice_shape as slice_shape
from .ranks_plan import stripe_size as stripe_size
from .reader import ShardIndex, repeated_name

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


def _header_digest(header: Header) -> str:
    """What every rank must agree on: the tensor table, where the data starts and the metadata
    (the digests recorded there among it: an owner checks the bytes it hands on against its own
    header's digests, so every rank's must be the same)."""
    table = [(t.name, t.dtype, t.shape, t.start, t.end) for t in header.tensors]
    metadata = sorted(header.metadata.items())
    return hashlib.sha256(repr((header.data_start, table, metadata)).encode()).hexdigest()


def _index_digest(index: ShardIndex) -> str:
    """What every rank reading an index must agree on: its shards in reading order, where each
    tensor is (an index) or each shard's size (a manifest)."""
    weight_map = sorted((index.weight_map or {}).items())
    table = (index.weight_map is None, index.shards, weight_map, sorted(index.shard_bytes.items()))
    return hashlib.sha256(repr(table).encode()).hexdigest()


def _check_same(everyone: list[tuple[Any, ...]], meaning: str) -> None:
    """:class:`RankFailedError`, on every rank alike, naming the first rank whose digest (the
    last item of its gathered tuple: what it digests, the digest) differs from rank 0's."""
    for rank, each in enumerate(everyone):
        if each[-1] != everyone[0][-1]:
            cause = f"its {each[-1][0]} differs from rank 0's ({meaning})"
            raise RankFailedError(f"rank {rank} failed: {cause}", rank=rank, cause=cause)


def _selected(include: Include) -> Callable[[str], bool]:
    if include is None:
        return lambda name: True
    if callable(include):
        return include
    names = include_names(include)
    return names.__contains__


def _slice_of(slices: Slices | None) -> Callable[[str], object]:
    if slices is None:
        return lambda name: None
    if callable(slices):
        return slices
    if not isinstance(slices, Mapping):
        raise UsageError(f"slices= takes a mapping or a function, got {type(slices).__name__}")
    return slices.get


class DistributedStream(TensorStream[TensorT]):
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
        max_tensor_bytes: int | None = None,
        max_total_bytes: int | None = None,
        unique_names: bool = False,
    ) -> None:
        super().__init__(
            source,
            max_header_size=max_header_size,
            verify=verify,
            clock=clock,
            delivery=delivery,
        )
        self._group = RankGroup(process_group)
        self._selected: Callable[[str], bool] = lambda name: True
        self._names: set[str] | None = None
        # Misuse on one rank is told to the group when it opens: raised here, it would leave
        # the others waiting for this rank until the group's timeout.
        self._problem: Failure | None = None
        self._slice: Callable[[str], object] = lambda name: None
        try:
            include = listed(include)
            if isinstance(include, set):
                self._names = set(include)
            self._selected = _selected(include)
            self._group.hand_out_on(device)
            self._slice = _slice_of(slices)
            if max_tensor_bytes is None and max_total_bytes is None:
                self._caps = current_caps()
            else:
                self._caps = Caps.of(max_tensor_bytes, max_total_bytes)
        except SafetensorsError as exc:
            self._problem = Failure.of(exc)
        self._counted: list[int] = []  # bytes each rank's caps counted, shard after shard
        # For one dict of names (load): each rank's wanted names -> the shard they came from.
        self._unique_names = unique_names
        self._shard_of: list[dict[str, str]] = []
        self._slices = slices
        self._index_address = os.fspath(source) if is_index(source) else None
        self._index: ShardIndex | None = None
        self._shard: TensorStream[Any] | None = None
        self._group_opened = False
        # Opened with the group, its iteration not begun: the group waits for this rank's
        # headers and wants, which aclose then gives, saying this rank left its stream.
        self._owes_wants = False
        self.headers: dict[str, Header] = {}
        self.plan: Plan | None = None

    @classmethod
    def refused(cls, process_group: Any, problem: Exception) -> DistributedStream[Any]:
        """A stream whose open tells the group that this rank's call was refused before it
        began (an option, a value the rank's own checks turned down): every rank then raises
        :class:`RankFailedError` naming this one at once, where raising here would leave the
        others waiting for this rank until the group's timeout. Without a group (None),
        ``problem`` is raised as it is."""
        if process_group is None:
            raise problem
        stream = cls("", process_group=process_group)
        stream._problem = Failure.of(problem)
        return stream

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

    async def _open(self, *, read_all: bool) -> Header:
        """Open the source and read its header (an index: read it) on every rank, and agree on
        it with the group, once: a rank that fails makes every rank raise
        :class:`RankFailedError`. :meth:`open` runs it one task at a time, so a rank joins the
        group's collectives once however many of its tasks open the stream."""
        if self._group_opened:
            return self._header or Header.from_tensors((), {}, 0)
        self._group_opened = True
        failure = self._problem
        digest: tuple[str, str] | None = None
        if failure is None:
            try:
                if self._index_address is None:
                    digest = ("header", _header_digest(await super()._open(read_all=False)))
                else:
                    self._clock.start()
                    index = self._index = await ShardIndex.read(self._index_address, self._clock)
                    if index.weight_map is not None or not index.shards:  # its names known now
                        self._check_names(set(index.weight_map or ()))
                    digest = ("index", _index_digest(self._index))
            except BaseException as exc:  # told to the group first, raised after
                failure = Failure.of(exc)
        group = self._group
        try:
            everyone = await group.gather((socket.gethostname(), os.getpid(), digest), failure)
            group.peers = [(host, pid) for host, pid, _ in everyone]
            _check_same(everyone, "not the same file or index")
        except BaseException:
            await self.aclose()
            raise
        # An index with no shard: the ranks that iterate it gather nothing more.
        self._owes_wants = self._index is None or bool(self._index.shards)
        return self._header or Header.from_tensors((), {}, 0)

    def _check_names(self, present: set[str]) -> None:
        """:class:`TensorNotFoundError` for ``include=``, ``slices=`` or ``into=`` names not in
        ``present`` (all of a file's, an index's or a manifest's names)."""
        self._delivery.check(sorted(present))
        named = set(self._names or ())
        if isinstance(self._slices, Mapping):
            named |= set(self._slices)
        missing = sorted(named - present)
        if missing:
            raise TensorNotFoundError(
                f"include= or slices= name tensors not in the source: {some_names(missing)}"
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
        self, stream: TensorStream[Any] | None, failure: Failure | None, shard: str = ""
    ) -> AsyncGenerator[tuple[str, Any]]:
        """One file read by the group: agree on its header and who wants what, check every
        rank's caps, then run the plan. ``failure``: opening it failed on this rank."""
        group = self._group
        wants: dict[int, Slice | None] = {}
        digest: tuple[str, str] | None = None
        digests: Digests | None = None
        if stream is not None and failure is None:
            try:
                header = stream.header
                index = self._index
                if index is None:
                    self._check_names(set(header.names()))
                elif index.weight_map is None and shard == index.shards[-1]:
                    # A manifest's names are known once its last shard is open.
                    self._check_names({n for each in self.headers.values() for n in each.names()})
                wants = self._wants(header)
                whole = [header.tensors[index] for index, part in wants.items() if part is None]
                self._delivery.check_apart(whole)  # received together: no memory given twice
                digests = Digests.from_header(header) if self._verify else None
                digest = ("header", _header_digest(header))
            except BaseException as exc:  # include= and slices= may be the caller's functions
                failure = Failure.of(exc)
        caps = (self._caps.tensor, self._caps.total)
        everyone = await group.gather((digest, wants, caps, digests is not None), failure)
        _check_same([each[::-1] for each in everyone], "not the same file")
        assert stream is not None
        self._check_caps(stream, [(each[1], Caps(*each[2])) for each in everyone])
        if self._unique_names and self._index_address is not None:
            self._claim_names(stream.header, shard, [each[1] for each in everyone])
        checked = [each[3] for each in everyone]
        plan = self.plan = plan_exchange(
            stream.header.tensors, [each[1] for each in everyone], checked=checked
        )
        file = FileExchange(group, stream, wants, self._delivery, digests, checked)
        async with contextlib.aclosing(file.run(plan)) as items:
            async for item in items:
                yield item
                del item

    def _claim_names(
        self, header: Header, shard: str, every: list[dict[int, Slice | None]]
    ) -> None:
        """For one dict of names: the same :class:`UsageError` on every rank, before any of
        ``shard``'s bytes move, if a tensor some rank wants of it came from an earlier shard
        (a batch-mode dataset repeats its columns in every shard), as ``load_file`` raises."""
        claimed = self._shard_of or [{} for _ in every]
        self._shard_of = claimed
        for rank, wants in enumerate(every):
            for index in sorted(wants):
                name = header.tensors[index].name
                first = claimed[rank].setdefault(name, shard)
                if first != shard:
                    assert self._index_address is not None
                    raise repeated_name(self._index_address, name, first, shard)

    def _check_caps(
        self, stream: TensorStream[Any], every: list[tuple[dict[int, Slice | None], Caps]]
    ) -> None:
        """Each rank's wants (a sliced tensor counted whole: it may be read whole to be cut)
        against that rank's caps, on every rank alike: if one is over, every rank raises the
        same :class:`~stream_st.AllocationError`, before anything is allocated."""
        tensors = stream.header.tensors
        counted = self._counted or [0] * len(every)
        for rank, (wants, caps) in enumerate(every):
            wanted = (tensors[index] for index in sorted(wants))
            counted[rank] = caps.check(
                wanted, f"{stream.source.name}, for rank {rank}", counted[rank]
            )
        self._counted = counted

    async def _iterate(self) -> AsyncGenerator[tuple[str, Any]]:
        owns = not self._group_opened
        await self.open()
        self._owes_wants = False  # from here on, the first shard's exchange gathers them
        try:
            if self._index_address is None:
                async with contextlib.aclosing(self._exchange(self, None)) as items:
                    async for item in items:
                        yield item
                        del item
                return
            index = self._index
            assert index is not None
            stream: TensorStream[Any] | None = None
            try:
                for shard in index.shards:
                    failure = None
                    # From the last gate of the shard before (closed here) to this shard's
                    # gather, the others' next collective: a failure is told to them there,
                    # raised after, or they would wait for this rank until the group's timeout.
                    try:
                        if stream is not None:
                            self._shard = None
                            await stream.aclose()
                        address = shard_address(index.home, shard)
                        stream = self._shard = TensorStream(
                            address, max_header_size=self._max_header_size, clock=self._clock
                        )
                        self.headers[shard] = await stream.open()
                        index.check(shard, address, stream.header)
                    except BaseException as exc:
                        failure = Failure.of(exc)
                    exchange = self._exchange(stream, failure, shard)
                    async with contextlib.aclosing(exchange) as items:
                        async for item in items:
                            yield item
                            del item
            finally:
                self._shard = None
                if stream is not None:
                    await stream.aclose()
        finally:
            if owns:
                self._generator = None
                await self.aclose()

    async def aclose(self) -> None:
        """Close the stream; left before its iteration began, tell the group first (at the
        gather of headers and wants it waits at), so that every other rank raises
        :class:`RankFailedError` at once rather than at the group's timeout."""
        try:
            if self._owes_wants:
                self._owes_wants = False
                with contextlib.suppress(GeneratorExit):  # the group heard it: this rank left
                    await self._group.gather(None, Failure.of(GeneratorExit()))
        finally:  # a broken group's error is raised once the source is closed
            shard, self._shard = self._shard, None
            if shard is not None:
                await shard.aclose()
            await super().aclose()


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
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
) -> dict[str, Any]:
    """Every tensor this rank wants of ``source`` as ``{name: torch tensor}`` (a sliced one: its
    slice), read with the group (see the module); returned on every rank only once every rank
    has all it wants. ``max_tensor_bytes``, ``max_total_bytes``: this rank's caps (see the
    module). An argument refused as the stream is made is told to the group, as any other
    failure is: every rank raises :class:`RankFailedError` naming this one."""
    try:
        stream = DistributedStream(
            source,
            process_group=process_group,
            include=include,
            slices=slices,
            verify=verify,
            clock=clock,
            delivery=Delivery("pt", into, exact=False, writable=True),
            device=device,
            max_tensor_bytes=max_tensor_bytes,
            max_total_bytes=max_total_bytes,
            unique_names=True,
        )
    except SafetensorsError as exc:  # raised here, it would leave the others waiting
        stream = DistributedStream.refused(process_group, exc)
    return await tensor_dict(stream)


def refuse(process_group: Any, problem: Exception) -> NoReturn:
    """Raise ``problem``, a refusal of this rank's call (or a failure of its own) before it
    joined the group, as every rank of the group raises it (:meth:`DistributedStream.refused`),
    from a call that has no event loop; without a group, as it is."""
    from ..compat._sync import run

    if process_group is not None:
        run(DistributedStream.refused(process_group, problem).open)
    raise problem


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
    (dtype, shape) are received straight into it, each then counting as changed in place for
    autograd; the others (slices among them, and those not received in place by
    :func:`stream_st.torch.load_model`: see :func:`~stream_st.compat._shared.receivable`) go
    through ``model.load_state_dict``. Names ``include=`` leaves out are not missing."""
    from ..compat._shared import (
        changed_in_place,
        find_shared_tensors,
        in_cpu_memory,
        receivable,
        shared_groups,
    )
    from ..compat._sync import run

    try:
        include = listed(include)
        state = model.state_dict()
        shared_groups(state)  # memory no name covers whole: refused before anything is read
        into = in_cpu_memory(receivable(model, state))
        # Names that share memory (tied weights) are received fresh and go through
        # load_state_dict: received in place, their buffers would overlap (one name read
        # while another is received into the same bytes).
        for group in find_shared_tensors(into):
            if len(group) > 1:
                for name in group:
                    del into[name]
    except Exception as exc:  # not a model: told to the group, which would wait for this rank
        refuse(process_group, exc)
    try:
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
    except BaseException:  # some may have been received into before it failed
        changed_in_place(into.values())
        raise
    failure = None
    try:
        missing, unexpected = _taken(model, state, into, loaded, include, strict)
    except Exception as exc:  # the model's own hooks too: any failure is told to the group
        failure = Failure.of(exc)
    run(RankGroup(process_group).agree, failure)  # no rank returns while another fails
    return missing, unexpected


def _taken(
    model: torch.nn.Module,
    state: Mapping[str, Any],
    into: Mapping[str, Any],
    loaded: Mapping[str, Any],
    include: Include,
    strict: bool,
) -> tuple[set[str], list[str]]:
    """The tensors ``loaded`` that were not received ``into`` the model given to it (those
    that were told to autograd as changed in place), and ``(missing, unexpected)``;
    :class:`UsageError` where ``strict`` finds either."""
    from ..compat._shared import changed_in_place, load_errors, load_state, shared_counted

    placed = {name for name, tensor in loaded.items() if tensor is into.get(name)}
    changed_in_place(into[name] for name in placed)
    fresh = {name: tensor for name, tensor in loaded.items() if name not in placed}
    missing_list, unexpected = load_state(model, fresh)
    missing = set(missing_list).difference(placed)
    shared_counted(state, loaded, missing, unexpected)  # before include= leaves names out:
    missing = set(filter(_selected(include), missing))  # a tied one dropped is not unexpected
    if strict and (missing or unexpected):
        raise UsageError(load_errors(model, missing, unexpected))
    return missing, unexpected

"""One-call helpers: :func:`save` a dict of arrays, :func:`load` a whole file into a dict."""

from __future__ import annotations

import os
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
)
from contextlib import aclosing, contextmanager
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack, overload

import anyio
import numpy as np

from ._util import task_group
from .core.arrays import Framework, as_array, spec_of
from .core.header import DEFAULT_MAX_HEADER_SIZE, Header, UnknownDtypes
from .core.message import Order
from .core.shards import is_index, scheme_of
from .errors import ArgumentTypeError, IntegrityError, SafetensorsError, UsageError, boolean
from .memory.delivery import Delivery
from .reader import NO_CAPS, Caps, Include, TensorStream
from .reader.ahead import _room_ahead
from .reader.caps import current_caps
from .reader.header import header_only
from .reader.stream import ObjectOnly, tensor_dict
from .sharded.reader import MAX_INDEX_SIZE, ShardedStream, ShardIndex
from .transports.base import Source
from .transports.file.source import FileSource, open_path
from .transports.options import UNLIMITED, Clock, TransportOptions, clock_of
from .transports.registry import SinkLike, SourceLike

if TYPE_CHECKING:
    import torch

    from .core.digests import Digests
    from .sharded.ranks import Slices
    from .transports.cache import Cache, CacheLike
    from .transports.cache.resolve import OnCopy, Resolved

__all__ = [
    "CachedShardedStream",
    "CachedStream",
    "cached_stream",
    "current_cache",
    "header_of",
    "load",
    "open_stream",
    "read_header",
    "save",
    "stream_for",
    "using_cache",
    "with_cache",
]


async def save(
    dst: SinkLike,
    tensors: Mapping[str, Any],
    *,
    metadata: Mapping[str, str] | None = None,
    order: Order = "reference",
    fsync: bool = False,
    checksums: bool | str | Digests = False,
    **options: Unpack[TransportOptions],
) -> Header:
    """Write ``{name: array}`` to ``dst`` and return the header written.

    By default tensors are ordered as the reference writer orders them, so a file is
    byte-identical to ``safetensors.numpy.save_file`` of the same dict and metadata;
    ``order="plan"`` keeps the dict's order. Each array's dtype and shape make its plan entry
    (a torch ``float4_e2m1fn_x2`` tensor is F4; other packed F4/F6 tensors need
    :func:`~stream_st.open_writer` with an explicit plan). Arrays are
    written straight from their memory, one after another; nothing is committed unless all are.
    Time limits, ``headers`` and ``ssl_context`` as in :func:`~stream_st.open_writer`.

    ``checksums=True`` (or an algorithm's name) records every tensor's digest in
    ``__metadata__`` (see :func:`~stream_st.open_writer`); on a destination written front to
    back (a socket, a pipe, an HTTP upload) they are computed from the arrays before the header
    goes out.

    ``fsync=True``: a local file is flushed to stable storage before it is moved into place, and
    its directory after, as :func:`~stream_st.open_writer` does.

    A local file given no time limit (nor a :class:`~stream_st.Digests` to check) is written at
    once, with no turn of the event loop per tensor (:func:`~stream_st.writer.save_at_once`):
    in one worker thread, or for a small dict (:data:`SAVE_INLINE`) on the loop's own thread.
    A cancelled call leaves nothing behind, unless the file was committed first.
    """
    if not isinstance(tensors, Mapping):
        raise ArgumentTypeError(
            f"save takes a mapping of names to arrays, got {type(tensors).__name__}"
        )
    fsync = boolean("fsync", fsync)
    # Imported here: a read needs neither (a tenth of the first read's imports).
    from .core.digests import Digests
    from .writer import TensorWriter, local_destination, run_stoppable, save_at_once

    if not options and not isinstance(checksums, Digests):
        path = local_destination(dst)
        if path is not None:  # every array in memory: written at once, off the loop
            return await run_stoppable(
                partial(save_at_once, tensors, path, metadata, checksums, order=order, fsync=fsync),
                inline=_small(tensors),
            )
    arrays = {name: as_array(array, name) for name, array in tensors.items()}
    plan = [spec_of(name, tensors[name], array) for name, array in arrays.items()]
    writer = TensorWriter(
        dst,
        plan,
        metadata=metadata,
        order=order,
        fsync=fsync,
        checksums=checksums,
        clock=clock_of(options),
        digests_up_front=lambda algorithm: Digests.compute(arrays, algorithm),
    )
    async with writer:
        await writer.write_many((info.name, arrays[info.name]) for info in writer.header.tensors)
    return writer.header


SAVE_INLINE = 1 << 20
"""A dict of at most :data:`SAVE_INLINE_TENSORS` arrays and fewer bytes than this is saved to a
local file on the event loop's thread, after a turn of the loop: about what the reference's
``save_file`` takes (a millisecond or less), cheaper than handing it to a worker thread and
back."""

SAVE_INLINE_TENSORS = 256
"""See :data:`SAVE_INLINE`."""


def _small(tensors: Mapping[str, Any]) -> bool:
    """Whether ``tensors`` is a dict :func:`save` writes on the event loop's thread (an object
    that does not say its size counts as large)."""
    if len(tensors) > SAVE_INLINE_TENSORS:
        return False
    try:
        sizes = [getattr(value, "nbytes", SAVE_INLINE) for value in tensors.values()]
    except Exception:  # a sparse tensor's nbytes raises: refused when it is laid out
        return False
    return sum(sizes) < SAVE_INLINE


async def load(
    source: SourceLike,
    *,
    include: Include = None,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    verify: bool = True,
    copy: bool = True,
    concurrency: int | None = None,
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> dict[str, np.ndarray[Any, Any]]:
    """Read a whole safetensors message into ``{name: array}`` in offset order.

    Takes every source :func:`~stream_st.open_stream` takes, and the same options: digests
    recorded in the header are checked (``verify=False`` skips that), and nothing is returned
    unless every tensor passed. ``copy=False`` maps a local file and returns read-only views of
    it (see :func:`~stream_st.open_stream` for when not to). ``max_tensor_bytes`` and
    ``max_total_bytes`` cap what the read may allocate, as for :func:`~stream_st.open_stream`.

    An index or manifest whose shards repeat a tensor name (a batch-mode dataset, whose shards
    all hold the same columns) is refused with a :class:`~stream_st.UsageError` before any of
    the repeating shard's tensors is read: a dict cannot hold every shard's rows. Stream it with
    :func:`open_stream`, or read a dataset by rows (:mod:`stream_st.integrations.dataset`).
    ``concurrency`` and ``cache`` as in :func:`~stream_st.open_stream`.
    """
    clock = clock_of(options)
    clock.transport = clock.transport.reading(concurrency)
    stream = stream_for(
        source,
        include=include,
        max_header_size=max_header_size,
        verify=verify,
        clock=clock,
        copy=copy,
        max_tensor_bytes=max_tensor_bytes,
        max_total_bytes=max_total_bytes,
        cache=cache,
    )
    return await tensor_dict(stream)


@overload
def open_stream(
    source: SourceLike,
    *,
    include: Include = None,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    framework: Literal["pt", "torch", "pytorch"],
    into: Mapping[str, Any] | None = None,
    verify: bool = True,
    copy: bool = True,
    concurrency: int | None = None,
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
    process_group: Any = None,
    slices: Slices | None = None,
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> TensorStream[torch.Tensor]: ...


@overload
def open_stream(
    source: SourceLike,
    *,
    include: Include = None,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    framework: Literal["np", "numpy"] | None = None,
    into: Mapping[str, Any] | None = None,
    verify: bool = True,
    copy: bool = True,
    concurrency: int | None = None,
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
    process_group: Any = None,
    slices: Slices | None = None,
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> TensorStream[np.ndarray[Any, Any]]: ...


def open_stream(
    source: SourceLike,
    *,
    include: Include = None,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    framework: Framework | None = None,
    into: Mapping[str, Any] | None = None,
    verify: bool = True,
    copy: bool = True,
    concurrency: int | None = None,
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
    process_group: Any = None,
    slices: Slices | None = None,
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> TensorStream[Any]:
    """Read a safetensors file as a stream of ``(name, numpy array)`` in offset order.

    ``source`` is a path (``str``, ``os.PathLike``, ``file://`` URL), a bytes-like object, an async
    iterable of bytes-like chunks, an anyio ``ByteReceiveStream`` or an asyncio ``StreamReader``.
    ``include`` selects tensors by name (a collection, one name, or a predicate); skipped tensors
    are never allocated, and a random-access source never reads their bytes. ``max_header_size``
    bounds the JSON header, checked before anything is allocated.

    ``copy=False`` lets arrays share memory with the source: a local regular file is mapped
    (``mmap``) and each tensor is a read-only view of the mapping, as the reference's
    ``load_file`` does, populated a window ahead of the consumer. Nothing is copied and the
    arrays stay valid after the stream closes. Do not use it for files that may be changed or
    truncated while the arrays live (they would see the change; a truncated file kills the
    process with ``SIGBUS`` when a lost page is touched), nor, for the same reason, on network
    file systems shared with writers. Other sources are read as with ``copy=True``: fresh,
    writable arrays. With ``framework="pt"`` the mapping is private and writable instead (torch
    has no read-only tensors): a write to a tensor copies its page for this process, never
    reaching the file.

    Time limits (seconds; ``None``, the default, for none): ``timeout`` bounds connecting and
    each wait for data; ``deadline`` the whole read, from opening until the last tensor;
    ``speed_limit`` (bytes per second) with ``speed_time`` (default 30 s) fails a transfer that
    stays slower than that while waiting on the transport. Each raises
    :class:`~stream_st.ReadTimeoutError`; a bad value is a :class:`~stream_st.UsageError`.

    Remote sources (``http(s)://``, ``s3://``; an index's shards too): ``headers`` (a mapping of
    str to str) go with every request, on top of a given source's own; ``ssl_context`` (an
    :class:`ssl.SSLContext`) decides which certificates https trusts. Proxies come from the
    environment (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``).
    ``concurrency=K`` reads each remote object through K ranged requests at once (see
    :class:`~stream_st.HttpSource`), replacing a given source's own; an index's shards too, the
    next shard opened while the current one streams. Other sources ignore it.

    An address ending in ``.index.json`` (a sharded checkpoint's index) gives a
    :class:`~stream_st.sharded.ShardedStream` over every shard.

    ``framework="pt"`` hands tensors out as torch tensors over the memory they were received in
    (every dtype torch has, BF16 and the F8 family included), and the stream's type says so
    (``TensorStream[torch.Tensor]``); ``"np"`` (the default) as numpy arrays. ``into`` maps
    names to memory the caller already owns (a torch tensor or numpy array of the tensor's dtype
    and shape, or a writable contiguous buffer of exactly its bytes): those tensors are received
    straight into it and handed out as it (a buffer: as an array over it); a name not in the
    header is a :class:`~stream_st.TensorNotFoundError`, memory of another dtype, shape or size
    a :class:`~stream_st.UsageError`. If the read fails, that memory may hold part of the
    tensor.

    ``verify`` (default True): a header that records digests (see :mod:`stream_st.integrity`)
    has each tensor checked, while its bytes arrive, before it is yielded; a mismatch raises
    :class:`~stream_st.IntegrityError` naming the tensor, and neither it nor any later tensor
    is yielded. ``verify=False`` skips the check.

    Caps on what a peer or file may make the reader allocate (bytes; ``None``, the default,
    for none): ``max_tensor_bytes`` for any one tensor read, ``max_total_bytes`` for all of them
    together (of every shard, for an index or manifest). The tensors to be read (those
    ``include`` selects) are checked against them once their header is known, before any is
    allocated, wherever they would land; one over a cap is refused with
    :class:`~stream_st.AllocationError` naming it, the size it declares and the cap.

    The header is read and validated in full before the first tensor. Errors are
    :class:`~stream_st.SafetensorsError` subclasses: a tensor the source ends inside is never
    yielded (:class:`~stream_st.TruncatedStreamError`).

    ``process_group`` (a ``torch.distributed`` process group; every rank makes the same call):
    each rank reads its share of the bytes and the group exchanges them; ``include=`` may differ
    per rank, and ``slices=`` (name -> ``(dim, part, parts)``) gives a rank only its part of a
    tensor (see :mod:`stream_st.sharded.ranks`); ``into=`` memory shared by several names of a
    file is refused there (the group fills them at once): every rank raises
    :class:`~stream_st.RankFailedError`, its cause the :class:`~stream_st.UsageError`.

    ``cache`` (``True``, a directory, ``"offline"`` or a :class:`~stream_st.Cache`) keeps a
    verified local copy of an ``http(s)://``, ``s3://`` or ``hf://`` object while it is read, and
    reads that copy next time after one conditional request (none offline); see
    ``docs/cache.md``. Other sources are read as they are.
    """
    if process_group is not None or slices is not None:
        from .sharded.ranks import DistributedStream

        try:
            no_cache_with_ranks(cache)
            return DistributedStream(
                source,
                process_group=process_group,
                include=include,
                slices=slices,
                max_header_size=max_header_size,
                verify=verify,
                clock=_clock(options, concurrency),
                delivery=Delivery(framework, into),
                max_tensor_bytes=max_tensor_bytes,
                max_total_bytes=max_total_bytes,
            )
        except SafetensorsError as exc:  # every rank raises it, naming this one
            return DistributedStream.refused(process_group, exc)
    clock = _clock(options, concurrency)
    return stream_for(
        source,
        include=include,
        max_header_size=max_header_size,
        verify=verify,
        clock=clock,
        delivery=Delivery(framework, into),
        copy=copy,
        unique_names=False,
        max_tensor_bytes=max_tensor_bytes,
        max_total_bytes=max_total_bytes,
        cache=cache,
    )


def _clock(options: Mapping[str, Any], concurrency: int | None) -> Clock:
    """The clock of a read with transport ``options`` and ``concurrency``."""
    clock = clock_of(options)
    clock.transport = clock.transport.reading(concurrency)
    return clock


def stream_for(
    source: SourceLike,
    *,
    include: Include = None,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    verify: bool | ObjectOnly = True,
    clock: Clock,
    delivery: Delivery | None = None,
    copy: bool = True,
    unique_names: bool = True,
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
    cache: CacheLike = None,
    unknown_dtypes: UnknownDtypes = "refuse",
) -> TensorStream[Any]:
    """:func:`open_stream` under ``clock``: reads that share one operation's limits.
    ``unknown_dtypes`` (one file's header-only read) as in :class:`~stream_st.TensorStream`.

    ``unique_names`` (the default: what callers collecting ``{name: array}`` need) refuses, with
    a :class:`~stream_st.UsageError` naming the streaming way to read it, an index or manifest
    whose shards repeat a tensor name (a batch-mode dataset's columns are in every shard), before
    any tensor of the repeating shard is read; :func:`open_stream` streams them all instead.
    A read given no caps takes those :func:`~stream_st.reader.caps.using_caps` set, if any.
    """
    if max_tensor_bytes is None and max_total_bytes is None:
        ambient = current_caps()
        max_tensor_bytes, max_total_bytes = ambient.tensor, ambient.total

    common: dict[str, Any] = {
        "include": include,
        "max_header_size": max_header_size,
        "verify": verify,
        "clock": clock,
        "delivery": delivery,
        "copy": copy,
        "max_tensor_bytes": max_tensor_bytes,
        "max_total_bytes": max_total_bytes,
    }
    # cache= (the cache's wiring; stream_st._api): given, or set by using_cache()
    settings = _cache_for(source, cache)
    if isinstance(source, str | os.PathLike) and is_index(source):
        if settings is not None:
            return CachedShardedStream(
                os.fspath(source), cache=settings, unique_names=unique_names, **common
            )
        return ShardedStream(source, unique_names=unique_names, **common)
    if settings is not None:
        return CachedStream(str(source), cache=settings, unknown_dtypes=unknown_dtypes, **common)
    return TensorStream(source, unknown_dtypes=unknown_dtypes, **common)


async def read_header(
    source: SourceLike,
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
    cache: CacheLike = None,
    unknown_dtypes: UnknownDtypes = "refuse",
    **options: Unpack[TransportOptions],
) -> Header:
    """Read and validate only the header of ``source``, then close it; limits and ``cache`` as
    in :func:`open_stream`. With ``max_tensor_bytes`` or ``max_total_bytes``, the header's
    tensors (all of them) are checked against those caps as :func:`open_stream` would check
    them before reading: :class:`~stream_st.AllocationError` for one over a cap.
    ``unknown_dtypes="keep"`` keeps the tensors of a dtype code stream_st does not know (a
    packed ``I4`` or ``I2``), sized by their ``data_offsets`` and named in
    :attr:`Header.unreadable <stream_st.Header.unreadable>`, instead of refusing the file with
    :class:`~stream_st.UnknownDtypeError`; their data stays unreadable. A sharded checkpoint's
    index (or a dataset's manifest) has no one header: :class:`~stream_st.UsageError`."""
    return await header_of(
        source,
        clock_of(options) if options else UNLIMITED,  # a clock no limit ever changes
        max_header_size=max_header_size,
        caps=NO_CAPS
        if max_tensor_bytes is None and max_total_bytes is None
        else Caps.of(max_tensor_bytes, max_total_bytes),
        cache=cache,
        unknown_dtypes=unknown_dtypes,
    )


async def header_of(
    source: SourceLike,
    clock: Clock,
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    caps: Caps = NO_CAPS,
    cache: CacheLike = None,
    unknown_dtypes: UnknownDtypes = "refuse",
) -> Header:
    """:func:`read_header` under ``clock``, checked against ``caps``. A file read as it is (no
    cache) needs no stream around its source: :func:`header_only`. An index or a manifest has
    no one header: :class:`~stream_st.UsageError`."""
    if is_index(source):
        raise UsageError(
            f"{os.fspath(source)} is the index of sharded files, which have a header "
            "each: read a shard's, or all of them with stream_st.tools.inspect(index)"
        )
    settings = _cache_for(source, cache)
    if settings is None:
        header, name = await header_only(source, clock, max_header_size, unknown_dtypes)
    else:
        stream = CachedStream(
            str(source),
            cache=settings,
            whole=False,  # a header: the copy is not given room for every byte up front
            max_header_size=max_header_size,
            clock=clock,
            unknown_dtypes=unknown_dtypes,
        )
        async with stream:
            header, name = stream.header, stream.source.name
    if caps is not NO_CAPS:  # a walk over every tensor, on the loop
        caps.check(header.tensors, name)
    return header


# The cache's wiring (open_stream(url, cache=...)): a stream through the verified local copy.

T = TypeVar("T")


class CachedStream(TensorStream[Any]):
    """:class:`~stream_st.TensorStream` over ``address`` (an ``http(s)://``, ``s3://`` or
    ``hf://`` address) and ``cache``. After it opens, ``cache_state`` says how the cache served
    it: ``"hit"`` (the local copy, checked fresh), ``"offline"`` (the copy, no request),
    ``"stale"`` (the copy; the server could not be asked), ``"fetch"`` (the remote object,
    kept while read), ``"shared"`` (the copy another process is writing, read as it grows) or
    ``"uncached"`` (the remote object, nothing kept; also a ``"shared"`` read once the copy's
    writer stopped first and the rest is read from the server).

    While the request that checks the local copy is in flight, it reads the copy ahead (its
    header and first tensors, :class:`_CopyAhead`), and hands out nothing of it, header
    included, before the answer says the copy is the object; not into the caller's memory
    (``into=``), nor with an ``include=`` predicate run on the copy's names.

    ``whole``: whether the read takes every byte, so the remote object may be fetched with one
    request and its copy given its room up front; by default, when no ``include=`` is given.
    A handle that reads on demand (``safe_open``) or a header's read says False."""

    def __init__(
        self, address: str, *, cache: Cache, whole: bool | None = None, **options: Any
    ) -> None:
        super().__init__(address, **options)
        self._address = address
        self._cache = cache
        self._whole = options.get("include") is None if whole is None else whole
        self._options = options
        self._ahead: _CopyAhead | None = None
        self._resolved: Resolved | None = None

    async def _open(self, *, read_all: bool) -> Header:
        try:
            if self.cache_state is None:
                if not self._may_read_ahead():
                    await self._resolve(read_all=read_all)
                elif (ahead := await self._resolve_reading_ahead()) is not None:
                    return self._adopt(ahead)
            return await super()._open(read_all=read_all)
        except BaseException:  # cancelled too: the copy being written lets go of its entry
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    def _adopt(self, ahead: _CopyAhead) -> Header:
        """Read on from the copy read ahead: its header, source and statistics this stream's."""
        stream = ahead.stream
        self.stats = stream.stats
        self._header, self._source = stream.header, ahead.source
        return stream.header

    async def aclose(self) -> None:
        await self._drop_ahead()
        resolved = self._source_like
        unopened = resolved if self._source is None and isinstance(resolved, Source) else None
        try:
            await super().aclose()
        finally:
            if unopened is not None:  # resolved, not yet opened (a cancel between the two)
                self._source_like = self._address
                await unopened.aclose()

    async def _resolve(self, *, read_all: bool, on_copy: OnCopy | None = None) -> Resolved:
        """What to read, through the cache (:func:`~.transports.cache.resolve.resolve`)."""
        from .transports.cache.resolve import resolve

        self._clock.start()
        resolved = await resolve(
            self._address, self._cache, self._clock, read_all=read_all, on_copy=on_copy
        )
        if self._closed and isinstance(resolved.target, Source):  # closed meanwhile: let go
            await resolved.target.aclose()
        else:
            self._source_like = resolved.target
        self._resolved = resolved
        return resolved

    @property
    def cache_state(self) -> str | None:
        """How the cache served this stream (see the class), as it stands; None before it
        opens."""
        return None if self._resolved is None else self._resolved.served

    async def _refuted(self) -> None:
        """A tensor failed its digest: the cache keeps nothing of what was read (see
        :meth:`~.transports.cache.resolve.Resolved.refuted`)."""
        if self._resolved is not None:
            await self._resolved.refuted()

    async def _iterate(self) -> AsyncGenerator[tuple[str, Any]]:
        owns = self._header is None  # iterated without 'async with': opened and closed here,
        if owns:  # through open(): an open() from another task meanwhile waits for this one
            self.stats.asked(first=True)
            await self.open(read_all=self._include is None)
        ahead = self._ahead  # the copy an open (this one, another task's) read ahead, or None
        try:
            if ahead is None:  # as any stream, from what the cache said to read
                async with aclosing(super()._iterate()) as items:
                    async for item in items:
                        yield item
                        del item
                return
            stream = ahead.stream
            self._adopt(ahead)
            try:
                for item in ahead.take_held():
                    yield item
                    del item
                if not ahead.ended:
                    async for item in ahead.items:
                        yield item
                        del item
                self.object_check = stream.object_check
            except IntegrityError:  # read from the copy, as the stream's own reads (see there)
                with anyio.CancelScope(shield=True):
                    await self._refuted()
                raise
        finally:
            if owns or ahead is not None:
                self._generator = self._held = None  # this one: ending, not closed again
                await self.aclose()

    def _may_read_ahead(self) -> bool:
        """Whether the copy may be read before the check: not into the caller's memory
        (``into=``), nor with the caller's code run on its names (an ``include=`` predicate)."""
        return not self._delivery.into and not callable(self._include)

    async def _resolve_reading_ahead(self) -> _CopyAhead | None:
        """Resolve the address, the copy read meanwhile (:class:`_CopyAhead`): that read when
        the answer is that copy and it went well, else None (it is dropped; what the cache said
        to read is then read as it would be without it)."""
        ahead = self._ahead = _CopyAhead(self._copy_stream)
        failure: Exception | None = None
        try:
            async with task_group() as group:  # Ctrl-C under trio: raised as itself

                def on_copy(path: str) -> None:
                    group.start_soon(ahead.run, path)

                try:
                    resolved = await self._resolve(read_all=self._whole, on_copy=on_copy)
                except Exception as exc:  # raised outside the group: no ExceptionGroup
                    failure = exc
                ahead.answered.set()
                if failure is not None or not ahead.named(resolved):
                    group.cancel_scope.cancel()  # not the copy: stop reading it now
            if failure is not None:
                raise failure
            if not self._closed and ahead.is_answer(resolved):
                return ahead
        except BaseException:  # cancelled too: the copy read ahead, and the copy being written
            with anyio.CancelScope(shield=True):  # (its entry's lock), let go with the stream
                await self.aclose()
            raise
        await self._drop_ahead()
        return None

    async def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await ahead.drop()

    def _copy_stream(self, source: Source) -> TensorStream:
        """A plain stream over the copy's ``source``, read as this one would read it."""
        options = {
            **self._options,
            "include": self._include,  # its names as listed: an iterator given is spent
            "clock": self._clock,
            "delivery": self._delivery,
        }
        return TensorStream(source, **options)


class _CopyAhead:
    """The local copy read while the request that checks it is in flight: opened, its header
    read, its first tensors read and held, the read-ahead running behind them as in a read of
    the copy; nothing of it handed out. Held while the answer is awaited: the first tensor, and
    more as long as those held stay within what the read-ahead itself queues ahead of a caller
    (:func:`~stream_st.reader.ahead._room_ahead`: 16 MiB, or two tensors of at most 64 MiB
    together), so at most twice the read-ahead's memory while the request is in flight. Used
    once the answer says the copy is the object; else :meth:`drop` closes it (its file, its
    read-ahead's threads) and lets go of what it read. A failure while reading ahead is not
    kept: the copy is then read again as it would be without this, and fails as it would."""

    def __init__(self, new_stream: Callable[[Source], TensorStream]) -> None:
        self._new_stream = new_stream
        self._path: str | None = None
        self._identity: tuple[int, int] | None = None  # the file read: device, inode
        self._source: FileSource | None = None
        self._stream: TensorStream | None = None
        self._items: AsyncIterator[tuple[str, Any]] | None = None
        self._held: list[tuple[str, Any]] = []
        self.answered = anyio.Event()
        self.ended = False  # every tensor is held
        self._read = False  # read as far as it goes ahead, without an error
        self._dropped = False

    @property
    def stream(self) -> TensorStream:
        assert self._stream is not None
        return self._stream

    @property
    def source(self) -> FileSource:
        assert self._source is not None
        return self._source

    @property
    def items(self) -> AsyncIterator[tuple[str, Any]]:
        assert self._items is not None
        return self._items

    async def run(self, path: str) -> None:
        """Read the copy at ``path`` ahead (see the class)."""
        if self._dropped:
            return
        self._path = path
        opened: list[int] = []  # the copy's descriptor, until its source holds it
        try:
            fd = open_path(path, os.O_RDONLY, opened)
            info = os.fstat(fd)
            self._source = FileSource(path, fd=fd, opened=opened)
            self._identity = (info.st_dev, info.st_ino)
            self._stream = self._new_stream(self._source)
            self._items = self._stream.__aiter__()
            self._held.append(await anext(self._items))
            sizes = [t.nbytes for t in self._stream.selected()]
            held = sizes[0]
            for size in sizes[1:]:  # more while the answer is awaited, as a read-ahead queue
                if self.answered.is_set() or not _room_ahead(len(self._held), held, size, False):
                    break
                self._held.append(await anext(self._items))
                held += size
        except StopAsyncIteration:  # every tensor read
            self.ended = True
        except Exception:
            return
        finally:  # a failure before the source held the copy, an interrupt included
            for unheld in opened:
                os.close(unheld)
        self._read = True

    def named(self, resolved: Resolved) -> bool:
        """Whether the cache's answer names the copy this reads (maybe not read yet)."""
        return resolved.state in ("hit", "stale") and resolved.target == self._path

    def is_answer(self, resolved: Resolved) -> bool:
        """Whether what this read is what the cache's answer says to read: that copy, read
        without an error, and the very file (not one that replaced it since)."""
        if not (self._read and self.named(resolved)):
            return False
        try:
            info = os.stat(self._path or "")
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self._identity

    def take_held(self) -> Iterator[tuple[str, Any]]:
        """The tensors read, in order, each let go of here as it is given."""
        while self._held:
            yield self._held.pop(0)

    async def drop(self) -> None:
        """Close what was read ahead (also when still being read: it stops), the copy's source
        too where no stream opened it (a failure, or an interrupt, before the stream did)."""
        self._dropped = True
        self._held.clear()
        stream, self._stream = self._stream, None
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await stream.aclose()  # its iteration too: held here until closed
        if self._source is not None:
            await self._source.aclose()  # closing it again is a no-op
        self._items = None


def _cache_of(cache: object) -> Cache | None:
    """:meth:`~stream_st.Cache.of` of ``cache``: the cache's modules (a twentieth of a first
    read's time) are imported only where a cache is named, not for a read without one."""
    if cache is None or cache is False:
        return None
    from .transports.cache import Cache

    return Cache.of(cache)


def _cache_for(source: object, cache: object) -> Cache | None:
    """The cache a read of ``source`` goes through: the one ``cache`` (any ``cache=`` value, see
    :meth:`~stream_st.Cache.of`; None: the one :func:`using_cache` set) names, when ``source``
    is an address a cache applies to; else None (the source is read as it is). An ``hf://``
    read with ``HF_HUB_OFFLINE`` set and no cache asked for goes through the offline cache:
    the Hub is not asked (as ``huggingface_hub`` does not ask it), a missing copy is a
    :class:`~stream_st.CacheMissError`."""
    settings = _cache_of(cache) if cache is not None else current_cache()
    if settings is None and scheme_of(source) == "hf":
        from .transports.cache.config import hub_offline

        if hub_offline(source):
            settings = _cache_of("offline")
    if settings is None:
        return None
    from .transports.cache.resolve import is_cached_address

    return settings if is_cached_address(source) else None


def no_cache_with_ranks(cache: object) -> None:
    """:class:`~stream_st.UsageError` for a ``cache=`` given to a read with a process group,
    ``include=`` per rank or ``slices=``: each rank reads only its share, so no rank could
    keep a whole copy (every rank makes the same call, so every rank refuses it)."""
    if cache is not None and cache is not False:
        raise UsageError(
            "cache= does not go with process_group=, slices= or (in stream_st.torch) include=: "
            "each rank reads only its share of the bytes, so none could keep a whole copy; "
            "read once with cache= (or `stream-st cp`) first, then load the local copy"
        )


def cached_stream(source: object, cache: object, **options: Any) -> CachedStream | None:
    """A :class:`CachedStream` over ``source`` when ``cache`` applies to it (see
    :func:`_cache_for`); None otherwise (the source is read as it is)."""
    settings = _cache_for(source, cache)
    if settings is None:
        return None
    return CachedStream(str(source), cache=settings, **options)


class CachedShardedStream(ShardedStream[Any]):
    """:class:`~stream_st.sharded.ShardedStream` over a remote index whose index and shards are
    each read through ``cache`` as a single file is (:class:`CachedStream`): a second read of the
    checkpoint, or an offline one, needs no byte from the network."""

    def __init__(self, index: str, *, cache: Cache, **options: Any) -> None:
        super().__init__(index, **options)
        self._cache = cache

    async def _load_index(self) -> ShardIndex:
        from .transports.cache.resolve import read_cached

        raw, home = await read_cached(self._address, self._cache, self._clock, limit=MAX_INDEX_SIZE)
        return ShardIndex(raw, self._address, home)

    def _shard_stream(self, address: str, **options: Any) -> TensorStream:
        return cached_stream(address, self._cache, **options) or TensorStream(address, **options)


_AMBIENT: ContextVar[Cache | None] = ContextVar("stream_st_cache", default=None)


def current_cache() -> Cache | None:
    """The cache set by :func:`using_cache` for the reads in this context, if any."""
    return _AMBIENT.get()


@contextmanager
def using_cache(cache: object) -> Iterator[Cache | None]:
    """Every read in the ``with`` block (in this task and those it starts) that is given no
    ``cache=`` of its own uses ``cache`` (any ``cache=`` value; None or False: none): how the
    command's ``--cache`` reaches its subcommands, and the drop-in functions their reads."""
    settings = _cache_of(cache)
    token = _AMBIENT.set(settings)
    try:
        yield settings
    finally:
        _AMBIENT.reset(token)


async def with_cache(cache: object, function: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await function(*args)`` under :func:`using_cache` (for calls run on another loop)."""
    with using_cache(cache):
        return await function(*args)

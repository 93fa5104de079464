"""One-call helpers: :func:`save` a dict of arrays, :func:`load` a whole file into a dict."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Unpack

import numpy as np

from .core.arrays import Framework, as_array, spec_of
from .core.digests import Digests
from .core.header import DEFAULT_MAX_HEADER_SIZE, Header
from .errors import UsageError
from .memory.delivery import Delivery
from .reader import Include, TensorStream
from .transports.cache import CacheLike
from .transports.options import Clock, TransportOptions, clock_of
from .transports.registry import SinkLike, SourceLike
from .writer import Order, TensorWriter

__all__ = ["header_of", "load", "open_stream", "read_header", "save", "stream_for"]


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
    """
    if not isinstance(tensors, Mapping):
        raise UsageError(f"save takes a mapping of names to arrays, got {type(tensors).__name__}")
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
        for info in writer.header.tensors:
            await writer.write(info.name, arrays[info.name])
    return writer.header


async def load(
    source: SourceLike,
    *,
    include: Include = None,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    verify: bool = True,
    copy: bool = True,
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> dict[str, np.ndarray[Any, Any]]:
    """Read a whole safetensors message into ``{name: array}`` in offset order.

    Takes every source :func:`~stream_st.open_stream` takes, and the same options: digests
    recorded in the header are checked (``verify=False`` skips that), and nothing is returned
    unless every tensor passed. ``copy=False`` maps a local file and returns read-only views of
    it (see :func:`~stream_st.open_stream` for when not to). ``cache`` as in
    :func:`~stream_st.open_stream`.
    """
    stream = open_stream(
        source,
        include=include,
        max_header_size=max_header_size,
        verify=verify,
        copy=copy,
        cache=cache,
        **options,
    )
    return {name: array async for name, array in stream}


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
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> TensorStream:
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
    (every dtype torch has, BF16 and the F8 family included); ``"np"`` (the default) as numpy
    arrays. ``into`` maps names to memory the caller already owns (a torch tensor or numpy array
    of the tensor's dtype and shape, or a writable contiguous buffer of exactly its bytes): those
    tensors are received straight into it and handed out as it (a buffer: as an array over it);
    a name not in the header is a :class:`~stream_st.TensorNotFoundError`, memory of another
    dtype, shape or size a :class:`~stream_st.UsageError`. If the read fails, that memory may
    hold part of the tensor.

    ``verify`` (default True): a header that records digests (see :mod:`stream_st.integrity`)
    has each tensor checked, while its bytes arrive, before it is yielded; a mismatch raises
    :class:`~stream_st.IntegrityError` naming the tensor, and neither it nor any later tensor
    is yielded. ``verify=False`` skips the check.

    The header is read and validated in full before the first tensor. Errors are
    :class:`~stream_st.SafetensorsError` subclasses: a tensor the source ends inside is never
    yielded (:class:`~stream_st.TruncatedStreamError`).

    ``cache`` (``True``, a directory, ``"offline"`` or a :class:`~stream_st.Cache`) keeps a
    verified local copy of an ``http(s)://``, ``s3://`` or ``hf://`` object while it is read, and
    reads that copy next time after one conditional request (none offline); see
    ``docs/cache.md``. Other sources are read as they are.
    """
    clock = clock_of(options)
    clock.transport = clock.transport.reading(concurrency)
    return stream_for(
        source,
        include=include,
        max_header_size=max_header_size,
        verify=verify,
        clock=clock,
        delivery=Delivery(framework, into),
        copy=copy,
        cache=cache,
    )


def stream_for(
    source: SourceLike,
    *,
    include: Include = None,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    verify: bool = True,
    clock: Clock,
    delivery: Delivery | None = None,
    copy: bool = True,
    cache: CacheLike = None,
) -> TensorStream:
    """:func:`open_stream` under ``clock``: reads that share one operation's limits."""
    from .core.shards import is_index
    from .sharded.reader import ShardedStream

    # cache= (the cache's wiring; stream_st.cached): given, or set by using_cache()
    if cache is not False and not is_index(str(source)):
        from .cached import cached_stream

        cached = cached_stream(
            source,
            cache,
            include=include,
            max_header_size=max_header_size,
            verify=verify,
            clock=clock,
            delivery=delivery,
            copy=copy,
        )
        if cached is not None:
            return cached

    if isinstance(source, str | os.PathLike) and is_index(source):
        return ShardedStream(
            source,
            include=include,
            max_header_size=max_header_size,
            verify=verify,
            clock=clock,
            delivery=delivery,
            copy=copy,
        )
    return TensorStream(
        source,
        include=include,
        max_header_size=max_header_size,
        verify=verify,
        clock=clock,
        delivery=delivery,
        copy=copy,
    )


async def read_header(
    source: SourceLike,
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> Header:
    """Read and validate only the header of ``source``, then close it; limits and ``cache`` as
    in :func:`open_stream`."""
    return await header_of(source, clock_of(options), max_header_size=max_header_size, cache=cache)


async def header_of(
    source: SourceLike,
    clock: Clock,
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    cache: CacheLike = None,
) -> Header:
    """:func:`read_header` under ``clock``."""
    stream = stream_for(source, max_header_size=max_header_size, clock=clock, cache=cache)
    async with stream:
        return stream.header

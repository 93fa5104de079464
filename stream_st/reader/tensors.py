"""Reading one tensor: its memory, the proof a stream of unknown length holds it, and reads
hashed as they go (:func:`read_hashing`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import numpy as np

from .._util import task_group
from ..core.header import TensorInfo
from ..errors import AllocationError, TruncatedStreamError
from ..memory.fresh import fresh_bytes
from ..transports.registry import Source

if TYPE_CHECKING:
    from ..core.digests import Digests, Hasher

PROVE_ABOVE = 1 << 30
"""On a source of unknown length, a tensor larger than this is allocated only once its first
``PROOF_SIZE`` bytes have arrived, so a short stream claiming a huge tensor costs nothing."""

PROOF_SIZE = 4 << 20


def _allocate(
    info: TensorInfo, take: Callable[[int], np.ndarray[Any, Any]] = fresh_bytes
) -> tuple[np.ndarray[Any, Any], memoryview]:
    """A fresh array for ``info`` (its memory from ``take``) and a writable byte view of it."""
    array, view, _ = _allocate_framed(info, lambda nbytes: (take(nbytes), None))
    return array, view


def _allocate_framed(
    info: TensorInfo, take: Callable[[int], tuple[np.ndarray[Any, Any], memoryview | None]]
) -> tuple[np.ndarray[Any, Any], memoryview, memoryview | None]:
    """:func:`_allocate` with ``take`` giving a frame too (see
    :meth:`~stream_st.memory.recycle.Recycler.take_framed`), returned third."""
    try:
        raw, frame = take(info.nbytes)
    except (MemoryError, ValueError, OSError) as exc:
        raise AllocationError(
            f"cannot allocate tensor {info.name!r} of {info.nbytes} bytes: {exc}"
        ) from None
    array = raw.view(info.array_dtype).reshape(info.array_shape)
    return array, raw.data, frame


def merge_ranges(
    ranges: Iterable[tuple[int, int]], merged: list[tuple[int, int]] | None = None
) -> list[tuple[int, int]]:
    """Ascending ``(start, end)`` ranges with empty ones dropped and touching ones joined;
    appended to ``merged`` (ranges merged before, all ending before these start) and returned
    in it when given, in a new list otherwise."""
    if merged is None:
        merged = []
    for start, end in ranges:
        if end <= start:
            continue
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _cut_short(info: TensorInfo, source: Source, base: int) -> TruncatedStreamError:
    """The error for ``info``'s bytes ending at ``source.position``, before the tensor did."""
    return TruncatedStreamError(
        f"tensor {info.name!r}",
        name=info.name,
        offset=source.position,
        expected=base + info.end,
        source=source.name,
    )


async def _read_tensor(
    source: Source,
    info: TensorInfo,
    base: int,
    target: tuple[np.ndarray[Any, Any], memoryview] | None = None,
    digests: Digests | None = None,
    whole: Hasher | None = None,
    take: Callable[[int], np.ndarray[Any, Any]] = fresh_bytes,
) -> np.ndarray[Any, Any]:
    """Read one tensor straight into a fresh array, or into ``target`` (memory the caller owns:
    an array and its byte view); never return a partly filled one, nor one that does not match
    its digest in ``digests``. ``whole`` is also fed the tensor's bytes (the object's digest).
    ``take`` gives the fresh memory (a stream's :class:`~stream_st.memory.recycle.Recycler`)."""
    start = base + info.start
    hasher = None if digests is None else digests.hasher()
    hashers = [h for h in (hasher, whole) if h is not None]
    read = (
        functools.partial(read_hashing, source, hashers=hashers) if hashers else source.read_into_at
    )
    if target is not None:
        array, view = target
        got = await read(start, view) if info.nbytes else 0
    elif source.size is None and info.nbytes > PROVE_ABOVE:
        proof = bytearray(PROOF_SIZE)
        got = await read(start, memoryview(proof))
        if got == PROOF_SIZE:
            array, view = _allocate(info, take)
            view[:PROOF_SIZE] = proof
            got += await read(source.position, view[PROOF_SIZE:])
    else:
        array, view = _allocate(info, take)
        got = await read(start, view) if info.nbytes else 0
    if got < info.nbytes:
        raise _cut_short(info, source, base)
    if digests is not None and hasher is not None:
        digests.check(info.name, hasher, source.name)
    return array


READ_CHUNK = 4 << 20
"""A verified tensor is read in chunks of this size, each hashed while the next one is read.
4 MiB measured best of 1, 2, 4 and 16 MiB and whole tensors (on a 2 GiB file of 32 MiB tensors,
paired against an unverified read, on a loaded 2-core machine): the chunk is still in the CPU's
caches when it is hashed."""


async def read_hashing(
    source: Source, offset: int, view: memoryview, *, hashers: Iterable[Hasher]
) -> int:
    """``source.read_into_at(offset, view)``, feeding every byte read to each of ``hashers``.

    A read of one chunk (:data:`READ_CHUNK`) or less is hashed once read (on the loop's thread
    when small). A bigger one goes in chunks, each hashed while the next one is read: by the
    source's own worker threads right after each read where it can (a local file:
    :meth:`~stream_st.transports.base.Source.read_feeding`, no thread hop per chunk), else in a
    worker
    thread fed chunk by chunk. Either way the bytes are hashed while still in the CPU's caches.
    Returns the bytes read (fewer if the source ended).
    """
    from ..core.digests import HASH_INLINE, update_sliced  # here: only a verified read hashes

    hashers = list(hashers)

    def update(piece: memoryview) -> None:
        for hasher in hashers:
            update_sliced(hasher, piece)

    total = len(view)
    if total <= READ_CHUNK:
        got = await source.read_into_at(offset, view)
        if got <= HASH_INLINE:
            update(view[:got])
        else:
            await anyio.to_thread.run_sync(update, view[:got])
        return got
    fed = await source.read_feeding(offset, view, update)
    if fed is not None:
        return fed
    send, receive = anyio.create_memory_object_stream[memoryview](0)

    async def hash_chunks() -> None:
        async with receive:
            async for piece in receive:
                await anyio.to_thread.run_sync(update, piece)

    got = 0
    async with task_group() as group:
        group.start_soon(hash_chunks)
        async with send:
            while got < total:
                chunk = view[got : got + READ_CHUNK]
                n = await source.read_into_at(offset + got, chunk)
                if n:
                    await send.send(chunk[:n])
                got += n
                if n < len(chunk):
                    break
    return got

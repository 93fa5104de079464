"""The sending side of a KV-cache transfer: the header at once, then each layer as it is produced,
its digest right after.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Unpack, cast

import anyio
import anyio.lowlevel
import numpy as np
from anyio.abc import ObjectReceiveStream, TaskGroup

from .._util import task_group
from ..connection import Connection
from ..core.codecs import Codec
from ..core.dtypes import dtype_for, wire_bytes
from ..errors import ArgumentTypeError, DtypeError, UsageError, integer_at_least
from ..transports.options import LimitOptions, Limits, TransportOptions, clock_of
from ..transports.registry import SinkLike
from ..writer import TensorWriter, open_writer
from .layout import Array, KVLayout, digest_name, key_name, value_name

__all__ = ["HASH_IN_THREAD", "SendReport", "send_kv"]


@dataclass
class SendReport:
    """When each layer was produced and when its last byte was handed to the transport
    (``time.perf_counter()`` values)."""

    produced_at: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    wire_bytes: int = 0
    header_sent_at: float = 0.0

    def __repr__(self) -> str:
        """The number of layers and each list's first and last times alone: a report of many
        layers stays short to print (``asyncio.run`` formats a task's result)."""
        return (
            f"SendReport(layers={len(self.produced_at)}, wire_bytes={self.wire_bytes!r}, "
            f"header_sent_at={self.header_sent_at!r}, produced_at={_ends(self.produced_at)}, "
            f"sent_at={_ends(self.sent_at)})"
        )


def _ends(times: list[float]) -> str:
    """``times`` as a list, those between the first and the last left out."""
    return repr(times) if len(times) <= 2 else f"[{times[0]!r}, ..., {times[-1]!r}]"


HASH_IN_THREAD = 256 << 10
"""Tensors from this size on are hashed in a worker thread (hashlib releases the GIL), so the
event loop keeps sending and receiving meanwhile."""

SAMPLES = 256
"""How many values of each key and value are noted when the producer yields them and compared
once their layer is sent and hashed: a producer that reuses its buffers changed them meanwhile."""


class LayerHash:
    """The SHA-256 of one layer's parts, fed in order while the bytes keep moving.

    :meth:`add` returns at once: the part is hashed in a task of ``group`` (in a worker thread
    from :data:`HASH_IN_THREAD` bytes on), after the parts added before it, so sending the next
    part, or receiving it, overlaps hashing this one. :meth:`digest` waits for all of them.
    """

    def __init__(self, group: TaskGroup) -> None:
        self._group = group
        self._sha = hashlib.sha256()
        self._last: anyio.Event | None = None

    def add(self, array: Array) -> None:
        before, self._last = self._last, anyio.Event()
        self._group.start_soon(self._update, before, wire_bytes(array), self._last)

    async def _update(
        self, before: anyio.Event | None, view: memoryview, done: anyio.Event
    ) -> None:
        if before is not None:
            await before.wait()
        if len(view) >= HASH_IN_THREAD:
            await anyio.to_thread.run_sync(self._sha.update, view)
        else:
            self._sha.update(view)
        done.set()

    async def digest(self) -> bytes:
        if self._last is not None:
            await self._last.wait()
        return self._sha.digest()


def _sample(array: Array) -> bytes:
    """The bytes of :data:`SAMPLES` values of ``array`` spread over it, at any strides."""
    if array.ndim == 0 or array.size <= SAMPLES:
        return array.tobytes()
    spread = np.linspace(0, array.size - 1, num=SAMPLES, dtype=np.intp)
    return array[np.unravel_index(spread, array.shape)].tobytes()


def _samples(item: object) -> tuple[bytes, ...]:
    """:func:`_sample` of a producer's key and value as yielded (nothing for an item that is no
    ``(layer, key, value)``: :func:`_checked` refuses it)."""
    if isinstance(item, tuple) and len(item) == 3:
        return tuple(_sample(part) for part in item[1:] if isinstance(part, np.ndarray))
    return ()


async def _write_layer(
    writer: TensorWriter,
    layout: KVLayout,
    codec: Codec,
    layer: int,
    key: Array,
    value: Array,
    yielded: tuple[bytes, ...],
) -> None:
    """Send one layer's parts, then its digest; ``yielded``: the key's and value's
    :func:`_sample` when the producer yielded them, checked once their bytes are sent and hashed
    (before the digest goes out), so a producer that reused a buffer meanwhile fails here, on
    the sender, and not as a layer the receiver finds corrupt."""
    async with task_group() as group:
        digest = LayerHash(group)
        for name, part in (
            *codec.encode(key_name(layer), key),
            *codec.encode(value_name(layer), value),
        ):
            array = np.ascontiguousarray(part)  # once, for both the send and the hash
            if layout.digest:
                digest.add(array)  # hashed while the part is being sent
            await writer.write(name, array)
        checksum = await digest.digest()
        for what, array, before in zip(("key", "value"), (key, value), yielded, strict=True):
            if _sample(array) != before:
                raise UsageError(
                    f"layer {layer} {what} changed after the producer yielded it, before it was "
                    "sent: does the producer reuse its buffers? Each array must stay unchanged "
                    "until its layer is sent, which may be after the next queue layers are "
                    "yielded (yield copies, or rotate queue + 1 sets of buffers)"
                )
        if layout.digest:
            await writer.write(digest_name(layer), np.frombuffer(checksum, dtype=np.uint8))


def _checked(item: object) -> tuple[int, Array, Array]:
    """A producer's ``(layer, key, value)``, or a UsageError saying what came instead."""
    if (
        not isinstance(item, tuple)
        or len(item) != 3
        or isinstance(item[0], bool)  # True is no layer 1
        or not isinstance(item[0], int | np.integer)
        or not all(isinstance(array, np.ndarray) for array in item[1:])
    ):
        kinds = [type(part).__name__ for part in item] if isinstance(item, tuple) else type(item)
        raise ArgumentTypeError(
            f"the producer must yield (layer: int, key: ndarray, value: ndarray), not {kinds}"
        )
    return int(item[0]), item[1], item[2]


def _code(array: Array) -> str | None:
    """The safetensors code of ``array``'s dtype; None for a dtype safetensors has none for."""
    try:
        return dtype_for(array.dtype).code
    except DtypeError:
        return None


_END = object()
"""What :class:`_Producer` asks ``next()`` / ``anext()`` for once the producer is exhausted."""


class _Producer:
    """The iterator of a producer's ``layers``, taken at once: its items as an async iterator,
    and that iterator (``layers`` itself, for a generator) closed (its ``aclose()`` or
    ``close()``) once, by whichever of :func:`send_kv`'s ways out comes first: the end of the
    iteration, or the end of the transfer (one that failed or was cancelled before the iteration
    started included).

    Whether the producer is async is decided once, from ``layers`` (as ``async for`` would), and
    its iterator is then only asked for its next item, as ``async for`` / ``for`` ask it: one
    with ``__anext__`` and no ``__aiter__`` of its own is an async iterator all the same."""

    def __init__(self, layers: AsyncIterable[Any] | Iterable[Any]) -> None:
        self._async = isinstance(layers, AsyncIterable)
        try:
            self._iterator: AsyncIterator[Any] | Iterator[Any] = (
                aiter(cast("AsyncIterable[Any]", layers))
                if self._async
                else iter(cast("Iterable[Any]", layers))
            )
        except TypeError as exc:  # its __aiter__ (__iter__) gave no iterator
            raise ArgumentTypeError(f"layers gave no iterator of layers: {exc}") from None
        self._closed = False

    async def items(self) -> AsyncGenerator[Any, None]:
        """The producer's items, a plain iterator's each taken in the event loop. Closing this
        generator closes the producer (its cleanup runs then, not whenever it is collected)."""
        try:
            if self._async:
                iterator = cast("AsyncIterator[Any]", self._iterator)
                while (item := await anext(iterator, _END)) is not _END:
                    yield item
            else:
                plain = cast("Iterator[Any]", self._iterator)
                while (item := next(plain, _END)) is not _END:
                    yield item
                    await anyio.lowlevel.checkpoint()
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the producer, the first time only: an async iterator's ``aclose()``, a plain
        one's ``close()``, where it has one."""
        if self._closed:
            return
        self._closed = True
        close = getattr(self._iterator, "aclose" if self._async else "close", None)
        if close is None:
            return
        if self._async:
            await close()
        else:
            close()


async def send_kv(
    dst: Connection | SinkLike,
    layout: KVLayout,
    layers: AsyncIterable[tuple[int, Array, Array]] | Iterable[tuple[int, Array, Array]],
    *,
    queue: int = 2,
    **options: Unpack[TransportOptions],
) -> SendReport:
    """Send a KV cache layer by layer as ``layers`` yields ``(layer, key, value)`` in order.
    ``layers`` is an async iterable (an ``async def`` generator) or a plain one (a list, a
    generator: each item is taken in the event loop, so a slow one holds it up).

    The header goes out before layer 0 exists. The producer runs ahead of the connection by at
    most ``queue`` layers: a slow receiver slows the producer (backpressure), never grows memory.
    If the transfer fails (the receiver went away, a layer is out of order or misshapen), it
    raises at once and stops pulling from the producer; the receiver sees an incomplete message.
    If the producer raises, the layers it made before go out whole first (the receiver has
    them, verified), then the transfer ends with the producer's exception. ``layers`` is closed
    (its ``aclose()`` or ``close()``; for one whose ``__aiter__`` / ``__iter__`` hands out
    another object, that iterator's) when the transfer ends, whichever way.

    Each key and value yielded is read until its layer is sent, which may be after the next
    ``queue`` layers are yielded: it must stay unchanged until then. A producer that refills
    the same buffers for each layer must yield copies (or rotate ``queue + 1`` sets of
    buffers); one that changes a buffer too early is caught in most cases
    (:class:`~stream_st.UsageError`, before that layer's digest goes out).
    Time limits as in :func:`~stream_st.open_writer` (on a Connection, the connection's unless
    given here), and for any other destination ``headers`` and ``ssl_context`` as there (an
    ``https://`` or ``s3://`` URL); any other keyword is an :class:`~stream_st.ArgumentTypeError`.
    Keys and values are of the layout's ``dtype``; a layout with a ``wire_dtype`` (a seed-style
    cache's, as received) is a :class:`~stream_st.UsageError`: the transfer's metadata has no
    word for tensors stored in another dtype than ``kv_dtype``.
    """
    if not isinstance(layers, AsyncIterable | Iterable):
        raise UsageError(
            f"layers must be an iterable or async iterable of (layer, key, value), "
            f"not {type(layers).__name__}"
        )
    producer = _Producer(layers)
    try:  # closed on every way out, a failure or a cancellation before the first layer included
        return await _send(dst, layout, producer, queue=queue, **options)
    finally:
        await producer.close()


async def _send(
    dst: Connection | SinkLike,
    layout: KVLayout,
    producer: _Producer,
    *,
    queue: int,
    **options: Unpack[TransportOptions],
) -> SendReport:
    """The transfer of :func:`send_kv`, of ``producer``'s layers (``send_kv`` closes the
    producer whichever way this ends)."""
    if not isinstance(layout, KVLayout):
        raise ArgumentTypeError(f"layout must be a KVLayout, not {type(layout).__name__}")
    if layout.wire_dtype is not None:  # no metadata key says so: the tensors are of kv_dtype
        raise UsageError(
            f"a KV transfer's tensors are of its dtype ({layout.dtype}), not wire_dtype "
            f"{layout.wire_dtype}: wire_dtype describes a seed-style cache as received; send "
            f"dataclasses.replace(layout, wire_dtype=None) with {layout.dtype} layers, or "
            f"a layout of dtype {layout.wire_dtype}"
        )
    queue = integer_at_least("queue", queue, 1)
    report = SendReport()
    codec = layout.get_codec()
    # checksums=, fsync=... would reach open_writer; a Connection takes no transport options
    if isinstance(dst, Connection):
        Limits.of(options, transport=False)
        limits = cast("LimitOptions", options)  # checked: no headers or ssl_context
        writer = dst.open_writer(layout.plan(), metadata=layout.metadata(), **limits)
    else:
        clock_of(options)
        writer = open_writer(dst, layout.plan(), metadata=layout.metadata(), **options)
    send_layers, receive_layers = anyio.create_memory_object_stream[
        tuple[object, tuple[bytes, ...]]
    ](max_buffer_size=max(0, queue - 1))

    failed: list[Exception] = []  # the producer's own failure, raised once its layers are out

    async def produce() -> None:
        # The producer's failure ends the transfer with its error, after the layers it made
        # before (queued, or being sent) have gone out whole: the receiver has them, verified.
        try:
            async with contextlib.aclosing(producer.items()) as items:
                async for item in items:
                    report.produced_at.append(time.perf_counter())
                    try:  # noted before the producer can change them
                        await send_layers.send((item, _samples(item)))
                    except anyio.BrokenResourceError:
                        return  # the sending side failed and stopped listening: it reports
        except Exception as exc:
            failed.append(exc)
        await send_layers.aclose()

    dtype = dtype_for(layout.dtype)

    async def consume(items: ObjectReceiveStream[tuple[object, tuple[bytes, ...]]]) -> None:
        async with items:
            expected = 0
            async for item, yielded in items:
                layer, key, value = _checked(item)
                if layer != expected:
                    raise UsageError(f"layer {layer} produced where layer {expected} was due")
                for what, array in (("key", key), ("value", value)):
                    if tuple(array.shape) != layout.shape:
                        raise UsageError(
                            f"layer {layer} {what} has shape {list(array.shape)}, "
                            f"the layout says {list(layout.shape)}"
                        )
                    if _code(array) != dtype.code:  # any byte order, as the writer takes
                        raise UsageError(
                            f"layer {layer} {what} has dtype {array.dtype}, "
                            f"the layout says {dtype.code} ({dtype.numpy})"
                        )
                await _write_layer(writer, layout, codec, layer, key, value, yielded)
                report.sent_at.append(time.perf_counter())
                expected += 1
            if failed:
                raise failed[0]
            if expected != layout.num_layers:
                raise UsageError(
                    f"the producer stopped after {expected} of {layout.num_layers} layers"
                )

    with send_layers, receive_layers:  # closed on every way out, a failed open included
        async with writer:
            report.header_sent_at = time.perf_counter()
            async with task_group() as group:  # a failure leaves the writer's block: aborted
                group.start_soon(produce)
                await consume(receive_layers)
    report.wire_bytes = writer.header.file_size
    return report

"""The sending side of a KV-cache transfer: the header at once, then each layer as it is produced,
its digest right after.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Unpack

import anyio
import anyio.lowlevel
import numpy as np
from anyio.abc import ObjectReceiveStream, TaskGroup

from .._util import task_group
from ..connection import Connection
from ..core.codecs import Codec
from ..core.dtypes import wire_bytes
from ..errors import ArgumentTypeError, UsageError, integer_at_least
from ..transports.options import LimitOptions
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


HASH_IN_THREAD = 256 << 10
"""Tensors from this size on are hashed in a worker thread (hashlib releases the GIL), so the
event loop keeps sending and receiving meanwhile."""


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


async def _write_layer(
    writer: TensorWriter, layout: KVLayout, codec: Codec, layer: int, key: Array, value: Array
) -> None:
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
        if layout.digest:
            checksum = np.frombuffer(await digest.digest(), dtype=np.uint8)
            await writer.write(digest_name(layer), checksum)


def _checked(item: object) -> tuple[int, Array, Array]:
    """A producer's ``(layer, key, value)``, or a UsageError saying what came instead."""
    if (
        not isinstance(item, tuple)
        or len(item) != 3
        or not isinstance(item[0], int | np.integer)
        or not all(isinstance(array, np.ndarray) for array in item[1:])
    ):
        kinds = [type(part).__name__ for part in item] if isinstance(item, tuple) else type(item)
        raise UsageError(
            f"the producer must yield (layer: int, key: ndarray, value: ndarray), not {kinds}"
        )
    return int(item[0]), item[1], item[2]


async def _each_of(items: AsyncIterable[Any] | Iterable[Any]) -> AsyncIterator[Any]:
    """The items of an async or a plain iterable, as an async iterator."""
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
            await anyio.lowlevel.checkpoint()


async def send_kv(
    dst: Connection | SinkLike,
    layout: KVLayout,
    layers: AsyncIterable[tuple[int, Array, Array]] | Iterable[tuple[int, Array, Array]],
    *,
    queue: int = 2,
    **limits: Unpack[LimitOptions],
) -> SendReport:
    """Send a KV cache layer by layer as ``layers`` yields ``(layer, key, value)`` in order.
    ``layers`` is an async iterable (an ``async def`` generator) or a plain one (a list, a
    generator: each item is taken in the event loop, so a slow one holds it up).

    The header goes out before layer 0 exists. The producer runs ahead of the connection by at
    most ``queue`` layers: a slow receiver slows the producer (backpressure), never grows memory.
    If the transfer fails (the receiver went away, a layer is out of order or misshapen), it
    raises at once and stops pulling from the producer; the receiver sees an incomplete message.
    If the producer raises, the layers it made before go out whole first (the receiver has
    them, verified), then the transfer ends with the producer's exception.
    Time limits as in :func:`~stream_st.open_writer` (on a Connection, the connection's unless
    given here).
    """
    if not isinstance(layout, KVLayout):
        raise ArgumentTypeError(f"layout must be a KVLayout, not {type(layout).__name__}")
    if not isinstance(layers, AsyncIterable | Iterable):
        raise UsageError(
            f"layers must be an iterable or async iterable of (layer, key, value), "
            f"not {type(layers).__name__}"
        )
    queue = integer_at_least("queue", queue, 1)
    report = SendReport()
    codec = layout.get_codec()
    if isinstance(dst, Connection):
        writer = dst.open_writer(layout.plan(), metadata=layout.metadata(), **limits)
    else:
        writer = open_writer(dst, layout.plan(), metadata=layout.metadata(), **limits)
    send_layers, receive_layers = anyio.create_memory_object_stream[tuple[int, Array, Array]](
        max_buffer_size=max(0, queue - 1)
    )

    failed: list[Exception] = []  # the producer's own failure, raised once its layers are out

    async def produce() -> None:
        # The producer's failure ends the transfer with its error, after the layers it made
        # before (queued, or being sent) have gone out whole: the receiver has them, verified.
        try:
            async for item in _each_of(layers):
                report.produced_at.append(time.perf_counter())
                try:
                    await send_layers.send(item)
                except anyio.BrokenResourceError:
                    return  # the sending side failed and stopped listening: its error is reported
        except Exception as exc:
            failed.append(exc)
        await send_layers.aclose()

    async def consume(items: ObjectReceiveStream[tuple[int, Array, Array]]) -> None:
        async with items:
            expected = 0
            async for item in items:
                layer, key, value = _checked(item)
                if layer != expected:
                    raise UsageError(f"layer {layer} produced where layer {expected} was due")
                for what, array in (("key", key), ("value", value)):
                    if tuple(array.shape) != layout.shape:
                        raise UsageError(
                            f"layer {layer} {what} has shape {list(array.shape)}, "
                            f"the layout says {list(layout.shape)}"
                        )
                await _write_layer(writer, layout, codec, layer, key, value)
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

"""Pipelined KV-cache transfer: layer 0 is in use at the receiver while the sender computes on.

A transfer is one plain safetensors message (any reader can open it) laid out as::

    layer_0_key, layer_0_value, layer_0_digest, layer_1_key, ... layer_{L-1}_digest

``layer_{i}_key`` / ``layer_{i}_value`` have shape ``[batch, n_kv_heads, seq, head_dim]`` in F16,
BF16 or F32, or the wire tensors of a codec (``stream_st.codecs``: INT8 adds ``.scale``, INT4 packs
codes in U8 and adds ``.scales``). ``layer_{i}_digest`` is U8 ``[32]``: the SHA-256 of every wire
byte of the layer's key and value tensors in plan order. Its size is fixed, so every offset is
known before any layer exists: the sender writes the header first, then each layer as soon as it
is produced, and fills the digest right after. The receiver checks the digest before it hands the
layer out, so a corrupted layer is never delivered as good.

``__metadata__`` records the codec (``compression``, ``group_size``, ``original_dtype``, ...), and
``kv_layers``, ``kv_shape``, ``kv_dtype``, ``kv_digest`` so a receiver knows the layout from the
header alone.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Unpack

import anyio
import numpy as np
from anyio.abc import ObjectReceiveStream, TaskGroup

from ._api import open_stream
from ._util import task_group
from .connection import Connection
from .core.codecs import Codec, codec_from_metadata, get_codec
from .core.dtypes import dtype_for, wire_bytes
from .core.header import Header, TensorSpec
from .errors import HeaderError, IntegrityError, UsageError
from .reader import TensorStream
from .transports.options import LimitOptions
from .transports.registry import SinkLike, SourceLike
from .writer import TensorWriter, open_writer

__all__ = [
    "DIGEST_SIZE",
    "IntegrityError",
    "KVLayout",
    "KVReceiver",
    "SendReport",
    "receive_kv",
    "send_kv",
]

Array = np.ndarray[Any, Any]
DIGEST_SIZE = 32


def key_name(layer: int) -> str:
    return f"layer_{layer}_key"


def value_name(layer: int) -> str:
    return f"layer_{layer}_value"


def digest_name(layer: int) -> str:
    return f"layer_{layer}_digest"


@dataclass(frozen=True)
class KVLayout:
    """What a transfer carries: ``num_layers`` of key and value, each of ``shape`` and ``dtype``
    (a safetensors code: F16, BF16, F32), through ``codec`` ("none", "int8", "int4")."""

    num_layers: int
    shape: tuple[int, ...]
    dtype: str = "F16"
    codec: str = "none"
    group_size: int = 64
    digest: bool = True

    def __post_init__(self) -> None:
        if self.num_layers < 1 or len(self.shape) != 4:
            raise UsageError(
                "a KV layout needs >= 1 layer and a [batch, heads, seq, head_dim] shape"
            )
        if self.dtype not in ("F16", "BF16", "F32"):
            raise UsageError(f"KV dtype must be F16, BF16 or F32, not {self.dtype!r}")
        self.layer_specs(0)  # a codec that cannot carry this shape says so now, not mid-send

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return dtype_for(self.dtype).numpy

    def get_codec(self) -> Codec:
        return get_codec(self.codec, group_size=self.group_size if self.codec == "int4" else None)

    def layer_specs(self, layer: int) -> list[TensorSpec]:
        """The wire tensors of one layer: key parts, value parts, then the digest."""
        codec = self.get_codec()
        specs = [
            *codec.specs(key_name(layer), self.shape, self.dtype),
            *codec.specs(value_name(layer), self.shape, self.dtype),
        ]
        if self.digest:
            specs.append(TensorSpec(digest_name(layer), "U8", (DIGEST_SIZE,)))
        return specs

    def plan(self) -> list[TensorSpec]:
        return [spec for layer in range(self.num_layers) for spec in self.layer_specs(layer)]

    def metadata(self) -> dict[str, str]:
        meta = self.get_codec().metadata(self.numpy_dtype)
        meta.update(
            kv_layers=str(self.num_layers),
            kv_shape=json.dumps(list(self.shape)),
            kv_dtype=self.dtype,
            kv_digest="sha256" if self.digest else "none",
            kv_layout="layer_{i}_key / layer_{i}_value: [batch, n_kv_heads, seq, head_dim]",
        )
        return meta

    @property
    def layer_bytes(self) -> int:
        """Wire bytes of one layer (key, value, codec siblings and digest)."""
        total = 0
        for spec in self.layer_specs(0):
            bits = dtype_for(spec.dtype).bits
            total += int(np.prod(spec.shape, dtype=np.int64)) * bits // 8
        return total

    @classmethod
    def from_header(cls, header: Header) -> KVLayout:
        meta = header.metadata
        try:
            layout = cls(
                num_layers=int(meta["kv_layers"]),
                shape=tuple(int(d) for d in json.loads(meta["kv_shape"])),
                dtype=meta["kv_dtype"],
                codec=codec_from_metadata(meta).key,
                group_size=int(meta.get("group_size", "64")),
                digest=meta.get("kv_digest", "sha256") == "sha256",
            )
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            raise HeaderError(
                f"not a KV-cache transfer: bad or missing KV metadata ({exc})"
            ) from None
        except UsageError as exc:
            raise HeaderError(f"not a KV-cache transfer: {exc}") from None
        if layout.num_layers * len(layout.layer_specs(0)) != len(header.tensors):
            raise HeaderError(  # checked before the plan is built: kv_layers may be anything
                f"the metadata announces {layout.num_layers} KV layers, "
                f"the header holds {len(header.tensors)} tensors"
            )
        expected = [(s.name, dtype_for(s.dtype).code, s.shape) for s in layout.plan()]
        actual = [(t.name, t.dtype, t.shape) for t in header.tensors]
        if expected != actual:
            raise HeaderError("the tensors do not follow the KV layout their metadata announces")
        return layout


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


class _LayerHash:
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
        digest = _LayerHash(group)
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


async def send_kv(
    dst: Connection | SinkLike,
    layout: KVLayout,
    layers: AsyncIterable[tuple[int, Array, Array]],
    *,
    queue: int = 2,
    **limits: Unpack[LimitOptions],
) -> SendReport:
    """Send a KV cache layer by layer as ``layers`` yields ``(layer, key, value)`` in order.

    The header goes out before layer 0 exists. The producer runs ahead of the connection by at
    most ``queue`` layers: a slow receiver slows the producer (backpressure), never grows memory.
    If the transfer fails (the receiver went away, a layer is out of order or misshapen), it
    raises at once and stops pulling from the producer; the receiver sees an incomplete message.
    Time limits as in :func:`~stream_st.open_writer` (on a Connection, the connection's unless
    given here).
    """
    report = SendReport()
    codec = layout.get_codec()
    if isinstance(dst, Connection):
        writer = dst.open_writer(layout.plan(), metadata=layout.metadata(), **limits)
    else:
        writer = open_writer(dst, layout.plan(), metadata=layout.metadata(), **limits)
    send_layers, receive_layers = anyio.create_memory_object_stream[tuple[int, Array, Array]](
        max_buffer_size=max(0, queue - 1)
    )

    async def produce() -> None:
        # The producer's own failure ends the transfer with its error: the channel is closed
        # only after the last layer, so the sending side never takes a failure for an early end.
        async for item in layers:
            report.produced_at.append(time.perf_counter())
            try:
                await send_layers.send(item)
            except anyio.BrokenResourceError:
                return  # the sending side failed and stopped listening: its error is reported
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


class KVReceiver:
    """The receiving side of a transfer; made by :func:`receive_kv`.

    Layers are read in the background as they arrive and verified before they are handed out,
    at most ``max_ahead`` layers past the highest one asked for: a slow consumer stops the
    reading, which stops the sender (backpressure), and memory stays bounded. Iterate for
    ``(layer, key, value)`` in order, or ``await wait_for_layer(i)`` for one layer (as attention
    does, layer by layer). ``received_at`` and ``verified_at`` time each layer
    (``time.perf_counter()`` values).
    """

    def __init__(self, layout: KVLayout, source: str, *, max_ahead: int = 2) -> None:
        if max_ahead < 0:
            raise UsageError("max_ahead must be >= 0")
        self.layout = layout
        self.source = source
        self.max_ahead = max_ahead
        self._asked = -1  # the highest layer asked for so far
        self._asked_changed = anyio.Event()
        self.received_at: list[float] = []
        self.verified_at: list[float] = []
        self._codec = layout.get_codec()
        self._layers: dict[int, tuple[Array, Array]] = {}
        self._events = [anyio.Event() for _ in range(layout.num_layers)]
        self._error: BaseException | None = None
        self._next = 0

    async def wait_for_layer(self, layer: int) -> tuple[Array, Array]:
        """Key and value of ``layer``, once it has arrived and passed its check."""
        if not 0 <= layer < self.layout.num_layers:
            raise UsageError(f"no layer {layer}: the transfer has {self.layout.num_layers}")
        if layer > self._asked:
            self._asked = layer
            self._asked_changed.set()  # the reader may go on
            self._asked_changed = anyio.Event()
        await self._events[layer].wait()
        if layer in self._layers:
            return self._layers[layer]
        assert self._error is not None
        raise self._error

    def __aiter__(self) -> AsyncIterator[tuple[int, Array, Array]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, Array, Array]]:
        for layer in range(self.layout.num_layers):
            key, value = await self.wait_for_layer(layer)
            yield layer, key, value

    async def _run(self, stream: TensorStream) -> None:
        try:
            await self._read(stream)
        except Exception as exc:  # handed to whoever waits for a layer, as a plain exception
            self._error = exc
        finally:
            for event in self._events:
                event.set()

    async def _read(self, stream: TensorStream) -> None:
        async with task_group() as group:
            finished: anyio.Event | None = None  # set when the previous layer is settled
            try:
                layer = 0
                wanted = len(self.layout.layer_specs(0))
                parts: dict[str, Array] = {}
                digest = _LayerHash(group)
                async for name, array in stream:
                    parts[name] = array
                    if self.layout.digest and name != digest_name(layer):
                        digest.add(array)  # hashed while the next part arrives
                    if len(parts) < wanted:
                        continue
                    self.received_at.append(time.perf_counter())
                    before, finished = finished, anyio.Event()
                    group.start_soon(self._settle, layer, parts, digest, before, finished)
                    layer += 1
                    parts = {}
                    digest = _LayerHash(group)
                    while layer < self.layout.num_layers and layer > self._asked + self.max_ahead:
                        await self._asked_changed.wait()  # the consumer is behind: stop reading
            except Exception:
                if finished is not None:
                    await finished.wait()  # layers read in full are still verified and handed out
                raise

    async def _settle(
        self,
        layer: int,
        parts: dict[str, Array],
        digest: _LayerHash,
        before: anyio.Event | None,
        finished: anyio.Event,
    ) -> None:
        """Verify and decode one layer read in full, then hand it out after the one before."""
        if before is not None:
            await before.wait()  # in order: nothing is handed out past a layer that failed
        if self.layout.digest and await digest.digest() != bytes(parts[digest_name(layer)]):
            raise IntegrityError(
                f"layer {layer} from {self.source} failed its SHA-256 check; not delivered",
                name=digest_name(layer),
                source=self.source,
                layer=layer,
            )
        dtype = self.layout.numpy_dtype
        key = self._codec.decode(key_name(layer), parts, dtype)
        value = self._codec.decode(value_name(layer), parts, dtype)
        self._layers[layer] = (key, value)
        self.verified_at.append(time.perf_counter())
        self._events[layer].set()
        finished.set()

    def release(self, layer: int) -> None:
        """Forget a layer handed out already (to bound memory when consuming once)."""
        self._layers.pop(layer, None)


@asynccontextmanager
async def receive_kv(
    source: Connection | SourceLike, *, max_ahead: int = 2, **limits: Unpack[LimitOptions]
) -> AsyncIterator[KVReceiver]:
    """Receive one KV-cache transfer from ``source`` (a Connection, ``tcp://`` URL, path...).

    The header is read and checked against the KV layout on entry. Leaving the block stops
    reading (on a Connection, an unfinished message leaves it unusable: close it). Time limits
    as in :func:`~stream_st.open_stream` (on a Connection, the connection's unless given here).
    """
    stream = (
        source.open_stream(**limits)
        if isinstance(source, Connection)
        else open_stream(source, **limits)
    )
    async with stream:
        receiver = KVReceiver(
            KVLayout.from_header(stream.header), stream.source.name, max_ahead=max_ahead
        )
        async with task_group() as group:
            group.start_soon(receiver._run, stream)
            try:
                yield receiver
            finally:
                group.cancel_scope.cancel()

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

The receiver also reads seed-style caches other programs write: ``layer_{i}_key`` /
``layer_{i}_value`` (and codec siblings) with no ``kv_*`` metadata, in any order, the layout
inferred from names and shapes and reported unverified (no layer digests). The byte-level
specification, for implementations in other languages, is ``docs/kv-wire-format.md``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Unpack

import anyio
import anyio.lowlevel
import numpy as np
from anyio.abc import ObjectReceiveStream, TaskGroup

from ._api import open_stream
from ._util import task_group
from .connection import Connection
from .core.codecs import Codec, codec_from_metadata, get_codec
from .core.dtypes import dtype_for, wire_bytes
from .core.header import Header
from .core.layout import TensorSpec
from .core.strict_json import decode_json
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
    wire_dtype: str | None = None
    """With codec "none", the dtype the tensors travel in when it is not ``dtype`` (a cache
    written in one float type whose ``original_dtype`` names another): decoding casts."""
    style: str = "stream_st"
    """"stream_st": laid out by :func:`send_kv`, its metadata announces it. "seed": inferred
    from ``layer_{i}_key`` / ``layer_{i}_value`` names and shapes alone (the exchange format
    other programs write; see ``docs/kv-wire-format.md``), any tensor order."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """What the receiver decided about the header where it was ambiguous (a seed-style cache
    whose metadata contradicts its tensors)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1 or len(self.shape) != 4:
            raise UsageError(
                "a KV layout needs >= 1 layer and a [batch, heads, seq, head_dim] shape"
            )
        for dtype in (self.dtype, self.wire_dtype or self.dtype):
            if dtype not in ("F16", "BF16", "F32"):
                raise UsageError(f"KV dtype must be F16, BF16 or F32, not {dtype!r}")
        if self.style not in ("stream_st", "seed"):
            raise UsageError(f"KV layout style must be 'stream_st' or 'seed', not {self.style!r}")
        self.layer_specs(0)  # a codec that cannot carry this shape says so now, not mid-send

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return dtype_for(self.dtype).numpy

    def get_codec(self) -> Codec:
        return get_codec(self.codec, group_size=self.group_size if self.codec == "int4" else None)

    def layer_specs(self, layer: int) -> list[TensorSpec]:
        """The wire tensors of one layer: key parts, value parts, then the digest."""
        codec = self.get_codec()
        wire = self.wire_dtype or self.dtype
        specs = [
            *codec.specs(key_name(layer), self.shape, wire),
            *codec.specs(value_name(layer), self.shape, wire),
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
        """The layout a header announces (``kv_*`` metadata, as :func:`send_kv` writes it) or,
        without any ``kv_*`` key, the seed-style layout its tensor names and shapes imply.
        :class:`~stream_st.HeaderError` if it is neither."""
        meta = header.metadata
        if not any(key in meta for key in _KV_KEYS):
            return _seed_layout(header)
        try:
            layout = cls(
                num_layers=int(meta["kv_layers"]),
                shape=_kv_shape(meta["kv_shape"]),
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


_KV_KEYS = ("kv_layers", "kv_shape", "kv_dtype", "kv_digest")
"""Metadata keys of a transfer laid out by :func:`send_kv`; a header with none of them is read
as a seed-style cache."""

_FLOAT_CODES = ("F16", "BF16", "F32")
_SEED_PARTS = {  # name suffix after layer_{i}_ -> (role, codec part)
    "key": ("key", ""),
    "value": ("value", ""),
    "key.scale": ("key", ".scale"),
    "value.scale": ("value", ".scale"),
    "key.scales": ("key", ".scales"),
    "value.scales": ("value", ".scales"),
}


def _kv_shape(text: str) -> tuple[int, ...]:
    """The ``kv_shape`` metadata (a JSON list of integers, from a peer) parsed by the header's
    strict, bounded parser: a ValueError (a :class:`~stream_st.HeaderError` where it is not
    JSON, however deeply nested) for anything else."""
    shape = decode_json(text, "'kv_shape'", strict=True)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise ValueError("'kv_shape' is not a JSON list of integers")
    return tuple(shape)


def _seed_name(name: str) -> tuple[int, str] | None:
    """``(layer, suffix)`` of a seed-style tensor name, or None if it is not one."""
    if not name.startswith("layer_"):
        return None
    number, _, suffix = name[len("layer_") :].partition("_")
    if not number.isdecimal() or not number.isascii() or str(int(number)) != number:
        return None  # "layer_01_key", "layer_1_key" spelled otherwise: not canonical
    if suffix not in _SEED_PARTS:
        return None
    return int(number), suffix


def _original_dtype(meta: dict[str, str]) -> str | None:
    """The seed's ``original_dtype`` (``"float32"``, ``"torch.float16"``, ``"F16"``...) as a
    safetensors code, or None when absent."""
    raw = meta.get("original_dtype")
    if raw is None:
        return None
    try:
        code = dtype_for(raw.removeprefix("torch.")).code
    except ValueError:  # DtypeError: not a dtype at all
        code = ""
    if code not in _FLOAT_CODES:
        raise HeaderError(
            f"not a KV cache: original_dtype {raw!r} is not float16, bfloat16 or float32"
        )
    return code


def _seed_layout(header: Header) -> KVLayout:
    """The layout of a cache written by another program: ``layer_{i}_key`` / ``layer_{i}_value``
    of one 4-D shape, no ``kv_*`` metadata, no per-layer digests, any tensor order.

    The tensors decide what the bytes are; the seed's metadata is honoured where it agrees:
    ``compression`` must match the wire tensors when they are encoded (I8 + ``.scale``: INT8,
    U8 + ``.scales``: INT4) and is recorded as a note when the tensors are plain floats (they are
    read as they are: decoding them as INT4 would misread every byte); ``group_size`` must match
    the INT4 scales' shape; ``original_dtype`` is the dtype the layers are handed out in.
    """
    meta = header.metadata
    tensors = {info.name: info for info in header.tensors}
    if not tensors:
        raise HeaderError("not a KV cache: no KV metadata and no layer_{i}_key tensors")
    layers: dict[int, dict[str, str]] = {}
    for name in tensors:
        parsed = _seed_name(name)
        if parsed is None:
            raise HeaderError(
                f"not a KV cache: tensor {name!r} is not layer_{{i}}_key or layer_{{i}}_value "
                "(or a codec's .scale / .scales of one), and there is no KV metadata"
            )
        layer, suffix = parsed
        layers.setdefault(layer, {})[suffix] = name
    num_layers = len(layers)
    if max(layers) != num_layers - 1:  # then some layer below num_layers is missing
        missing = [layer for layer in range(num_layers) if layer not in layers]
        raise HeaderError(
            f"not a KV cache: layer_{{i}} tensors for layers up to {max(layers)}, "
            f"but layers {missing[:5]} are missing"
        )
    first = tensors.get(key_name(0))
    if first is None:
        raise HeaderError("not a KV cache: layer_0_key is missing")
    codec = {
        "I8": "int8",
        "U8": "int4",
    }.get(first.dtype, "none" if first.dtype in _FLOAT_CODES else "")
    if not codec:
        raise HeaderError(
            f"not a KV cache: layer_0_key is {first.dtype}; a KV cache holds F16, BF16 or F32 "
            "tensors, or INT8 (I8 + .scale) or INT4 (U8 + .scales) codes"
        )
    wanted = {"none": {"key", "value"}, "int8": {"key", "value", "key.scale", "value.scale"}}
    wanted["int4"] = {"key", "value", "key.scales", "value.scales"}
    for layer, parts in layers.items():
        if set(parts) != wanted[codec]:
            raise HeaderError(
                f"not a KV cache: layer {layer} has {sorted(parts)}; a {codec} cache has "
                f"{sorted(wanted[codec])} in every layer"
            )
    notes: list[str] = []
    declared = meta.get("compression")
    if declared is not None and declared.lower() not in ("none", "int8", "int4"):
        raise HeaderError(f"not a KV cache: unknown compression {declared!r} in the metadata")
    if declared is not None and declared.lower() != codec:
        if codec != "none":
            raise HeaderError(
                f"the metadata says compression {declared!r}, the tensors are {codec.upper()} "
                "codes: which one is meant cannot be told"
            )
        notes.append(
            f"compression {declared!r} in the metadata, but the tensors are plain "
            f"{first.dtype} values: read as they are (the metadata describes how they were "
            "produced, not how they are stored)"
        )
    original = _original_dtype(meta)
    group_size = 64
    if codec == "none":
        shape = first.shape
        dtype, wire = original or first.dtype, first.dtype
    else:
        dtype, wire = original or "F32", None
        if original is None:
            notes.append("no original_dtype in the metadata: decoded to float32")
        scales = tensors[layers[0]["key" + (".scale" if codec == "int8" else ".scales")]]
        if codec == "int8":
            shape = first.shape
        else:
            if len(first.shape) != 4 or len(scales.shape) != 4 or scales.shape[-1] < 1:
                raise HeaderError(
                    f"not a KV cache: INT4 codes {list(first.shape)} and scales "
                    f"{list(scales.shape)} are not [batch, heads, seq, head_dim / 2] and "
                    "[batch, heads, seq, head_dim / group_size]"
                )
            shape = (*first.shape[:-1], 2 * first.shape[-1])
            group_size = shape[-1] // scales.shape[-1]
            if group_size * scales.shape[-1] != shape[-1]:
                raise HeaderError(
                    f"not a KV cache: INT4 codes of {shape[-1]} values a row do not split into "
                    f"{scales.shape[-1]} equal groups"
                )
    if "group_size" in meta and (codec == "int4" or (declared or "").lower() == "int4"):
        raw = meta["group_size"]
        if not (raw.isdecimal() and raw.isascii() and int(raw) > 0):
            raise HeaderError(f"not a KV cache: group_size {raw!r} is not a positive integer")
        if codec == "int4" and int(raw) != group_size:
            raise HeaderError(
                f"the metadata says group_size {raw}, the INT4 scales' shape says {group_size}"
            )
    if wire is not None and wire == dtype:
        wire = None
    try:
        layout = KVLayout(
            num_layers=num_layers,
            shape=tuple(shape),
            dtype=dtype,
            codec=codec,
            group_size=group_size,
            digest=False,
            wire_dtype=wire,
            style="seed",
            notes=tuple(notes),
        )
    except (UsageError, ValueError) as exc:  # ValueError: CodecError, a shape INT4 cannot carry
        raise HeaderError(f"not a KV cache: {exc}") from None
    by_name = {s.name: (dtype_for(s.dtype).code, s.shape) for s in layout.plan()}
    for name, info in tensors.items():
        if by_name.get(name) != (info.dtype, info.shape):
            want = by_name.get(name)
            raise HeaderError(
                f"not a KV cache: {name!r} is {info.dtype} {list(info.shape)}, the cache's "
                f"layer_0 makes it {want[0]} {list(want[1])}"
                if want
                else f"not a KV cache: unexpected tensor {name!r}"
            )
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
    Time limits as in :func:`~stream_st.open_writer` (on a Connection, the connection's unless
    given here).
    """
    if not isinstance(layers, AsyncIterable | Iterable):
        raise UsageError(
            f"layers must be an iterable or async iterable of (layer, key, value), "
            f"not {type(layers).__name__}"
        )
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
        async for item in _each_of(layers):
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

    ``integrity`` says what was checked before a layer was handed out: ``"layer-sha256"`` (each
    layer's ``layer_{i}_digest``), ``"tensor-digests"`` (the file's ``stream_st.digest`` keys,
    checked by the reader tensor by tensor) or ``"unverified"`` (nothing: a seed-style cache, or
    a transfer sent without digests); ``verified`` is False for the last. A seed-style cache's
    layers may lie in any order in the file: each is handed out once all its parts arrived,
    and reading goes on past ``max_ahead`` while the layer asked for has not (the file's order,
    not the receiver, then decides how many layers wait in memory).
    """

    def __init__(
        self, layout: KVLayout, source: str, *, max_ahead: int = 2, integrity: str | None = None
    ) -> None:
        if max_ahead < 0:
            raise UsageError("max_ahead must be >= 0")
        self.layout = layout
        self.source = source
        self.max_ahead = max_ahead
        self.integrity = integrity or ("layer-sha256" if layout.digest else "unverified")
        self._asked = -1  # the highest layer asked for so far
        self._asked_changed = anyio.Event()
        self.received_at: list[float] = []
        self.verified_at: list[float] = []
        self._codec = layout.get_codec()
        self._layers: dict[int, tuple[Array, Array]] = {}
        self._events = [anyio.Event() for _ in range(layout.num_layers)]
        self._error: BaseException | None = None
        self._next = 0

    @property
    def verified(self) -> bool:
        """Whether every layer handed out was checked against a digest (see ``integrity``)."""
        return self.integrity != "unverified"

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
        layer_of = {
            spec.name: layer
            for layer in range(self.layout.num_layers)
            for spec in self.layout.layer_specs(layer)
        }
        wanted = len(self.layout.layer_specs(0))
        async with task_group() as group:
            finished: anyio.Event | None = None  # set when the layer read before is settled
            try:
                pending: dict[int, tuple[dict[str, Array], _LayerHash]] = {}
                complete = [False] * self.layout.num_layers
                lowest = 0  # the lowest layer not read in full
                async for name, array in stream:
                    layer = layer_of[name]  # the header was checked against the layout
                    if layer not in pending:
                        pending[layer] = ({}, _LayerHash(group))
                    parts, digest = pending[layer]
                    parts[name] = array
                    if self.layout.digest and name != digest_name(layer):
                        digest.add(array)  # hashed while the next part arrives
                    if len(parts) < wanted:
                        continue
                    del pending[layer]
                    self.received_at.append(time.perf_counter())
                    before, finished = finished, anyio.Event()
                    group.start_soon(self._settle, layer, parts, digest, before, finished)
                    complete[layer] = True
                    while lowest < self.layout.num_layers and complete[lowest]:
                        lowest += 1
                    while lowest < self.layout.num_layers and lowest > self._asked + self.max_ahead:
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
    source: Connection | SourceLike,
    *,
    max_ahead: int = 2,
    require_digests: bool = False,
    **limits: Unpack[LimitOptions],
) -> AsyncIterator[KVReceiver]:
    """Receive one KV cache from ``source`` (a Connection, ``tcp://`` URL, path...).

    The header is read and checked against the KV layout on entry: a transfer from
    :func:`send_kv`, or a seed-style cache another program wrote (``layer_{i}_key`` /
    ``layer_{i}_value``, no stream_st metadata; see :meth:`KVLayout.from_header`). Such a cache
    carries no digests: the receiver's ``integrity`` is then ``"unverified"``, and
    ``require_digests=True`` refuses it (and a transfer sent without digests) on entry with
    :class:`~stream_st.IntegrityError`. Leaving the block stops reading (on a Connection, an
    unfinished message leaves it unusable: close it). Time limits as in
    :func:`~stream_st.open_stream` (on a Connection, the connection's unless given here).
    """
    stream = (
        source.open_stream(**limits)
        if isinstance(source, Connection)
        else open_stream(source, **limits)
    )
    async with stream:
        header = stream.header
        layout = KVLayout.from_header(header)
        if layout.digest:
            integrity = "layer-sha256"
        elif any(key.startswith("stream_st.digest:") for key in header.metadata):
            integrity = "tensor-digests"  # the reader checks each tensor before it is yielded
        else:
            integrity = "unverified"
        if require_digests and integrity == "unverified":
            raise IntegrityError(
                f"the KV cache from {stream.source.name} carries no digests (unverified) and "
                "digests are required",
                source=stream.source.name,
            )
        receiver = KVReceiver(layout, stream.source.name, max_ahead=max_ahead, integrity=integrity)
        async with task_group() as group:
            group.start_soon(receiver._run, stream)
            try:
                yield receiver
            finally:
                group.cancel_scope.cancel()

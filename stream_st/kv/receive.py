"""The receiving side of a KV-cache transfer: each layer handed out as soon as its bytes are in
and its digest checks.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Unpack, cast

import anyio
import numpy as np

from .._api import open_stream
from .._util import task_group
from ..connection import Connection
from ..core.codecs import decoded
from ..errors import ArgumentTypeError, IntegrityError, UsageError, boolean, integer_at_least
from ..reader import TensorStream
from ..transports.options import LimitOptions, Limits, TransportOptions, clock_of
from ..transports.registry import SourceLike
from .layout import Array, KVLayout, digest_name, key_name, value_name
from .send import LayerHash

__all__ = ["KVReceiver", "receive_kv"]


class KVReceiver:
    """The receiving side of a transfer; made by :func:`receive_kv`.

    Layers are read in the background as they arrive and verified before they are handed out,
    at most ``max_ahead`` layers past the highest one asked for: a slow consumer stops the
    reading, which stops the sender (backpressure), and memory stays bounded. Iterate for
    ``(layer, key, value)`` in order (each layer is released as the next is asked for: keep
    what you need of it), or ``await wait_for_layer(i)`` for one layer (as attention does,
    layer by layer; :meth:`release` it once used). Leaving the ``receive_kv`` block lets go of
    every layer still held: keep what you need of them. ``received_at[i]`` and ``verified_at[i]``
    time layer ``i``: when its bytes were all in, and when it was checked and handed out
    (``time.perf_counter()`` values; NaN while it has not been).

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
        max_ahead = integer_at_least("max_ahead", max_ahead, 0)
        self.layout = layout
        self.source = source
        self.max_ahead = max_ahead
        self.integrity = integrity or ("layer-sha256" if layout.digest else "unverified")
        self._asked = -1  # the highest layer asked for so far
        self._asked_changed = anyio.Event()
        self.received_at = [math.nan] * layout.num_layers  # by layer, whatever order they come in
        self.verified_at = [math.nan] * layout.num_layers
        self._codec = layout.get_codec()
        self._layers: dict[int, tuple[Array, Array]] = {}
        self._events = [anyio.Event() for _ in range(layout.num_layers)]
        self._error: BaseException | None = None
        self._released: set[int] = set()
        self._let_go: set[int] = set()  # held when the receive_kv block was left
        self._next = 0

    @property
    def verified(self) -> bool:
        """Whether every layer handed out was checked against a digest (see ``integrity``)."""
        return self.integrity != "unverified"

    async def wait_for_layer(self, layer: int) -> tuple[Array, Array]:
        """Key and value of ``layer``, once it has arrived and passed its check.

        Raises the transfer's error if it failed before that layer was handed out, and
        :class:`~stream_st.UsageError` for a layer :meth:`release` forgot, or any layer once the
        ``receive_kv`` block was left (reading stopped there, and what was held was let go)."""
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
            raise ArgumentTypeError(f"a layer is an integer, not {type(layer).__name__}")
        if not 0 <= layer < self.layout.num_layers:
            raise UsageError(f"no layer {layer}: the transfer has {self.layout.num_layers}")
        layer = int(layer)
        if layer > self._asked:
            self._asked = layer
            self._asked_changed.set()  # the reader may go on
            self._asked_changed = anyio.Event()
        await self._events[layer].wait()
        if layer in self._layers:
            return self._layers[layer]
        if layer in self._released:
            raise UsageError(f"layer {layer} was released: it is handed out once only")
        if layer in self._let_go:
            raise UsageError(
                f"layer {layer} was let go when the receive_kv block was left: keep what you "
                "need of a layer inside the block"
            )
        if self._error is None:
            raise UsageError(
                f"layer {layer} had not arrived when the receive_kv block was left: "
                "reading stopped there"
            )
        raise self._error

    def __aiter__(self) -> AsyncIterator[tuple[int, Array, Array]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, Array, Array]]:
        """Each layer in order, released (see :meth:`release`) when the next one is asked for:
        the consumer holds what it keeps, so iterating holds one layer at a time."""
        for layer in range(self.layout.num_layers):
            key, value = await self.wait_for_layer(layer)
            yield layer, key, value
            del key, value
            self.release(layer)

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
                pending: dict[int, tuple[dict[str, Array], LayerHash]] = {}
                complete = [False] * self.layout.num_layers
                lowest = 0  # the lowest layer not read in full
                async for name, array in stream:
                    layer = layer_of[name]  # the header was checked against the layout
                    if layer not in pending:
                        pending[layer] = ({}, LayerHash(group))
                    parts, digest = pending[layer]
                    parts[name] = array
                    if self.layout.digest and name != digest_name(layer):
                        digest.add(array)  # hashed while the next part arrives
                    if len(parts) < wanted:
                        continue
                    del pending[layer]
                    self.received_at[layer] = time.perf_counter()
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
        digest: LayerHash,
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
        code = self.layout.dtype  # values decoded beyond it: a warning counting them
        key = decoded(self._codec, key_name(layer), parts, code)
        value = decoded(self._codec, value_name(layer), parts, code)
        self._layers[layer] = (key, value)
        self.verified_at[layer] = time.perf_counter()
        self._events[layer].set()
        finished.set()

    def _leave(self) -> None:
        """Let go of every layer still held: the ``receive_kv`` block was left."""
        self._let_go.update(self._layers)
        self._layers.clear()

    def release(self, layer: int) -> None:
        """Forget a layer handed out already (to bound memory when consuming once); asking for
        it again raises :class:`~stream_st.UsageError`."""
        if self._layers.pop(layer, None) is not None:
            self._released.add(layer)


@asynccontextmanager
async def receive_kv(
    source: Connection | SourceLike,
    *,
    max_ahead: int = 2,
    require_digests: bool = False,
    **options: Unpack[TransportOptions],
) -> AsyncIterator[KVReceiver]:
    """Receive one KV cache from ``source`` (a Connection, ``tcp://`` URL, path...).

    The header is read and checked against the KV layout on entry: a transfer from
    :func:`send_kv`, or a seed-style cache another program wrote (``layer_{i}_key`` /
    ``layer_{i}_value``, no stream_st metadata; see :meth:`KVLayout.from_header`). Such a cache
    carries no digests: the receiver's ``integrity`` is then ``"unverified"``, and
    ``require_digests=True`` refuses it (and a transfer sent without digests) on entry with
    :class:`~stream_st.IntegrityError`. Leaving the block stops reading (on a Connection, an
    unfinished message leaves it unusable: close it). Time limits as in
    :func:`~stream_st.open_stream` (on a Connection, the connection's unless given here), and
    for any other source ``headers`` and ``ssl_context`` as there (an ``https://`` or ``s3://``
    URL); any other keyword is an :class:`~stream_st.ArgumentTypeError`.

    ``max_ahead`` (an integer >= 0, default 2): how many layers past the highest one asked for
    are read and held before reading waits for the consumer (see :class:`KVReceiver`).
    """
    require_digests = boolean("require_digests", require_digests)  # "no" would be true
    # verify=False, include=... would reach open_stream; a Connection takes no transport options
    if isinstance(source, Connection):
        Limits.of(options, transport=False)
        stream = source.open_stream(**cast("LimitOptions", options))  # checked: no transport ones
    else:
        clock_of(options)
        stream = open_stream(source, **options)
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
        try:
            async with task_group() as group:
                group.start_soon(receiver._run, stream)
                try:
                    yield receiver
                finally:
                    group.cancel_scope.cancel()
        finally:  # the reader has stopped: nothing is handed out any more
            receiver._leave()

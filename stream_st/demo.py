"""``stream-st demo``: a pipelined KV-cache transfer over loopback TCP, measured.

A sender computes a TinyLlama-shaped KV cache layer by layer (real numpy work: the key and value
projections of a block of hidden states) and sends each layer as soon as it exists; a receiver
verifies each layer and consumes it (grouped-query attention of new queries over the cached keys
and values) while later layers are still being computed. The transfer runs once per codec on one
connection (a session), and the demo prints:

* a per-layer timeline: produced, sent, received, verified, consumed (ms from the start);
* time to first layer: from the start until layer 0 is usable at the receiver;
* overlap efficiency: ``1 - stall / transfer time``, where *stall* is the time the consumer spent
  waiting for a layer that had already been produced (waiting on the wire, not on the model), and
  *transfer time* runs from the header going out to the last layer verified;
* payload GB/s (KV bytes over the transfer time, which the producer's compute bounds), the mean
  time a layer spends in flight (produced to verified), bytes on the wire per codec, and each
  codec's error against the original layers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Unpack

import anyio
import numpy as np

from ._limits import LimitOptions
from ._util import task_group
from .codecs import error_stats
from .connection import connect, listen
from .errors import AllocationError, UsageError
from .kv import KVLayout, receive_kv, send_kv

__all__ = ["DemoResult", "run_demo"]

Array = np.ndarray[Any, Any]
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, NEW_TOKENS = 32, 4, 64, 512, 16


@dataclass
class DemoResult:
    """One transfer's measurements (seconds from the moment the sender began this transfer)."""

    codec: str
    start: float = 0.0
    produced: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    received: list[float] = field(default_factory=list)
    verified: list[float] = field(default_factory=list)
    consumed: list[float] = field(default_factory=list)
    header_sent: float = 0.0
    stall: float = 0.0
    wire_bytes: int = 0
    payload_bytes: int = 0
    errors: dict[str, float] = field(default_factory=dict)

    @property
    def transfer_time(self) -> float:
        return self.verified[-1] - self.header_sent

    @property
    def overlap_efficiency(self) -> float:
        return 1.0 - self.stall / self.transfer_time

    @property
    def first_layer(self) -> float:
        return self.verified[0]

    @property
    def in_flight(self) -> float:
        """Mean time from a layer produced to the layer verified at the receiver."""
        return float(np.mean(np.array(self.verified) - np.array(self.produced)))


def _weights(seq: int, seed: int = 0) -> tuple[Array, Array, Array]:
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((seq, HIDDEN), dtype=np.float32)
    wk = rng.standard_normal((HIDDEN, KV_HEADS * HEAD_DIM), dtype=np.float32) / np.sqrt(HIDDEN)
    wv = rng.standard_normal((HIDDEN, KV_HEADS * HEAD_DIM), dtype=np.float32) / np.sqrt(HIDDEN)
    return hidden, wk, wv


def compute_layer(layer: int, hidden: Array, wk: Array, wv: Array) -> tuple[Array, Array]:
    """Keys and values of one layer, ``[1, KV_HEADS, seq, HEAD_DIM]`` F16 (real matmuls)."""
    x = hidden * np.float32(1.0 + 0.01 * layer)  # each layer sees different states
    seq = x.shape[0]

    def heads(t: Array) -> Array:
        return t.reshape(1, seq, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3).astype(np.float16)

    return heads(x @ wk), heads(x @ wv)


def consume_layer(queries: Array, key: Array, value: Array) -> Array:
    """Grouped-query attention of ``queries`` [1, HEADS, NEW_TOKENS, HEAD_DIM] over the layer."""
    group = HEADS // KV_HEADS  # query heads sharing one key/value head
    q = queries.reshape(1, KV_HEADS, group * queries.shape[2], HEAD_DIM)
    k_t = np.ascontiguousarray(key.astype(np.float32).transpose(0, 1, 3, 2))
    scores = q @ k_t / np.float32(np.sqrt(HEAD_DIM))
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out: Array = (probs @ value.astype(np.float32)).reshape(queries.shape)
    return out


def _layouts(layers: int, seq: int, codecs: tuple[str, ...]) -> list[KVLayout]:
    """The layout of each transfer; :class:`~stream_st.UsageError` for what cannot run."""
    for name, value in (("layers", layers), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    names = [codec.lower() for codec in codecs]
    if not names or len(set(names)) != len(names):
        raise UsageError(f"the demo needs one or more different codecs, got {list(codecs)}")
    return [KVLayout(layers, (1, KV_HEADS, seq, HEAD_DIM), "F16", codec) for codec in names]


async def run_demo(
    layers: int = 22,
    seq: int = 2048,
    codecs: tuple[str, ...] = ("none", "int8", "int4"),
    **limits: Unpack[LimitOptions],
) -> list[DemoResult]:
    """Run one transfer per codec over one loopback TCP connection; returns the measurements.

    The limits (see :func:`~stream_st.open_stream`) apply to each transfer; ``timeout``
    defaults to 30 s.
    """
    layouts = _layouts(layers, seq, codecs)
    limits.setdefault("timeout", 30)
    try:
        hidden, wk, wv = _weights(seq)
    except MemoryError:
        raise AllocationError(f"no memory for the demo's states of {seq} tokens") from None
    queries = np.random.default_rng(1).standard_normal(
        (1, HEADS, NEW_TOKENS, HEAD_DIM), dtype=np.float32
    )
    results: list[DemoResult] = []
    async with listen("127.0.0.1", 0, **limits) as listener:
        for layout in layouts:
            results.append(DemoResult(layout.codec))

        async def sender() -> None:
            async with await connect(listener.url, **limits) as connection:
                for index, (result, layout) in enumerate(zip(results, layouts, strict=True)):
                    if index:  # measure each transfer alone: wait until the last one is used up
                        await finished[index - 1].wait()
                    result.start = time.perf_counter()

                    async def produce() -> AsyncIterator[tuple[int, Array, Array]]:
                        for layer in range(layers):
                            key, value = await anyio.to_thread.run_sync(
                                compute_layer, layer, hidden, wk, wv
                            )
                            yield layer, key, value

                    report = await send_kv(connection, layout, produce())
                    result.produced, result.sent = report.produced_at, report.sent_at
                    result.header_sent = report.header_sent_at
                    result.wire_bytes = report.wire_bytes

        async def receiver() -> None:
            async with await listener.accept() as connection:
                for result in results:
                    keys: list[Array] = []
                    async with receive_kv(connection) as incoming:
                        for layer in range(layers):
                            key, value = await incoming.wait_for_layer(layer)
                            await anyio.to_thread.run_sync(consume_layer, queries, key, value)
                            result.consumed.append(time.perf_counter())
                            keys.append(key)
                            incoming.release(layer)
                        result.received = list(incoming.received_at)
                        result.verified = list(incoming.verified_at)
                    result.payload_bytes = layers * 2 * 2 * KV_HEADS * seq * HEAD_DIM
                    received_keys[result.codec] = keys
                    finished[results.index(result)].set()

        received_keys: dict[str, list[Array]] = {}
        finished = [anyio.Event() for _ in results]
        async with task_group() as group:
            group.start_soon(receiver)
            group.start_soon(sender)
    for result in results:
        if result.codec != "none":  # measured after every transfer, off the clock
            errors = [
                error_stats(compute_layer(i, hidden, wk, wv)[0], key)
                for i, key in enumerate(received_keys[result.codec])
            ]
            result.errors = {
                "rmse": float(np.mean([e["rmse"] for e in errors])),
                "max_abs_error": max(e["max_abs_error"] for e in errors),
                "snr_db": float(np.mean([e["snr_db"] for e in errors])),
            }
        _stall_on_wire(result)
        for series in (
            result.produced,
            result.sent,
            result.received,
            result.verified,
            result.consumed,
        ):
            series[:] = [t - result.start for t in series]
        result.header_sent -= result.start
    return results


def _stall_on_wire(result: DemoResult) -> None:
    """Recompute the stall: per layer, the wait after the layer was produced and before it was
    usable, counted only while the consumer was ready for it."""
    stall = 0.0
    ready = result.header_sent
    for layer, verified in enumerate(result.verified):
        waited_from = max(ready, result.produced[layer])
        stall += max(0.0, verified - waited_from)
        ready = result.consumed[layer]
    result.stall = stall


def print_report(results: list[DemoResult], layers: int, seq: int) -> None:
    first = results[0]
    size = first.payload_bytes
    print(
        f"stream-st demo: KV cache of {layers} layers x key/value [1, {KV_HEADS}, {seq}, "
        f"{HEAD_DIM}] F16 ({size / 1e6:.1f} MB), computed layer by layer and sent over "
        "loopback TCP; one connection, one transfer per codec"
    )
    print(f"\ntimeline, codec {first.codec!r} (ms from start)")
    print(
        f"{'layer':>5} {'produced':>9} {'sent':>9} {'received':>9} {'verified':>9} {'consumed':>9}"
    )
    for layer in range(layers):
        print(
            f"{layer:>5} "
            + " ".join(
                f"{series[layer] * 1e3:>9.1f}"
                for series in (
                    first.produced,
                    first.sent,
                    first.received,
                    first.verified,
                    first.consumed,
                )
            )
        )
    print(
        f"\n{'codec':<6} {'wire MB':>8} {'first layer ms':>15} {'total ms':>9} {'overlap':>8} "
        f"{'payload GB/s':>13} {'in flight ms':>13} {'RMSE':>9} {'max err':>9} {'SNR dB':>7}"
    )
    for r in results:
        total = r.consumed[-1]
        rate = r.payload_bytes / r.transfer_time / 1e9
        errors = (
            f"{r.errors['rmse']:>9.5f} {r.errors['max_abs_error']:>9.5f} {r.errors['snr_db']:>7.1f}"
            if r.errors
            else f"{'exact':>9} {'0':>9} {'inf':>7}"
        )
        print(
            f"{r.codec:<6} {r.wire_bytes / 1e6:>8.2f} {r.first_layer * 1e3:>15.1f} "
            f"{total * 1e3:>9.1f} {r.overlap_efficiency:>8.1%} {rate:>13.3f} "
            f"{r.in_flight * 1e3:>13.1f} {errors}"
        )
    print(
        "\nTimes from the start of each transfer. first layer: layer 0 usable at the receiver."
        "\noverlap = 1 - stall / transfer time; stall = time the receiver waited for layers "
        "already produced.\npayload GB/s = KV bytes / transfer time (bounded by the producer's "
        "compute); in flight = produced -> verified, per layer.\nEvery layer passed its SHA-256 "
        "check before use."
    )

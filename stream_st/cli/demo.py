"""``stream-st demo``: a pipelined KV-cache transfer over loopback TCP, measured.

The main job (:func:`run_model_demo`) runs a real decoder, SmolLM2-135M-Instruct
(:mod:`stream_st.llm`): a sender prefills a context and sends each layer's keys and values as
soon as the layer exists; the receiver runs that layer of the continuation on them as they
arrive, and the continuation's perplexity, per codec, is compared with the receiver recomputing
the context itself. Every layer received is compared, bit for bit, with the recomputed cache
through the codec (the codecs are deterministic). :func:`print_model_report` prints it,
:meth:`ModelDemo.to_json` gives it, and its :func:`verdict` is OK or CHECK (:func:`problems`).

The synthetic demo (:func:`run_demo`, ``stream-st demo --synthetic``) needs no model: a sender
computes a TinyLlama-shaped KV cache layer by layer (real numpy work: the key and value
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

import hashlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

import anyio
import numpy as np

from .._util import task_group
from ..connection import Connection, connect, listen
from ..core.codecs import error_stats
from ..errors import AllocationError, UsageError, integer_at_least
from ..kv import KVLayout, KVReceiver, SendReport, receive_kv, send_kv
from ..kv.layout import key_name, value_name
from ..tools.common import plural
from ..transports.options import Clock, LimitOptions, Limits

if TYPE_CHECKING:
    from ..models.llm import KVCache, Llama, LlamaConfig

__all__ = ["DemoResult", "ModelDemo", "ModelResult", "run_demo", "run_model_demo"]

Array = np.ndarray[Any, Any]
T = TypeVar("T")
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, NEW_TOKENS = 32, 4, 64, 512, 16

MAX_LAYERS = 1024
"""The most layers the synthetic demo takes (decoders have up to about 128): each transfer plans
every layer's wire tensors before the first goes out."""

MAX_CACHE = 1 << 30
"""The most bytes of keys and values (F16) the synthetic demo's cache holds: the receiver keeps
every codec's keys to measure their errors."""


def _cache_bytes(layers: int, seq: int) -> int:
    """Bytes of the synthetic cache's keys and values (F16) of ``layers`` layers of ``seq``
    tokens."""
    return layers * 2 * 2 * KV_HEADS * seq * HEAD_DIM


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
    if layers > MAX_LAYERS:
        raise UsageError(f"layers must be at most {MAX_LAYERS}, got {layers}")
    cache = _cache_bytes(layers, seq)
    if cache > MAX_CACHE:
        raise UsageError(
            f"a cache of {plural(layers, 'layer')} of {seq:,} tokens holds {cache:,} bytes, "
            f"over the demo's {MAX_CACHE:,}: fewer layers or a shorter seq"
        )
    names = [codec.lower() for codec in codecs]
    if not names or len(set(names)) != len(names):
        raise UsageError(f"the demo needs one or more different codecs, got {list(codecs)}")
    return [KVLayout(layers, (1, KV_HEADS, seq, HEAD_DIM), "F16", codec) for codec in names]


def _whole_run(limits: LimitOptions) -> tuple[Clock, LimitOptions]:
    """The clock of a whole demo, started now, and the limits of each of its transfers (a bad
    one is a :class:`~stream_st.UsageError` now, before anything runs). ``deadline`` bounds the
    whole demo, as a command's bounds all the command does; the others apply to each transfer,
    ``timeout`` defaulting to 30 s."""
    clock = Clock(Limits.of(limits, transport=False))
    clock.start()
    each = limits.copy()
    each.pop("deadline", None)
    each.setdefault("timeout", 30)
    return clock, each


async def _in_thread(work: Callable[..., T], *args: object) -> T:
    """``work(*args)`` in a worker thread, given up (left to finish alone) when the demo's
    deadline passes: loading the model, recomputing a cache."""
    return await anyio.to_thread.run_sync(work, *args, abandon_on_cancel=True)


async def _session(
    count: int,
    send: Callable[[Connection, int], Awaitable[None]],
    receive: Callable[[Connection, int], Awaitable[None]],
    **limits: Unpack[LimitOptions],
) -> None:
    """Run ``count`` transfers over one loopback TCP connection (a session): ``send`` and
    ``receive`` of transfer ``i`` on its two ends, each transfer measured alone (the sender
    starts one when the receiver has used up the one before)."""
    finished = [anyio.Event() for _ in range(count)]
    async with listen("127.0.0.1", 0, **limits) as listener:

        async def sender() -> None:
            async with await connect(listener.url, **limits) as connection:
                for index in range(count):
                    if index:
                        await finished[index - 1].wait()
                    await send(connection, index)

        async def receiver() -> None:
            async with await listener.accept() as connection:
                for index in range(count):
                    await receive(connection, index)
                    finished[index].set()

        async with task_group() as group:
            group.start_soon(receiver)
            group.start_soon(sender)


async def run_demo(
    layers: int = 22,
    seq: int = 2048,
    codecs: tuple[str, ...] = ("none", "int8", "int4"),
    **limits: Unpack[LimitOptions],
) -> list[DemoResult]:
    """The synthetic demo: one transfer per codec of a TinyLlama-shaped cache over one loopback
    TCP connection; returns the measurements.

    The limits (see :func:`~stream_st.open_stream`): ``deadline`` bounds the whole demo (a
    :class:`~stream_st.ReadTimeoutError` when it passes), the others apply to each transfer;
    ``timeout`` defaults to 30 s.
    """
    layouts = _layouts(layers, seq, codecs)
    clock, limits = _whole_run(limits)
    with clock.within_deadline(""):
        return await _run_demo(layouts, seq, limits)


async def _run_demo(layouts: list[KVLayout], seq: int, limits: LimitOptions) -> list[DemoResult]:
    """:func:`run_demo` of ``layouts``, checked, each transfer under ``limits``."""
    layers = layouts[0].num_layers
    try:
        hidden, wk, wv = _weights(seq)
    except MemoryError:
        raise AllocationError(f"no memory for the demo's states of {seq} tokens") from None
    queries = np.random.default_rng(1).standard_normal(
        (1, HEADS, NEW_TOKENS, HEAD_DIM), dtype=np.float32
    )
    results = [DemoResult(layout.codec) for layout in layouts]
    received_keys: dict[str, list[Array]] = {}

    async def send(connection: Connection, index: int) -> None:
        result = results[index]
        result.start = time.perf_counter()

        async def produce() -> AsyncIterator[tuple[int, Array, Array]]:
            for layer in range(layers):
                key, value = await anyio.to_thread.run_sync(compute_layer, layer, hidden, wk, wv)
                yield layer, key, value

        _sent(result, await send_kv(connection, layouts[index], produce()))

    async def receive(connection: Connection, index: int) -> None:
        result = results[index]
        keys: list[Array] = []
        async with receive_kv(connection) as incoming:
            for layer in range(layers):
                key, value = await incoming.wait_for_layer(layer)
                await anyio.to_thread.run_sync(consume_layer, queries, key, value)
                result.consumed.append(time.perf_counter())
                keys.append(key)
                incoming.release(layer)
            _received(result, incoming)
        result.payload_bytes = _cache_bytes(layers, seq)
        received_keys[result.codec] = keys

    def measured(keys: list[Array]) -> dict[str, float]:
        """A codec's errors over the keys received."""
        errors = [
            error_stats(compute_layer(i, hidden, wk, wv)[0], key) for i, key in enumerate(keys)
        ]
        return {
            "rmse": float(np.mean([e["rmse"] for e in errors])),
            "max_abs_error": max(e["max_abs_error"] for e in errors),
            "snr_db": float(np.mean([e["snr_db"] for e in errors])),
        }

    await _session(len(layouts), send, receive, **limits)
    for result in results:
        if result.codec != "none":  # measured after every transfer, off the transfers' clock
            result.errors = await _in_thread(measured, received_keys[result.codec])
        _finish(result)
    return results


def _sent(result: DemoResult, report: SendReport) -> None:
    result.produced, result.sent = report.produced_at, report.sent_at
    result.header_sent = report.header_sent_at
    result.wire_bytes = report.wire_bytes


def _received(result: DemoResult, incoming: KVReceiver) -> None:
    result.received = list(incoming.received_at)
    result.verified = list(incoming.verified_at)


def _finish(result: DemoResult) -> None:
    """The stall, then every time made relative to the transfer's start."""
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


MODEL_CODECS = {
    "none": ("none", "F32"),
    "f16": ("none", "F16"),
    "int8": ("int8", "F32"),
    "int4": ("int4", "F32"),
}
"""The model demo's codecs: the KV codec and the dtype of the keys and values it carries."""
MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ModelResult(DemoResult):
    """One transfer of the model demo: :class:`DemoResult`'s timeline (``consumed``: when the
    receiver finished each layer of the continuation), and what the receiver computed."""

    dtype: str = "F32"
    finished: float = 0.0  # the continuation's logits ready at the receiver
    perplexity: float = math.nan
    max_logit_error: float = math.nan  # against the receiver's own recomputation
    identical: bool = False  # logits bit for bit those of the recomputation
    wrong_layer: int | None = None  # the first layer received other than expected (see below)

    @property
    def label(self) -> str:
        return f"{self.codec}/{self.dtype}" if self.codec == "none" else self.codec


@dataclass
class ModelDemo:
    """The model demo's measurements: the receiver recomputing the context itself, then one
    transfer of the context's cache per codec (seconds from the start of each)."""

    context_tokens: int
    continuation_tokens: int
    recompute_time: float
    recompute_perplexity: float
    results: list[ModelResult]
    config: LlamaConfig
    notice: str | None = None  # how the text was split, when that needs saying

    def to_json(self) -> dict[str, Any]:
        return {
            "model": MODEL_NAME,
            "layers": self.config.num_layers,
            "kv_shape": [1, self.config.num_kv_heads, self.context_tokens, self.config.head_dim],
            "context_tokens": self.context_tokens,
            "continuation_tokens": self.continuation_tokens,
            "scored_tokens": self.continuation_tokens - 1,
            "verdict": verdict(self),
            "notice": self.notice,
            "recompute": {"seconds": self.recompute_time, "perplexity": self.recompute_perplexity},
            "transfers": [
                {
                    "codec": r.codec,
                    "dtype": r.dtype,
                    "wire_bytes": r.wire_bytes,
                    "perplexity": r.perplexity,
                    "perplexity_change": r.perplexity / self.recompute_perplexity - 1,
                    "max_logit_error": r.max_logit_error,
                    "logits_identical": r.identical,
                    "first_wrong_layer": r.wrong_layer,
                    "first_layer_seconds": r.first_layer,
                    "prefill_seconds": r.produced[-1],
                    "finished_seconds": r.finished,
                    "overlap_efficiency": r.overlap_efficiency,
                }
                for r in self.results
            ],
        }


DEFAULT_CONTEXT = 256
"""Tokens the sender prefills when ``--context`` is not given and the text is long enough."""

MIN_SCORED = 64
"""Fewest continuation tokens worth a perplexity: fewer, and the number is mostly noise."""


def split_tokens(tokens: int, context: int | None) -> tuple[int, str | None]:
    """Where to split a text of ``tokens`` tokens into the context and the continuation scored
    after it, and a notice (None when there is nothing to say).

    ``context`` None (not asked for): :data:`DEFAULT_CONTEXT`, shortened for a short text so
    that at least :data:`MIN_SCORED` tokens, or half the text, are scored. An explicit
    ``context`` is kept; leaving fewer than :data:`MIN_SCORED` tokens to score gives a notice.
    A text with no two tokens past the context is a :class:`~stream_st.UsageError`."""
    if context is None:
        chosen = max(1, min(DEFAULT_CONTEXT, max(tokens - MIN_SCORED - 1, tokens // 2)))
        if tokens < chosen + 2:
            raise UsageError(f"the text has {tokens} tokens: 3 or more needed")
        if chosen == DEFAULT_CONTEXT:
            return chosen, None
        return chosen, (
            f"the text has {tokens} tokens: the context is shortened from {DEFAULT_CONTEXT} to "
            f"{chosen} so that {tokens - chosen - 1} are scored"
        )
    if tokens < context + 2:
        raise UsageError(f"the text has {tokens} tokens: {context + 2} or more needed")
    scored = tokens - context - 1
    if scored < MIN_SCORED:
        below = tokens - MIN_SCORED  # a --context below it scores enough, if one is positive
        shorter = f", or a --context below {below}" if below > 1 else ""
        return context, (
            f"only {scored} tokens past the {context}-token context are scored: their "
            f"perplexity is noisy (give a longer text{shorter})"
        )
    return context, None


MAX_CONTINUATION = 512
"""Most tokens of the continuation the receiver runs (and scores, from the second on): a longer
text is cut there, said in a notice. A block of ``n`` tokens on top of a context of ``c`` takes
attention scores of ``n * (c + n)`` per head: scored whole, 12,000 tokens need gigabytes."""

TRAINED_CONTEXT = 8192
"""Positions SmolLM2-135M-Instruct was trained on (its GGUF's ``llama.context_length``): the
context and the continuation run together stay within them."""


def cap_continuation(tokens: int, context: int, limit: int | None = None) -> tuple[int, str | None]:
    """How many of the ``tokens - context`` tokens after the context the receiver runs, and a
    notice (None when it runs them all): at most ``limit`` (None: :data:`MAX_CONTINUATION`),
    and no position past :data:`TRAINED_CONTEXT`. A context that leaves fewer than 2 of those
    positions is a :class:`~stream_st.UsageError`."""
    limit = MAX_CONTINUATION if limit is None else limit
    room = TRAINED_CONTEXT - context
    if room < 2:
        raise UsageError(
            f"a context of {context} tokens leaves no room for a continuation in the "
            f"{TRAINED_CONTEXT} positions {MODEL_NAME} was trained on"
        )
    after = tokens - context
    count = min(after, limit, room)
    if count == after:
        return count, None
    why = (
        f"at most {limit} are run"
        if count == limit
        else f"the model was trained on {TRAINED_CONTEXT} positions"
    )
    return count, (
        f"the text has {tokens} tokens: the continuation is its {count} tokens after the "
        f"{context}-token context ({count - 1} scored; {why}), the last {after - count} are "
        "not scored"
    )


def problems(demo: ModelDemo) -> list[str]:
    """What makes the verdict CHECK (none: OK), from what was computed alone, never from how
    long anything took: a layer received other than the codec makes it from the recomputed
    cache, none/F32 logits not bit for bit the recomputation's, a perplexity beyond
    :data:`PERPLEXITY_TOLERANCE`, fewer than :data:`MIN_SCORED` tokens scored."""
    found = [
        f"{r.label} layer {r.wrong_layer} is not the recomputed cache through the codec"
        for r in demo.results
        if r.wrong_layer is not None
    ]
    found += [
        f"{r.label} logits differ"
        for r in demo.results
        if r.codec == "none" and r.dtype == "F32" and not r.identical
    ]
    for r in demo.results:
        change = r.perplexity / demo.recompute_perplexity - 1
        if not abs(change) <= PERPLEXITY_TOLERANCE:
            found.append(f"{r.label} perplexity {change:+.1%}")
    if demo.continuation_tokens - 1 < MIN_SCORED:
        found.append(f"only {demo.continuation_tokens - 1} tokens scored")
    return found


def verdict(demo: ModelDemo) -> str:
    """One line: what the demo showed and whether it went well (:func:`problems`)."""
    best = min(demo.results, key=lambda r: r.finished)
    tail = best.finished - best.produced[-1]
    shown = (
        f"the receiver, which computed none of the {demo.context_tokens}-token context, had the "
        f"continuation's logits {tail * 1e3:.0f} ms after the sender's last layer "
        f"({best.label}, overlap {best.overlap_efficiency:.0%}); recomputing it took "
        f"{demo.recompute_time * 1e3:.0f} ms of its own compute"
    )
    found = problems(demo)
    if found:
        return f"verdict: CHECK ({'; '.join(found)}): {shown}"
    lossless = any(r.codec == "none" and r.dtype == "F32" for r in demo.results)
    exact = " (none/F32 logits bit for bit)" if lossless else ""
    return (
        "verdict: OK: every layer arrived bit for bit as its codec makes it of the recomputed "
        f"cache, every codec within {PERPLEXITY_TOLERANCE:.0%} of the recomputation's "
        f"perplexity{exact}; {shown}"
    )


PERPLEXITY_TOLERANCE = 0.05
"""How far a codec's perplexity may move from the recomputation's and the demo still be OK."""


def default_text() -> str:
    """The demo's text: a few paragraphs of plain English prose, written for it."""
    return (Path(__file__).parent / "demo_text.txt").read_text(encoding="utf-8")


async def run_model_demo(
    text: str | None = None,
    *,
    context: int | None = None,
    codecs: tuple[str, ...] = tuple(MODEL_CODECS),
    progress: Callable[[str], None] | None = None,
    max_continuation: int | None = None,
    **limits: Unpack[LimitOptions],
) -> ModelDemo:
    """The main job with a real model (SmolLM2-135M-Instruct, from the ``llm`` extra).

    ``text`` (default :func:`default_text`) is tokenized and split after ``context`` tokens
    (None: 256, fewer for a short text, see :func:`split_tokens`, which ``progress`` is told).
    The continuation is the next ``max_continuation`` tokens at most (None:
    :data:`MAX_CONTINUATION`; never past the model's :data:`TRAINED_CONTEXT`): a longer text
    is cut there and the notice says so (:func:`cap_continuation`).
    The receiver first recomputes the context's cache itself and scores the continuation: the
    reference. Then, once per codec over one loopback TCP connection, a sender prefills the
    context and sends each layer's keys and values as soon as the layer exists; the receiver
    runs layer ``l`` of the continuation as soon as layer ``l`` has arrived and passed its
    check. The continuation's perplexity counts its tokens from the second on (the first has
    no logits from a cache alone). ``progress`` is told what runs. Limits as in
    :func:`run_demo`: ``deadline`` bounds it all, loading the model included (work in a worker
    thread when it passes is left to finish alone). Memory that runs out (a long ``context``)
    is an :class:`~stream_st.AllocationError`.
    """
    from ..models.llm import load_tokenizer, read_gguf
    from ..models.llm.transfer import one_blas_thread

    names = [codec.lower() for codec in codecs]
    if not names or len(set(names)) != len(names) or not set(names) <= set(MODEL_CODECS):
        raise UsageError(f"the demo needs different codecs of {list(MODEL_CODECS)}: {codecs}")
    if context is not None and (
        isinstance(context, bool) or not isinstance(context, int) or context < 1
    ):
        raise UsageError(f"context must be a positive integer, got {context!r}")
    if max_continuation is not None:
        max_continuation = integer_at_least("max_continuation", max_continuation, 2)
    clock, limits = _whole_run(limits)  # a bad limit says so before the model loads
    say = progress or (lambda _: None)
    sizes = "tokenizing the text"  # what ran out of memory, if anything does
    try:
        # sender and receiver: one core each
        with one_blas_thread(), clock.within_deadline(""):
            tokenizer = await _in_thread(load_tokenizer)
            ids = np.array(tokenizer.encode(default_text() if text is None else text).ids)
            context, notice = split_tokens(int(ids.size), context)
            count, capped = cap_continuation(int(ids.size), context, max_continuation)
            notices = [n for n in (notice, capped) if n is not None]
            for line in notices:
                say(line)
            sizes = f"a context of {context} tokens and a continuation of {count}"
            say(f"loading {MODEL_NAME} (GGUF, dequantized to float32)")
            model = await _in_thread(read_gguf)
            prompt, continuation = ids[:context], ids[context : context + count]
            demo = await _run_model_demo(model, prompt, continuation, names, say, limits)
    except AllocationError:
        raise
    except MemoryError:  # numpy's, bare: a bug's exit status otherwise
        raise AllocationError(f"no memory for the model demo ({sizes})") from None
    demo.notice = "; ".join(notices) or None
    return demo


async def _run_model_demo(
    model: Llama,
    prompt: Array,
    continuation: Array,
    names: list[str],
    say: Callable[[str], None],
    limits: LimitOptions,
) -> ModelDemo:
    """The model demo's runs, :func:`run_model_demo`'s text tokenized and split."""
    from ..models.llm import perplexity
    from ..models.llm.transfer import continue_received, send_prefill

    context = int(prompt.size)
    say(f"receiver recomputes the context ({context} tokens) and scores the continuation")
    began = time.perf_counter()
    cache = await _in_thread(model.cache, prompt)
    reference = await _in_thread(model.score, continuation, cache)
    recompute_time = time.perf_counter() - began
    results = [ModelResult(MODEL_CODECS[n][0], dtype=MODEL_CODECS[n][1]) for n in names]
    layouts = [model.config.kv_layout(context, r.dtype, r.codec) for r in results]
    expected = [await _in_thread(_expected_layers, cache, x) for x in layouts]
    del cache

    async def send(connection: Connection, index: int) -> None:
        say(f"transfer {index + 1}/{len(results)}: {results[index].label}")
        results[index].start = time.perf_counter()
        report = await send_prefill(connection, model, prompt, layouts[index])
        _sent(results[index], report)

    async def receive(connection: Connection, index: int) -> None:
        result = results[index]

        def check(layer: int, key: Array, value: Array) -> None:
            if result.wrong_layer is None and _layer_digest(key, value) != expected[index][layer]:
                result.wrong_layer = layer

        async with receive_kv(connection) as incoming:
            logits = await continue_received(
                incoming, model, continuation, done_at=result.consumed, each_layer=check
            )
            _received(result, incoming)
        result.finished = time.perf_counter() - result.start
        result.payload_bytes = 2 * model.config.num_layers * int(np.prod(layouts[0].shape)) * 4
        result.perplexity = perplexity(logits[:-1], continuation[1:])
        result.max_logit_error = float(np.max(np.abs(logits - reference)))
        result.identical = bool(np.array_equal(logits, reference))

    await _session(len(results), send, receive, **limits)
    for result in results:
        _finish(result)
    return ModelDemo(
        context_tokens=context,
        continuation_tokens=int(continuation.size),
        recompute_time=recompute_time,
        recompute_perplexity=perplexity(reference[:-1], continuation[1:]),
        results=results,
        config=model.config,
    )


def _layer_digest(key: Array, value: Array) -> bytes:
    """SHA-256 of a layer's keys' and values' bytes: a received layer compared bit for bit with
    the expected one, without holding the expected one."""
    digest = hashlib.sha256()
    for array in (key, value):
        digest.update(np.ascontiguousarray(array).data)
    return digest.digest()


def _expected_layers(cache: KVCache, layout: KVLayout) -> list[bytes]:
    """Each layer's :func:`_layer_digest` as a transfer of ``cache`` through ``layout`` must
    deliver it: cast to the layout's dtype, then encoded and decoded by its codec (the codecs
    are deterministic), one layer at a time."""
    codec, dtype = layout.get_codec(), layout.numpy_dtype

    def through(name: str, array: Array) -> Array:
        return codec.decode(name, dict(codec.encode(name, array.astype(dtype, copy=False))), dtype)

    return [
        _layer_digest(through(key_name(layer), key), through(value_name(layer), value))
        for layer, (key, value) in enumerate(cache)
    ]


def print_model_report(demo: ModelDemo) -> None:
    c = demo.config
    print(
        f"stream-st demo: {MODEL_NAME} ({c.num_layers} layers, KV [1, {c.num_kv_heads}, "
        f"{demo.context_tokens}, {c.head_dim}] per layer). A sender prefills a context of "
        f"{demo.context_tokens} tokens and sends each layer's keys and values over loopback "
        "TCP as soon as the layer exists; the receiver scores the continuation "
        f"({demo.continuation_tokens} tokens) layer by layer as the cache arrives."
    )
    if demo.notice is not None:
        print(f"note: {demo.notice}")
    print(
        f"\nreceiver recomputing the context itself: {demo.recompute_time * 1e3:.0f} ms, "
        f"perplexity {demo.recompute_perplexity:.3f}"
    )
    print(
        f"\n{'codec':<9} {'wire MB':>8} {'first layer ms':>15} {'prefill ms':>11} "
        f"{'done ms':>8} {'overlap':>8} {'perplexity':>11} {'change':>8} {'logits':>16}"
    )
    for r in demo.results:
        change = r.perplexity / demo.recompute_perplexity - 1
        logits = "identical" if r.identical else f"max err {r.max_logit_error:.3g}"
        print(
            f"{r.label:<9} {r.wire_bytes / 1e6:>8.2f} {r.first_layer * 1e3:>15.1f} "
            f"{r.produced[-1] * 1e3:>11.1f} {r.finished * 1e3:>8.1f} "
            f"{r.overlap_efficiency:>8.1%} {r.perplexity:>11.3f} {change:>+8.2%} {logits:>16}"
        )
    print(
        "\nTimes from the start of each transfer. first layer: layer 0 verified at the "
        "receiver; prefill: the sender's last layer computed; done: the continuation's logits "
        "ready at the receiver.\noverlap = 1 - stall / transfer time. change: perplexity "
        "against the receiver's own recomputation; logits: against it, bit for bit.\n"
        "Perplexity counts the continuation from its second token. Every layer passed its "
        "SHA-256 check before use, and is compared, bit for bit, with the receiver's "
        "recomputed layer through the codec.\nOn one machine a transfer's done time includes the "
        "sender's prefill, so it cannot beat recomputing: what counts is how soon after the "
        "sender's last layer the receiver is ready, and that the perplexity holds."
    )
    print(f"\n{verdict(demo)}")

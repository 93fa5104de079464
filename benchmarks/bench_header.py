"""Header parsing: ``stream_st.read_header`` against the reference, on big and hostile headers.

Run it from the repository root (about two minutes on 2 cores; ~3 GiB of RAM, ~100 MiB of disk)::

    python benchmarks/bench_header.py [--tensors 1000000] [--repeat 3] [--skip-big]

Five parts:

* ``big``: a valid file of ``--tensors`` F32 tensors of shape [1] (a 10**6-tensor header is about
  65 MB of JSON), in a temporary directory. Timed interleaved (A B A B ...), medians:

  - A: ``stream_st.read_header(path)`` inside ``anyio.run``; then once more, untimed, with a
    ticker task on the same loop (``anyio.sleep(0.001)`` in a loop) whose longest gap between two
    ticks is the event loop's longest stall while the header is read;
  - B: ``safetensors.safe_open(path, "np").keys()``, the reference.

  Then how long one full ``gc.collect()`` takes while the parsed header lives (every full
  collection of the process pays it for as long as the header is kept), and each variant once
  more in a fresh subprocess, which reports its peak RSS (``VmHWM``, reset after imports where
  the kernel allows it) above the RSS after imports.
* ``small``: a 100-tensor header, the kind most reads open: ``parse_header`` plus one pass over
  ``header.tensors`` (the reader makes one per read), and ``stream_st.read_header(path)`` plus
  that pass, medians of many.
* ``hostile``: headers a peer may send, each refused by both: ``stream_st.parse_header`` against
  ``safetensors.deserialize`` on the same bytes, best of ``--repeat``. The reference's time
  includes copying the bytes in; both are well under a millisecond for a small header.
* ``threshold``: what a worker thread costs (``anyio.to_thread.run_sync`` of a no-op, median of
  200) against ``parse_header`` of valid headers of growing size, to place
  ``PARSE_IN_THREAD_ABOVE`` (the reader parses longer headers off the loop).
* ``prefix only``: 32 peers each send an 8-byte prefix declaring a 90 MB header, then stall; the
  receiver's traced allocation peak (``tracemalloc``) while their 32 reads wait.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import safetensors
from bench_read import _status_kib  # this script's folder is on sys.path

import stream_st
from stream_st import SafetensorsError, parse_header
from stream_st.reader import PARSE_IN_THREAD_ABOVE

MB = 1_000_000
U64_MAX = 2**64 - 1


def header_text(tensors: int) -> bytes:
    """A valid header of ``tensors`` F32 tensors of shape [1], as the reference writes it."""
    parts = [
        f'"layer.{i}.w":{{"dtype":"F32","shape":[1],"data_offsets":[{4 * i},{4 * i + 4}]}}'
        for i in range(tensors)
    ]
    text = ("{" + ",".join(parts) + "}").encode()
    return text + b" " * (-len(text) % 8)


def write_file(path: Path, tensors: int) -> int:
    """Write a file of ``tensors`` tensors (zero data); return its header length."""
    text = header_text(tensors)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.write(bytes(4 * tensors))
    return len(text)


async def read_with_ticker(path: Path, tick: bool = True) -> tuple[float, float, int]:
    """``read_header(path)``: seconds taken, the loop's longest stall meanwhile, tensor count.

    Without ``tick`` no ticker runs (its wakeups take the GIL from the parsing thread 1000 times
    a second) and the stall reads 0.
    """
    longest = 0.0
    done = not tick

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await anyio.sleep(0.001)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.01)
        start = time.perf_counter()
        header = await stream_st.read_header(path)
        took = time.perf_counter() - start
        done = True
    return took, longest, len(header)


def reference_keys(path: Path) -> tuple[float, int]:
    start = time.perf_counter()
    with safetensors.safe_open(str(path), "np") as f:
        count = len(f.keys())
    return time.perf_counter() - start, count


def rss_child(variant: str, path: Path) -> None:
    """Run one variant in this fresh process and print its peak RSS above the baseline."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    baseline = _status_kib("VmRSS")
    if variant == "ours":
        anyio.run(read_with_ticker, path)
    else:
        reference_keys(path)
    print(json.dumps({"peak_kib": _status_kib("VmHWM") - baseline, "reset": reset}))


def peak_rss_mib(variant: str, path: Path) -> str:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--rss-child", variant, str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    note = "" if result["reset"] else " (VmHWM not reset: includes imports)"
    return f"{result['peak_kib'] / 1024:.0f} MiB{note}"


def _collect_ms() -> float:
    """Milliseconds of one full ``gc.collect()``."""
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1000


def full_collection_ms(path: Path) -> tuple[float, float]:
    """Milliseconds of one full ``gc.collect()`` while the header of ``path`` is alive (after a
    first one), and of one once it is gone."""
    header = anyio.run(stream_st.read_header, path)
    gc.collect()
    alive = _collect_ms()
    del header
    gc.collect()
    return alive, _collect_ms()


def bench_big(tensors: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "big.safetensors"
        n = write_file(path, tensors)
        print(f"\n== big: {tensors} tensors, header {n / MB:.1f} MB")
        ours: list[float] = []
        stalls: list[float] = []
        ref: list[float] = []
        for _ in range(repeat):
            took, _, count = anyio.run(read_with_ticker, path, False)
            assert count == tensors
            ours.append(took)
            stalls.append(anyio.run(read_with_ticker, path)[1])
            took, count = reference_keys(path)
            assert count == tensors
            ref.append(took)
        a, b = statistics.median(ours), statistics.median(ref)
        print(f"  A read_header       median {a:7.2f} s  runs {[round(t, 2) for t in ours]}")
        print(f"  B reference keys()  median {b:7.2f} s  runs {[round(t, 2) for t in ref]}")
        print(f"  A / B = {a / b:.2f} (target <= 1.00)")
        print(
            f"  event loop longest stall during A: {max(stalls) * 1000:.1f} ms "
            f"(runs {[round(s * 1000, 1) for s in stalls]} ms; target < 50 ms)"
        )
        alive, gone = full_collection_ms(path)
        print(f"  one full gc.collect(): {alive:.1f} ms with the header alive, {gone:.1f} ms after")
        print(f"  peak RSS above imports: A {peak_rss_mib('ours', path)}, ", end="", flush=True)
        print(f"B {peak_rss_mib('ref', path)}")


def _dims_header(dims: list[int], dtype: str = "U8") -> bytes:
    entry = {"dtype": dtype, "shape": dims, "data_offsets": [0, 0]}
    return json.dumps({"a": entry}, separators=(",", ":")).encode()


SURROGATE_NAME = b'{"a\\ud800":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
MINUS_ZERO_DIM = b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'

HOSTILE: list[tuple[str, bytes]] = [
    ("230 dims of 2**64-1", _dims_header([U64_MAX] * 230)),
    ("50,000 dims ending in 0, F6 (1 MB)", _dims_header([U64_MAX] * 50_000 + [0], "F6_E2M3")),
    ("200,000 dims ending in 0, F6 (4 MB)", _dims_header([U64_MAX] * 200_000 + [0], "F6_E2M3")),
    ("50,000 dims ending in 0, U8 (1 MB)", _dims_header([U64_MAX] * 50_000 + [0])),
    ("lone surrogate in a name", SURROGATE_NAME),
    ("-0 as a dimension", MINUS_ZERO_DIM),
]


def _best(func: Callable[[], Any], repeat: int) -> tuple[float, str]:
    best = float("inf")
    outcome = "accepted"
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            func()
        except (SafetensorsError, safetensors.SafetensorError) as exc:
            outcome = type(exc).__name__
        best = min(best, time.perf_counter() - start)
    return best, outcome


def bench_hostile(repeat: int) -> None:
    print("\n== hostile headers: time to refuse (best of runs)")
    for label, text in HOSTILE:
        framed = struct.pack("<Q", len(text)) + text
        ours, ours_outcome = _best(partial(parse_header, text), repeat)
        ref, ref_outcome = _best(partial(safetensors.deserialize, framed), repeat)
        print(
            f"  {label:38} ours {ours * 1000:8.2f} ms ({ours_outcome})   "
            f"reference {ref * 1000:8.2f} ms ({ref_outcome})"
        )


async def _thread_hop() -> float:
    times = []
    for _ in range(200):
        start = time.perf_counter()
        await anyio.to_thread.run_sync(lambda: None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_threshold(repeat: int) -> None:
    hop = anyio.run(_thread_hop)
    print(f"\n== threshold: a worker-thread hop costs {hop * 1e6:.0f} us (median)")
    for tensors in (250, 1000, 4000, 16000):
        text = header_text(tensors)
        took, _ = _best(partial(parse_header, text), repeat)
        marker = "  <- PARSE_IN_THREAD_ABOVE" if len(text) > PARSE_IN_THREAD_ABOVE else ""
        print(
            f"  {len(text) / 1024:7.0f} KiB ({tensors:5} tensors): parse {took * 1000:6.2f} ms,"
            f" hop / parse = {hop / took:.1%}{marker}"
        )


async def _prefix_only(peers: int, declared: int) -> int:
    prefix = struct.pack("<Q", declared)
    stalled = anyio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield prefix
        await stalled.wait()

    async def read_one() -> None:
        with contextlib.suppress(SafetensorsError):
            await stream_st.read_header(chunks())

    tracemalloc.start()
    async with anyio.create_task_group() as tg:
        for _ in range(peers):
            tg.start_soon(read_one)
        await anyio.sleep(0.2)
        _, peak = tracemalloc.get_traced_memory()
        stalled.set()
    tracemalloc.stop()
    return peak


def bench_prefix_only() -> None:
    peers, declared = 32, 90 * MB
    peak = anyio.run(_prefix_only, peers, declared)
    print(
        f"\n== prefix only: {peers} peers each declaring {declared / MB:.0f} MB and sending 8 "
        f"bytes: traced peak {peak / 2**20:.1f} MiB "
        f"(declared in all: {peers * declared / MB:.0f} MB)"
    )


def _parse_and_walk(text: bytes) -> int:
    return sum(1 for _ in parse_header(text).tensors)


async def _read_and_walk(path: Path, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        header = await stream_st.read_header(path)
        for _ in header.tensors:
            pass
        times.append(time.perf_counter() - start)
    return times


def bench_small(tensors: int = 100, runs: int = 2000) -> None:
    text = header_text(tensors)
    parse_times = []
    for _ in range(runs):
        start = time.perf_counter()
        _parse_and_walk(text)
        parse_times.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "small.safetensors"
        write_file(path, tensors)
        read_times = anyio.run(_read_and_walk, path, runs)
    print(
        f"\n== small: {tensors} tensors ({len(text)} bytes), medians of {runs}: "
        f"parse_header + walk {statistics.median(parse_times) * 1e6:.0f} us, "
        f"read_header(path) + walk {statistics.median(read_times) * 1e6:.0f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument("--rss-child", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], Path(args.rss_child[1]))
        return
    print(
        f"python {sys.version.split()[0]}, stream_st from {Path(stream_st.__file__).parent}, "
        f"safetensors {version('safetensors')}, {os.cpu_count()} CPUs"
    )
    bench_hostile(args.repeat)
    bench_threshold(args.repeat)
    bench_prefix_only()
    bench_small()
    if not args.skip_big:
        bench_big(args.tensors, args.repeat)


if __name__ == "__main__":
    main()

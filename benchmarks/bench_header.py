"""Header parsing: ``stream_st.read_header`` against the reference, on big and hostile headers.

Run it from the repository root (about four minutes on 2 cores; ~3 GiB of RAM, ~200 MiB of
disk)::

    python benchmarks/bench_header.py [--sizes 10,100,...] [--rounds 3] [--tensors 1000000]
                                      [--repeat 3] [--skip-big] [--base DIR] [--idle MS]
                                      [--only-sizes]

Five parts:

* ``sizes``: valid files of 10 to 10**6 F32 tensors of shape [1] (``--sizes``), each variant the
  first call in a fresh process (imports done before the clock starts: stream_st, anyio's
  asyncio backend, numpy, safetensors), rounds interleaved (A R T B C, then R T B C A...):

  - A: ``await stream_st.read_header(path)`` on a running event loop;
  - R: ``anyio.run(stream_st.read_header, path)``, the loop's start and end included;
  - T: A again with a ticker task on the same loop (``anyio.sleep(0.001)`` in a loop): the
    longest gap between two ticks is the event loop's longest stall while the header is read;
  - B: ``safetensors.safe_open(path, "np")`` with ``.keys()`` and ``.metadata()``, the
    reference;
  - C: the header read by hand and given to ``json.loads``, another bar.

  - A0 (with ``--base DIR``): A with the ``stream_st`` of another checkout's root ``DIR`` (its
    ``PYTHONPATH``), the "before" of a change, in the same interleaved rounds.

  Each clock starts right after the imports and the loop's start, as a program's first read
  would: with ``--idle MS``, each variant first waits ``MS`` ms idle (``anyio.sleep`` on the
  loop, ``time.sleep`` for B and C), which lets the CPU cool its caches (at 10 tensors 10 ms
  made A about 120 us slower, B about 45 us). T's ticker starts 10 ms before its clock.

  Printed: medians, and the paired ratios B / A, B / R and C / A of each round (median and
  range, and B / A of every round; above 1.00 stream_st is faster), with ``--base`` A0 / A
  (above 1.00: the change is faster) and B / A0, the load average before and after each size.
  ``--only-sizes`` runs this part alone.
* ``big``: a valid file of ``--tensors`` tensors (a 10**6-tensor header is about 77 MB of
  JSON): how long one full ``gc.collect()`` takes while the parsed header lives (every full
  collection of the process pays it for as long as the header is kept), and A and B each in a
  fresh subprocess, which reports its peak RSS (``VmHWM``, reset after imports where the kernel
  allows it) above the RSS after imports.
* ``small``: a 100-tensor header, the kind most reads open: ``parse_header`` plus one pass over
  ``header.tensors`` (the reader makes one per read), and ``stream_st.read_header(path)`` plus
  that pass, medians of many.
* ``hostile``: headers a peer may send, each refused by both: ``stream_st.parse_header`` against
  ``safetensors.deserialize`` on the same bytes, best of ``--repeat``. The reference's time
  includes copying the bytes in; both are well under a millisecond for a small header.
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
import anyio.lowlevel
import numpy  # noqa: F401  # imported before any clock starts: the reference's "np" needs it
import safetensors
from bench_read import _status_kib  # this script's folder is on sys.path

import stream_st
from stream_st import SafetensorsError, parse_header

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


async def read_with_ticker(
    path: Path, tick: bool = True, idle: float = 0.0
) -> tuple[float, float, int]:
    """``read_header(path)``: seconds taken, the loop's longest stall meanwhile, tensor count.

    Without ``tick`` no ticker runs (its wakeups take the GIL from the parsing thread 1000 times
    a second) and the stall reads 0; the clock starts after ``idle`` seconds of sleep, else at
    once. With ``tick``, after 10 ms at least: the ticker is running.
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
        if tick or idle:
            await anyio.sleep(max(idle, 0.01 if tick else 0.0))
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


def bench_big(tensors: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "big.safetensors"
        n = write_file(path, tensors)
        print(f"\n== big: {tensors} tensors, header {n / MB:.1f} MB")
        alive, gone = full_collection_ms(path)
        print(f"  one full gc.collect(): {alive:.1f} ms with the header alive, {gone:.1f} ms after")
        print(f"  peak RSS above imports: A {peak_rss_mib('ours', path)}, ", end="", flush=True)
        print(f"B {peak_rss_mib('ref', path)}")


VARIANTS = ("A", "R", "T", "B", "C")
"""The variants of ``sizes``, each the first call in a fresh process (see the module's doc);
A0 joins them with ``--base``."""


async def _first_read(path: Path, tick: bool, idle: float) -> dict[str, float]:
    await anyio.lowlevel.checkpoint()  # the loop runs
    cpu = time.process_time()
    took, stall, _ = await read_with_ticker(path, tick, idle)
    return {"seconds": took, "cpu": time.process_time() - cpu, "stall": stall}


def json_header(path: Path) -> int:
    """The header of ``path`` read by hand and parsed by ``json.loads``: its member count."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return len(json.loads(f.read(n)))


def first_call_child(variant: str, path: Path, idle: float) -> None:
    """Time one variant of ``sizes`` in this fresh process and print the result as JSON."""
    import anyio._backends._asyncio  # the backend a first anyio.run imports

    from stream_st import read_header

    result: dict[str, float]
    if variant in ("A", "A0", "T"):
        result = anyio.run(_first_read, path, variant == "T", idle)
    else:
        time.sleep(idle)
        cpu = time.process_time()
        start = time.perf_counter()
        if variant == "R":
            anyio.run(read_header, path)
        elif variant == "B":
            with safetensors.safe_open(str(path), "np") as f:
                f.keys()
                f.metadata()
        else:
            json_header(path)
        result = {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    print(json.dumps(result))


def first_call(variant: str, path: Path, idle: float, base: str | None) -> dict[str, float]:
    """One variant's first call in a fresh process; A0 with the ``stream_st`` of ``base``."""
    env = dict(os.environ)
    if variant == "A0":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [base, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--first-call", variant, str(path), str(idle)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _ratio(tops: list[float], bottoms: list[float]) -> str:
    ratios = sorted(t / b for t, b in zip(tops, bottoms, strict=True))
    return f"{statistics.median(ratios):5.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:9.2f}"


def bench_sizes(sizes: list[int], rounds: int, idle: float, base: str | None) -> None:
    variants = (*VARIANTS, "A0") if base else VARIANTS
    print(
        f"\n== sizes: first call in a fresh process, {rounds} interleaved rounds, "
        f"{idle * 1000:g} ms idle before each clock; medians in ms of wall and CPU (process) "
        "time; paired ratios B/A, B/R, C/A, median [range] (above 1: stream_st faster)"
    )
    if base:
        print(f"  A0: stream_st from {base}; A0/A above 1: this checkout faster")
    print(
        f"  {'tensors':>8} {'clock':>5} {'A await':>9} {'R run':>9} {'B ref':>9} {'C json':>9}  "
        f"{'B/A':>17} {'B/R':>17} {'C/A':>17}" + (f" {'A0 base':>9} {'A0/A':>17}" if base else "")
    )
    with tempfile.TemporaryDirectory() as directory:
        for tensors in sizes:
            path = Path(directory) / f"{tensors}.safetensors"
            write_file(path, tensors)
            load = os.getloadavg()[0]
            runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            for r in range(rounds):
                for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
                    runs[variant].append(first_call(variant, path, idle, base))
            path.unlink()
            med = statistics.median
            for clock, label in (("seconds", "wall"), ("cpu", "cpu")):
                a, r_, b, c = ([run[clock] for run in runs[v]] for v in "ARBC")
                line = (
                    f"  {tensors:>8} {label:>5} {_ms(med(a))} {_ms(med(r_))} {_ms(med(b))} "
                    f"{_ms(med(c))}  {_ratio(b, a)} {_ratio(b, r_)} {_ratio(c, a)}"
                )
                if base:
                    a0 = [run[clock] for run in runs["A0"]]
                    line += f" {_ms(med(a0))} {_ratio(a0, a)}"
                print(line)
            for top, bottom in (("B", "A"), ("B", "A0"), ("A0", "A")):
                if bottom in runs and top in runs:
                    per_round = [
                        round(t["seconds"] / b["seconds"], 2)
                        for t, b in zip(runs[top], runs[bottom], strict=True)
                    ]
                    print(f"  {'':>8} {top}/{bottom} wall, round by round: {per_round}")
            stalls = sorted(run["stall"] * 1000 for run in runs["T"])
            print(
                f"  {'':>8} event loop's longest stall (T): {stalls[-1]:.1f} ms "
                f"(runs {[round(x, 1) for x in stalls]}); load average {load:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after"
            )


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
    parser.add_argument("--sizes", default="10,100,1000,10000,100000,1000000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument(
        "--base", metavar="DIR", help="also time A with the stream_st of this checkout's root (A0)"
    )
    parser.add_argument(
        "--idle", type=float, default=0.0, metavar="MS", help="ms idle before each first call"
    )
    parser.add_argument("--only-sizes", action="store_true", help="run the sizes part alone")
    parser.add_argument("--rss-child", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--first-call", nargs=3, metavar=("VARIANT", "PATH", "IDLE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], Path(args.rss_child[1]))
        return
    if args.first_call:
        first_call_child(args.first_call[0], Path(args.first_call[1]), float(args.first_call[2]))
        return
    print(
        f"python {sys.version.split()[0]}, stream_st from {Path(stream_st.__file__).parent}, "
        f"safetensors {version('safetensors')}, {os.cpu_count()} CPUs"
    )
    base = os.path.abspath(args.base) if args.base else None
    bench_sizes([int(n) for n in args.sizes.split(",")], args.rounds, args.idle / 1000, base)
    if args.only_sizes:
        return
    bench_hostile(args.repeat)
    bench_prefix_only()
    bench_small()
    if not args.skip_big:
        bench_big(args.tensors)


if __name__ == "__main__":
    main()

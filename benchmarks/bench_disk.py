"""What the disk gives for a file that is not in the page cache, by read pattern: the bar for
cold reads.

Run it from the repository root (root to drop caches; else the buffered rows evict with
``posix_fadvise(DONTNEED)`` on the file, which the table title says)::

    python benchmarks/bench_disk.py [--size 512] [--threads 1,2,4,8,16] [--blocks 1,4,8,16]
                                    [--modes direct,buffered,willneed] [--rounds 3] [--file PATH]

It reads the first ``--size`` MiB of ``--file`` (by default a file of random bytes written under a
temporary directory and deleted at the end) from N threads at once, each taking the next block
of B MiB in file order (the way :mod:`stream_st.transports.file.readahead` hands out pieces) with
``os.preadv`` into a buffer of its own that it reuses, so neither page faults nor allocation
count, only the read. Modes:

* ``direct``: ``O_DIRECT`` (the page cache bypassed: what the device itself gives at that
  queue depth and request size);
* ``buffered``: plain reads after the file was evicted (the kernel's own read-ahead only);
* ``willneed``: ``posix_fadvise(POSIX_FADV_WILLNEED)`` on the whole range first, then the same
  buffered reads (the kernel reads asynchronously while the threads copy what is in).

Every cell is timed once per round, the cells of a round in a rotated order, and the median GB/s
over rounds printed, with the best cell of each mode. On a virtual machine the host may cache the
disk image, so this is the guest's device as it is offered, not the physical disk.

**Cold readers against the device** (``--readers``)::

    python benchmarks/bench_disk.py --readers [--files f32,kv] [--scale 0.5] [--rounds 5]
        [--variants st_stream,st_load,runai,sft_np] [--bars psync:1:16,io_uring:16:8]
        [--evict drop_caches|fadvise] [--dir DIR]

The files of ``benchmarks/bench_peers.py`` (``f32``: 32 MiB F32 tensors, 2 GiB at scale 1;
``kv``: the 44 MiB TinyLlama KV cache), each read by every variant once per round, each variant
in a fresh process that evicts the file after its imports, right before its clock starts (see
``bench_peers.py``; ``--evict fadvise`` evicts only the file, kinder to a shared machine, by
default ``/proc/sys/vm/drop_caches`` where writable). The variants are ``bench_peers.py``'s
(``st_stream``: ``open_stream`` streaming; ``st_load``: ``stream_st.load``, load-and-keep;
``runai``: runai-model-streamer; ``sft_np``/``sft_pt``: the reference's ``load_file``; ...).
The bars are the device's pace: ``fio`` reading the file with ``O_DIRECT``, one job of
sequential reads, ``ENGINE:DEPTH:MiB`` each (``psync:1:16``: one read of 16 MiB at a time;
``io_uring:16:8``: 16 reads of 8 MiB in flight), the file evicted first as well, timed by fio
itself; the device's pace in a round is the best bar of that round. Without ``fio`` on the path,
``psync`` bars are a Python loop of sequential ``O_DIRECT`` reads into one reused buffer, and
the others are left out. Rounds are interleaved (a rotated order). Printed: every round's GB/s
per variant, then per reader its paired ratios (per round, its speed over the device's and over
each peer's: runai, the reference) with their median and range, and the load average before
and after.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import bench_peers  # this script's folder is on sys.path

MiB = 1 << 20


def read_all(path: Path, size: int, threads: int, block: int, mode: str) -> float:
    """Seconds to read ``size`` bytes of ``path`` from ``threads`` threads, ``block`` bytes per
    call, in ``mode`` (see the module)."""
    flags = os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0)
    fd = os.open(path, flags)
    buffers = [mmap.mmap(-1, block) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
    for buffer in buffers:
        buffer.write(b"\0" * block)  # fault the pages in before timing
    lock = threading.Lock()
    next_offset = [0]

    def work(buffer: mmap.mmap) -> None:
        view = memoryview(buffer)
        while True:
            with lock:
                offset = next_offset[0]
                next_offset[0] += block
            if offset >= size:
                return
            if os.preadv(fd, [view], offset) == 0:
                return

    try:
        start = time.perf_counter()
        if mode == "willneed":
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        workers = [threading.Thread(target=work, args=(b,)) for b in buffers]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return time.perf_counter() - start
    finally:
        os.close(fd)


def write_file(path: Path, size: int) -> None:
    chunk = os.urandom(MiB)
    with open(path, "wb") as file:
        for _ in range(size // MiB):
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())


# --- cold readers against the device (--readers) ----------------------------------------------

READERS = ("st_stream", "st_load", "st_map", "st_stream_direct", "st_load_direct")
"""stream_st's variants: the readers whose ratios are printed (the others are peers)."""

PEERS = ("runai", "sft_np", "sft_pt")
"""The peers each reader is paired with, where they ran."""


def fio_seconds(path: Path, engine: str, depth: int, block: int) -> float:
    """Seconds ``fio`` takes to read ``path`` with ``O_DIRECT`` in one job of sequential reads
    of ``block`` bytes, ``depth`` in flight, as fio times it."""
    command = [
        "fio",
        "--name=bar",
        f"--filename={path}",
        "--rw=read",
        "--direct=1",
        "--numjobs=1",
        f"--ioengine={engine}",
        f"--iodepth={depth}",
        f"--bs={block}",
        f"--size={path.stat().st_size // block * block}",
        "--output-format=terse",
        "--terse-version=3",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    fields = done.stdout.strip().splitlines()[-1].split(";")
    read_kib, runtime_ms = int(fields[5]), int(fields[8])
    return max(runtime_ms, 1) / 1000 * path.stat().st_size / (read_kib * 1024)


def bar_seconds(path: Path, bar: str) -> float | None:
    """Seconds the bar ``ENGINE:DEPTH:MiB`` takes to read ``path`` (evicted first); None for a
    bar that cannot run here (no fio, and not a ``psync`` bar of depth 1)."""
    engine, depth, mib = bar.split(":")
    bench_peers.evict(path)
    if shutil.which("fio"):
        return fio_seconds(path, engine, int(depth), int(mib) * MiB)
    if engine != "psync" or depth != "1":
        return None
    return read_all(
        path, path.stat().st_size // (int(mib) * MiB) * int(mib) * MiB, 1, int(mib) * MiB, "direct"
    )


def ratio_line(label: str, ratios: Sequence[float]) -> str:
    """``label``: median (range) of ``ratios``, and each round's."""
    each = " ".join(f"{r:.2f}" for r in ratios)
    return (
        f"| {label} | {statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f} "
        f"| {each} |"
    )


def run_readers(args: argparse.Namespace) -> None:
    """The ``--readers`` comparison (see the module)."""
    variants = args.variants.split(",")
    bars = args.bars.split(",")
    start_load = os.getloadavg()
    print(
        f"# bench_disk --readers: scale {args.scale:g}, {args.rounds} rounds, load average "
        f"{' '.join(f'{x:.2f}' for x in start_load)}, evicted by "
        f"{bench_peers.eviction_method()}, bars by {'fio' if shutil.which('fio') else 'Python'}"
    )
    directory = args.dir or Path(tempfile.mkdtemp(prefix="bench_disk-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        specs = bench_peers.bench_files(args.scale)
        for label in args.files.split(","):
            spec = specs[label]
            path = bench_peers.ensure_file(directory, spec, args.scale)
            size = path.stat().st_size
            names = [*variants, *(f"bar {b}" for b in bars)]
            seconds: dict[str, list[float]] = {name: [] for name in names}
            for round_index in range(args.rounds):
                for name in bench_peers.rotated(names, round_index):
                    if name.startswith("bar "):
                        took = bar_seconds(path, name[4:])
                        if took is not None:
                            seconds[name].append(took)
                        continue
                    got = bench_peers.run_variant(name, path, runs=1, cold=True)
                    if "error" in got:
                        raise SystemExit(f"{name} failed on {label}: {got['error']}")
                    seconds[name].append(got["times"][0])
            ran = {name: times for name, times in seconds.items() if times}
            bar_names = [name for name in ran if name.startswith("bar ")]
            device = [min(ran[b][i] for b in bar_names) for i in range(args.rounds)]
            print(f"\n### cold {label}: {size / MiB:.0f} MiB in {len(spec.tensors)} tensors\n")
            print("| variant | GB/s median | each round |")
            print("|---|---|---|")
            for name, times in [*ran.items(), ("device (best bar)", device)]:
                speeds = [size / t / 1e9 for t in times]
                each = " ".join(f"{x:.2f}" for x in speeds)
                print(f"| {name} | {statistics.median(speeds):.2f} | {each} |")
            print("\n| paired ratio (its speed over the other's) | median | range | each round |")
            print("|---|---|---|---|")
            for reader in (v for v in variants if v in READERS):
                own = ran[reader]
                print(
                    ratio_line(
                        f"{reader} / device", [d / t for d, t in zip(device, own, strict=True)]
                    )
                )
                for peer in (p for p in PEERS if p in ran):
                    pairs = zip(ran[peer], own, strict=True)
                    print(ratio_line(f"{reader} / {peer}", [p / t for p, t in pairs]))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    end_load = os.getloadavg()
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in end_load)}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--readers", action="store_true", help="cold readers against the device")
    parser.add_argument("--files", default="f32,kv", help="--readers: bench_peers.py's files")
    parser.add_argument("--scale", type=float, default=0.5, help="--readers: shrink f32")
    parser.add_argument("--variants", default="st_stream,st_load,runai,sft_np")
    parser.add_argument("--bars", default="psync:1:16,io_uring:16:8", help="ENGINE:DEPTH:MiB")
    parser.add_argument("--evict", choices=("drop_caches", "fadvise"), default="drop_caches")
    parser.add_argument("--dir", type=Path, help="--readers: keep the files here and reuse them")
    parser.add_argument("--size", type=int, default=512, help="MiB to read")
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--blocks", default="1,4,8,16", help="MiB per read call")
    parser.add_argument("--modes", default="direct,buffered,willneed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--file", type=Path, help="read this file (at least --size MiB)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.evict == "fadvise":
        os.environ["BENCH_EVICT"] = "fadvise"  # bench_peers.evict, here and in the children
    if args.readers:
        run_readers(args)
        return
    size = args.size * MiB
    threads = [int(n) for n in args.threads.split(",")]
    blocks = [int(n) for n in args.blocks.split(",")]
    modes = args.modes.split(",")
    cells = [(m, t, b) for m in modes for t in threads for b in blocks]
    with tempfile.TemporaryDirectory(prefix="bench_disk-") as scratch:
        path = args.file or Path(scratch) / "data"
        if args.file is None:
            write_file(path, size)
        if path.stat().st_size < size:
            raise SystemExit(f"{path} holds less than {args.size} MiB")
        times: dict[tuple[str, int, int], list[float]] = {cell: [] for cell in cells}
        how = ""
        for round_index in range(args.rounds):
            shift = round_index * len(cells) // max(1, args.rounds)
            for cell in cells[shift:] + cells[:shift]:
                mode, count, block = cell
                if mode != "direct":
                    bench_peers.evict(path)
                    how = bench_peers.eviction_method()
                times[cell].append(read_all(path, size, count, block * MiB, mode))
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"# bench_disk: {args.size} MiB, {args.rounds} rounds, load average {load}")
    if how:
        print(f"# buffered modes evicted by {how}")
    for mode in modes:
        print(f"\n### {mode}: GB/s (median over rounds)\n")
        print("| threads | " + " | ".join(f"{b} MiB" for b in blocks) + " |")
        print("|---|" + "---|" * len(blocks))
        for count in threads:
            row = [size / statistics.median(times[(mode, count, b)]) / 1e9 for b in blocks]
            print(f"| {count} | " + " | ".join(f"{gbs:.2f}" for gbs in row) + " |")
        best = min(
            ((mode, t, b) for t in threads for b in blocks),
            key=lambda cell: statistics.median(times[cell]),
        )
        speed = size / statistics.median(times[best]) / 1e9
        print(f"\nbest {mode}: {best[1]} threads x {best[2]} MiB, {speed:.2f} GB/s")


if __name__ == "__main__":
    main()

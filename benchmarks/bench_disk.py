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
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

MiB = 1 << 20
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def evict(path: Path) -> str:
    """Take ``path`` out of the page cache; how it was done."""
    if os.access(DROP_CACHES, os.W_OK):
        os.sync()
        DROP_CACHES.write_text("1\n")
        return "drop_caches"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "fadvise"


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=512, help="MiB to read")
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--blocks", default="1,4,8,16", help="MiB per read call")
    parser.add_argument("--modes", default="direct,buffered,willneed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--file", type=Path, help="read this file (at least --size MiB)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
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
                    how = evict(path)
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

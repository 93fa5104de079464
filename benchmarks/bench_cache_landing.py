"""Where a first read with ``cache=`` could land its bytes: the kernel mechanisms alone, no
stream_st, on the CPU time of the receiving process.

Run it from the repository root (about a minute on 2 cores; twice ``--size-mib`` of disk)::

    python benchmarks/bench_cache_landing.py [--size-mib 256] [--repeat 9] [--dir DIR]
        [--variants none,write,map,map-sparse,splice]

A server process sends a header's worth of bytes and then ``--size-mib`` of random bytes, as
32 MiB tensors, over loopback TCP; each run is a fresh process that receives them as one of:

* ``none``: each tensor into fresh memory (``np.empty``), no copy: a read without a cache;
* ``write``: the same, and a thread of the copy's writes each MiB landed (``pwrite``) into a
  copy whose blocks were reserved up front (``posix_fallocate``) and hashes it (xxh3-128):
  what ``cache=`` does;
* ``map``: the copy's blocks reserved; each tensor received straight into a shared writable
  mapping of its range of the copy (``MAP_SHARED``), the thread hashing each MiB landed from
  there; the tensor then handed out as a copy-on-write view of the same range (``MAP_PRIVATE``);
* ``map-sparse``: ``map`` with the copy only sized (``ftruncate``, no blocks reserved) and each
  tensor's range populated for writing first (``MADV_POPULATE_WRITE``, so a full disk is an
  error there rather than a ``SIGBUS``);
* ``splice``: the copy's blocks reserved; the bytes moved from the socket to a pipe and from the
  pipe into the copy (``splice``: the kernel's one copy, into the page cache), the thread
  hashing each MiB landed through a read-only mapping; handed out as ``map`` does.

Every tensor handed out is touched (one byte per 4 KiB page summed), as ``bench_cache.py``
does. The variants that hash check the digest against the server's. Rounds are interleaved
after one untimed warm-up round; printed: per variant the median seconds, CPU seconds of the
receiving process (all its threads) and minor page faults; then, paired per round, ``write``'s
CPU seconds over each variant's (above 1: it costs less CPU than today's copy) and ``none``'s
wall time over each variant's (below 1: it takes longer than a read without a copy); the load
average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import mmap
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

TENSOR = 32 << 20
HEADER = 8 + 4000  # the tensors start at an offset that is not page-aligned, as in a file
PIECE = 1 << 20  # handed to the copy's thread as it lands, as the cache does
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's values
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
F_SETPIPE_SZ = 1031
VARIANTS = ("none", "write", "map", "map-sparse", "splice")

Piece = tuple[int, memoryview | int]


def serve(size_mib: int) -> None:
    """Send the digest, then the payload, to each connection that asks with ``b"g"``."""
    payload = np.random.default_rng(0).bytes(HEADER + (size_mib << 20))
    digest = xxhash.xxh3_128(payload).digest()
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            if conn.recv(1) != b"g":
                return
            conn.sendall(digest)
            conn.sendall(payload)


class Keeper:
    """The copy's thread: ``work`` on each piece handed over, in order; :meth:`drain` waits."""

    def __init__(self, work: Callable[[int, Any], None]) -> None:
        self._work = work
        self._pieces: deque[Piece | None] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def hand(self, offset: int, what: memoryview | int) -> None:
        with self._cond:
            self._pieces.append((offset, what))
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pieces:
                    self._cond.wait()
                piece = self._pieces.popleft()
                self._busy = True
            if piece is None:
                return
            self._work(*piece)
            del piece  # hold no view of the caller's memory while waiting
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def drain(self) -> None:
        with self._cond:
            while self._pieces or self._busy:
                self._cond.wait()

    def stop(self) -> None:
        with self._cond:
            self._pieces.append(None)
            self._cond.notify_all()
        self._thread.join()


def receive(sock: socket.socket, view: memoryview, landed: Callable[[int, int], None]) -> None:
    """Fill ``view`` from ``sock``, calling ``landed(start, end)`` for each MiB in."""
    got = handed = 0
    while got < len(view):
        count = sock.recv_into(view[got:])
        if not count:
            raise EOFError("the server stopped early")
        got += count
        while got - handed >= PIECE or (got == len(view) and handed < got):
            end = min(got, handed + PIECE)
            landed(handed, end)
            handed = end


def write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def handing(keeper: Keeper | None, start: int, view: memoryview) -> Callable[[int, int], None]:
    """What tells ``keeper`` of the bytes landed in ``view`` (those of the copy from ``start``)."""

    def landed(begin: int, end: int) -> None:
        if keeper is not None:
            keeper.hand(start + begin, view[begin:end])

    return landed


@contextlib.contextmanager
def mapped(
    fd: int, start: int, length: int, flags: int, prot: int
) -> Iterator[tuple[mmap.mmap, memoryview]]:
    """A mapping of the copy's bytes ``start`` to ``start + length``, and a view of exactly them."""
    base = start - start % mmap.PAGESIZE
    region = mmap.mmap(fd, start + length - base, flags=flags, prot=prot, offset=base)
    view = memoryview(region)[start - base :]
    try:
        yield region, view
    finally:
        view.release()
        region.close()


def touch(view: memoryview) -> float:
    """Touch a tensor as the consumer of ``bench_cache.py`` does (one value per 4 KiB)."""
    return float(np.frombuffer(view, np.uint8)[::4096].sum())


def hand_out(fd: int, start: int) -> float:
    """The tensor at ``start`` as the user would get it: a copy-on-write view of the copy."""
    flags, prot = mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
    with mapped(fd, start, TENSOR, flags, prot) as (_, view):
        return touch(view)


def run(variant: str, port: int, directory: str, size_mib: int) -> dict[str, float]:
    """One read of the payload as ``variant``; its seconds, CPU seconds and minor faults."""
    count = size_mib // 32
    size = HEADER + count * TENSOR
    fd = os.open(Path(directory) / "copy.part", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if variant == "map-sparse":
        os.ftruncate(fd, size)
    elif variant != "none":
        os.posix_fallocate(fd, 0, size)
    hasher = xxhash.xxh3_128()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"g")
    digest = bytearray(16)
    receive(sock, memoryview(digest), lambda start, end: None)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, faults = usage.ru_utime + usage.ru_stime, usage.ru_minflt
    started = time.perf_counter()
    header = bytearray(HEADER)
    receive(sock, memoryview(header), lambda start, end: None)
    if variant != "none":
        write_all(fd, memoryview(header), 0)
        hasher.update(header)
    touched = 0.0
    keeper: Keeper | None = None
    if variant == "write":

        def write(offset: int, view: memoryview) -> None:
            write_all(fd, view, offset)
            hasher.update(view)

        keeper = Keeper(write)
    elif variant in ("map", "map-sparse"):
        keeper = Keeper(lambda offset, view: hasher.update(view))
    elif variant == "splice":
        reader = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        whole = memoryview(reader)

        def hash_landed(offset: int, length: int) -> None:
            aligned = offset - offset % mmap.PAGESIZE
            reader.madvise(MADV_POPULATE_READ, aligned, offset + length - aligned)
            hasher.update(whole[offset : offset + length])

        keeper = Keeper(hash_landed)
        pipe_out, pipe_in = os.pipe()
        fcntl.fcntl(pipe_in, F_SETPIPE_SZ, PIECE)
    for index in range(count):
        start = HEADER + index * TENSOR
        if variant in ("none", "write"):
            view = np.empty(TENSOR, np.uint8).data
            receive(sock, view, handing(keeper, start, view))
            if keeper is not None:
                keeper.drain()
            touched += touch(view)
            view.release()
        elif variant in ("map", "map-sparse"):
            assert keeper is not None
            shared = mmap.PROT_READ | mmap.PROT_WRITE
            with mapped(fd, start, TENSOR, mmap.MAP_SHARED, shared) as (region, view):
                if variant == "map-sparse":
                    region.madvise(MADV_POPULATE_WRITE)
                receive(sock, view, handing(keeper, start, view))
                keeper.drain()
            touched += hand_out(fd, start)
        else:  # splice
            assert keeper is not None
            got = 0
            while got < TENSOR:
                moved = os.splice(sock.fileno(), pipe_in, min(TENSOR - got, PIECE))
                if not moved:
                    raise EOFError("the server stopped early")
                written = 0
                while written < moved:
                    written += os.splice(
                        pipe_out, fd, moved - written, offset_dst=start + got + written
                    )
                keeper.hand(start + got, moved)
                got += moved
            keeper.drain()
            touched += hand_out(fd, start)
    if keeper is not None:
        keeper.stop()
    seconds = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    if variant != "none" and hasher.digest() != bytes(digest):
        raise AssertionError(f"{variant}: the copy's digest does not match the server's")
    os.close(fd)
    return {
        "seconds": seconds,
        "cpu": usage.ru_utime + usage.ru_stime - cpu,
        "faults": usage.ru_minflt - faults,
        "touched": touched,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.size_mib)
        return
    if args.child:
        variant, port, directory = args.child
        print(json.dumps(run(variant, int(port), directory, args.size_mib)))
        return
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown or "none" not in variants or "write" not in variants:
        parser.error(f"--variants: from {', '.join(VARIANTS)}, with none and write")
    me = [sys.executable, __file__, "--size-mib", str(args.size_mib)]
    server = subprocess.Popen([*me, "--serve"], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = server.stdout.readline().strip()
    scratch = tempfile.mkdtemp(dir=args.dir)
    try:
        print(f"{args.size_mib} MiB over loopback TCP, {args.repeat} rounds, a fresh process each")
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for round_ in range(args.repeat + 1):
            for name in variants:
                out = subprocess.run(
                    [*me, "--child", name, port, scratch], capture_output=True, text=True
                )
                if out.returncode:
                    raise SystemExit(f"{name} failed:\n{out.stderr}")
                if round_:  # round 0 warms up
                    results[name].append(json.loads(out.stdout))
        columns = f"{'median s':>9} {'CPU s':>6} {'faults':>7}  {'CPU write/it':17} time none/it"
        print(f"{'variant':11} {columns}")
        for name in variants:
            rows = results[name]

            def paired(key: str, bar: str, rows: list[dict[str, float]] = rows) -> str:
                ratios = [b[key] / r[key] for b, r in zip(results[bar], rows, strict=True)]
                return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

            seconds, cpu, faults = (
                statistics.median(row[key] for row in rows) for key in ("seconds", "cpu", "faults")
            )
            print(
                f"{name:11} {seconds:9.3f} {cpu:6.3f} {faults:7.0f}  "
                f"{paired('cpu', 'write'):17} {paired('seconds', 'none')}"
            )
        print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", int(port))).sendall(b"x")
        server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

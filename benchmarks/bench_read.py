"""Read throughput of ``stream_st.open_stream`` against the reference package and raw I/O.

Run it from the repository root (about a minute on 2 cores; needs ~2.1 GiB of disk and ~5 GiB RAM)::

    python benchmarks/bench_read.py [--repeat 7] [--kv-repeat 35] [--warmup 1] [--rotate]
                                    [--dir DIR] [--variants AEF] [--files big]
                                    [--files kv,64,128,256] [--no-rss]

It writes two safetensors files (in a temporary directory, deleted at the end; with ``--dir`` the
files are kept there and reused by later runs):

* ``big``: 64 tensors of 32 MiB F32 (2 GiB of data);
* ``kv``:  a TinyLlama KV cache, 22 layers x (key, value) of shape [1, 4, 2048, 64] F16 (44 MiB);
* a number N in ``--files``: N MiB of 32 MiB F32 tensors, like ``big`` (``64,128,256``: the
  sizes where fixed costs still show), timed ``--kv-repeat`` rounds as the KV file.

Then, page cache warm, it times these variants, interleaved (A B C D A B C D ...) after
``--warmup`` untimed rounds, and prints the median of the repetitions for each file:

* A: ``stream_st.open_stream(path)``, ``async for`` over every array, each dropped at once;
* B: ``safetensors.numpy.load_file(path)`` (the reference, default mmap backend);
* C: a hand-written synchronous loop: header by ``os.pread``, then per tensor a fresh ``np.empty``
  filled by ``os.preadv``: the raw-I/O bar;
* D: ``open_stream`` fed by an async iterator yielding 1 MiB chunks of the file;
* E: ``open_stream`` of a copy of the file with per-tensor xxh3-128 digests (``checksums=True``),
  every tensor verified while it is read;
* F: the same with SHA-256 digests (``checksums="sha256"``);
* G: ``open_stream`` fed by a producer with ``async def readinto(buffer)`` reading the file
  (blocking, like D) straight into each array: the source protocol without D's second copy.

E and F read copies that differ from the file only in their header, written once beside it.
Their cost is reported as the paired ratio (per round, E's time over A's, then the median).

Every variant "touches" each array it gets the same way (sums byte 0 of every 4 KiB page), so each
page the reference might leave unmapped is faulted in, and the per-page sums double as a check
that every variant delivered the same bytes. ``load_file`` in fact returns arrays backed by
``bytearray`` copies (checked and printed), so the touch adds the same small cost to all four.

D's iterator reads each chunk with a blocking ``readinto`` into one reused 1 MiB ``bytearray`` and
yields a view of it. Blocking is deliberate: a 1 MiB read from the page cache takes ~0.1 ms, less
than a hop to a worker thread would cost, and D measures the reader's chunk path, not file I/O.
Reusing the buffer is safe because the reader copies every byte out of a chunk before it asks for
the next one (``ChunkIteratorSource`` only calls ``anext`` once the current chunk is used up).

All async variants run inside one ``anyio.run`` (asyncio backend), as in an application whose loop
is already running; the synchronous variants run on the same thread.

Finally a fresh subprocess (``python benchmarks/bench_read.py --rss-child PATH``) streams the big
file with ``open_stream`` dropping each array, and reports its peak RSS (``VmHWM``) above the
baseline taken after imports; the target is the largest tensor + 64 MiB (not with
``--no-rss``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import safetensors
import safetensors.numpy

import stream_st

MiB = 1 << 20
GiB = 1 << 30
PAGE = 4096
CHUNK_SIZE = 1 * MiB
RSS_SLACK = 64 * MiB

NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
}

Touches = dict[str, int]
"""Per tensor name, the sum of byte 0 of every 4 KiB page of its array."""


@dataclass(frozen=True)
class TensorLayout:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * NUMPY_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class BenchFile:
    label: str
    description: str
    tensors: tuple[TensorLayout, ...]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def largest(self) -> int:
        return max(t.nbytes for t in self.tensors)


def big_file(label: str, mib: int) -> BenchFile:
    """``mib`` MiB (rounded down to whole tensors, at least one) of 32 MiB F32 tensors."""
    count = max(1, mib // 32)
    return BenchFile(
        label,
        f"{count} x 32 MiB F32 [2048, 4096]",
        tuple(TensorLayout(f"weight_{i:03d}", "F32", (2048, 4096)) for i in range(count)),
    )


BIG = big_file("big", 2048)
KV = BenchFile(
    "kv",
    "TinyLlama KV cache, 22 layers x key/value [1, 4, 2048, 64] F16",
    tuple(
        TensorLayout(f"layer_{i}_{kind}", "F16", (1, 4, 2048, 64))
        for i in range(22)
        for kind in ("key", "value")
    ),
)


# --------------------------------------------------------------------------- file creation


def _header_bytes(tensors: Sequence[TensorLayout]) -> bytes:
    entries: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        entries[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writes it
    return len(raw).to_bytes(8, "little") + raw


def write_file(path: Path, spec: BenchFile) -> None:
    """Write ``spec`` tensor by tensor (never the whole file in memory), then fsync it so no
    writeback runs during the timings. Byte values vary with the tensor and the position."""
    header = _header_bytes(spec.tensors)
    rng = np.random.default_rng(20240601)
    pattern = rng.integers(0, 256, size=spec.largest, dtype=np.uint8)
    scratch = np.empty_like(pattern)
    with path.open("wb") as f:
        f.write(header)
        for index, t in enumerate(spec.tensors):
            part = scratch[: t.nbytes]
            np.bitwise_xor(pattern[: t.nbytes], np.uint8((index * 37 + 1) % 256), out=part)
            f.write(part.data)
        f.flush()
        os.fsync(f.fileno())
    expected = len(header) + spec.data_bytes
    if path.stat().st_size != expected:
        raise RuntimeError(f"{path}: wrote {path.stat().st_size} bytes, expected {expected}")


def ensure_file(directory: Path, spec: BenchFile) -> Path:
    """The file for ``spec`` in ``directory``, written unless an identical one is already there."""
    path = directory / f"bench_{spec.label}_{len(spec.tensors)}.safetensors"
    header = _header_bytes(spec.tensors)
    if path.exists() and path.stat().st_size == len(header) + spec.data_bytes:
        with path.open("rb") as f:
            if f.read(len(header)) == header:
                return path
    write_file(path, spec)
    with safetensors.safe_open(str(path), framework="np") as f:  # the reference accepts it
        if list(f.keys()) != sorted(t.name for t in spec.tensors):
            raise RuntimeError(f"{path}: the reference reads other tensor names")
    return path


# --------------------------------------------------------------------------- the variants


def touch(array: np.ndarray[Any, Any]) -> int:
    """Sum byte 0 of every 4 KiB page of ``array``: faults in every page, costs ~1 load a page."""
    flat = array.reshape(-1).view(np.uint8)
    return int(np.add.reduce(flat[::PAGE], dtype=np.uint64))


async def variant_a(path: Path) -> Touches:
    """A: open_stream(path), every array dropped after the touch."""
    touches: Touches = {}
    async for name, array in stream_st.open_stream(path):
        touches[name] = touch(array)
        del array
    return touches


def variant_b(path: Path) -> Touches:
    """B: the reference safetensors.numpy.load_file (mmap backend)."""
    tensors = safetensors.numpy.load_file(path)
    touches = {name: touch(array) for name, array in tensors.items()}
    del tensors
    return touches


def _hand_header(fd: int) -> tuple[int, list[tuple[int, int, str, str, list[int]]]]:
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    header: dict[str, Any] = json.loads(os.pread(fd, length, 8))
    header.pop("__metadata__", None)
    entries = sorted(
        (v["data_offsets"][0], v["data_offsets"][1], name, v["dtype"], v["shape"])
        for name, v in header.items()
    )
    return 8 + length, entries


def variant_c(path: Path) -> Touches:
    """C: raw I/O. One positioned read per tensor straight into a fresh array, one thread."""
    touches: Touches = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        base, entries = _hand_header(fd)
        for start, end, name, dtype, shape in entries:
            raw = np.empty(end - start, dtype=np.uint8)
            view = raw.data
            filled = 0
            while filled < len(view):
                got = os.preadv(fd, [view[filled:]], base + start + filled)
                if got == 0:
                    raise RuntimeError(f"{path}: ends inside tensor {name!r}")
                filled += got
            array = raw.view(NUMPY_DTYPES[dtype]).reshape(shape)
            touches[name] = touch(array)
            del raw, view, array
    finally:
        os.close(fd)
    return touches


async def file_chunks(path: Path, chunk_size: int = CHUNK_SIZE) -> AsyncIterator[memoryview]:
    """The bytes of ``path`` as views of one reused ``chunk_size`` buffer (see module docstring)."""
    buffer = bytearray(chunk_size)
    view = memoryview(buffer)
    # Blocking reads on purpose: a page-cache read of 1 MiB is cheaper than a thread hop.
    with open(path, "rb", buffering=0) as f:  # noqa: ASYNC230
        while got := f.readinto(buffer):
            yield view[:got]


async def variant_d(path: Path) -> Touches:
    """D: open_stream over an async iterator of 1 MiB chunks."""
    touches: Touches = {}
    async for name, array in stream_st.open_stream(file_chunks(path)):
        touches[name] = touch(array)
        del array
    return touches


def checked_path(path: Path, algorithm: str) -> Path:
    """Where the copy of ``path`` with ``algorithm`` digests lies."""
    return path.with_name(f"{path.stem}.{algorithm}.safetensors")


async def write_checked(path: Path, algorithm: str) -> None:
    """Copy ``path`` with per-tensor digests, streamed (constant memory), unless already there."""
    if checked_path(path, algorithm).exists():
        return
    header = await stream_st.read_header(path)
    plan = [stream_st.TensorSpec(t.name, t.dtype, t.shape) for t in header.tensors]
    async with stream_st.open_writer(
        checked_path(path, algorithm), plan, checksums=algorithm
    ) as writer:
        async for name, array in stream_st.open_stream(path):
            await writer.write(name, array)


def verified(algorithm: str) -> Callable[[Path], Awaitable[Touches]]:
    """E, F: open_stream over the copy with ``algorithm`` digests, each tensor verified."""

    async def run(path: Path) -> Touches:
        touches: Touches = {}
        async for name, array in stream_st.open_stream(checked_path(path, algorithm)):
            touches[name] = touch(array)
            del array
        return touches

    return run


class FileProducer:
    """G's producer: ``async def readinto`` filling the reader's buffer from the file (blocking,
    like D's iterator); the reader hands it each array's own memory."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - see close()

    async def readinto(self, buffer: memoryview) -> int:
        return self._file.readinto(buffer) or 0

    def close(self) -> None:
        self._file.close()


async def variant_g(path: Path) -> Touches:
    """G: open_stream over a readinto producer (stream_st.AsyncReadInto)."""
    touches: Touches = {}
    producer = FileProducer(path)
    try:
        async for name, array in stream_st.open_stream(producer):
            touches[name] = touch(array)
            del array
    finally:
        producer.close()
    return touches


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    run: Callable[[Path], Awaitable[Touches]]


async def _sync(func: Callable[[Path], Touches], path: Path) -> Touches:
    return func(path)  # on the event loop thread, as the timing harness does for every variant


VARIANTS = (
    Variant("A", "open_stream(path)", variant_a),
    Variant("B", "safetensors.numpy.load_file", lambda p: _sync(variant_b, p)),
    Variant("C", "hand loop: np.empty + os.preadv", lambda p: _sync(variant_c, p)),
    Variant("D", "open_stream(async iter, 1 MiB chunks)", variant_d),
    Variant("E", "open_stream(path), xxh3-128 verified", verified("xxh3-128")),
    Variant("F", "open_stream(path), sha256 verified", verified("sha256")),
    Variant("G", "open_stream(readinto producer)", variant_g),
)
CHECKED = ("xxh3-128", "sha256")


# --------------------------------------------------------------------------- measuring


async def measure(
    path: Path,
    spec: BenchFile,
    repeat: int,
    warmup: int,
    rotate: bool = False,
    variants: Sequence[Variant] = VARIANTS,
) -> dict[str, list[float]]:
    """Run every variant ``warmup`` times untimed, then ``repeat`` interleaved timed rounds
    (A B C D A B C D ...; with ``rotate``, A B C D, B C D A, ... so no variant always runs
    right after the same other one, e.g. after B has freed 2 GiB)."""
    expected: Touches | None = None
    times: dict[str, list[float]] = {v.key: [] for v in variants}
    for round_index in range(warmup + repeat):
        shift = round_index % len(variants) if rotate else 0
        for variant in [*variants[shift:], *variants[:shift]]:
            started = time.perf_counter()
            touches = await variant.run(path)
            elapsed = time.perf_counter() - started
            if expected is None:
                expected = touches
                if sorted(touches) != sorted(t.name for t in spec.tensors):
                    raise RuntimeError(f"{variant.key} delivered other tensors on {spec.label}")
            elif touches != expected:
                raise RuntimeError(f"{variant.key} delivered other bytes than A on {spec.label}")
            if round_index >= warmup:
                times[variant.key].append(elapsed)
    return times


def _ratio_line(times: dict[str, float], fast: str, slow: str, target: float) -> str:
    if fast not in times or slow not in times:
        return f"  {fast}/{slow}: not measured"
    ratio = times[slow] / times[fast]  # speed of `fast` over speed of `slow`
    verdict = "PASS" if ratio >= target else "MISS"
    return f"  {fast}/{slow} = {ratio:5.2f}   target >= {target:.1f}   {verdict}"


def report(spec: BenchFile, path: Path, times: dict[str, list[float]]) -> None:
    medians = {key: statistics.median(values) for key, values in times.items()}
    n = len(next(iter(times.values())))
    print(f"\n== {spec.label}: {spec.description}: {spec.data_bytes / MiB:.0f} MiB of tensor data")
    print(f"   {path}  ({n} interleaved rounds, median)")
    print(f"  {'variant':<44} {'median s':>9} {'GB/s':>7}  {'min s':>8} {'max s':>8}")
    for v in VARIANTS:
        if v.key not in times:
            continue
        values = times[v.key]
        gbps = spec.data_bytes / medians[v.key] / 1e9
        print(
            f"  {v.key} {v.label:<42} {medians[v.key]:9.4f} {gbps:7.2f}"
            f"  {min(values):8.4f} {max(values):8.4f}"
        )
    print("  ratios are speed over speed (median time of the second / of the first):")
    print(_ratio_line(medians, "A", "B", 2.0))
    print(_ratio_line(medians, "A", "C", 0.9))
    print(_ratio_line(medians, "D", "C", 0.8))
    print("  verifying, paired per round (time of the verified read / of A's, median):")
    for key, target in (("E", 0.10), ("F", None)):
        if key not in times or "A" not in times:
            continue
        cost = statistics.median(t / a for t, a in zip(times[key], times["A"], strict=True)) - 1
        verdict = (
            ""
            if target is None
            else (f"   target <= {target:.0%}   {'PASS' if cost <= target else 'MISS'}")
        )
        print(f"  {key}: costs {cost:+6.1%} of A's time{verdict}")
    print(_ratio_line(medians, "G", "C", 0.8))


def describe_reference_arrays(path: Path) -> str:
    """What backs the arrays load_file returns: the mmap, or copies."""
    tensors = safetensors.numpy.load_file(path)
    array = next(iter(tensors.values()))
    root: object = array
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    owner = root.obj if isinstance(root, memoryview) else root
    kind = type(owner).__name__
    copy = isinstance(owner, bytes | bytearray)
    return (
        f"load_file arrays are backed by a {kind}"
        + (" (a copy of the file bytes, not the mmap)" if copy else "")
        + f", writeable={array.flags.writeable}"
    )


# --------------------------------------------------------------------------- peak RSS


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


async def _noop() -> None:
    await anyio.lowlevel.checkpoint()


def rss_child(path: Path) -> None:
    """In a fresh process: stream ``path`` dropping every array; print peak RSS as JSON."""
    anyio.run(_noop)  # import the asyncio backend before the baseline
    reset = True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        reset = False
    baseline = _status_kib("VmRSS")
    hwm_before = _status_kib("VmHWM")
    touches = anyio.run(variant_a, path)
    result = {
        "baseline_kib": baseline,
        "hwm_before_kib": hwm_before,
        "hwm_kib": _status_kib("VmHWM"),
        "hwm_reset": reset,
        "tensors": len(touches),
    }
    print(json.dumps(result))


def measure_rss(path: Path, spec: BenchFile) -> None:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--rss-child", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if result["tensors"] != len(spec.tensors):
        raise RuntimeError(f"the RSS child read {result['tensors']} tensors")
    growth = (result["hwm_kib"] - result["baseline_kib"]) * 1024
    target = spec.largest + RSS_SLACK
    verdict = "PASS" if growth <= target else "MISS"
    baseline_note = "" if result["hwm_reset"] else " (VmHWM could not be reset; includes imports)"
    print(f"\n== peak RSS: open_stream over {spec.label}, each array dropped, fresh subprocess")
    print(
        f"  baseline VmRSS after imports {result['baseline_kib'] / 1024:.1f} MiB, "
        f"VmHWM at end {result['hwm_kib'] / 1024:.1f} MiB{baseline_note}"
    )
    print(
        f"  peak - baseline = {growth / MiB:.1f} MiB   target <= largest tensor "
        f"{spec.largest / MiB:.0f} MiB + {RSS_SLACK // MiB} MiB = {target / MiB:.0f} MiB"
        f"   {verdict}"
    )


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--repeat", type=int, default=7, help="timed rounds on the 2 GiB file (>= 5)"
    )
    parser.add_argument(
        "--kv-repeat", type=int, default=None, help="timed rounds on the KV file (default 5x)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument(
        "--rotate", action="store_true", help="rotate the variant order every round"
    )
    parser.add_argument("--dir", type=Path, default=None, help="keep and reuse the files here")
    parser.add_argument(
        "--variants", default="ABCDEFG", help="the variants to run, e.g. AEF (default: all)"
    )
    parser.add_argument(
        "--files",
        default="kv,big",
        help="the files to read: kv, big, sizes in MiB (default kv,big)",
    )
    parser.add_argument("--no-rss", action="store_true", help="skip the peak RSS child")
    parser.add_argument("--rss-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeat < 5 and args.rss_child is None:
        parser.error("--repeat must be at least 5")
    if args.kv_repeat is None:
        args.kv_repeat = 5 * args.repeat
    return args


def bench_files(names: Sequence[str]) -> list[BenchFile]:
    """The files ``--files`` names: ``kv``, ``big`` or a size in MiB."""
    known = {KV.label: KV, BIG.label: BIG}
    return [known[n] if n in known else big_file(f"{int(n)}mib", int(n)) for n in names]


async def run_all(paths: dict[str, Path], args: argparse.Namespace) -> None:
    variants = [v for v in VARIANTS if v.key in args.variants.upper()]
    for spec in bench_files(args.files.split(",")):
        repeat = args.repeat if spec is BIG else args.kv_repeat
        times = await measure(paths[spec.label], spec, repeat, args.warmup, args.rotate, variants)
        report(spec, paths[spec.label], times)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rss_child is not None:
        rss_child(args.rss_child)
        return
    started = time.perf_counter()
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, anyio {version('anyio')}, "
        f"safetensors {version('safetensors')}, stream_st {stream_st.__version__} "
        f"({Path(stream_st.__file__).parent}), "
        f"{os.cpu_count()} CPUs, {platform.machine()}"
    )
    keep = args.dir is not None
    directory = Path(args.dir) if keep else Path(tempfile.mkdtemp(prefix="bench_read_"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        made = time.perf_counter()
        paths = {
            spec.label: ensure_file(directory, spec) for spec in bench_files(args.files.split(","))
        }
        for path in paths.values():
            for algorithm in CHECKED:
                anyio.run(write_checked, path, algorithm)
        print(f"files in {directory} ready in {time.perf_counter() - made:.1f} s")
        print(describe_reference_arrays(next(iter(paths.values()))))
        anyio.run(run_all, paths, args)
        if "big" in paths and not args.no_rss:
            measure_rss(paths["big"], BIG)
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

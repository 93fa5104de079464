"""stream_st against the other safetensors loaders, side by side, each variant in a fresh process.

Run it from the repository root with the ``bench`` extra installed (see docs/install.md)::

    python benchmarks/bench_peers.py [--medium warm,cold] [--scale 1.0] [--rounds 5]
                                     [--files f32,bf16,kv] [--variants ...] [--dir DIR] [--json OUT]

Files (written with ``stream_st`` under a temporary directory, deleted at the end; ``--dir`` keeps
and reuses them; ``--scale`` shrinks the first two, the machine being shared):

* ``f32``: 64 tensors of 32 MiB F32 (2 GiB);
* ``bf16``: a 1 GiB BF16 model-like file, 40 layers of attention (4 x [1024, 1024]), MLP
  (3 x [1024, 2816]) and two norms ([1024]) each: 360 tensors of 2-6 MiB and 80 of 2 KiB;
* ``kv``: a TinyLlama KV cache, 22 layers x (key, value) [1, 4, 2048, 64] F16 (44 MiB).

Media: ``warm`` (page cache filled by a read before each round) and ``cold`` (the file evicted
before each run: ``/proc/sys/vm/drop_caches`` when writable, which needs root and empties the
whole machine's cache, else ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file, which evicts its
clean unmapped pages; the table says which). The child process evicts, after its imports and
right before it starts the clock, so every variant starts reading the same time after the
eviction whatever its imports cost (on a virtual machine the memory the eviction frees goes back
to the host a few seconds later, and reading into it then costs more: evicting before the
child started favoured the variants with slow imports). ``--medium remote`` hands over to
``benchmarks/bench_peers_remote.py`` when it exists: it is imported lazily and its
``main(argv)`` called with the arguments this script did not take, so object-store and HTTP
peers live in their own module and may reuse :func:`run_variant`, :func:`summarize` and
:func:`print_table` from this one.

Variants (``--variants`` picks some): each run in a fresh ``python`` that imports what it needs,
then times run 1 (the first, what a user loading a model pays) and run 2 (the same again in the
same process), each until every page of every tensor has been touched (byte 0 of each 4 KiB page
of each tensor summed, which doubles as a check that all deliver the same bytes), and reports its
peak RSS above the baseline after imports (``VmHWM``; mapped file pages count there too).
Imports are outside the timing; so is, for stream_st's variants, starting and stopping one empty
event loop, as anyio imports its backend then.

* ``st_stream``: ``stream_st.open_stream(path)``, each array touched and dropped (streaming);
* ``st_load``: ``stream_st.load(path)``, every array kept (load-and-keep, copies);
* ``st_map``: ``stream_st.load(path, copy=False)``: read-only views of the mapped file;
* ``sft_np`` / ``sft_pt``: ``safetensors.numpy`` / ``safetensors.torch`` ``load_file`` (mmap
  backend; numpy's copies each tensor, torch's are views of the mapping);
* ``sft_pread``: ``safetensors.torch.load_file(backend="pread")``;
* ``runai``: runai-model-streamer's ``SafetensorsStreamer`` (streaming: its tensors live in a
  reused buffer, so each is touched and dropped);
* ``fastsafetensors``: ``fastsafe_open(..., device="cpu", nogds=True)``, every tensor kept;
* ``stsw``: ``stsw.StreamReader`` (mmap) ``to_numpy`` of every tensor, kept;
* ``raw``: the bar, no peer: a single-thread loop of ``np.empty`` + ``readinto`` per tensor;
* ``st_stream_direct`` / ``st_load_direct``: ``st_stream`` / ``st_load`` with
  ``STREAM_ST_DIRECT_IO=1``: what the page cache lacks read straight from the disk
  (``O_DIRECT``) whatever the file's size (by default only files larger than half the memory
  available are);
* ``disk``: the device's bar, no peer: the file read with ``O_DIRECT`` (no page cache), 8 MiB
  per ``preadv`` into reused buffers, by :data:`DISK_THREADS` threads (4 to 64 reads of 8 MiB in
  flight drew the same 1.47-1.49 GB/s here, one 1.36); a file system without ``O_DIRECT`` makes
  it fail.

Rounds are interleaved (every variant once per round, in a rotated order) and each figure is
the median over rounds; ratios are paired (per round, the peer's time over stream_st's) and
their median printed. One table per medium and file gives stream_st's ratio to the best peer of
its kind: ``st_map`` against the zero-copy peers (``sft_pt``, ``stsw``), ``st_stream`` and
``st_load`` against the copying ones.
"""

from __future__ import annotations

import argparse
import importlib
import json
import mmap
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import ml_dtypes
import numpy as np

import stream_st
from stream_st import TensorSpec

PAGE = 4096
MiB = 1 << 20
DISK_THREADS = 4
"""Threads of the ``disk`` bar, each with one 8 MiB read in flight."""
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


@dataclass(frozen=True)
class BenchFile:
    """A file to write: ``(name, dtype, shape)`` per tensor."""

    label: str
    tensors: tuple[tuple[str, Any, tuple[int, ...]], ...]

    @property
    def nbytes(self) -> int:
        return sum(np.dtype(d).itemsize * int(np.prod(s)) for _, d, s in self.tensors)


def bench_files(scale: float) -> dict[str, BenchFile]:
    """The three files; ``scale`` shrinks the first two (at least one tensor or layer each)."""
    big = tuple((f"w{i:03}", np.float32, (8 * MiB,)) for i in range(max(1, round(64 * scale))))
    h, inter = 1024, 2816
    model: list[tuple[str, Any, tuple[int, ...]]] = []
    for layer in range(max(1, round(40 * scale))):
        p = f"layers.{layer}."
        model += [(p + f"attn.{m}.weight", ml_dtypes.bfloat16, (h, h)) for m in "qkvo"]
        model += [(p + f"mlp.{m}.weight", ml_dtypes.bfloat16, (inter, h)) for m in ("up", "gate")]
        model += [(p + "mlp.down.weight", ml_dtypes.bfloat16, (h, inter))]
        model += [(p + f"norm{n}.weight", ml_dtypes.bfloat16, (h,)) for n in (1, 2)]
    kv = tuple(
        (f"layer_{i}_{kind}", np.float16, (1, 4, 2048, 64))
        for i in range(22)
        for kind in ("key", "value")
    )
    return {
        "f32": BenchFile("f32", big),
        "bf16": BenchFile("bf16", tuple(model)),
        "kv": BenchFile("kv", kv),
    }


async def _write(path: Path, spec: BenchFile) -> None:
    block = np.random.default_rng(0).integers(0, 255, MiB + PAGE, dtype=np.uint8)
    plan = [TensorSpec(name, np.dtype(d), shape) for name, d, shape in spec.tensors]
    async with stream_st.open_writer(path, plan) as writer:
        for i, (name, dtype, shape) in enumerate(spec.tensors):
            n = np.dtype(dtype).itemsize * int(np.prod(shape))
            raw = np.resize(block[i % PAGE :], n)  # distinct bytes per tensor, cheap to make
            await writer.write(name, raw.view(dtype).reshape(shape))


def ensure_file(directory: Path, spec: BenchFile, scale: float) -> Path:
    path = directory / f"{spec.label}-{scale:g}.safetensors"
    if not path.exists() or path.stat().st_size < spec.nbytes:
        anyio.run(_write, path, spec)
    return path


# --- eviction -------------------------------------------------------------------------------


def eviction_method() -> str:
    """``drop_caches`` where it is writable, unless ``BENCH_EVICT=fadvise`` asks for the file's
    own eviction (kinder to a shared machine: only this file's pages leave the cache)."""
    if os.environ.get("BENCH_EVICT") == "fadvise":
        return "fadvise"
    return "drop_caches" if os.access(DROP_CACHES, os.W_OK) else "fadvise"


def evict(path: Path) -> None:
    """Take ``path`` out of the page cache (see the module docstring for how)."""
    if eviction_method() == "drop_caches":
        os.sync()
        DROP_CACHES.write_text("1\n")
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: Path) -> None:
    with open(path, "rb") as file:
        while file.read(64 * MiB):
            pass


# --- the variants (run in the child) --------------------------------------------------------


def touch(array: Any) -> int:
    """Sum byte 0 of every 4 KiB page of a numpy array or torch tensor."""
    if not isinstance(array, np.ndarray):
        array = array.reshape(-1).view(_torch().uint8).numpy()
    flat = array.reshape(-1).view(np.uint8)
    return int(flat[::PAGE].sum(dtype=np.uint64))


def _torch() -> Any:
    return importlib.import_module("torch")


def _st_stream(path: str) -> tuple[int, Any]:
    async def run() -> int:
        return sum([touch(array) async for _, array in stream_st.open_stream(path)])

    return anyio.run(run), None


def _st_load(copy: bool) -> Callable[[str], tuple[int, Any]]:
    def run(path: str) -> tuple[int, Any]:
        kept: dict[str, np.ndarray[Any, Any]] = {}

        async def load() -> None:
            # Kept out of the task's result: Python 3.11's asyncio.run formats the result of its
            # main task (through the SIGINT handler's repr) when it restores the handler, which
            # would charge numpy's array printing to the load.
            kept.update(await stream_st.load(path, copy=copy))

        anyio.run(load)
        return sum(touch(array) for array in kept.values()), kept

    return run


def _sft(module: str, **kwargs: Any) -> Callable[[str], tuple[int, Any]]:
    def run(path: str) -> tuple[int, Any]:
        kept = importlib.import_module(module).load_file(path, **kwargs)
        return sum(touch(array) for array in kept.values()), kept

    return run


def _runai(path: str) -> tuple[int, Any]:
    streamer_type = importlib.import_module("runai_model_streamer").SafetensorsStreamer
    with streamer_type() as streamer:
        streamer.stream_file(path)
        return sum(touch(tensor) for _, tensor in streamer.get_tensors()), None


def _fastsafetensors(path: str) -> tuple[int, Any]:
    fst = importlib.import_module("fastsafetensors")
    with fst.fastsafe_open(path, framework="pt", device="cpu", nogds=True) as opened:
        kept = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118 - no __iter__
    return sum(touch(tensor) for tensor in kept.values()), kept


def _stsw(path: str) -> tuple[int, Any]:
    reader = importlib.import_module("stsw").StreamReader(path, mmap=True)
    kept = {name: reader.to_numpy(name) for name in reader}
    return sum(touch(array) for array in kept.values()), (kept, reader)


def _raw(path: str) -> tuple[int, Any]:
    header = anyio.run(lambda: stream_st.read_header(path))
    total = 0
    with open(path, "rb", buffering=0) as file:
        for info in header.tensors:
            array = np.empty(info.nbytes, np.uint8)
            file.seek(header.data_start + info.start)
            file.readinto(array.data)
            total += touch(array)
    return total, None


def _disk(path: str) -> tuple[int, Any]:
    header = anyio.run(lambda: stream_st.read_header(path))
    marks = np.concatenate(  # the bytes `touch` sums, as file offsets
        [header.data_start + t.start + np.arange(0, t.nbytes, PAGE) for t in header.tensors]
    )
    block = 8 * MiB
    buffers = queue.SimpleQueue[mmap.mmap]()  # page-aligned, as O_DIRECT needs; reused
    for _ in range(DISK_THREADS):
        buffers.put(mmap.mmap(-1, block))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

    def read(offset: int) -> int:
        buffer = buffers.get()
        try:
            got = os.preadv(fd, [buffer], offset)
            first, last = np.searchsorted(marks, [offset, offset + got])
            return int(np.frombuffer(buffer, np.uint8)[marks[first:last] - offset].sum())
        finally:
            buffers.put(buffer)

    try:
        with ThreadPoolExecutor(DISK_THREADS) as pool:
            total = sum(pool.map(read, range(0, os.path.getsize(path), block)))
    finally:
        os.close(fd)
    return total, None


def _direct(run: Callable[[str], tuple[int, Any]]) -> Callable[[str], tuple[int, Any]]:
    """``run`` with stream_st reading what the page cache lacks straight from the disk, for any
    file size (``STREAM_ST_DIRECT_IO=1``; by default only for files larger than half the memory
    available)."""

    def direct(path: str) -> tuple[int, Any]:
        os.environ["STREAM_ST_DIRECT_IO"] = "1"
        return run(path)

    return direct


VARIANTS: dict[str, tuple[str, Callable[[str], tuple[int, Any]]]] = {
    "st_stream": ("stream_st", _st_stream),
    "st_load": ("stream_st", _st_load(copy=True)),
    "st_map": ("stream_st", _st_load(copy=False)),
    "st_stream_direct": ("stream_st", _direct(_st_stream)),
    "st_load_direct": ("stream_st", _direct(_st_load(copy=True))),
    "sft_np": ("copying", _sft("safetensors.numpy")),
    "sft_pt": ("zero-copy", _sft("safetensors.torch")),
    "sft_pread": ("copying", _sft("safetensors.torch", backend="pread")),
    "runai": ("copying", _runai),
    "fastsafetensors": ("copying", _fastsafetensors),
    "stsw": ("zero-copy", _stsw),
    "raw": ("bar", _raw),
    "disk": ("bar", _disk),
}
PEERS_OF = {
    "st_map": "zero-copy",
    "st_stream": "copying",
    "st_load": "copying",
    "st_stream_direct": "copying",
    "st_load_direct": "copying",
}
_IMPORTS = {
    "sft_np": "safetensors.numpy",
    "sft_pt": "safetensors.torch",
    "sft_pread": "safetensors.torch",
    "runai": "runai_model_streamer",
    "fastsafetensors": "fastsafetensors",
    "stsw": "stsw",
}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(variant: str, path: str, runs: int, cold: bool = False) -> None:
    """Time ``variant`` on ``path`` ``runs`` times in this (fresh) process, ``cold``: the file
    evicted right before the first run; print JSON."""
    if variant in _IMPORTS:
        importlib.import_module(_IMPORTS[variant])
    else:  # stream_st's own "import": anyio loads its event loop backend on first use, and
        # ``import stream_st`` is lazy: naming the reader's entry points imports the reader
        # (as safetensors' import is untimed for its variants)
        anyio.run(anyio.lowlevel.checkpoint)
        entry_points = (stream_st.load, stream_st.open_stream)
        del entry_points
    run = VARIANTS[variant][1]
    baseline = _status_kib("VmRSS")
    times, sums, peak = [], [], 0
    if cold:
        evict(Path(path))
    for index in range(runs):
        start = time.perf_counter()
        total, kept = run(path)
        times.append(time.perf_counter() - start)
        sums.append(total)
        if index == 0:
            peak = _status_kib("VmHWM") - baseline
        del kept
    print(json.dumps({"times": times, "sums": sums, "peak_mib": peak / 1024}))


# --- the parent -----------------------------------------------------------------------------


@dataclass
class Result:
    first: list[float]
    second: list[float]
    peak_mib: list[float]
    sums: set[int]
    error: str = ""


def run_variant(
    variant: str, path: Path, runs: int, timeout: float = 600, cold: bool = False
) -> dict[str, Any]:
    """One fresh process timing ``variant`` on ``path`` (``cold``: evicted first, see
    :func:`child`): ``{"times", "sums", "peak_mib"}``, or ``{"error": ...}`` when it fails."""
    command = [sys.executable, __file__, "--child", variant, str(path), str(runs), str(int(cold))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def rotated(items: Sequence[str], shift: int) -> Iterator[str]:
    for i in range(len(items)):
        yield items[(i + shift) % len(items)]


def measure(medium: str, path: Path, variants: Sequence[str], rounds: int) -> dict[str, Result]:
    results = {v: Result([], [], [], set()) for v in variants}
    for round_index in range(rounds):
        if medium == "warm":
            warm(path)
        for variant in rotated(variants, round_index):
            got = run_variant(variant, path, runs=2, cold=medium == "cold")
            result = results[variant]
            if "error" in got:
                result.error = got["error"]
                continue
            result.first.append(got["times"][0])
            result.second.append(got["times"][1])
            result.peak_mib.append(got["peak_mib"])
            result.sums.update(got["sums"])
    return results


def summarize(
    results: dict[str, Result], nbytes: int
) -> tuple[dict[str, float], dict[str, tuple[str, float]]]:
    """First-run GB/s (median) per variant, and per stream_st variant its best peer of its kind
    with the paired ratio (median over rounds of the peer's time over stream_st's)."""
    speed = {v: nbytes / statistics.median(r.first) / 1e9 for v, r in results.items() if r.first}
    ratios: dict[str, tuple[str, float]] = {}
    for mine, kind in PEERS_OF.items():
        peers = [v for v in speed if VARIANTS[v][0] == kind]
        if mine not in speed or not peers:
            continue
        best = max(peers, key=speed.__getitem__)
        pairs = zip(results[best].first, results[mine].first, strict=False)
        ratios[mine] = (best, statistics.median(peer / own for peer, own in pairs))
    return speed, ratios


def print_table(title: str, results: dict[str, Result], nbytes: int) -> None:
    speed, ratios = summarize(results, nbytes)
    print(f"\n### {title}\n")
    print("| variant | kind | run 1 GB/s | run 2 GB/s | peak RSS MiB | ratio to best peer |")
    print("|---|---|---|---|---|---|")
    for variant, result in results.items():
        kind = VARIANTS[variant][0]
        if result.error:
            print(f"| {variant} | {kind} | failed: {result.error[:80]} | | | |")
            continue
        second = nbytes / statistics.median(result.second) / 1e9
        peak = statistics.median(result.peak_mib)
        ratio = ratios.get(variant)
        note = f"{ratio[1]:.2f}x {ratio[0]}" if ratio else ""
        print(f"| {variant} | {kind} | {speed[variant]:.2f} | {second:.2f} | {peak:.0f} | {note} |")
    if len({s for r in results.values() for s in r.sums}) > 1:
        print("\nWARNING: the variants' page sums differ: not every variant read the same bytes")


def run_remote(argv: Sequence[str]) -> None:
    """The remote media live in their own module, imported only when asked for."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        remote = importlib.import_module("bench_peers_remote")
    except ModuleNotFoundError:
        print("\n(remote: benchmarks/bench_peers_remote.py is not there; skipped)")
        return
    remote.main(list(argv))


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--medium", default="warm,cold", help="warm,cold,remote")
    parser.add_argument("--files", default="f32,bf16,kv")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the f32 and bf16 files")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="keep the files here and reuse them")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args, rest = parse_args(argv)
    media = args.medium.split(",")
    variants = args.variants.split(",")
    directory = args.dir or Path(tempfile.mkdtemp(prefix="bench_peers-"))
    directory.mkdir(parents=True, exist_ok=True)
    uptime = Path("/proc/loadavg").read_text().split()[:3]
    print(f"# bench_peers: scale {args.scale:g}, {args.rounds} rounds, load average {uptime}")
    figures: dict[str, Any] = {}
    try:
        specs = bench_files(args.scale)
        for label in args.files.split(","):
            spec = specs[label]
            path = ensure_file(directory, spec, args.scale)
            for medium in (m for m in media if m in ("warm", "cold")):
                how = f", evicted by {eviction_method()}" if medium == "cold" else ""
                title = (
                    f"{medium} local, {label}: {spec.nbytes / MiB:.0f} MiB in "
                    f"{len(spec.tensors)} tensors{how}"
                )
                results = measure(medium, path, variants, args.rounds)
                print_table(title, results, spec.nbytes)
                figures[f"{medium}/{label}"] = {
                    v: {"first": r.first, "second": r.second, "peak_mib": r.peak_mib}
                    for v, r in results.items()
                }
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if "remote" in media:
        run_remote(rest)
    elif rest:
        raise SystemExit(f"unknown arguments: {rest}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:6] == ["1"])
    else:
        main()

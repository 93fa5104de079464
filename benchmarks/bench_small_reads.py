"""The fixed costs of reading small files: the first load of a warm file, in a fresh process.

Run it from the repository root (about six minutes with ``--rounds 4`` on 2 cores; 90 MiB of
disk)::

    python benchmarks/bench_small_reads.py [--rounds 5] [--sizes 1,4,16,64] [--dir DIR]
                                           [--variants raw,st_load,...] [--measures import,call]

It writes one F32 file per size (1, 4, 16 and 64 MiB of data, 16, 32, 64 and 64 tensors of
mixed sizes: one large tensor, the rest split between matrices and small vectors, as a model's
layers are), reads each once so the page cache is warm, then in interleaved rounds (every
variant of every size once per round and measure, the order rotated each round) starts a fresh
process per (variant, file, measure) that times the FIRST call, as a user meets it, with every
page of every array touched (byte 0 of each 4 KiB page summed, which doubles as a check that all
variants but ``raw`` delivered the same bytes). stream_st is compiled to bytecode first, as an
install leaves it (``PYTHONDONTWRITEBYTECODE`` would otherwise make every child compile it):

* ``raw``: ``os.open`` and one ``readinto`` of the whole file into a numpy buffer: the bar;
* ``st_load``: ``asyncio.run(stream_st.load(path))``;
* ``st_np``: ``stream_st.numpy.load_file(path)``;
* ``st_pt``: ``stream_st.torch.load_file(path)``;
* ``sft_np``: ``safetensors.numpy.load_file(path)`` (the reference);
* ``sft_pt``: ``safetensors.torch.load_file(path)`` (the reference).

Two measures, each in processes of its own:

* ``import``: the timer covers the library's import (``import stream_st.torch``, ``import
  safetensors.torch``, ...) and the first call: what a script that loads one file pays. What a
  user has imported anyway is imported before the timer: numpy, and torch for the ``*_pt``
  variants (so torch's own import, which both libraries need, is not counted);
* ``call``: the library is imported before the timer, the timer covers the first call (and
  whatever that call imports on its way): what a program that imported the library earlier pays.

stream_st imports its parts on first use, so a benchmark that imports the reference before the
timer but lets stream_st's first call import its own parts would compare unlike things; the two
measures make each side pay the same. A child also times a second call in the same process
(``run 2``), the fixed cost the first call pays being their difference. The report prints, per
size and measure, each variant's median time of the first call, its GB/s, the paired ratios (per
round, over ``raw`` and ours over the reference: median and range) and the load average before
and after.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
PAGE = 4096
VARIANTS = ("raw", "st_load", "st_np", "st_pt", "sft_np", "sft_pt")
MEASURES = ("import", "call")
# Tensor count per size (MiB): 16-64 tensors, as a small model's file holds.
COUNTS = {1: 16, 4: 32, 16: 64, 64: 64}
PAIRS = (("st_np", "sft_np"), ("st_pt", "sft_pt"), ("st_load", "sft_np"))


def shapes(mib: int) -> list[tuple[int, ...]]:
    """F32 shapes totalling ``mib`` MiB: a quarter in one tensor, half in matrices, a quarter in
    vectors (the file's many small tensors)."""
    count = COUNTS.get(mib, 64)
    floats = mib * MiB // 4
    matrices = count // 2
    vectors = count - 1 - matrices
    out: list[tuple[int, ...]] = [(floats // 4 // 256, 256)]
    out += [(floats // 2 // matrices // 128, 128)] * matrices
    out += [(floats // 4 // vectors,)] * vectors
    return out


def ensure_file(directory: Path, mib: int) -> Path:
    """The ``mib`` MiB file in ``directory``, written with the reference unless already there."""
    import safetensors.numpy

    path = directory / f"small_{mib}mib.safetensors"
    if not path.exists():
        rng = np.random.default_rng(mib)
        tensors = {
            f"layer.{i}.weight": rng.standard_normal(shape, dtype=np.float32)
            for i, shape in enumerate(shapes(mib))
        }
        safetensors.numpy.save_file(tensors, str(path))
    path.read_bytes()  # warm the page cache
    return path


def touch(arrays: Sequence[Any]) -> int:
    """The sum of byte 0 of every 4 KiB page of every array (numpy or torch)."""
    total = 0
    for array in arrays:
        flat = np.asarray(array).reshape(-1).view(np.uint8)
        total += int(flat[::PAGE].sum(dtype=np.int64))
    return total


def _loader(variant: str) -> Callable[[str], Sequence[Any]]:
    """Import what ``variant`` needs and return the call to time."""
    if variant == "raw":

        def raw(path: str) -> Sequence[Any]:
            fd = os.open(path, os.O_RDONLY)
            try:
                buffer = np.empty(os.fstat(fd).st_size, dtype=np.uint8)
                with os.fdopen(fd, "rb", buffering=0, closefd=False) as file:
                    file.readinto(buffer.data)
            finally:
                os.close(fd)
            return [buffer[8:]]

        return raw
    if variant == "st_load":
        import asyncio

        import stream_st

        load = stream_st.load  # ``import stream_st`` is lazy: this imports the reader

        return lambda path: list(asyncio.run(load(path)).values())
    if variant == "st_np":
        import stream_st.numpy

        return lambda path: list(stream_st.numpy.load_file(path).values())
    if variant == "st_pt":
        import stream_st.torch

        return lambda path: list(stream_st.torch.load_file(path).values())
    if variant == "sft_np":
        import safetensors.numpy

        return lambda path: list(safetensors.numpy.load_file(path).values())
    if variant == "sft_pt":
        import safetensors.torch

        return lambda path: list(safetensors.torch.load_file(path).values())
    raise SystemExit(f"unknown variant {variant!r}")


def child(variant: str, path: str, measure: str) -> None:
    """Time the first and a second call of ``variant`` on ``path`` (with ``measure="import"``
    the first includes the library's import); print them as JSON."""
    if variant.endswith("_pt"):
        import torch  # what a torch user has imported anyway: untimed for both libraries

        del torch
    started = time.perf_counter()
    load = _loader(variant)
    if measure == "call":
        started = time.perf_counter()  # the import untimed
    times = []
    sums = []
    for _ in range(2):
        arrays = load(path)
        sums.append(touch(arrays))
        times.append(time.perf_counter() - started)
        del arrays
        started = time.perf_counter()
    print(json.dumps({"first": times[0], "second": times[1], "sum": sums[0]}))


def run_child(variant: str, path: Path, measure: str) -> dict[str, Any]:
    """One fresh process timing ``variant`` on ``path``."""
    command = [sys.executable, __file__, "--child", variant, str(path), measure]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(mib: int, size: int, measure: str, rounds: list[dict[str, dict[str, Any]]]) -> None:
    """Print one size's and measure's medians, GB/s and paired ratios."""
    variants = list(rounds[0])
    what = "import + first call" if measure == "import" else "first call after the import"
    print(f"\n{mib} MiB file ({len(shapes(mib))} tensors), {len(rounds)} rounds, {what}:")
    print(f"  {'variant':8} {'run 1 ms':>9} {'GB/s':>6} {'run 2 ms':>9} {'x raw (paired)':>20}")
    for variant in variants:
        first = [r[variant]["first"] for r in rounds]
        second = [r[variant]["second"] for r in rounds]
        over_raw = (
            [r["raw"]["first"] / r[variant]["first"] for r in rounds] if "raw" in variants else []
        )
        median = statistics.median(first)
        ratio = _spread(over_raw) if over_raw else "-"
        print(
            f"  {variant:8} {median * 1e3:9.2f} {size / median / 1e9:6.2f} "
            f"{statistics.median(second) * 1e3:9.2f} {ratio:>20}"
        )
    for ours, theirs in PAIRS:
        if ours in variants and theirs in variants:
            ratios = [r[theirs]["first"] / r[ours]["first"] for r in rounds]
            print(f"  {ours} speed over {theirs} (paired): {_spread(ratios)}")


def compile_package() -> None:
    """Compile the stream_st the children import to bytecode, as installing it does: a child
    must not pay for compiling its sources (the reference comes installed, compiled)."""
    spec = importlib.util.find_spec("stream_st")
    if spec is None or spec.origin is None:
        raise SystemExit("stream_st is not importable")
    compileall.compile_dir(os.path.dirname(spec.origin), quiet=1)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="1,4,16,64", help="file sizes in MiB")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--measures", default=",".join(MEASURES), help="import, call or both")
    parser.add_argument("--dir", type=Path, help="keep the files there and reuse them")
    parser.add_argument(
        "--child", nargs=3, metavar=("VARIANT", "PATH", "MEASURE"), help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(*args.child)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = args.variants.split(",")
    measures = args.measures.split(",")
    cases = [(mib, measure) for mib in sizes for measure in measures]
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        paths = {mib: ensure_file(directory, mib) for mib in sizes}
        compile_package()
        print(f"load average before: {os.getloadavg()}")
        results: dict[tuple[int, str], list[dict[str, dict[str, Any]]]] = {c: [] for c in cases}
        for index in range(args.rounds):
            for mib, measure in cases:
                order = variants[index % len(variants) :] + variants[: index % len(variants)]
                got = {variant: run_child(variant, paths[mib], measure) for variant in order}
                if len({r["sum"] for v, r in got.items() if v != "raw"}) > 1:
                    raise SystemExit(f"variants disagree on the bytes of the {mib} MiB file")
                results[mib, measure].append({variant: got[variant] for variant in variants})
        for mib, measure in cases:
            report(mib, paths[mib].stat().st_size, measure, results[mib, measure])
        print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

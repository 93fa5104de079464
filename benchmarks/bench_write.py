"""Write throughput and peak memory of ``stream_st.open_writer`` against the reference and raw I/O.

Run it from the repository root (about a minute on 2 cores; needs ~2.1 GiB of disk, ~2.5 GiB RAM)::

    python benchmarks/bench_write.py [--repeat 7] [--dir DIR] [--variants A,B,C,...]

The plan is 64 tensors of 32 MiB F32 (2 GiB of data), named ``t00`` ... ``t63``. Every variant
writes the same bytes to a file in a temporary directory (deleted at the end): each tensor holds
``arange(8 Mi)`` as float32, and the header is the reference's, so all files are byte-identical.
Variants, interleaved (A B C A B C ...), each repetition in a fresh subprocess so its peak RSS
(``VmHWM``) is its own:

* ``stream_st``: ``open_writer(path, plan)`` then ``await writer.write(name, array)`` 64 times.
  The arrays are produced one at a time by reusing ONE preallocated array, filled before the
  timer starts: the streaming use, where a producer hands over a tensor and reuses its buffer.
* ``save_file``: ``safetensors.numpy.save_file(dict, path)``, the reference, with a dict of 64
  distinct arrays built before the timer starts (the only way to call it).
* ``plain``: a ``FileIO.write`` loop of the same bytes (header, then the reused array 64 times)
  straight to the destination: the raw-I/O bar.
* ``save`` (extra): ``stream_st.save(path, dict)`` with the same dict as ``save_file``.
* ``single`` (optional, not run by default): ``stream_st`` with every 32 MiB write done by one
  worker thread instead of split in two halves between two threads (``SPLIT_THRESHOLD``).
* ``nofalloc`` (optional, not run by default): ``stream_st`` without reserving the file's blocks
  up front (``fallocate``), to measure what that buys.

Timed: from opening the destination to the file complete and closed (for ``stream_st``: header,
64 writes, commit by ``os.replace``). No fsync anywhere, as ``save_file`` does none. The first
repetition of each variant also checks the whole file's CRC-32 against the expected bytes.

Peak RSS is reported absolute and above the child's baseline after imports, before any array is
allocated; the target for the streaming variant is the largest tensor + 64 MiB above baseline.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from importlib.metadata import version
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
TENSORS = 64
TENSOR_BYTES = 32 * MiB
ELEMENTS = TENSOR_BYTES // 4
RSS_SLACK = 64 * MiB
DEFAULT_VARIANTS = ("stream_st", "save_file", "plain", "save")
ALL_VARIANTS = (*DEFAULT_VARIANTS, "single", "nofalloc")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")  # pragma: no cover


def _load() -> str:
    """The 1, 5 and 15 minute load averages: other processes on the machine skew the figures."""
    with open("/proc/loadavg") as loadavg:
        return " ".join(loadavg.read().split()[:3])


def _names() -> list[str]:
    return [f"t{i:02d}" for i in range(TENSORS)]


def _header_prefix() -> bytes:
    """The reference's header for the plan (its JSON layout, padded to 8 bytes)."""
    entries = {
        name: {
            "dtype": "F32",
            "shape": [ELEMENTS],
            "data_offsets": [i * TENSOR_BYTES, (i + 1) * TENSOR_BYTES],
        }
        for i, name in enumerate(_names())
    }
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _crc_of_file(path: str) -> int:
    crc = 0
    buffer = bytearray(64 * MiB)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while True:
            got = file.readinto(buffer)
            if not got:
                return crc
            crc = zlib.crc32(view[:got], crc)


def _expected_crc() -> int:
    import numpy as np

    one = np.arange(ELEMENTS, dtype=np.float32).data
    crc = zlib.crc32(_header_prefix())
    for _ in range(TENSORS):
        crc = zlib.crc32(one, crc)
    return crc


# ---------------------------------------------------------------------------------- the children


def _child(variant: str, path: str, check: bool) -> dict[str, Any]:
    """Run one variant once in this (fresh) process; return its timing and memory."""
    import numpy as np

    if variant in ("stream_st", "save", "single", "nofalloc"):
        import anyio

        import stream_st
        import stream_st.transports.file.sink
    if variant == "save_file":
        import safetensors.numpy
    baseline = _status_kib("VmRSS")

    names = _names()
    if variant in ("save_file", "save"):
        arrays = {name: np.arange(ELEMENTS, dtype=np.float32) for name in names}
    else:
        array = np.arange(ELEMENTS, dtype=np.float32)  # the one reused buffer

    if variant in ("stream_st", "single", "nofalloc"):
        if variant == "single":
            stream_st.transports.file.sink.SPLIT_THRESHOLD = None
        if variant == "nofalloc":
            stream_st.transports.file.sink._FALLOCATE = None
        plan = [stream_st.TensorSpec(name, "F32", (ELEMENTS,)) for name in names]

        async def write() -> None:
            async with stream_st.open_writer(path, plan) as writer:
                for name in names:
                    # A producer would fill ``array`` with this tensor's values here.
                    await writer.write(name, array)

        start = time.perf_counter()
        anyio.run(write)
        seconds = time.perf_counter() - start
    elif variant == "save":

        async def save() -> None:
            await stream_st.save(path, arrays)

        start = time.perf_counter()
        anyio.run(save)
        seconds = time.perf_counter() - start
    elif variant == "save_file":
        start = time.perf_counter()
        safetensors.numpy.save_file(arrays, path)
        seconds = time.perf_counter() - start
    elif variant == "plain":
        prefix = _header_prefix()
        view = array.data
        start = time.perf_counter()
        with io.FileIO(path, "w") as file:
            file.write(prefix)
            for _ in names:
                file.write(view)
        seconds = time.perf_counter() - start
    else:  # pragma: no cover
        raise ValueError(variant)

    result: dict[str, Any] = {
        "seconds": seconds,
        "bytes": os.path.getsize(path),
        "baseline": baseline,
        "peak": _status_kib("VmHWM"),
    }
    if check:
        result["crc"] = _crc_of_file(path)
    return result


def _run_child(variant: str, path: str, check: bool) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant, "--path", path]
    if check:
        command.append("--check")
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------------- the parent


def _main(repeat: int, directory: str | None, variants: list[str]) -> None:
    import numpy as np
    import safetensors

    import stream_st

    print(
        f"python {platform.python_version()}, numpy {np.__version__}, "
        f"safetensors {safetensors.__version__}, anyio {version('anyio')}, "
        f"stream_st {stream_st.__version__}, {os.cpu_count()} CPUs"
    )
    print(
        f"plan: {TENSORS} x {TENSOR_BYTES // MiB} MiB F32 = "
        f"{TENSORS * TENSOR_BYTES / GiB:.0f} GiB; "
        f"{repeat} repetitions, interleaved {' '.join(variants)}; each in a fresh subprocess"
    )
    print(f"load average at start: {_load()}")
    expected_crc = _expected_crc()
    expected_size = len(_header_prefix()) + TENSORS * TENSOR_BYTES
    workdir = tempfile.mkdtemp(prefix="bench_write_", dir=directory)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        path = os.path.join(workdir, "out.safetensors")
        for rep in range(repeat):
            for variant in variants:
                result = _run_child(variant, path, check=rep == 0)
                if result["bytes"] != expected_size:
                    raise SystemExit(
                        f"{variant}: wrote {result['bytes']} bytes, not {expected_size}"
                    )
                if rep == 0 and result["crc"] != expected_crc:
                    raise SystemExit(f"{variant}: the file's bytes differ from the expected ones")
                leftovers = sorted(set(os.listdir(workdir)) - {"out.safetensors"})
                if leftovers:
                    raise SystemExit(f"{variant}: left files behind: {leftovers}")
                os.unlink(path)
                os.sync()
                results[variant].append(result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"load average at end:   {_load()}")
    print("all files byte-identical (CRC-32 of the first repetition); no temporary file left\n")
    medians = {v: statistics.median(r["seconds"] for r in rs) for v, rs in results.items()}
    rate = {v: expected_size / s / 1e9 for v, s in medians.items()}
    header = (
        f"{'variant':<10} {'median s':>9} {'GB/s':>6} {'best':>5}  {'runs GB/s':<34} "
        f"{'peak RSS':>9} {'above base':>11}"
    )
    print(header)
    print("-" * len(header))
    for variant, rs in results.items():
        runs = " ".join(f"{expected_size / r['seconds'] / 1e9:.2f}" for r in rs)
        peak = max(r["peak"] for r in rs)
        above = max(r["peak"] - r["baseline"] for r in rs)
        best = expected_size / min(r["seconds"] for r in rs) / 1e9
        print(
            f"{variant:<10} {medians[variant]:>9.3f} {rate[variant]:>6.2f} {best:>5.2f}  "
            f"{runs:<34} {peak / MiB:>6.0f} MiB {above / MiB:>7.0f} MiB"
        )
    print()
    if "stream_st" in rate:
        for other, target in (("save_file", 1.0), ("plain", 0.9), ("save", None)):
            if other in rate:
                ratio = rate["stream_st"] / rate[other]
                verdict = (
                    ""
                    if target is None
                    else f"  (target >= {target:.1f}x: {'met' if ratio >= target else 'MISSED'})"
                )
                print(f"stream_st / {other:<9} = {ratio:.2f}x{verdict}")
        if "save" in rate and "save_file" in rate:
            print(f"save      / save_file = {rate['save'] / rate['save_file']:.2f}x")
        for other in ("single", "nofalloc"):
            if other in rate:
                print(f"{other:<9} / stream_st = {rate[other] / rate['stream_st']:.2f}x")
        print("paired (per round, then the median; robust to drifts between rounds):")
        for other in results:
            if other != "stream_st":
                paired = statistics.median(
                    b["seconds"] / a["seconds"]
                    for a, b in zip(results["stream_st"], results[other], strict=True)
                )
                print(f"  stream_st / {other:<9} = {paired:.2f}x")
        above = max(r["peak"] - r["baseline"] for r in results["stream_st"])
        limit = TENSOR_BYTES + RSS_SLACK
        print(
            f"stream_st peak RSS above baseline: {above / MiB:.0f} MiB "
            f"(target <= largest tensor + 64 MiB = {limit / MiB:.0f} MiB: "
            f"{'met' if above <= limit else 'MISSED'})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="repetitions per variant (>= 5)")
    parser.add_argument("--dir", default=None, help="where to create the temporary directory")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, from {', '.join(ALL_VARIANTS)}",
    )
    parser.add_argument("--child", choices=ALL_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.path, args.check)))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(ALL_VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}")
    _main(args.repeat, args.dir, variants)


if __name__ == "__main__":
    main()

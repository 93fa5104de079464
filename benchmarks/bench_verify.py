"""What verifying a checksummed local file costs: the same warm file read with and without
``verify``, each read in a fresh process, on two cores and pinned to one.

Run it from the repository root (about a minute on 2 cores; needs the file's size in disk and
about twice that in RAM)::

    python benchmarks/bench_verify.py [--mib 512] [--tensor-mib 32] [--rounds 7] [--dir DIR]
                                      [--cores 2,1] [--algorithm xxh3-128] [--base DIR]

It writes one file of ``--mib`` MiB of F32 tensors of ``--tensor-mib`` MiB each with per-tensor
digests (``stream_st.save(..., checksums=algorithm)``; kept in ``--dir`` and reused if given),
reads it once to warm the page cache, then runs rounds. In each round, for each core setting
(``2``: the process may use both cores; ``1``: pinned to core 0 with ``os.sched_setaffinity``),
two fresh processes read the whole file with ``stream_st.open_stream`` (every array dropped at
once): one with ``verify=False`` (plain), one with the default ``verify=True`` (verified), in an
order that alternates from round to round. Each process reads the file ``--reads`` times and
reports the median; the first read of a process pays for starting threads and faulting in fresh
memory just as the later ones do for the verified and the plain read alike.

Printed: per round and setting the two medians (wall time, and the CPU time of all the process's
threads), the ratios verified / plain and the load average (``os.getloadavg()``, 1 minute); then
per setting the median and range of the ratios. The
machine may be loaded by other work: the paired ratio is the figure to compare.

``--base DIR`` also runs both reads with the stream_st of the checkout ``DIR`` (the code before a
change; its modules first on the import path), in the same rounds, the four processes of a
setting in an order that rotates from round to round; printed as well: the base's ratios, and
the verified read's time (wall and CPU) over the base's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

import stream_st

MiB = 1 << 20


def write_file(path: Path, mib: int, tensor_mib: int, algorithm: str) -> None:
    """``mib`` MiB of ``tensor_mib`` MiB F32 tensors with ``algorithm`` digests at ``path``."""
    count = max(1, mib // tensor_mib)
    elements = tensor_mib * MiB // 4
    rng = np.random.default_rng(0)
    tensors = {
        f"weight_{i:03d}": rng.integers(0, 1 << 30, elements, dtype=np.int32).view(np.float32)
        for i in range(count)
    }
    anyio.run(lambda: stream_st.save(path, tensors, checksums=algorithm))


def warm(path: Path) -> None:
    """Read every byte of ``path`` once, so the page cache holds it."""
    with path.open("rb") as file:
        while file.read(16 * MiB):
            pass


async def read_all(path: Path, verify: bool) -> tuple[float, float]:
    """Seconds (wall, and CPU of the process's threads) to stream every tensor of ``path``,
    each array dropped at once."""
    start, cpu = time.perf_counter(), time.process_time()
    async with stream_st.open_stream(path, verify=verify) as stream:
        async for _name, array in stream:
            del array
    return time.perf_counter() - start, time.process_time() - cpu


def child(path: Path, verify: bool, cores: int, reads: int) -> None:
    """A fresh process's part: pin to ``cores`` cores, time ``reads`` reads, print the median."""
    os.sched_setaffinity(0, set(range(cores)))
    times = [anyio.run(read_all, path, verify) for _ in range(reads)]
    print(json.dumps([statistics.median(column) for column in zip(*times, strict=True)]))


def run_child(
    path: Path, verify: bool, cores: int, reads: int, base: Path | None = None
) -> tuple[float, float]:
    """The median read time, wall and CPU, of a fresh process (see :func:`child`), with the
    stream_st of checkout ``base`` if given."""
    command = [sys.executable, __file__, "--child", str(path), "--cores", str(cores)]
    command += ["--reads", str(reads)] + (["--verify"] if verify else [])
    env = dict(os.environ)
    if base is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(base), env.get("PYTHONPATH")]))
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    wall, cpu = json.loads(out.splitlines()[-1])
    return wall, cpu


def summary(label: str, values: list[float]) -> str:
    """``label``, then the median and range of ``values``."""
    return (
        f"{label} median {statistics.median(values):.3f} "
        f"(range {min(values):.3f}-{max(values):.3f}, {len(values)} rounds)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--tensor-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reads", type=int, default=3)
    parser.add_argument("--cores", default="2,1")
    parser.add_argument("--algorithm", default="xxh3-128")
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--base", type=Path, help="a checkout of the code before, run alongside")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.verify, int(args.cores), args.reads)
        return
    settings = [int(cores) for cores in args.cores.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.dir or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"verify-{args.mib}-{args.tensor_mib}-{args.algorithm}.safetensors"
        if not path.exists():
            write_file(path, args.mib, args.tensor_mib, args.algorithm)
        warm(path)
        print(
            f"{path.stat().st_size / MiB:.0f} MiB, {args.tensor_mib} MiB tensors, "
            f"{args.algorithm}; {args.rounds} rounds x {args.reads} reads per process; "
            f"load average at start {os.getloadavg()[0]:.2f}"
        )
        versions = [None] if args.base is None else [None, args.base.resolve()]
        variants = [(base, verify) for base in versions for verify in (False, True)]
        ratios: dict[tuple[int, str], list[float]] = {}
        loads: list[float] = []
        for round_ in range(args.rounds):
            for cores in settings:
                turn = round_ % len(variants)
                order = variants[turn:] + variants[:turn]
                times = {key: run_child(path, key[1], cores, args.reads, key[0]) for key in order}
                load = os.getloadavg()[0]
                loads.append(load)
                for base in versions:
                    (plain, plain_cpu), (verified, verified_cpu) = (
                        times[base, False],
                        times[base, True],
                    )
                    label = "" if base is None else "base "
                    ratios.setdefault((cores, f"{label}time"), []).append(verified / plain)
                    ratios.setdefault((cores, f"{label}CPU"), []).append(verified_cpu / plain_cpu)
                    print(
                        f"round {round_ + 1} cores {cores}: {label}plain {plain:.3f} s "
                        f"(CPU {plain_cpu:.3f} s), verified {verified:.3f} s (CPU "
                        f"{verified_cpu:.3f} s), ratio {verified / plain:.3f}, CPU "
                        f"{verified_cpu / plain_cpu:.3f} (load {load:.2f})"
                    )
                if args.base is not None:
                    (now, now_cpu), (before, before_cpu) = (
                        times[None, True],
                        times[args.base.resolve(), True],
                    )
                    ratios.setdefault((cores, "over base time"), []).append(now / before)
                    ratios.setdefault((cores, "over base CPU"), []).append(now_cpu / before_cpu)
        for (cores, what), values in ratios.items():
            if what.startswith("over base"):
                label = f"cores {cores}: verified read now / base, {what.split()[-1]}"
            else:
                label = f"cores {cores}: verified / plain {what}"
            print(summary(label, values))
        print(f"load average during the rounds: {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()

"""Two checkouts of stream_st side by side on the hot paths: did a change cost speed?

    python benchmarks/bench_ab.py --a . --b ../other-checkout [--rounds 7] [--dir DIR]
        [--figures read-kv,import]

Writes (once, kept in ``--dir`` when given) the two files of ``bench_read.py``: ``big`` (64
tensors of 32 MiB F32, 2 GiB) and ``kv`` (a TinyLlama KV cache, 44 MiB). Then, in rounds of
A B B A (the order alternates, so drift over the run falls on both), each in a fresh process
with that checkout first on ``sys.path``, it times, page cache warm:

* ``read-big`` / ``read-kv``: ``open_stream(path)``, every array touched once and dropped;
* ``load-big``: ``stream_st.load(path)`` of ``big``, every array kept and touched once (2 GiB of
  fresh memory in a fresh process);
* ``read-chunks``: the same of ``kv`` read from memory as an async iterator of 16 KiB pieces (as
  a network client's iterator gives them), after one such read untimed: the reader's per-chunk
  path, not I/O nor first use;
* ``write-big``: ``open_writer`` of 64 fresh 32 MiB F32 arrays to a new file (then removed): the
  fresh arrays' first touch makes this one bimodal here (1.0 or 2.3 s either way), so take many
  rounds; ``write-reused``: the same with one array written 64 times (the writer's own path);
* ``import``: ``import stream_st`` and a first ``read_header`` of ``kv``.

``--figures`` times a comma-separated subset of these (default: all).

It prints, per figure, each side's median seconds and the median of the per-round ratios A/B
(below 1: A is faster), with the load average before and after. The checkouts must hold the
same public API (``open_stream``, ``open_writer``, ``read_header``, ``TensorSpec``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

FIGURES = ("read-big", "load-big", "read-kv", "read-chunks", "write-big", "write-reused", "import")

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import anyio, numpy as np
import stream_st
figure, path, out = sys.argv[1], sys.argv[2], sys.argv[3]

data = open(path, "rb").read() if figure == "read-chunks" else b""

async def chunks():
    view = memoryview(data)
    for start in range(0, len(view), 16384):
        yield view[start : start + 16384]

async def read():
    total = 0
    async with stream_st.open_stream(chunks() if data else path) as stream:
        async for _name, array in stream:
            flat = array.reshape(-1).view(np.uint8)
            total += int(flat[::4096].sum()) if flat.size else 0
    return total

async def load():
    arrays = await stream_st.load(path)  # every array kept: the fresh memory of the whole file
    return sum(int(a.reshape(-1).view(np.uint8)[::4096].sum()) for a in arrays.values())

async def write():
    plan = [stream_st.TensorSpec(f"t{i:02}", "F32", (8 << 20,)) for i in range(64)]
    reused = np.ones(8 << 20, dtype=np.float32)
    async with stream_st.open_writer(out, plan) as writer:
        for spec in plan:
            if figure == "write-reused":
                array = reused
            else:
                array = np.empty(8 << 20, dtype=np.float32)
                array[::1024] = 1.0
            await writer.write(spec.name, array)

async def header():
    await stream_st.read_header(path)

if figure == "import":
    anyio.run(header)
    print(time.perf_counter() - t0)
else:
    if data:  # the reader's first use (its imports) untimed: its chunk path alone is
        anyio.run(read)
    start = time.perf_counter()
    anyio.run(write if figure.startswith("write") else load if figure == "load-big" else read)
    print(time.perf_counter() - start)
"""


def _write_files(directory: Path) -> dict[str, Path]:
    import safetensors.numpy as reference

    big, kv = directory / "big.safetensors", directory / "kv.safetensors"
    if not big.exists():
        arrays = {f"t{i:02}": np.full(8 << 20, i, dtype=np.float32) for i in range(64)}
        reference.save_file(arrays, str(big))
    if not kv.exists():
        rng = np.random.default_rng(0)
        layers = {
            f"layer_{i}_{part}": rng.random((1, 4, 2048, 64)).astype(np.float16)
            for i in range(22)
            for part in ("key", "value")
        }
        reference.save_file(layers, str(kv))
    return {"big": big, "kv": kv}


def _run(tree: Path, figure: str, files: dict[str, Path], scratch: Path) -> float:
    """One figure's seconds, in a fresh process with the stream_st of the checkout at ``tree``."""
    path = files["kv"] if figure in ("read-kv", "read-chunks", "import") else files["big"]
    out = scratch / "written.safetensors"
    root = tree.resolve()
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, figure, str(path.resolve()), str(out.resolve())],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=root,  # '-c' puts the working directory first on the path, before PYTHONPATH
    )
    out.unlink(missing_ok=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A (its root)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B, the baseline")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of A B B A (default 7)")
    parser.add_argument("--dir", type=Path, default=None, help="keep and reuse the files here")
    parser.add_argument("--figures", default=",".join(FIGURES), help="comma-separated subset")
    args = parser.parse_args()
    figures = [f for f in args.figures.split(",") if f]
    if unknown := sorted(set(figures) - set(FIGURES)):
        parser.error(f"unknown --figures {', '.join(unknown)} (choose from {', '.join(FIGURES)})")
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch_name:
        scratch = Path(scratch_name)
        files = _write_files(args.dir or scratch)
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        times: dict[str, dict[str, list[float]]] = {f: {"a": [], "b": []} for f in figures}
        for round_ in range(args.rounds):
            order = ("a", "b") if round_ % 2 == 0 else ("b", "a")
            for figure in figures:
                for side in order:
                    tree = args.a if side == "a" else args.b
                    times[figure][side].append(_run(tree, figure, files, scratch))
        print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"{'figure':<10} {'A median s':>11} {'B median s':>11} {'A/B (paired median)':>20}")
        for figure in figures:
            a, b = times[figure]["a"], times[figure]["b"]
            ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
            print(
                f"{figure:<10} {statistics.median(a):>11.4f} {statistics.median(b):>11.4f} "
                f"{ratio:>20.3f}"
            )


if __name__ == "__main__":
    main()

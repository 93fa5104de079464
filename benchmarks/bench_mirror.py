"""What the all-or-nothing copy of a sharded checkpoint costs: ``tools.mirror`` against copying
its shards one by one.

Run it from the repository root (about 2 x the checkpoint on disk; a minute on a loaded 2-core
machine with the defaults)::

    python benchmarks/bench_mirror.py [--repeat 5] [--shards 4] [--shard-mib 64] [--dir DIR]

The checkpoint: ``--shards`` shards of ``--shard-mib`` MiB of F32 each and its
``model.safetensors.index.json``, written once by the reference (and so in the page cache), in
a temporary directory in ``--dir`` (the system's by default). Variants, each in a fresh process,
interleaved, each first in turn (A B C, B C A, C A B...), the timer running from the first byte
read to the last file in place (no fsync anywhere); the copy is deleted and the dirty pages
flushed (``os.sync``) after each run, outside the timer:

* ``copyfile``: the bar, ``shutil.copyfile`` of each shard, then of the index.
* ``cp_each``: ``stream_st.tools.cp`` of each shard to its place, each committed as it ends, then
  the index: what a mirror did before it held its shards.
* ``mirror``: ``stream_st.tools.mirror(index, dst + "/")``: every shard and the index held
  uncommitted (nameless files) until all are complete, then committed, the index last.

Reported: GB/s per round, and each variant's paired ratio (the other's time / its own, per
round: median, min and max) to ``copyfile`` and to ``cp_each``; the load average (other
processes skew the figures) at the start, per round and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench_write import _load, _ratios  # this script's folder is on sys.path

VARIANTS = ("copyfile", "cp_each", "mirror")
INDEX = "model.safetensors.index.json"
MiB = 1 << 20


def _shards(src: str) -> list[str]:
    with open(os.path.join(src, INDEX)) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def _child(variant: str, src: str, dst: str) -> float:
    """Copy the checkpoint in ``src`` into ``dst`` with ``variant``; the seconds it took."""
    import anyio

    from stream_st import tools

    async def cp_each() -> None:
        for shard in _shards(src):
            await tools.cp(os.path.join(src, shard), os.path.join(dst, shard))
        shutil.copyfile(os.path.join(src, INDEX), os.path.join(dst, INDEX))

    async def mirror() -> None:
        await tools.mirror(os.path.join(src, INDEX), dst + "/")

    os.makedirs(dst)
    anyio.run(anyio.sleep, 0)  # the event loop's backend imported outside the timer
    start = time.perf_counter()
    if variant == "copyfile":
        for name in [*_shards(src), INDEX]:
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    else:
        anyio.run(cp_each if variant == "cp_each" else mirror)
    return time.perf_counter() - start


def _main(repeat: int, shards: int, shard_mib: int, directory: str | None) -> None:
    import numpy as np
    import safetensors.numpy

    workdir = tempfile.mkdtemp(prefix="bench_mirror_", dir=directory)
    src, dst = os.path.join(workdir, "src"), os.path.join(workdir, "dst")
    os.makedirs(src)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        array = np.full(shard_mib * MiB // 4, i, np.float32)
        safetensors.numpy.save_file({f"t{i}": array}, os.path.join(src, name))
        weight_map[f"t{i}"] = name
    with open(os.path.join(src, INDEX), "w") as f:
        json.dump(
            {"metadata": {"total_size": shards * shard_mib * MiB}, "weight_map": weight_map}, f
        )
    data = shards * shard_mib * MiB
    print(f"checkpoint: {shards} shards x {shard_mib} MiB; {repeat} rounds of {' '.join(VARIANTS)}")
    print(f"load average at start: {_load()}")
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for rep in range(repeat):
            for variant in VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]:  # each goes first in turn
                out = subprocess.run(
                    [sys.executable, __file__, "--child", variant, "--src", src, "--dst", dst],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                if sorted(os.listdir(dst)) != sorted(os.listdir(src)):
                    raise SystemExit(f"{variant}: wrote {sorted(os.listdir(dst))}")
                shutil.rmtree(dst)
                os.sync()
                seconds[variant].append(float(out))
            line = " ".join(f"{v}={data / seconds[v][-1] / 1e9:.2f}" for v in VARIANTS)
            print(f"round {rep + 1} GB/s: {line}  (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average at end: {_load()}\n")
    print("paired ratios (the bar's time / the variant's, per round):")
    for variant, bar in (("cp_each", "copyfile"), ("mirror", "copyfile"), ("mirror", "cp_each")):
        rounds = [b / a for a, b in zip(seconds[variant], seconds[bar], strict=True)]
        print(f"  {variant} to {bar}: {_ratios(rounds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--dir", help="where the checkpoint and its copies go")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--dst", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(_child(args.child, args.src, args.dst))
        return
    _main(args.repeat, args.shards, args.shard_mib, args.dir)


if __name__ == "__main__":
    main()

"""What a ``safe_open`` handle of a local file costs: stream_st's drop-in against the reference
(``safetensors``), paired.

Run it from the repository root::

    python benchmarks/bench_handles.py [--rounds 5] [--ops 2000] [--handles 50] [--shards 1000]

Each round runs every variant once, each in a fresh Python process, in an order that alternates
from round to round (so neither always runs first on a warm machine): the child times
``--ops`` rounds of open + ``get_tensor`` + close of a small file (after a warm-up), then opens
``--handles`` handles of it at once and counts the process's threads and open descriptors.
Printed: each round's microseconds per open+get+close and the ratio stream_st / reference,
their medians, the resources of the open handles, and the load average before and after (other
work on the machine skews every number; the pairing keeps the ratio meaningful). Last, in a
fresh process with ``ulimit -n 1024``, ``--shards`` shards of a checkpoint are opened at once and
one tensor taken from each, for each variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "reference": "from safetensors import safe_open",
    "stream_st": "from stream_st.torch import safe_open",
}

CHILD = """
import gc, json, os, sys, threading, time
{import_line}
import torch
path, ops, handles = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def once():
    with safe_open(path, framework="pt") as f:
        return f.get_tensor("weight")
for _ in range(max(ops // 10, 50)):
    once()
gc.collect()
start = time.perf_counter()
for _ in range(ops):
    once()
per_op = (time.perf_counter() - start) / ops
fds_before = len(os.listdir("/proc/self/fd"))
threads_before = threading.active_count()
opened = [safe_open(path, framework="pt") for _ in range(handles)]
tensors = [f.get_tensor("weight") for f in opened]
print(json.dumps({{
    "us": per_op * 1e6,
    "fds": len(os.listdir("/proc/self/fd")) - fds_before,
    "threads": threading.active_count() - threads_before,
}}))
"""

SHARDS = """
import resource, sys
{import_line}
import torch
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
paths = sys.argv[1:]
opened = [safe_open(p, framework="pt") for p in paths]
tensors = [f.get_tensor(f.keys()[0]) for f in opened]
print(len(opened), "shards open, one tensor from each:", sum(t.numel() for t in tensors), "values")
"""


def _child(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False
    )
    if done.returncode:
        return "FAILED: " + (done.stderr.strip().splitlines() or ["?"])[-1]
    return done.stdout.strip()


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--handles", type=int, default=50)
    parser.add_argument("--shards", type=int, default=1000)
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp, "small.safetensors")
        save_file({"weight": torch.randn(16, 16), "bias": torch.randn(16)}, small)
        print(f"load average before: {_load()} ({os.cpu_count()} CPUs)")
        results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            line = []
            for name in order:
                out = _child(
                    CHILD.format(import_line=VARIANTS[name]),
                    str(small),
                    str(args.ops),
                    str(args.handles),
                )
                results[name].append(json.loads(out))
                line.append(f"{name} {results[name][-1]['us']:.1f} us")
            ratio = results["stream_st"][-1]["us"] / results["reference"][-1]["us"]
            print(f"round {round_ + 1}: {', '.join(line)}; ratio {ratio:.2f}")
        ratios = [
            ours["us"] / ref["us"]
            for ours, ref in zip(results["stream_st"], results["reference"], strict=True)
        ]
        for name in names:
            print(
                f"{name}: median {statistics.median(r['us'] for r in results[name]):.1f} us per "
                f"open+get+close; {args.handles} open handles hold "
                f"{results[name][-1]['threads']} extra threads, "
                f"{results[name][-1]['fds']} extra descriptors"
            )
        print(f"ratio stream_st / reference: median {statistics.median(ratios):.2f}")
        print(f"load average after: {_load()}")

        shard_dir = Path(tmp, "shards")
        shard_dir.mkdir()
        paths = []
        for i in range(args.shards):
            path = shard_dir / f"model-{i:05d}.safetensors"
            save_file({f"layer.{i}.weight": torch.full((4,), float(i))}, path)
            paths.append(str(path))
        for name in names:
            out = _child(SHARDS.format(import_line=VARIANTS[name]), *paths)
            print(f"{args.shards} shards under ulimit -n 1024, {name}: {out}")


if __name__ == "__main__":
    main()

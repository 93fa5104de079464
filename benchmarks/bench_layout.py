"""Laying out a plan's header: the compiled layout against the Python loop, at 10**2 to 10**6
tensors, each variant in a fresh process.

Run it from the repository root (about two minutes on 2 cores with the defaults; ~1.5 GiB of
RAM at 10**6 tensors)::

    python benchmarks/bench_layout.py [--sizes 100,1000,...] [--rounds 5] [--calls 20]

``stream_st.build_header`` of a plan of ``TensorSpec("layers.N.weight", "F32", (16, 16))``
(the writers' first step: ``open_writer``, ``save``, the sharded writer's shards), two variants:

* ``c``: as installed, the plan laid out by ``stream_st/core/_compact.c`` (``laid``);
* ``python``: the same call with the compiled layout switched off (the loop of
  ``stream_st.core.layout._laid_here``, what every plan took before, and still takes where the
  package was built without a C compiler).

Each round runs both, in a fresh process each, the first in turn alternating; a process makes
the plan (outside the timer), then times ``--calls`` calls (one at 10**5 tensors and more) and
reports their median. The header each gives is compared (its SHA-1): they must be the same.
Printed per size: each variant's median over the rounds, the paired ratio python / c of each
round (median [min-max]; above 1.00 the compiled layout is faster) and the load average.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

VARIANTS = ("c", "python")


def _child(variant: str, size: int, calls: int) -> dict[str, Any]:
    """Time ``build_header`` of a plan of ``size`` tensors in this (fresh) process."""
    from stream_st import TensorSpec, build_header
    from stream_st.core import layout

    if variant == "python":
        layout._LAID = None
    elif layout._LAID is None:
        raise SystemExit("the compiled layout was not built (python setup.py build_ext --inplace)")
    plan = [TensorSpec(f"layers.{i}.weight", "F32", (16, 16)) for i in range(size)]
    times = []
    prefix = b""
    for _ in range(calls):
        start = time.perf_counter()
        prefix, _ = build_header(plan)
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "sha1": hashlib.sha1(prefix).hexdigest()}


def _run(variant: str, size: int, calls: int) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant]
    command += ["--sizes", str(size), "--calls", str(calls)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000,100000,1000000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    if args.child:
        print(json.dumps(_child(args.child, sizes[0], args.calls)))
        return
    print(f"build_header of F32 [16, 16] plans; {args.rounds} rounds; load average {_load()}")
    for size in sizes:
        calls = args.calls if size < 100_000 else 1
        seconds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for round_ in range(args.rounds):
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            results = {variant: _run(variant, size, calls) for variant in order}
            if len({result["sha1"] for result in results.values()}) != 1:
                raise SystemExit(f"{size} tensors: the two layouts gave different headers")
            for variant, result in results.items():
                seconds[variant].append(result["seconds"])
        ratios = [p / c for p, c in zip(seconds["python"], seconds["c"], strict=True)]
        print(
            f"{size:>9} tensors: c {statistics.median(seconds['c']) * 1e3:9.3f} ms, "
            f"python {statistics.median(seconds['python']) * 1e3:9.3f} ms, python / c "
            f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] "
            f"(load {_load()})"
        )


if __name__ == "__main__":
    main()

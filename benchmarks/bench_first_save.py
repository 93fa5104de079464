"""What a script's first ``save_file`` of a small dict costs: the drop-ins against the reference,
each in a fresh process.

Run it from the repository root (a few KiB of disk; about a minute on a loaded 2-core
machine with the defaults)::

    python benchmarks/bench_first_save.py [--repeat 9] [--tensors 1] [--calls 30] [--dir DIR]
                                          [--variants A,B,...] [--base DIR]

Each variant runs in a fresh process per round, the rounds interleaved and each variant first
in turn (A B C D, B C D A, ...), stream_st's modules compiled before the first (as an installed
package has them: where bytecode is not written, each process would compile what changed). The
process imports what a user's program has imported before (numpy, and torch for the torch
variants), outside the timer, then times:

* the import of the writer's module (``safetensors.numpy`` / ``stream_st.numpy``,
  ``safetensors.torch`` / ``stream_st.torch``);
* its first ``save_file`` of ``--tensors`` F32 tensors of 10 x 10 (the dict of the issue this
  measures), to a new file in a temporary directory in ``--dir`` (the system's by default);
* ``--calls`` later calls writing a new file (the file removed after each, outside the timer),
  then as many replacing the file there: the median of each.

Variants: ``ref_np`` and ``ref_torch`` (the reference's ``save_file``), ``np_save_file`` and
``torch_save_file`` (the drop-ins'). ``--base DIR`` also runs each drop-in with the stream_st of
the checkout ``DIR`` (the code before a change), as ``VARIANT@base`` in the same rounds. Every
file written is checked against the reference's bytes.

Reported per variant: each figure's median over the rounds in ms, and its paired ratio to the
reference of the same round (``ref_np`` for numpy, ``ref_torch`` for torch: the reference's
time / the variant's, median [min-max]), for the import, the first call, the two together and
the later calls; with ``--base``, the same ratios to the base; whether the process had loaded
asyncio or anyio by the end (torch imports asyncio itself). The load average (other processes
skew the figures) is printed at the start, after each round and at the end.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

VARIANTS = ("ref_np", "np_save_file", "ref_torch", "torch_save_file")
FIGURES = ("import", "first", "import+first", "later_new", "later_replace")


def _child(variant: str, workdir: str, tensors: int, calls: int) -> dict[str, Any]:
    """Import ``variant``'s module and time its calls in this (fresh) process, which has imported
    nothing else yet but what Python starts with (the modules this script needs to report are
    imported after the timing)."""
    import numpy as np

    torch_variant = "torch" in variant
    if torch_variant:
        import torch

        values: dict[str, Any] = {f"t{i}": torch.zeros((10, 10)) for i in range(tensors)}
    else:
        values = {f"t{i}": np.zeros((10, 10), np.float32) for i in range(tensors)}
    path = os.path.join(workdir, f"{variant}.safetensors")
    start = time.perf_counter()
    save_file: Any
    if variant == "ref_np":
        from safetensors.numpy import save_file
    elif variant == "ref_torch":
        from safetensors.torch import save_file
    elif torch_variant:
        from stream_st.torch import save_file
    else:
        from stream_st.numpy import save_file
    imported = time.perf_counter()
    save_file(values, path)
    first = time.perf_counter()
    import statistics
    import zlib

    with open(path, "rb") as f:
        crc = zlib.crc32(f.read())
    new: list[float] = []
    replace: list[float] = []
    for times in (new, replace):
        for _ in range(calls):
            if times is new:
                os.unlink(path)
            start_call = time.perf_counter()
            save_file(values, path)
            times.append(time.perf_counter() - start_call)
    os.unlink(path)
    return {
        "import": imported - start,
        "first": first - imported,
        "import+first": first - start,
        "later_new": statistics.median(new),
        "later_replace": statistics.median(replace),
        "crc": crc,
        "loop": [name for name in ("asyncio", "anyio") if name in sys.modules],
    }


def _expected(tensors: int) -> int:
    """The CRC-32 of the reference's file."""
    import zlib

    import numpy as np
    import safetensors.numpy

    arrays = {f"t{i}": np.zeros((10, 10), np.float32) for i in range(tensors)}
    return zlib.crc32(safetensors.numpy.save(arrays))


def _main(
    repeat: int, directory: str | None, variants: list[str], tensors: int, calls: int, base: str
) -> None:
    import compileall
    import statistics
    import tempfile

    from bench_write import BASE, CHECKOUT, _child_output, _load, _span  # its folder: sys.path

    if base:
        variants = [
            name for v in variants for name in ((v,) if v.startswith("ref_") else (v, v + BASE))
        ]
    for checkout in {CHECKOUT, base} - {""}:  # compiled, as an installed package is
        compileall.compile_dir(os.path.join(checkout, "stream_st"), quiet=1)
    print(
        f"{tensors} F32 tensor(s) of 10 x 10; {repeat} rounds of {' '.join(variants)}, each in a "
        f"fresh process, each first in turn; {calls} later calls of each kind"
    )
    print(f"load average at start: {_load()}")
    expected = _expected(tensors)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench_first_save_", dir=directory) as workdir:
        for rep in range(repeat):
            shift = rep % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                name, on_base, _ = variant.partition(BASE)
                command = [sys.executable, os.path.abspath(__file__), "--child", name, workdir]
                command += [str(tensors), str(calls)]
                result = _child_output(variant, command, base if on_base else CHECKOUT)
                if result["crc"] != expected:
                    raise SystemExit(f"{variant}: the file's bytes differ from the reference's")
                runs[variant].append(result)
            print(f"round {rep + 1} done (load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"load average at end: {_load()}")
    print("every file matched the reference's bytes\n")
    print(
        "per variant and figure: the median over the rounds in ms; the paired ratio to the "
        "reference of the same round (its time / the variant's), median [min-max]; with --base, "
        "the same to the base"
    )
    for variant in variants:
        bar = "ref_torch" if "torch" in variant else "ref_np"
        loop = sorted({name for result in runs[variant] for name in result["loop"]})
        print(f"{variant} (loaded by the end: {', '.join(loop) or 'neither asyncio nor anyio'})")
        for figure in FIGURES:
            times = [result[figure] for result in runs[variant]]
            line = f"  {figure:<14} {statistics.median(times) * 1e3:>8.3f} ms"
            if bar != variant and bar in runs:
                line += f"  vs {bar} {_span(times, [r[figure] for r in runs[bar]])}"
            if variant + BASE in runs:
                line += f"  vs base {_span(times, [r[figure] for r in runs[variant + BASE]])}"
            print(line)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # a child imports no more than it must before the timing
        variant, workdir, tensors, calls = sys.argv[2:]
        result = _child(variant, workdir, int(tensors), int(calls))
        import json

        print(json.dumps(result))
        return
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9, help="rounds (default 9)")
    parser.add_argument("--tensors", type=int, default=1, help="10 x 10 F32 tensors (default 1)")
    parser.add_argument("--calls", type=int, default=30, help="later calls of each kind")
    parser.add_argument("--dir", default=None, help="where to create the temporary directory")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--base", default="", help="a checkout whose stream_st to compare with")
    args = parser.parse_args()
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir}: no such directory")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants: {', '.join(unknown)}")
    _main(args.repeat, args.dir, variants, args.tensors, args.calls, args.base)


if __name__ == "__main__":
    main()

"""What importing stream_st costs against the reference, by ``python -X importtime``.

Run it from the repository root (about half a minute on 2 cores)::

    python benchmarks/bench_import.py [--rounds 9] [--torch] [--first-read] [--base DIR]

Each import runs in a fresh interpreter (``python -X importtime -c ...``), the variants
interleaved and each first in turn from round to round, stream_st compiled to bytecode before
the first (as an installed package has it). The settings:

* ``bare``: nothing imported before (numpy's own import counted for the modules that import
  it): ``import safetensors.numpy`` against ``import stream_st`` and ``import stream_st.numpy``;
* ``after numpy``: the same, ``import numpy`` first, untimed: only the modules' own cost, as in
  a program that has numpy already;
* ``after torch`` (with ``--torch``): ``import safetensors.torch`` against ``import
  stream_st.torch``, ``import torch`` first, untimed;
* ``first read`` (with ``--first-read``): the import and the first read of a small file (16
  tensors of 1,000 F32) together, ``numpy`` and ``asyncio`` imported first, untimed, timed by
  the clock in the child (not ``-X importtime``): ``safetensors.numpy.load_file`` against
  ``stream_st.numpy.load_file`` and ``asyncio.run(stream_st.load(path))``.

``--base DIR`` also times each stream_st module with the checkout ``DIR``'s code (the code before
a change), as ``MODULE@base`` in the same rounds.

A variant's time is the cumulative time ``-X importtime`` reports for the module's own line
(every module it imported first included), in ms. Printed: per setting and variant the median
and range over the rounds, the paired ratio to the reference of the same setting and round
(stream_st's time / the reference's: at most 1.2 is the target for ``import stream_st``), with
``--base`` this checkout's time over the base's (below 1: the change is faster), and
the load average (``os.getloadavg()``, 1 minute) before and after. Import times move with
the machine's load and its file cache; the paired ratio is the figure to compare.
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import safetensors.numpy

ROOT = Path(__file__).resolve().parent.parent

Variant = tuple[str, str, str, Path]
"""A setting, the module imported first untimed (or ""), the module timed, and the checkout
whose stream_st it imports."""


FIRST_READS = {
    "safetensors.numpy": "import safetensors.numpy as m; m.load_file(PATH)",
    "stream_st.numpy": "import stream_st.numpy as m; m.load_file(PATH)",
    "stream_st": "import stream_st; asyncio.run(stream_st.load(PATH))",
}
"""What the ``first read`` setting times for each module (``PATH`` the small file)."""


def variants(torch: bool, base: Path | None, first_read: bool = False) -> list[Variant]:
    """The variants run, the reference first in each setting."""
    settings = [("bare", "", "numpy"), ("after numpy", "numpy", "numpy")]
    if torch:
        settings.append(("after torch", "torch", "torch"))
    if first_read:
        settings.append(("first read", "numpy, asyncio", "numpy"))
    roots = [ROOT] if base is None else [ROOT, base]
    chosen: list[Variant] = []
    for setting, first, kind in settings:
        chosen.append((setting, first, f"safetensors.{kind}", ROOT))
        ours = ["stream_st", "stream_st.numpy"] if kind == "numpy" else [f"stream_st.{kind}"]
        chosen += [(setting, first, module, root) for root in roots for module in ours]
    return chosen


def import_ms(first: str, module: str, root: Path, small: Path | None = None) -> float:
    """Milliseconds ``-X importtime`` gives ``module``'s own line, in a fresh interpreter that
    imported ``first`` before it, with ``root``'s stream_st; with ``small`` (the ``first read``
    setting), the clock's milliseconds for :data:`FIRST_READS`' line of ``module`` on it."""
    code = (f"import {first}; " if first else "") + f"import {module}"
    timing = ["-X", "importtime"]
    if small is not None:
        timed = FIRST_READS[module].replace("PATH", repr(str(small)))
        code = (
            f"import time, {first}; start = time.perf_counter(); {timed}; "
            "print((time.perf_counter() - start) * 1000)"
        )
        timing = []
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(  # in root: "-c" puts the working directory first on the path
        [sys.executable, *timing, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    if small is not None:
        return float(done.stdout)
    for line in done.stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        _, cumulative, name = line.split("|")
        if name.strip() == module and not name.startswith("  "):
            return int(cumulative) / 1000
    raise RuntimeError(f"no import line for {module} (imported already by {first or 'Python'}?)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--torch", action="store_true", help="also the torch drop-in")
    parser.add_argument(
        "--first-read", action="store_true", help="also the import with a first read"
    )
    parser.add_argument("--base", type=Path, help="a checkout whose stream_st is timed too")
    args = parser.parse_args()
    for root in filter(None, [ROOT, args.base]):
        compileall.compile_dir(root / "stream_st", quiet=1)
    chosen = variants(args.torch, args.base, args.first_read)
    with tempfile.TemporaryDirectory() as folder:
        small = Path(folder) / "small.safetensors"
        safetensors.numpy.save_file(
            {f"t{i}": np.full(1000, i, np.float32) for i in range(16)}, str(small)
        )
        run(args, chosen, small)


def run(args: argparse.Namespace, chosen: list[Variant], small: Path) -> None:
    """Time ``chosen`` in ``args.rounds`` interleaved rounds and print the table."""
    times: dict[Variant, list[float]] = {variant: [] for variant in chosen}
    print(f"python {sys.version.split()[0]}; {args.rounds} rounds, each import in a fresh process")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for round_ in range(args.rounds):
        turn = round_ % len(chosen)
        for variant in chosen[turn:] + chosen[:turn]:
            reads = small if variant[0] == "first read" else None
            times[variant].append(import_ms(*variant[1:], small=reads))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("setting      module               ms median [range]      vs reference (ours / ref)")
    for variant in chosen:
        setting, first, module, root = variant
        values = times[variant]
        reference = next(v for v in chosen if v[0] == setting and v[2].startswith("safetensors"))
        label = module if root == ROOT else f"{module}@base"
        line = (
            f"{setting:12} {label:20} {statistics.median(values):7.1f} "
            f"[{min(values):.1f}-{max(values):.1f}]"
        )
        if reference != variant:
            line += f"   {_paired(values, times[reference])} of {reference[2]}"
        if root != ROOT:  # the change's own effect: this checkout's time over the base's
            ours = times[(setting, first, module, ROOT)]
            line += f"; this checkout {_paired(ours, values)} of it"
        print(line)


def _paired(tops: list[float], bottoms: list[float]) -> str:
    """The median and range of the paired ratios ``top / bottom`` of the same rounds."""
    ratios = sorted(a / b for a, b in zip(tops, bottoms, strict=True))
    return f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]"


if __name__ == "__main__":
    main()

"""``get_slice(name)[key]`` of a local file with ``framework="pt"``: two checkouts of stream_st
and the reference (``safetensors``), paired.

    python benchmarks/bench_slice.py --a . --b ../other-checkout [--rounds 7] [--ops 300]

One file (a 4096 x 1024 F32 tensor, 16 MiB) is written once. Each round runs every variant once,
each in a fresh process (a checkout first on ``sys.path``), in an order that alternates from
round to round; the child opens the file, warms up, then times ``--ops`` slices of each key:

* ``rows``: ``[1024:1536]``, rows a first slice names (read alone);
* ``cols``: ``[1024:1536, :256]``, those rows cut in their second dimension (a copy);
* ``row``: ``[7]``, one row;
* ``mask``: ``[mask]``, a bool tensor picking every other row (the whole tensor read).

Printed: per key, each variant's median microseconds per slice, and the median and range of the
per-round ratios B/A and reference/A (above 1: A is faster), with the load average before and
after (other work on the machine skews every number; the pairing keeps the ratios meaningful).
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

KEYS = ("rows", "cols", "row", "mask")

CHILD = r"""
import json, sys, time
checkout, path, ops = sys.argv[1], sys.argv[2], int(sys.argv[3])
origin = ""
if checkout:
    sys.path.insert(0, checkout)
    import stream_st
    from stream_st.torch import safe_open
    origin = stream_st.__file__
else:
    from safetensors import safe_open
import torch
mask = torch.arange(4096) % 2 == 0
keys = {
    "rows": slice(1024, 1536),
    "cols": (slice(1024, 1536), slice(None, 256)),
    "row": 7,
    "mask": mask,
}
out = {}
with safe_open(path, "pt") as f:
    part = f.get_slice("w")
    for name, key in keys.items():
        try:
            for _ in range(5):
                part[key]
        except Exception:  # a key this checkout refuses
            out[name] = None
            continue
        began = time.perf_counter()
        for _ in range(ops):
            part[key]
        out[name] = (time.perf_counter() - began) / ops * 1e6
print(json.dumps({"origin": origin, **out}))
"""


def child(checkout: str, path: Path, ops: int) -> dict[str, float | None]:
    """Microseconds per slice of each key (None where the key is refused), in a fresh process
    (``checkout`` empty: the reference)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, checkout, str(path), str(ops)],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    times = json.loads(done.stdout)
    origin = times.pop("origin")
    assert origin.startswith(checkout), f"{checkout}: stream_st imported from {origin}"
    return dict(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="a checkout of stream_st")
    parser.add_argument("--b", required=True, help="another checkout of stream_st")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", type=int, default=300)
    args = parser.parse_args()

    import safetensors.torch
    import torch

    variants = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve()), "ref": ""}
    print(f"load average before: {os.getloadavg()}")
    runs: dict[str, list[dict[str, float | None]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slice.safetensors"
        safetensors.torch.save_file({"w": torch.randn(4096, 1024)}, path)
        for round_ in range(args.rounds):
            order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for variant in order:
                runs[variant].append(child(variants[variant], path, args.ops))
    print(f"{'key':<6} {'A us':>8} {'B us':>8} {'ref us':>8} {'B/A median [range]':>24}", end="")
    print(f" {'ref/A median [range]':>24}")
    for key in KEYS:
        line = f"{key:<6}"
        for variant in variants:
            times = [t for r in runs[variant] if (t := r[key]) is not None]
            shown = f"{statistics.median(times):.1f}" if times else "refused"
            line += f" {shown:>8}"
        for other in ("B", "ref"):
            pairs = [(a[key], b[key]) for a, b in zip(runs["A"], runs[other], strict=True)]
            ratios = [b / a for a, b in pairs if a is not None and b is not None]
            shown = "-"
            if len(ratios) == len(pairs):
                shown = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            line += f" {shown:>24}"
        print(line)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

"""Time to a fully loaded torch model, and its peak memory: ``stream_st.torch.load_model`` against
the reference ``safetensors.torch``.

Run it from the repository root (``--size-mb`` sets the model's size; a minute or so at 256)::

    python benchmarks/bench_torch.py [--size-mb 256] [--repeat 5]

The model is a stack of ``nn.Linear(d, d)`` layers (F32, 16 MiB weights at the default ``d``)
saved once with the reference writer. Each variant runs in a fresh subprocess, which builds the
model first (its memory allocated and touched: that is not timed), then times only the load:

* ``ours``: ``stream_st.torch.load_model(model, src)``: every tensor received straight into the
  model's parameters;
* ``ref_model``: ``safetensors.torch.load_model(model, path)`` (mmap, then ``load_state_dict``);
* ``ref_dict``: ``model.load_state_dict(safetensors.torch.load_file(path))``.

Over HTTP (the test server, ``tests/http_server.py``, in this process) ``ours`` reads the URL and
the reference variants first fetch the body with ``urllib`` and call ``safetensors.torch.load``
on it (the reference cannot read a URL). Every variant leaves every parameter page written (a
``load_state_dict`` copy or our receive), and each child returns a checksum of all parameters
(taken after the timing), compared across variants. Peak RSS is the child's ``VmHWM`` above its
RSS once the model is built (reset through ``/proc/self/clear_refs`` where the kernel allows);
the target is the largest tensor + 64 MiB. Rounds are interleaved (A B C A B C ...); medians and
each variant's median ratio to ``ours`` are printed.

Last, ``get_slice`` of 1/8 of one remote tensor: the bytes the server sent for it, against 1/8
of the tensor + 64 KiB.
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
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WIDTH = 2048  # a 16 MiB F32 weight per layer
VARIANTS = ("ours", "ref_model", "ref_dict")


def build(layers: int) -> Any:
    """The model, its memory allocated and written (as a real model's initialisation does)."""
    import torch

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(0.5)
    return model


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(variant: str, src: str, layers: int) -> None:
    """Build, time one load, report ``{seconds, peak_mib, checksum}`` as JSON on stdout."""
    import safetensors.torch
    import torch

    import stream_st.torch

    model = build(layers)
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    base = rss_kib("VmRSS")
    remote = src.startswith("http")
    start = time.perf_counter()
    if variant == "ours":
        stream_st.torch.load_model(model, src)
    elif remote:
        with urllib.request.urlopen(src) as answer:
            state = safetensors.torch.load(answer.read())
        model.load_state_dict(state)
        del state
    elif variant == "ref_model":
        safetensors.torch.load_model(model, src)
    else:
        model.load_state_dict(safetensors.torch.load_file(src))
    seconds = time.perf_counter() - start
    peak = rss_kib("VmHWM") - base
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    print(json.dumps({"seconds": seconds, "peak_mib": peak / 1024, "checksum": checksum}))


def run_child(variant: str, src: str, layers: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, src, str(layers)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def compare(label: str, src: str, layers: int, repeat: int, largest_mib: float) -> None:
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(repeat):
        for variant in VARIANTS:
            runs[variant].append(run_child(variant, src, layers))
    checksums = {r["checksum"] for rs in runs.values() for r in rs}
    assert len(checksums) == 1, f"variants loaded different weights: {checksums}"
    ours = [r["seconds"] for r in runs["ours"]]
    print(
        f"\n{label}  (median of {repeat}; target: ours >= 1.5x faster locally, peak <= "
        f"{largest_mib + 64:.0f} MiB)"
    )
    print(f"{'variant':<10} {'time s':>8} {'x ours':>7} {'peak MiB above model':>21}")
    for variant in VARIANTS:
        times = [r["seconds"] for r in runs[variant]]
        ratio = statistics.median(t / o for t, o in zip(times, ours, strict=True))
        peak = statistics.median(r["peak_mib"] for r in runs[variant])
        print(f"{variant:<10} {statistics.median(times):>8.3f} {ratio:>7.2f} {peak:>21.0f}")


def slice_transfer(path: Path) -> None:
    """Bytes sent by the server for ``get_slice`` of 1/8 of one remote tensor."""
    from stream_st.torch import safe_open
    from tests.http_server import RangeHTTPServer

    with RangeHTTPServer() as server:
        server.objects["/m.safetensors"] = path.read_bytes()
        with safe_open(server.url("/m.safetensors"), "pt") as f:
            server.settle()
            opened = sum(sent for *_, sent in server.requests)
            name = "3.weight"
            rows = f.get_slice(name).get_shape()[0]
            f.get_slice(name)[: rows // 8]
            server.settle()
            sent = sum(sent for *_, sent in server.requests) - opened
    eighth = WIDTH * WIDTH * 4 // 8
    print(
        f"\nget_slice of 1/8 of a remote {WIDTH}x{WIDTH} F32 tensor: opening sent {opened} B, "
        f"the slice {sent} B (1/8 of the tensor = {eighth} B; target <= {eighth + 65536} B)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "SRC", "LAYERS"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return

    import safetensors.torch

    layers = max(1, args.size_mb // 16)
    largest = WIDTH * WIDTH * 4 / 2**20
    print(
        f"model: {layers} x Linear({WIDTH}, {WIDTH}) F32, {layers * (largest + 0.008):.0f} MiB; "
        f"load avg {os.getloadavg()[0]:.2f} (2 cores, shared with other work)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        safetensors.torch.save_model(build(layers), str(path))
        path.read_bytes()  # page cache warm
        compare("local file, page cache warm", str(path), layers, args.repeat, largest)
        if not args.skip_http:
            from tests.http_server import RangeHTTPServer

            with RangeHTTPServer() as server:
                server.objects["/model.safetensors"] = path.read_bytes()
                url = server.url("/model.safetensors")
                compare("test HTTP server (loopback)", url, layers, args.repeat, largest)
        slice_transfer(path)


if __name__ == "__main__":
    main()

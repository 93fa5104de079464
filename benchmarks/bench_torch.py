"""Time to a fully loaded torch model, and its peak memory: ``stream_st.torch.load_model`` against
the reference ``safetensors.torch``; and ``load_file`` against the reference's ``load_file``.

Run it from the repository root (``--size-mb`` sets the model's size; a minute or so at 256)::

    python benchmarks/bench_torch.py [--size-mb 256] [--repeat 5] [--skip-http] [--device cuda]

The model is a stack of ``nn.Linear(d, d)`` layers (F32, 16 MiB weights at the default ``d``)
saved once with the reference writer. Each variant runs in a fresh subprocess, which builds the
model first (its memory allocated and touched: that is not timed) and loads a tiny file the same
way (what the call imports on its first use imported then), then times only the load:

* ``ours``: ``stream_st.torch.load_model(model, src)``: every tensor received straight into the
  model's parameters;
* ``ours_assign``: ``stream_st.torch.load_model(model, src, assign=True)``: the model's tensors
  replaced by the file's (a local file's: views of a private mapping, never copied), then every
  page of every parameter read, inside the timing (the other variants write every page);
* ``ours_dict``: ``model.load_state_dict(stream_st.torch.load_file(src))`` (a local file mapped);
* ``ref_model``: ``safetensors.torch.load_model(model, path)`` (mmap, then ``load_state_dict``);
* ``ref_dict``: ``model.load_state_dict(safetensors.torch.load_file(path))``.

Over HTTP (the test server, ``tests/servers/http_server.py``, in this process; not with
``--skip-http``) ``ours`` and ``ours_dict`` read the URL and the reference variants first fetch the
body with ``urllib`` and call ``safetensors.torch.load`` on it (the reference cannot read a URL).
Every variant leaves every parameter page written (a ``load_state_dict`` copy or our receive), and
each child returns a checksum of all parameters (taken after the timing), compared across variants.
Peak RSS is the child's ``VmHWM`` above its RSS once the model is built (reset through
``/proc/self/clear_refs`` where the kernel allows); the target is the largest tensor + 64 MiB.
Rounds are interleaved (A B C A B C ...); medians and each variant's median ratio to ``ours`` are
printed.

Then ``load_file`` alone on the local file, every page of every tensor touched (one byte read
per page) inside the timing, no model built:

* ``file_ours``: ``stream_st.torch.load_file(path)``: writable views of a private
  (copy-on-write) mapping, populated a window ahead;
* ``file_pread``: ``stream_st.torch.load_file(path, backend="pread")``: read into fresh memory;
* ``file_shared``: ``stream_st.load(path, copy=False)``: numpy read-only views of a shared
  mapping (what ``open_stream(copy=False)`` gives; the private mapping's cost is its difference);
* ``file_ref``: ``safetensors.torch.load_file(path)`` (mmap, each page faulted in when touched).

Last, ``get_slice`` of 1/8 of one remote tensor: the bytes the server sent for it, against 1/8
of the tensor + 64 KiB.

With ``--device cuda`` (a CUDA machine; the CUDA context made before the clock starts, the clock
stopped after ``torch.cuda.synchronize()``), only the loads onto the device, the local file warm:

* ``cuda_file_ours`` / ``cuda_file_ref``: ``load_file(path, device="cuda")`` of stream_st / of
  the reference;
* ``cuda_model_ours`` / ``cuda_model_ref``: ``load_model`` into the model built on the device,
  stream_st's / the reference's (``device="cuda"``: its state dict loaded there, then copied in).
"""

from __future__ import annotations

import argparse
import asyncio
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
MODEL_VARIANTS = ("ours", "ours_assign", "ours_dict", "ref_model", "ref_dict")
FILE_VARIANTS = ("file_ours", "file_pread", "file_shared", "file_ref")
CUDA_FILE_VARIANTS = ("cuda_file_ours", "cuda_file_ref")
CUDA_MODEL_VARIANTS = ("cuda_model_ours", "cuda_model_ref")
PAGE = 4096


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


def tiny_model() -> Any:
    """The model of the warm-up file: one ``Linear(2, 2)``."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(2, 2))


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> int:
    """Reset ``VmHWM`` to the current RSS where the kernel allows; the RSS in KiB."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
    return rss_kib("VmRSS")


def load_model(variant: str, src: str, model: Any) -> None:
    """Load ``src`` into ``model`` the way ``variant`` does."""
    import safetensors.torch

    import stream_st.torch

    if variant == "cuda_model_ours":
        stream_st.torch.load_model(model, src, device="cuda")
    elif variant == "cuda_model_ref":
        safetensors.torch.load_model(model, src, device="cuda")
    elif variant == "ours":
        stream_st.torch.load_model(model, src)
    elif variant == "ours_assign":
        stream_st.torch.load_model(model, src, assign=True)
        touch(dict(model.named_parameters()))  # mapped, not written: read every page
    elif variant == "ours_dict":
        model.load_state_dict(stream_st.torch.load_file(src))
    elif src.startswith("http"):
        with urllib.request.urlopen(src) as answer:
            state = safetensors.torch.load(answer.read())
        model.load_state_dict(state)
        del state
    elif variant == "ref_model":
        safetensors.torch.load_model(model, src)
    else:
        model.load_state_dict(safetensors.torch.load_file(src))


def load_file(variant: str, path: str) -> dict[str, Any]:
    """Every tensor of ``path`` loaded the way ``variant`` does."""
    import safetensors.torch

    import stream_st
    import stream_st.torch

    if variant == "cuda_file_ours":
        return stream_st.torch.load_file(path, device="cuda")
    if variant == "cuda_file_ref":
        return safetensors.torch.load_file(path, device="cuda")
    if variant == "file_ours":
        return stream_st.torch.load_file(path)
    if variant == "file_pread":
        return stream_st.torch.load_file(path, backend="pread")
    if variant == "file_shared":
        return asyncio.run(stream_st.load(path, copy=False))
    return safetensors.torch.load_file(path)


def touch(tensors: dict[str, Any]) -> int:
    """Read one byte of every page of every tensor (and its last byte); their sum."""
    import numpy as np
    import torch

    total = 0
    for tensor in tensors.values():
        raw = (
            tensor.detach().reshape(-1).view(torch.uint8).numpy()
            if isinstance(tensor, torch.Tensor)
            else tensor.reshape(-1).view(np.uint8)
        )
        if raw.size:
            total += int(raw[::PAGE].sum(dtype=np.uint64)) + int(raw[-1])
    return total


def warm_up(variant: str, warm: str) -> None:
    """Load ``warm`` (the file of :func:`tiny_model`, a path or a URL as the measured source is)
    the way ``variant`` loads: the modules its call imports on first use (the event loop's
    backend, the reader, the HTTP client) are imported then, not inside the timing."""
    if variant in FILE_VARIANTS or variant in CUDA_FILE_VARIANTS:
        load_file(variant, warm)
        return
    model = tiny_model()
    load_model(variant, warm, model.cuda() if variant.startswith("cuda_") else model)


def child(variant: str, src: str, warm: str, layers: int) -> None:
    """Time one load, report ``{seconds, peak_mib, checksum}`` as JSON on stdout: into a model
    built first (not timed), or (``file_*``) of the file alone with every page touched. Every
    module a variant uses is imported before the timing (:func:`warm_up` of ``warm``), the
    checksum taken after the peak."""
    import torch

    cuda = variant.startswith("cuda_")
    if cuda:
        torch.zeros(1, device="cuda")  # the CUDA context, made before the clock
    warm_up(variant, warm)
    files = variant in FILE_VARIANTS or variant in CUDA_FILE_VARIANTS
    model = None if files else build(layers)
    if cuda and model is not None:
        model = model.cuda()
    base = reset_peak()
    start = time.perf_counter()
    if model is None:
        loaded = load_file(variant, src)
        touched = 0 if cuda else touch(loaded)
    else:
        load_model(variant, src, model)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = rss_kib("VmHWM") - base
    with torch.no_grad():
        if model is not None:
            checksum = float(sum(p.double().sum() for p in model.parameters()))
        else:
            checksum = float(sum(t.double().sum() for t in loaded.values())) if cuda else touched
    print(json.dumps({"seconds": seconds, "peak_mib": peak / 1024, "checksum": checksum}))


def run_child(variant: str, src: str, warm: str, layers: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, src, warm, str(layers)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def compare(
    label: str, variants: tuple[str, ...], src: str, warm: str, layers: int, repeat: int
) -> None:
    """Run ``variants`` on ``src`` (``warm`` the warm-up file of the same kind) in interleaved
    rounds; print medians and paired ratios to the first."""
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(repeat):
        for variant in variants:
            runs[variant].append(run_child(variant, src, warm, layers))
    checksums = {r["checksum"] for rs in runs.values() for r in rs}
    assert len(checksums) == 1, f"variants loaded different bytes: {checksums}"
    first = [r["seconds"] for r in runs[variants[0]]]
    print(f"\n{label}  (median of {repeat})")
    print(f"{'variant':<12} {'time s':>8} {f'x {variants[0]}':>12} {'peak MiB':>9}")
    for variant in variants:
        times = [r["seconds"] for r in runs[variant]]
        ratio = statistics.median(t / o for t, o in zip(times, first, strict=True))
        peak = statistics.median(r["peak_mib"] for r in runs[variant])
        print(f"{variant:<12} {statistics.median(times):>8.3f} {ratio:>12.2f} {peak:>9.0f}")


def slice_transfer(path: Path) -> None:
    """Bytes sent by the server for ``get_slice`` of 1/8 of one remote tensor."""
    from stream_st.torch import safe_open
    from tests.servers.http_server import RangeHTTPServer

    with RangeHTTPServer() as server:
        server.objects["/m.safetensors"] = path.read_bytes()
        with safe_open(server.url("/m.safetensors"), "pt") as f:
            server.settle()
            opened = sum(sent for *_, sent in server.requests)
            names = f.keys()
            name = max(name for name in names if name.endswith("weight"))
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
    parser.add_argument("--device", choices=["cuda"], help="only the loads onto a CUDA device")
    parser.add_argument(
        "--child", nargs=4, metavar=("VARIANT", "SRC", "WARM", "LAYERS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2], int(args.child[3]))
        return

    import safetensors.torch
    import torch

    if args.device and not torch.cuda.is_available():
        print(f"skipped: this torch ({torch.__version__}) sees no CUDA device")
        return
    layers = max(1, args.size_mb // 16)
    largest = WIDTH * WIDTH * 4 / 2**20
    print(
        f"model: {layers} x Linear({WIDTH}, {WIDTH}) F32, {layers * (largest + 0.008):.0f} MiB; "
        f"load avg {os.getloadavg()[0]:.2f} (2 cores, shared with other work)"
    )
    targets = f"target: ours >= 1.5x locally; peak above the model <= {largest + 64:.0f} MiB"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        safetensors.torch.save_model(build(layers), str(path))
        path.read_bytes()  # page cache warm
        local = str(path)
        warm = Path(tmp) / "tiny.safetensors"
        safetensors.torch.save_model(tiny_model(), str(warm))
        if args.device:
            for label, variants in (
                ("load_file onto the CUDA device, local file warm", CUDA_FILE_VARIANTS),
                (
                    "load_model into a model on the CUDA device, local file warm",
                    CUDA_MODEL_VARIANTS,
                ),
            ):
                compare(label, variants, local, str(warm), layers, args.repeat)
            print(f"\nload avg at the end {os.getloadavg()[0]:.2f}")
            return
        compare(
            f"load_model, local file, page cache warm; {targets}",
            MODEL_VARIANTS,
            local,
            str(warm),
            layers,
            args.repeat,
        )
        compare(
            "load_file, local file, page cache warm, every page touched",
            FILE_VARIANTS,
            local,
            str(warm),
            layers,
            args.repeat,
        )
        if not args.skip_http:
            from tests.servers.http_server import RangeHTTPServer

            with RangeHTTPServer() as server:
                server.objects["/model.safetensors"] = path.read_bytes()
                server.objects["/tiny.safetensors"] = warm.read_bytes()
                compare(
                    "load_model, test HTTP server (loopback)",
                    MODEL_VARIANTS,
                    server.url("/model.safetensors"),
                    server.url("/tiny.safetensors"),
                    layers,
                    args.repeat,
                )
        slice_transfer(path)
        print(f"\nload avg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

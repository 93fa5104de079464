"""The default concurrency of remote reads: adaptive (``concurrency=None``) against one stream and
a fixed window, on an object-store link and on loopback.

Run it from the repository root (the object-store link needs root; without it that part prints
``skipped: <reason>``; about 3 minutes on 2 cores with the defaults)::

    sudo python benchmarks/bench_concurrency.py [--repeat 3] [--size-mib 256] [--rate 200e6]
        [--delay-ms 15] [--media store,loopback,nginx] [--variants default,1,8,runai]

Media:

* ``store``: nginx behind a shaped link (``benchmarks/netns_store.py``): a round trip of
  ``2 * --delay-ms`` and ``--rate`` bytes per second per connection, read as
  ``s3://bench/FILE`` with :class:`~stream_st.S3Source`;
* ``loopback``: ``tests/servers/http_server.py`` on 127.0.0.1 (threads of this process, strong
  ETags), read with :class:`~stream_st.HttpSource`: no link to fill, so more connections must
  not make it slower than one;
* ``nginx``: nginx on 127.0.0.1 (``tests/servers/nginx_server.py``, its own process): the same,
  from a server that is not the bottleneck.

Variants, each read in a fresh subprocess (imports and set-up untimed; the read is timed from the
first request to the last tensor touched; every 4 KiB page of every tensor is touched and checked
against the file, in offset order): ``default`` (no ``concurrency=``), ``1``, ``8`` (``K``:
``concurrency=K``), and ``runai`` (runai-model-streamer's ``SafetensorsStreamer`` on the store,
its own default concurrency) where it is installed. Rounds are interleaved (the order rotated
each round); the table gives medians, GB/s, the peak RSS above the RSS before the read, the
parts at once the read ended with, and the paired ratios (per round, the other variant's time
over the default's, then the median and the range); the load average is printed before and
after.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bench_peers_remote import (
    BUCKET,
    CREDENTIALS,
    _status_kib,
    child_result,
    digest,
    expected_digests,
)
from bench_read import big_file, ensure_file, touch
from netns_store import NetnsStore, StoreUnavailable

SCRIPT = str(Path(__file__).resolve())
ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
KEY = "big.safetensors"


def child(args: argparse.Namespace) -> None:
    """``--child``: one timed read in this fresh process; prints one JSON line."""
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=args.endpoint)
    if args.child == "runai":
        os.environ.update(RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0")
        streamer_module = importlib.import_module("runai_model_streamer")

        def runai() -> tuple[list[tuple[str, int]], int]:
            with streamer_module.SafetensorsStreamer() as streamer:
                streamer.stream_file(f"s3://{BUCKET}/{KEY}")
                touches = sorted((name, touch(t.numpy())) for name, t in streamer.get_tensors())
            return touches, 0

        read = runai
    else:
        import anyio

        import stream_st
        from stream_st.transports.http.source import HttpSource
        from stream_st.transports.s3.config import S3Config
        from stream_st.transports.s3.source import S3Source

        config = S3Config.resolve()
        anyio.run(config.ready)  # credentials looked up untimed
        k = None if args.child == "default" else int(args.child)

        async def stream() -> tuple[list[tuple[str, int]], int]:
            if args.medium == "store":
                source: HttpSource = S3Source(f"s3://{BUCKET}/{KEY}", config=config, concurrency=k)
            else:
                source = HttpSource(f"{args.endpoint}/{BUCKET}/{KEY}", concurrency=k)
            touches = [(name, touch(a)) async for name, a in stream_st.open_stream(source)]
            return touches, source.concurrency

        def read() -> tuple[list[tuple[str, int]], int]:
            return anyio.run(stream)

    before = _status_kib("VmRSS")
    started = time.perf_counter()
    touches, parts = read()
    seconds = time.perf_counter() - started
    peak = (_status_kib("VmHWM") - before) / 1024
    print(json.dumps({"seconds": seconds, "digest": digest(touches), "peak": peak, "k": parts}))


def run_child(variant: str, medium: str, endpoint: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, SCRIPT, "--child", variant, "--medium", medium, "--endpoint", endpoint],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return child_result(done)


def measure(
    args: argparse.Namespace, medium: str, endpoint: str, path: Path
) -> dict[str, list[dict[str, Any]]]:
    """Every variant once per round, the order rotated each round; each result checked."""
    in_order, by_name = expected_digests(path)
    variants = [v for v in args.variants if v != "runai" or medium == "store"]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_index in range(args.repeat):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            result = run_child(variant, medium, endpoint)
            wanted = by_name if variant == "runai" else in_order
            if "error" not in result and result["digest"] != wanted:
                result = {"error": "delivered other bytes or another order than the file"}
            results[variant].append(result)
    return results


def report(medium: str, size: int, results: dict[str, list[dict[str, Any]]]) -> None:
    print(f"  {'variant':<10} {'median s':>9} {'GB/s':>6} {'peak MiB':>9} {'K at end':>9}")
    for variant, rounds in results.items():
        ok = [r for r in rounds if "seconds" in r]
        if not ok:
            errors = "; ".join(sorted({r["error"] for r in rounds}))
            print(f"  {variant:<10} failed: {errors[:100]}")
            continue
        seconds = statistics.median(r["seconds"] for r in ok)
        peak = statistics.median(r["peak"] for r in ok)
        ks = sorted({r["k"] for r in ok})
        failed = f"  ({len(rounds) - len(ok)} failed)" if len(ok) < len(rounds) else ""
        shown = ",".join(map(str, ks)) if variant != "runai" else "-"
        rate = size / seconds / 1e9
        print(f"  {variant:<10} {seconds:9.3f} {rate:6.3f} {peak:9.0f} {shown:>9}{failed}")
    print(f"  paired ratios on {medium} (other time / default time; > 1: the default is faster):")
    for other in results:
        if other == "default":
            continue
        pairs = [
            b["seconds"] / a["seconds"]
            for a, b in zip(results["default"], results[other], strict=True)
            if "seconds" in a and "seconds" in b
        ]
        if pairs:
            print(
                f"    {other:>8} / default: median {statistics.median(pairs):.2f} "
                f"(range {min(pairs):.2f}-{max(pairs):.2f}, {len(pairs)} rounds)"
            )


@contextlib.contextmanager
def loopback(root: Path, medium: str) -> Iterator[str]:
    """The folder's objects on 127.0.0.1 (strong ETags), served by this process's threads or by
    nginx (``medium``); the endpoint."""
    sys.path.insert(0, str(ROOT))
    from tests.servers.http_server import RangeHTTPServer
    from tests.servers.nginx_server import NginxServer

    with contextlib.ExitStack() as stack:
        if medium == "nginx":
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-nginx-")))
            nginx = stack.enter_context(NginxServer(root, work))
            yield f"http://127.0.0.1:{nginx.port}"
            return
        objects = {}
        for path in (root / BUCKET).iterdir():
            data = np.memmap(path, dtype=np.uint8, mode="r")
            objects[f"/{BUCKET}/{path.name}"] = data.data
        server = stack.enter_context(RangeHTTPServer(objects=objects, etag="strong"))
        yield f"http://127.0.0.1:{server.port}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="default concurrency against fixed ones")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rate", type=float, default=200e6, help="store: bytes/s a connection")
    parser.add_argument("--delay-ms", type=float, default=15.0, help="store: added each way")
    parser.add_argument("--media", default="store,loopback,nginx")
    parser.add_argument("--variants", default="default,1,8,runai")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--medium", default="", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.media = [m for m in args.media.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    if "runai" in args.variants and importlib.util.find_spec("runai_model_streamer") is None:
        args.variants.remove("runai")
        if args.child is None:
            print("runai-model-streamer is not installed: its variant is left out")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        child(args)
        return
    spec = big_file("big", args.size_mib)
    root = Path(tempfile.mkdtemp(prefix="bench-concurrency-"))
    try:
        (root / BUCKET).mkdir()
        path = root / BUCKET / KEY
        shutil.move(ensure_file(root, spec), path)
        size = path.stat().st_size
        print(f"file: {spec.description} ({size / MiB:.0f} MiB), {args.repeat} rounds")
        print(f"load average before: {os.getloadavg()[0]:.2f} (2 cores, shared)")
        for medium in args.media:
            if medium == "store":
                try:
                    store = NetnsStore(root, delay_ms=args.delay_ms, rate=int(args.rate))
                    with store:
                        print(f"\n== store: {store.describe()}")
                        report(medium, size, measure(args, medium, store.endpoint, path))
                except StoreUnavailable as exc:
                    print(f"\n== store skipped: {exc}")
            else:
                with loopback(root, medium) as endpoint:
                    server = "nginx" if medium == "nginx" else "this process's threads"
                    print(f"\n== {medium}: {endpoint} ({server} serve)")
                    report(medium, size, measure(args, medium, endpoint, path))
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

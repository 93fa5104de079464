"""What ``cache=`` costs on a first read and gives on the next one, over loopback HTTP and over
the shaped object-store link of ``benchmarks/netns_store.py``.

Run it from the repository root (about a minute per link on 2 cores; ~3x ``--size-mib`` of
disk; the object-store link needs root, and is skipped with the reason otherwise)::

    python benchmarks/bench_cache.py [--size-mib 256] [--repeat 5] [--links loopback,store]
        [--concurrency 8] [--dir DIR] [--baseline OTHER-CHECKOUT]

The file: ``--size-mib`` of 32 MiB F32 tensors. The links:

* ``loopback``: the test suite's HTTP server (Range, strong ETags, ``If-None-Match``) in its
  own process, ``http://127.0.0.1``;
* ``store``: nginx in a network namespace behind a link with a 30 ms round trip and 200 MB/s
  per connection, read as ``s3://`` with ``concurrency=--concurrency``.

Four variants per link, each run in a fresh process (imports done before the clock starts, the
HTTP, S3 and cache modules too), interleaved A B C D A B C D ... after one untimed warm-up
round; each streams every tensor with ``open_stream``, touches it and drops it:

* ``remote``: ``open_stream(url)``, no cache (the bar for the first read);
* ``remote+cache``: ``open_stream(url, cache=DIR)`` into an emptied cache: the first read, which
  also writes and hashes the copy and moves it into place;
* ``local copy``: ``open_stream(path)`` of the cache's copy itself, as a plain local file (the
  bar for the second read);
* ``cache hit``: ``open_stream(url, cache=DIR)`` with the copy in place: one conditional
  request (304), then the copy read as a local file.

With ``--baseline``, the two cache variants run a second time in each round with the stream_st of
another checkout (the commit before a change, say) first on the path: ``remote+cache (base)``
and ``cache hit (base)``, their ratios printed beside this checkout's, on the same machine state.

Printed per link: median seconds, GB/s, CPU seconds of the reading process and its peak RSS
above what it held before the read (``VmHWM``, reset after the imports), per variant; the
paired ratios (per round, the bar's time over the variant's; then the median and the range)
with their targets: first read >= 0.9x ``remote``, second read >= 0.95x ``local copy``, peak
RSS of the first read against ``remote``; the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from netns_store import NetnsStore, StoreUnavailable, check_available  # noqa: E402

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}

CHILD = """
import asyncio, json, resource, sys, time
import stream_st
import stream_st._api, stream_st.transports.cache.resolve, stream_st.transports.http.source
import stream_st.transports.s3.source

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

async def main(source, cache, concurrency):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here: what the read takes
    before = status("VmRSS")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    started = time.perf_counter()
    stream = stream_st.open_stream(source, cache=cache or None, concurrency=concurrency or None)
    touched = 0.0
    name = None
    async for _, array in stream:
        name = name or stream.source.name
        touched += float(array.reshape(-1)[::1024].sum())
        del array
    seconds = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "seconds": seconds,
        "cpu": usage.ru_utime + usage.ru_stime - cpu,
        "peak": status("VmHWM") - before,
        "state": getattr(stream, "cache_state", None),
        "name": name,
        "touched": touched,
    }))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""

SERVER = """
import mmap, sys
from tests.servers.http_server import RangeHTTPServer
with open(sys.argv[1], "rb") as f:
    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
server = RangeHTTPServer(objects={"/model.safetensors": data}, etag="strong").start()
print(server.port, flush=True)
sys.stdin.read()
server.stop()
"""

METRICS = ("seconds", "cpu", "peak")


def write_file(path: Path, size_mib: int) -> None:
    import numpy as np

    import stream_st.numpy

    count = max(1, size_mib // 32)
    rng = np.random.default_rng(0)
    tensors = {f"w{i}": rng.random((2048, 4096), dtype=np.float32) for i in range(count)}
    stream_st.numpy.save_file(tensors, str(path))


def run_child(
    source: str, cache: str, concurrency: int, env: dict[str, str], root: Path = ROOT
) -> dict[str, Any]:
    """One read in a fresh process, with the stream_st of the checkout at ``root``."""
    environment = {**os.environ, **env, "PYTHONPATH": str(root)}
    environment.pop("HF_HUB_OFFLINE", None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, source, cache, str(concurrency)],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
        cwd=root,  # '-c' puts the working directory first on the path, before PYTHONPATH
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@contextlib.contextmanager
def loopback(path: Path) -> Iterator[tuple[str, int, dict[str, str]]]:
    """The test suite's HTTP server over ``path``: the URL, concurrency 0 (the default), no
    environment."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert server.stdout is not None
        yield f"http://127.0.0.1:{int(server.stdout.readline())}/model.safetensors", 0, {}
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=10)


@contextlib.contextmanager
def store(path: Path, concurrency: int) -> Iterator[tuple[str, int, dict[str, str]]]:
    """``path`` as ``s3://bench/model.safetensors`` behind the shaped link."""
    check_available()
    root = path.parent / "store"
    (root / "bench").mkdir(parents=True, exist_ok=True)
    os.link(path, root / "bench" / path.name)
    with NetnsStore(root) as endpoint:
        print(f"endpoint: {endpoint.describe()}; concurrency {concurrency}")
        yield (
            "s3://bench/model.safetensors",
            concurrency,
            {
                **CREDENTIALS,
                "AWS_ENDPOINT_URL": endpoint.endpoint,
            },
        )


def measure(
    link: str,
    url: str,
    concurrency: int,
    env: dict[str, str],
    scratch: Path,
    size: int,
    repeat: int,
    baseline: Path | None,
) -> None:
    cold, warm = scratch / f"{link}-cold", scratch / f"{link}-warm"
    run_child(url, str(warm), concurrency, env)  # the copy the hits read
    copy = run_child(url, str(warm), concurrency, env)["name"]  # its path, as a hit reads it
    assert Path(copy).is_file(), copy
    variants = {
        "remote": (url, "", ROOT),
        "remote+cache": (url, str(cold), ROOT),
        "local copy": (str(copy), "", ROOT),
        "cache hit": (url, str(warm), ROOT),
    }
    if baseline is not None:
        variants["remote+cache (base)"] = (url, str(cold), baseline.resolve())
        variants["cache hit (base)"] = (url, str(warm), baseline.resolve())
    print(f"\n{link}: {url}; file {size / 1e6:.0f} MB, {repeat} rounds, a fresh process per run")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results: dict[str, dict[str, list[float]]] = {
        name: {metric: [] for metric in METRICS} for name in variants
    }
    for round_ in range(repeat + 1):
        for name, (source, cache, root) in variants.items():
            if cache == str(cold):
                shutil.rmtree(cold, ignore_errors=True)
            result = run_child(source, cache, concurrency, env, root)
            expected = {"remote+cache": "fetch", "cache hit": "hit"}.get(
                name.removesuffix(" (base)")
            )
            assert result["state"] == expected, (name, result["state"])
            if round_ == 0:
                continue  # warm-up
            for metric in METRICS:
                results[name][metric].append(float(result[metric]))
    print(f"{'variant':19} {'median s':>9} {'GB/s':>6} {'CPU s':>6} {'peak RSS MB':>12}")
    for name in variants:
        seconds, cpu, peak = (statistics.median(results[name][m]) for m in METRICS)
        print(f"{name:19} {seconds:9.3f} {size / seconds / 1e9:6.2f} {cpu:6.3f} {peak / 1e6:12.0f}")

    def paired(bar: str, variant: str, target: float, what: str) -> None:
        ratios = [
            b / v for b, v in zip(results[bar]["seconds"], results[variant]["seconds"], strict=True)
        ]
        median = statistics.median(ratios)
        print(
            f"{what}: {median:.3f}x (range {min(ratios):.2f}-{max(ratios):.2f}; target >= "
            f"{target}x) {'PASS' if median >= target else 'MISS'}"
        )

    paired("remote", "remote+cache", 0.9, "first read, cache= over none")
    paired("local copy", "cache hit", 0.95, "second read, cache hit over a local read of the copy")
    if baseline is not None:
        paired("remote", "remote+cache (base)", 0.9, "the same, base: first read")
        paired("local copy", "cache hit (base)", 0.95, "the same, base: second read")
    memory = statistics.median(results["remote+cache"]["peak"]) / statistics.median(
        results["remote"]["peak"]
    )
    print(f"peak RSS, first read with cache= over none: {memory:.3f}x")
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--links", default="loopback,store")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another checkout, for its cache variants"
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        path = scratch / "model.safetensors"
        write_file(path, args.size_mib)
        size = path.stat().st_size
        for link in args.links.split(","):
            endpoint = loopback(path) if link == "loopback" else store(path, args.concurrency)
            try:
                with endpoint as (url, concurrency, env):
                    measure(link, url, concurrency, env, scratch, size, args.repeat, args.baseline)
            except StoreUnavailable as exc:
                print(f"\n{link}: skipped: {exc}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

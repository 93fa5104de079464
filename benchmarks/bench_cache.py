"""What ``cache=`` costs on a first read and gives on the next one, over loopback HTTP.

Run it from the repository root (about a minute on 2 cores; ~3x ``--size-mib`` of disk)::

    python benchmarks/bench_cache.py [--size-mib 256] [--repeat 5] [--dir DIR]

The file: ``--size-mib`` of 32 MiB F32 tensors. The server: the test suite's HTTP server
(Range, strong ETags, ``If-None-Match``) in its own process. Four variants, each run in a fresh
process (imports done before the clock starts, the HTTP and cache modules too), interleaved
A B C D A B C D ... after one untimed warm-up round; each streams every tensor with
``open_stream``, touches it and drops it:

* ``http``: ``open_stream(url)``, no cache (the bar for the first read);
* ``http+cache``: ``open_stream(url, cache=DIR)`` into an emptied cache: the first read, which
  also writes and hashes the copy and moves it into place;
* ``local``: ``open_stream(path)`` of the same file, from the page cache (the bar for the
  second read);
* ``http+cache hit``: ``open_stream(url, cache=DIR)`` with the copy in place: one conditional
  request (304), then the copy read as a local file.

Printed: median seconds and GB/s per variant, each child's peak RSS (``ru_maxrss``) median, and
the paired ratios (per round, the bar's time over the variant's; then the median) with their
targets: first read >= 0.9x ``http``, second read >= 0.95x ``local``; the load average before
and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import asyncio, json, resource, sys, time
import stream_st
import stream_st._api, stream_st.transports.cache.resolve, stream_st.transports.http.source

async def main(source, cache):
    started = time.perf_counter()
    stream = stream_st.open_stream(source, cache=cache or None)
    touched = 0.0
    async for _, array in stream:
        touched += float(array.reshape(-1)[::1024].sum())
        del array
    seconds = time.perf_counter() - started
    state = getattr(stream, "cache_state", None)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "rss": rss, "state": state, "touched": touched}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
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


def write_file(path: Path, size_mib: int) -> None:
    import numpy as np

    import stream_st.numpy

    count = max(1, size_mib // 32)
    rng = np.random.default_rng(0)
    tensors = {f"w{i}": rng.random((2048, 4096), dtype=np.float32) for i in range(count)}
    stream_st.numpy.save_file(tensors, str(path))


def run_child(source: str, cache: str) -> dict[str, float | str | None]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_OFFLINE", None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, source, cache],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result: dict[str, float | str | None] = json.loads(out.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(dir=args.dir))
    server = None
    try:
        path = scratch / "model.safetensors"
        write_file(path, args.size_mib)
        size = path.stat().st_size
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}/model.safetensors"
        cold, warm = scratch / "cold", scratch / "warm"
        run_child(url, str(warm))  # the copy the hits read
        variants = {
            "http": (url, ""),
            "http+cache": (url, str(cold)),
            "local": (str(path), ""),
            "http+cache hit": (url, str(warm)),
        }
        print(f"file: {size / 1e6:.0f} MB, {args.repeat} rounds, one fresh process per run")
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        times: dict[str, list[float]] = {name: [] for name in variants}
        rss: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(args.repeat + 1):
            for name, (source, cache) in variants.items():
                if name == "http+cache":
                    shutil.rmtree(cold, ignore_errors=True)
                result = run_child(source, cache)
                expected = {"http+cache": "fetch", "http+cache hit": "hit"}.get(name)
                assert result["state"] == expected, (name, result["state"])
                if round_ == 0:
                    continue  # warm-up
                times[name].append(float(result["seconds"] or 0))
                rss[name].append(float(result["rss"] or 0))
        print(f"{'variant':16} {'median s':>9} {'GB/s':>6} {'peak RSS MB':>12}")
        for name in variants:
            median = statistics.median(times[name])
            peak = statistics.median(rss[name]) / 1e6
            print(f"{name:16} {median:9.3f} {size / median / 1e9:6.2f} {peak:12.0f}")

        def paired(bar: str, variant: str) -> float:
            return statistics.median(b / v for b, v in zip(times[bar], times[variant], strict=True))

        first = paired("http", "http+cache")
        second = paired("local", "http+cache hit")
        memory = statistics.median(rss["http+cache"]) / statistics.median(rss["http"])
        print(
            f"first read, cache= over none: {first:.3f}x (target >= 0.9x) "
            f"{'PASS' if first >= 0.9 else 'MISS'}"
        )
        print(
            f"second read, cache hit over a local read: {second:.3f}x (target >= 0.95x) "
            f"{'PASS' if second >= 0.95 else 'MISS'}"
        )
        print(f"peak RSS, first read with cache= over none: {memory:.3f}x")
        print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if server is not None:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(timeout=10)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

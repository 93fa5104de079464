"""Serving throughput on loopback: ``stream-st serve`` against nginx serving the same file.

Run it from the repository root (about 2 minutes on 2 cores; 1 GiB of disk)::

    PYTHONPATH=. python benchmarks/bench_serve.py [--size-mib 1024] [--repeat 5] [--replicas 4]
        [--libraries] [--dir DIR]

The file: ``--size-mib`` of 32 MiB F32 tensors (``bench_read.big_file``), read once before the
first round so that every server sends it from the page cache. Every server runs in its own
process on 127.0.0.1:

* ``nginx``: the system's nginx as the tests run it (one worker), with ``sendfile on`` (its
  zero-copy path, what a deployment turns on);
* ``serve``: ``stream-st serve FILE``;
* with ``--libraries``, the two server libraries ``stream-st serve`` was chosen from, each
  serving the file in the smallest way it allows: ``aiohttp`` (``web.FileResponse``, which sends
  with ``sendfile``) and ``uvicorn`` (with ``httptools``; an ASGI app sending 4 MiB ``preadv``
  chunks: uvicorn has no zero-copy send).

Two measurements, each in interleaved rounds (A B C A B C ...) after one untimed warm-up:

* one client: ``curl -o /dev/null`` fetching the whole file, wall time per fetch;
* ``--replicas`` clients at once, each a fresh Python process streaming the whole object through
  ``stream_st.open_stream`` (every tensor checked against its header size, then dropped), all
  started and ready (stream_st imported, the header read once) before the word go: the wall
  time from go until the last one is done, GB/s = replicas x size / time; nginx and ``serve``
  only. On 2 cores the clients' own work (receiving 4 x the file into fresh arrays) bounds this
  one more than the server does.

Printed: median seconds and GB/s per server, and the paired ratio to nginx (per round, nginx's
time over the server's, then median and range), with the target ``serve >= 0.9x nginx``, and
the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench_read import big_file, ensure_file

from tests.servers.daemon import Daemon, find_program
from tests.servers.nginx_server import NginxServer

TARGET = 0.9
"""``stream-st serve`` aims at this fraction of nginx's throughput (or more)."""

NAME = "model.safetensors"
"""The path every server serves the file at."""

AIOHTTP_APP = """
import sys
from aiohttp import web
path, port = sys.argv[1], int(sys.argv[2])
async def handler(request):
    return web.FileResponse(path)
app = web.Application()
app.router.add_get("/model.safetensors", handler)
web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
"""

UVICORN_APP = """
import os, sys
import uvicorn
path, port = sys.argv[1], int(sys.argv[2])
CHUNK = 4 << 20
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        headers = [(b"content-length", str(size).encode()),
                   (b"content-type", b"application/octet-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        buffer = bytearray(CHUNK)
        offset = 0
        while offset < size:
            count = os.preadv(fd, [memoryview(buffer)[: min(CHUNK, size - offset)]], offset)
            offset += count
            await send({"type": "http.response.body", "body": bytes(buffer[:count]),
                        "more_body": offset < size})
    finally:
        os.close(fd)
uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", log_level="warning",
            access_log=False, lifespan="off")
"""


class Nginx(NginxServer):
    """The tests' nginx (``tests.servers.nginx_server``) with ``sendfile on``."""

    def configure(self, ports: list[int]) -> list[str]:
        arguments = super().configure(ports)
        conf = self.folder / "nginx.conf"
        conf.write_text(conf.read_text().replace("http {", "http {\n    sendfile on;", 1))
        return arguments


class PythonServer(Daemon):
    """A Python server program: ``python -c CODE FILE PORT``, or ``stream-st serve``."""

    program = sys.executable

    def __init__(self, folder: Path, arguments: Callable[[int], list[str]]) -> None:
        super().__init__(folder)
        self.arguments = arguments

    def configure(self, ports: list[int]) -> list[str]:
        return self.arguments(ports[0])


def servers(path: Path, folder: Path, libraries: bool) -> dict[str, Daemon]:
    """The servers to measure, by label, not started."""
    (folder / "nginx").mkdir()
    found: dict[str, Daemon] = {"nginx": Nginx(path.parent, folder / "nginx")}

    def command(port: int) -> list[str]:
        return ["-m", "stream_st.cli", "serve", str(path), "--port", str(port)]

    found["serve"] = PythonServer(folder, command)
    if libraries:
        for label, code in (("aiohttp", AIOHTTP_APP), ("uvicorn", UVICORN_APP)):
            found[label] = PythonServer(folder, partial(_app, code, path))
    return found


def _app(code: str, path: Path, port: int) -> list[str]:
    """The arguments that run the server program ``code`` on ``path`` and ``port``."""
    return ["-c", code, str(path), str(port)]


def curl_fetch(url: str, size: int) -> float:
    """Seconds ``curl`` takes to fetch ``url`` whole (checked to be ``size`` bytes)."""
    start = time.perf_counter()
    done = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{size_download}", url],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - start
    if int(done.stdout) != size:
        raise RuntimeError(f"{url}: curl fetched {done.stdout} bytes, not {size}")
    return seconds


REPLICA = """
import sys, anyio, stream_st
async def main(url):
    count = 0
    async with stream_st.open_stream(url) as stream:
        async for name, array in stream:
            if array.nbytes != stream.header[name].nbytes:
                raise SystemExit(f"{name}: {array.nbytes} bytes")
            count += 1
    print(count, flush=True)
anyio.run(stream_st.read_header, sys.argv[1])  # every module the read needs, imported now
print("ready", flush=True)
sys.stdin.readline()
anyio.run(main, sys.argv[1])
"""


def replicas_fetch(url: str, replicas: int, tensors: int) -> float:
    """Seconds ``replicas`` fresh processes, started and ready (the header read once), take from
    the word go until the last one has streamed every tensor of ``url``."""
    children = [
        subprocess.Popen(
            [sys.executable, "-c", REPLICA, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(replicas)
    ]
    for child in children:
        assert child.stdout is not None
        if child.stdout.readline() != "ready\n":
            raise RuntimeError("a replica did not start")
    start = time.perf_counter()
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    outputs = [child.communicate()[0] for child in children]
    seconds = time.perf_counter() - start
    for child, output in zip(children, outputs, strict=True):
        if child.returncode or int(output) != tensors:
            raise RuntimeError(f"a replica failed ({child.returncode}): {output!r}")
    return seconds


def report(title: str, times: dict[str, list[float]], size: int) -> list[str]:
    """Print the table of one measurement; the target lines for the summary."""
    print(f"\n{title}")
    print(f"  {'server':<10} {'median s':>9} {'GB/s':>7} {'vs nginx (paired)':>30}")
    summary = []
    base = times["nginx"]
    for label, seconds in times.items():
        median = statistics.median(seconds)
        ratios = [b / s for b, s in zip(base, seconds, strict=True)]
        paired = (
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
            if label != "nginx"
            else ""
        )
        print(f"  {label:<10} {median:>9.3f} {size / median / 1e9:>7.2f} {paired:>30}")
        if label == "serve":
            ratio = statistics.median(ratios)
            verdict = "PASS" if ratio >= TARGET else "MISS"
            summary.append(f"{title}: serve {ratio:.2f}x nginx (target >= {TARGET}x) {verdict}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--libraries", action="store_true", help="also aiohttp and uvicorn alone")
    parser.add_argument("--dir", type=Path, help="keep the file here (default: a temporary one)")
    args = parser.parse_args()
    for program in ("nginx", "curl"):
        if find_program(program) is None:
            print(f"skipped: {program} is not installed")
            return
    # The servers and replicas run with this checkout's stream_st, whatever the working folder.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
    )
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    try:
        folder = args.dir or work
        folder.mkdir(parents=True, exist_ok=True)
        spec = big_file("serve", args.size_mib)
        path = ensure_file(folder, spec)
        if path.name != NAME:
            os.replace(path, folder / NAME)
            path = folder / NAME
        size = path.stat().st_size
        with path.open("rb") as f:  # into the page cache
            while f.read(64 << 20):
                pass
        print(f"file: {spec.description}, {size / 2**30:.2f} GiB")
        running = servers(path, work, args.libraries)
        try:  # those started are stopped, also when a later one fails to start
            for server in running.values():
                server.start()
            urls = {label: f"http://127.0.0.1:{s.port}/{NAME}" for label, s in running.items()}
            one: dict[str, list[float]] = {label: [] for label in urls}
            many: dict[str, list[float]] = {label: [] for label in ("nginx", "serve")}
            for round_ in range(args.repeat + 1):
                for label, url in urls.items():
                    seconds = curl_fetch(url, size)
                    if round_:
                        one[label].append(seconds)
                for label in many:
                    seconds = replicas_fetch(urls[label], args.replicas, len(spec.tensors))
                    if round_:
                        many[label].append(seconds)
            summary = report("one client (curl -o /dev/null)", one, size)
            summary += report(
                f"{args.replicas} replicas at once (open_stream, fresh processes)",
                many,
                args.replicas * size,
            )
        finally:
            for server in running.values():
                server.stop()
        print()
        for line in summary:
            print(line)
    finally:  # the servers' folders, and the file unless --dir keeps it
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

"""Network read throughput of ``stream_st.open_stream`` on loopback: TCP, HTTP, S3, parallel ranges.

Run it from the repository root (about 4 minutes on 2 cores; ~3 GiB of disk, ~4 GiB of RAM)::

    python benchmarks/bench_network.py [--repeat 7] [--kv-repeat 21] [--warmup 1]
        [--size-mib 2048] [--s3-size-mib 512] [--ranged-size-mib 512]
        [--parallel 8x8,8x16,16x8,16x4]
        [--rss-parallel 8x16,16x8] [--dir DIR] [--skip-tcp] [--skip-http] [--skip-s3]
        [--skip-ranged] [--skip-rss] [--skip-kv] [--skip-big]

Files (written to a temporary directory, deleted at the end; kept and reused with ``--dir``):

* ``big``: ``--size-mib`` of 32 MiB F32 tensors [2048, 4096] (default 2 GiB, 64 tensors), for
  TCP and HTTP;
* ``kv``: a TinyLlama KV cache, 22 layers x (key, value) [1, 4, 2048, 64] F16 (44 MiB, 1 MiB each),
  everywhere;
* the S3 object and the shaped-server file are built like ``big`` with ``--s3-size-mib`` and
  ``--ranged-size-mib`` (default 512 MiB each, labelled ``big`` too: moto keeps every object in
  memory and serves ~0.7 GB/s, so 2 GiB there costs ~16 s to upload, ~4.4 GiB of RSS in the moto
  process and ~3 s a read; one 200 MB/s stream takes ~2.7 s for 512 MiB).

Every server runs in its own process, never in the measured one (no shared GIL):

* TCP: a child of this script (``--tcp-sender FILE``) accepts one connection at a time and sends
  the file with ``socket.sendfile`` (zero-copy), then closes;
* HTTP: ``python -m tests.servers.http_server FILE`` (threaded, Range-capable);
* S3: moto's server (``tests.servers.s3_server.MotoS3Server``), both files uploaded once with boto3;
* parallel ranges: ``python -m tests.servers.http_server FILE --latency 0.03 --rate 200e6``: 30 ms
  before the first byte of every response and 200 MB/s per connection, an object store's profile.

Variants run interleaved (A B C A B C ...) after ``--warmup`` untimed rounds (default 1), all in one
``anyio.run`` (asyncio backend); synchronous variants run on the same thread. Each variant builds
a fresh array per tensor, "touches" it (sums byte 0 of every 4 KiB page) and drops it; the touches
and the order of the names are checked against the file on every round. Clients that hand out
chunks (aiohttp, httpx, urllib3, boto3 ``read``, obstore ``stream``) have each chunk copied into
the arrays; clients with ``readinto`` read into them (boto3's and aiobotocore's ``readinto`` copy
internally). Each table gives median seconds, GB/s (file bytes / median) and the median CPU
seconds of this process (all its threads: obstore's runtime too; the servers' CPU is not counted).
Ratios are speed over speed, paired (per round, the bar's time over the variant's, then the
median; the ratio of the medians beside it), with target and PASS/MISS:

* TCP ``open_stream("tcp://...")`` >= 0.95x a blocking ``recv_into`` loop of the same bytes;
* HTTP ``open_stream("http://...")`` >= 0.8x a blocking raw-socket HTTP/1.1 client (one GET);
  aiohttp, httpx, urllib3 (boto3's transport) and obstore's ``HTTPStore`` (the Rust client behind
  its ``S3Store``) read the same body for the record: each client's ceiling without moto;
* S3 ``open_stream(S3Source)`` >= 0.9x one boto3 ``get_object``, both with ``Body.readinto``
  (``b3i``) and ``Body.read(1 MiB)`` (``b3r``); aiobotocore and obstore (``get`` streamed, and
  ``get_range``: the first 64 KiB then the rest, S3Source's request pattern) on the same object.
  moto answers every GET, ranged or not, by copying the whole object, so on moto each extra
  request costs a full read of the object: this is why ranged patterns look slow there;
* parallel ranges: ``HttpSource(url, concurrency=K, part_size=M)`` >= 3x ``HttpSource(url)`` on
  the shaped server, tensors still in offset order (checked); and, in a fresh subprocess
  (``--rss-child``), the peak RSS (``VmHWM``) of the parallel read above its baseline stays
  under largest tensor + K x M + 64 MiB.

A summary of every target is printed at the end. aiohttp, httpx, aiobotocore and obstore are
optional (``pip install aiohttp httpx aiobotocore obstore``): a missing one is skipped with a
note. They are imported through ``importlib`` so the type check does not depend on them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, BinaryIO

import anyio
import anyio.lowlevel
import numpy as np
from bench_read import KV, NUMPY_DTYPES, BenchFile, Touches, big_file, ensure_file, touch

import stream_st
from stream_st.transports.http.source import HttpSource

SCRIPT = str(Path(__file__).resolve())
REPO = Path(SCRIPT).parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for tests.servers.s3_server

MiB = 1 << 20
CHUNK = 1 * MiB
RSS_SLACK = 64 * MiB
BUCKET = "bench"
SHAPED_LATENCY = 0.03
SHAPED_RATE = 200e6
FIRST = 64 << 10  # what HttpSource asks for first
DEFAULT_PARALLEL = ((8, 8 * MiB), (8, 16 * MiB), (16, 8 * MiB), (16, 4 * MiB))
DEFAULT_RSS_PARALLEL = ((8, 16 * MiB), (16, 8 * MiB))


def optional(module: str) -> Any | None:
    """``module`` if it is installed, else None (the variants that need it are skipped)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int  # relative to the data section
    end: int


def parse_entries(raw: bytes | bytearray | memoryview) -> list[Entry]:
    """The tensors of a JSON header, in offset order (what a hand-written client does)."""
    header: dict[str, Any] = json.loads(bytes(raw))
    header.pop("__metadata__", None)
    entries = [
        Entry(name, NUMPY_DTYPES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
        for name, v in header.items()
    ]
    return sorted(entries, key=lambda e: e.start)


@dataclass(frozen=True)
class Prepared:
    """A bench file on disk: what every variant must deliver, and its layout."""

    spec: BenchFile
    path: Path
    size: int
    data_start: int
    entries: tuple[Entry, ...]
    expected: tuple[tuple[str, int], ...]  # (name, touch) in offset order

    @classmethod
    def load(cls, spec: BenchFile, path: Path) -> Prepared:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            entries = parse_entries(f.read(n))
        data = np.memmap(path, dtype=np.uint8, mode="r")
        base = 8 + n
        expected = tuple((e.name, touch(data[base + e.start : base + e.end])) for e in entries)
        del data
        return cls(spec, path, path.stat().st_size, base, tuple(entries), expected)


# --------------------------------------------------------------------------- shared readers


def _fill_blocking(readinto: Callable[[memoryview], int], view: memoryview) -> None:
    filled = 0
    while filled < len(view):
        got = readinto(view[filled:])
        if not got:
            raise RuntimeError(f"the body ended {len(view) - filled} bytes early")
        filled += got


def read_arrays_blocking(readinto: Callable[[memoryview], int]) -> Touches:
    """A safetensors body read with ``readinto`` straight into a fresh array per tensor."""
    prefix = bytearray(8)
    _fill_blocking(readinto, memoryview(prefix))
    raw = bytearray(int.from_bytes(prefix, "little"))
    _fill_blocking(readinto, memoryview(raw))
    touches: Touches = {}
    position = 0
    for e in parse_entries(raw):
        if e.start != position:
            raise RuntimeError("the bench files have no gaps")
        flat = np.empty(e.end - e.start, dtype=np.uint8)
        _fill_blocking(readinto, flat.data)
        touches[e.name] = touch(flat.view(e.dtype).reshape(e.shape))
        del flat
        position = e.end
    return touches


async def read_arrays_async(readinto: Callable[[memoryview], Awaitable[int]]) -> Touches:
    """:func:`read_arrays_blocking` with an awaitable ``readinto``."""

    async def fill(view: memoryview) -> None:
        filled = 0
        while filled < len(view):
            got = await readinto(view[filled:])
            if not got:
                raise RuntimeError(f"the body ended {len(view) - filled} bytes early")
            filled += got

    prefix = bytearray(8)
    await fill(memoryview(prefix))
    raw = bytearray(int.from_bytes(prefix, "little"))
    await fill(memoryview(raw))
    touches: Touches = {}
    for e in parse_entries(raw):
        flat = np.empty(e.end - e.start, dtype=np.uint8)
        await fill(flat.data)
        touches[e.name] = touch(flat.view(e.dtype).reshape(e.shape))
        del flat
    return touches


class Assembler:
    """A safetensors body arriving as chunks, copied into a fresh array per tensor."""

    def __init__(self) -> None:
        self.touches: Touches = {}
        self._head = bytearray()
        self._entries: list[Entry] | None = None
        self._index = 0
        self._array: np.ndarray[Any, Any] | None = None
        self._filled = 0

    def feed(self, chunk: memoryview) -> None:
        chunk = chunk.cast("B") if chunk.format != "B" or chunk.ndim != 1 else chunk
        while chunk:
            if self._entries is None:
                need = 8 if len(self._head) < 8 else 8 + int.from_bytes(self._head[:8], "little")
                take = min(len(chunk), need - len(self._head))
                self._head += chunk[:take]
                chunk = chunk[take:]
                if len(self._head) == need and need > 8:
                    self._entries = parse_entries(self._head[8:])
                continue
            if self._array is None:
                if self._index == len(self._entries):
                    raise RuntimeError("bytes after the last tensor")
                e = self._entries[self._index]
                self._array = np.empty(e.end - e.start, dtype=np.uint8)
                self._filled = 0
            dest = self._array.data
            take = min(len(chunk), len(dest) - self._filled)
            dest[self._filled : self._filled + take] = chunk[:take]
            self._filled += take
            chunk = chunk[take:]
            if self._filled == len(dest):
                e = self._entries[self._index]
                self.touches[e.name] = touch(self._array.view(e.dtype).reshape(e.shape))
                self._array = None
                self._index += 1

    def result(self) -> Touches:
        if self._entries is None or self._index != len(self._entries):
            raise RuntimeError("the body ended early")
        return self.touches


async def stream_touches(source: Any) -> Touches:
    """``open_stream(source)``: touch every array in the order yielded, drop it."""
    touches: Touches = {}
    async for name, array in stream_st.open_stream(source):
        touches[name] = touch(array)
        del array
    return touches


# --------------------------------------------------------------------------- child processes


class Child:
    """A server in its own process: prints its port on the first line, serves until stdin
    closes."""

    def __init__(self, args: Sequence[str], what: str) -> None:
        self.what = what
        self.process = subprocess.Popen(
            list(args), cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"{what} did not start: {line!r}")
        self.port = int(line)

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def http_server(path: Path, *extra: str) -> Child:
    return Child(
        [sys.executable, "-m", "tests.servers.http_server", str(path), *extra], "http server"
    )


def tcp_sender_main(path: Path, rate: float | None = None) -> None:
    """``--tcp-sender FILE [--tcp-rate B/S]``: send FILE to every connection, one at a time, then
    close it. With a rate, paced in 64 KiB steps like a link
    (``tests.servers.http_server.Link``)."""
    from tests.servers.http_server import Link

    listener = socket.create_server(("127.0.0.1", 0), backlog=8)

    def send(connection: socket.socket, f: BinaryIO) -> None:
        if rate is None:
            connection.sendfile(f)
            return
        link = Link(rate)
        while piece := f.read(64 << 10):
            link.wait(len(piece))
            connection.sendall(piece)

    def serve() -> None:
        with path.open("rb") as f:
            while True:
                try:
                    connection, _ = listener.accept()
                except OSError:
                    return
                with connection:
                    try:
                        f.seek(0)
                        send(connection, f)
                        connection.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass

    threading.Thread(target=serve, daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    sys.stdin.read()
    listener.close()


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    run: Callable[[], Awaitable[Touches]]


def sync_variant(key: str, label: str, func: Callable[[], Touches]) -> Variant:
    async def run() -> Touches:
        return func()  # on the event loop thread, like every other variant

    return Variant(key, label, run)


@dataclass
class Timings:
    """Per variant key, the wall-clock seconds and this process's CPU seconds of each round."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


async def measure(
    prepared: Prepared, variants: Sequence[Variant], repeat: int, warmup: int
) -> Timings:
    """``warmup`` untimed rounds, then ``repeat`` interleaved timed ones; every round checked."""
    timings = Timings({v.key: [] for v in variants}, {v.key: [] for v in variants})
    for round_index in range(warmup + repeat):
        for variant in variants:
            cpu_started = time.process_time()  # all threads of this process (obstore's too)
            started = time.perf_counter()
            touches = await variant.run()
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu_started
            if tuple(touches.items()) != prepared.expected:
                raise RuntimeError(
                    f"{variant.key} ({variant.label}) delivered other bytes or another order "
                    f"than the file {prepared.path.name}"
                )
            if round_index >= warmup:
                timings.wall[variant.key].append(elapsed)
                timings.cpu[variant.key].append(cpu)
    return timings


@dataclass(frozen=True)
class Ratio:
    variant: str
    bar: str
    target: float | None  # None: for the record only


SUMMARY: list[str] = []
"""One line per ratio with a target, printed again at the end."""


def report(
    title: str,
    prepared: Prepared,
    variants: Sequence[Variant],
    timings: Timings,
    ratios: Sequence[Ratio],
) -> dict[str, float]:
    medians = {key: statistics.median(values) for key, values in timings.wall.items()}
    n = len(next(iter(timings.wall.values())))
    print(
        f"\n== {title}\n   {prepared.spec.label}: {prepared.spec.description}, "
        f"{prepared.size / MiB:.0f} MiB ({n} interleaved rounds, median; cpu: this process)"
    )
    print(f"  {'variant':<58} {'median s':>8} {'GB/s':>6} {'min s':>7} {'max s':>7} {'cpu s':>6}")
    for v in variants:
        values = timings.wall[v.key]
        print(
            f"  {v.key:<5} {v.label:<52} {medians[v.key]:8.4f} "
            f"{prepared.size / medians[v.key] / 1e9:6.2f} {min(values):7.4f} {max(values):7.4f} "
            f"{statistics.median(timings.cpu[v.key]):6.3f}"
        )
    if ratios:
        print(
            "  ratios, speed over speed (paired: per round, the bar's time over the variant's, "
            "then the median; in brackets: median over median):"
        )
    for r in ratios:
        if r.variant not in medians or r.bar not in medians:
            continue
        pairs = zip(timings.wall[r.bar], timings.wall[r.variant], strict=True)
        value = statistics.median(bar / variant for bar, variant in pairs)
        of_medians = f"({medians[r.bar] / medians[r.variant]:.2f})"
        if r.target is None:
            tail = f"{of_medians} (for the record)"
        else:
            verdict = "PASS" if value >= r.target else "MISS"
            tail = f"{of_medians} target >= {r.target:.2f}   {verdict}"
            SUMMARY.append(
                f"  {title.split(' (')[0]:<16} {prepared.spec.label:<7} "
                f"{r.variant + '/' + r.bar:<13} = {value:5.2f}   {tail}"
            )
        print(f"  {r.variant + '/' + r.bar:<13} = {value:5.2f}   {tail}")
    return medians


def note(message: str) -> None:
    print(f"  note: {message}")


# --------------------------------------------------------------------------- TCP


def tcp_variants(port: int) -> list[Variant]:
    def raw() -> Touches:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return read_arrays_blocking(sock.recv_into)

    async def ours() -> Touches:
        return await stream_touches(f"tcp://127.0.0.1:{port}")

    return [
        sync_variant("raw", "blocking socket, recv_into each fresh array", raw),
        Variant("st", 'open_stream("tcp://127.0.0.1:PORT")', ours),
    ]


async def bench_tcp(files: Sequence[tuple[Prepared, int]], warmup: int) -> None:
    for prepared, repeat in files:
        with Child(
            [sys.executable, SCRIPT, "--tcp-sender", str(prepared.path)],
            "tcp sender",
        ) as sender:
            variants = tcp_variants(sender.port)
            timings = await measure(prepared, variants, repeat, warmup)
        report(
            "TCP (sender: socket.sendfile)", prepared, variants, timings, [Ratio("st", "raw", 0.95)]
        )


# --------------------------------------------------------------------------- HTTP


def raw_http_get(host: str, port: int, path: str) -> Touches:
    """A blocking HTTP/1.1 client: one GET, the head parsed by hand, the body by ``recv_into``."""
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
        sock.sendall(request.encode("latin-1"))
        head = bytearray()
        while (end := head.find(b"\r\n\r\n")) < 0:
            more = sock.recv(65536)
            if not more:
                raise RuntimeError("connection closed before the response head")
            head += more
        status_line, *lines = head[:end].decode("latin-1").split("\r\n")
        if status_line.split(" ")[1] != "200":
            raise RuntimeError(f"unexpected answer {status_line!r}")
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        remaining = int(fields["content-length"])
        leftover = memoryview(bytes(head[end + 4 :]))

        def readinto(view: memoryview) -> int:
            nonlocal leftover, remaining
            if leftover:
                count = min(len(view), len(leftover))
                view[:count] = leftover[:count]
                leftover = leftover[count:]
            else:
                count = sock.recv_into(view[:remaining])
            remaining -= count
            return count

        touches = read_arrays_blocking(readinto)
        if remaining:
            raise RuntimeError(f"{remaining} body bytes left over")
        return touches


def http_variants(url: str, port: int, path: str) -> list[Variant]:
    variants = [
        sync_variant(
            "raw",
            "raw-socket HTTP/1.1 client, recv_into",
            lambda: raw_http_get("127.0.0.1", port, path),
        ),
        Variant("st", "open_stream(url)", lambda: stream_touches(url)),
    ]
    aiohttp = optional("aiohttp")
    if aiohttp is not None:

        async def via_aiohttp() -> Touches:
            assembler = Assembler()
            async with aiohttp.ClientSession() as session, session.get(url) as response:
                response.raise_for_status()
                async for chunk in response.content.iter_any():
                    assembler.feed(memoryview(chunk))
            return assembler.result()

        variants.append(Variant("aio", "aiohttp, content.iter_any() copied", via_aiohttp))
    else:
        note("aiohttp is not installed: its variant is skipped")
    httpx = optional("httpx")
    if httpx is not None:

        async def via_httpx() -> Touches:
            assembler = Assembler()
            async with httpx.AsyncClient() as client, client.stream("GET", url) as response:
                response.raise_for_status()
                async for chunk in response.aiter_raw():
                    assembler.feed(memoryview(chunk))
            return assembler.result()

        variants.append(Variant("htx", "httpx AsyncClient.stream, aiter_raw() copied", via_httpx))
    else:
        note("httpx is not installed: its variant is skipped")
    urllib3 = optional("urllib3")
    if urllib3 is not None:
        pool = urllib3.PoolManager()

        def via_urllib3() -> Touches:
            response = pool.request("GET", url, preload_content=False)
            assembler = Assembler()
            while chunk := response.read(CHUNK):
                assembler.feed(memoryview(chunk))
            response.release_conn()
            return assembler.result()

        variants.append(
            sync_variant("u3", "urllib3 (boto3's transport), read(1 MiB) copied", via_urllib3)
        )
    obstore, obstore_store = optional("obstore"), optional("obstore.store")
    if obstore is not None and obstore_store is not None:
        base, _, name = url.rpartition("/")
        store = obstore_store.HTTPStore.from_url(base + "/", client_options={"allow_http": True})

        async def via_obstore() -> Touches:
            result = await obstore.get_async(store, name)
            assembler = Assembler()
            async for buffer in result.stream(min_chunk_size=CHUNK):
                assembler.feed(memoryview(buffer))
            return assembler.result()

        variants.append(
            Variant("obs", "obstore HTTPStore get_async, stream(1 MiB) copied", via_obstore)
        )
    else:
        note("obstore is not installed: its variant is skipped")
    return variants


async def bench_http(files: Sequence[tuple[Prepared, int]], warmup: int) -> None:
    for prepared, repeat in files:
        with http_server(prepared.path) as server:
            path = "/" + prepared.path.name
            variants = http_variants(f"http://127.0.0.1:{server.port}{path}", server.port, path)
            timings = await measure(prepared, variants, repeat, warmup)
        ratios = [Ratio("st", "raw", 0.8)] + [
            Ratio(v.key, "raw", None) for v in variants if v.key not in ("st", "raw")
        ]
        report("HTTP (tests.servers.http_server)", prepared, variants, timings, ratios)


# --------------------------------------------------------------------------- S3


def s3_variants(
    endpoint: str,
    credentials: dict[str, str],
    key: str,
    size: int,
    stack: contextlib.AsyncExitStack,
) -> Callable[[], Awaitable[list[Variant]]]:
    """The S3 clients, each created once (as an application would) and reused every round."""
    from stream_st.transports.s3.config import S3Config
    from stream_st.transports.s3.source import S3Source

    region = credentials["AWS_DEFAULT_REGION"]
    access = credentials["AWS_ACCESS_KEY_ID"]
    secret = credentials["AWS_SECRET_ACCESS_KEY"]
    config = S3Config.resolve(
        endpoint_url=endpoint, region=region, access_key_id=access, secret_access_key=secret
    )

    async def build() -> list[Variant]:
        import boto3

        boto = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            aws_access_key_id=access,
            aws_secret_access_key=secret,
        )

        async def ours() -> Touches:
            return await stream_touches(S3Source(f"s3://{BUCKET}/{key}", config=config))

        def boto_readinto() -> Touches:
            body = boto.get_object(Bucket=BUCKET, Key=key)["Body"]
            try:
                return read_arrays_blocking(body.readinto)
            finally:
                body.close()

        def boto_read() -> Touches:
            body = boto.get_object(Bucket=BUCKET, Key=key)["Body"]
            assembler = Assembler()
            while chunk := body.read(CHUNK):
                assembler.feed(memoryview(chunk))
            body.close()
            return assembler.result()

        variants = [
            sync_variant("b3i", "boto3 get_object, Body.readinto each array", boto_readinto),
            Variant("st", "open_stream(S3Source) (our HTTP client + SigV4)", ours),
            sync_variant("b3r", "boto3 get_object, Body.read(1 MiB) copied", boto_read),
        ]

        aiobotocore_session = optional("aiobotocore.session")
        if aiobotocore_session is not None:
            aio = await stack.enter_async_context(
                aiobotocore_session.get_session().create_client(
                    "s3",
                    endpoint_url=endpoint,
                    region_name=region,
                    aws_access_key_id=access,
                    aws_secret_access_key=secret,
                )
            )

            async def via_aiobotocore() -> Touches:
                response = await aio.get_object(Bucket=BUCKET, Key=key)
                async with response["Body"] as body:
                    return await read_arrays_async(body.readinto)

            variants.append(
                Variant("abc", "aiobotocore get_object, Body.readinto each array", via_aiobotocore)
            )
        else:
            note("aiobotocore is not installed: its variant is skipped")

        obstore = optional("obstore")
        obstore_store = optional("obstore.store")
        if obstore is not None and obstore_store is not None:
            store = obstore_store.S3Store(
                BUCKET,
                endpoint=endpoint,
                region=region,
                access_key_id=access,
                secret_access_key=secret,
                client_options={"allow_http": True},
            )

            def obstore_get(min_chunk: int) -> Callable[[], Awaitable[Touches]]:
                async def run() -> Touches:
                    result = await obstore.get_async(store, key)
                    assembler = Assembler()
                    async for buffer in result.stream(min_chunk_size=min_chunk):
                        assembler.feed(memoryview(buffer))
                    return assembler.result()

                return run

            async def obstore_ranges() -> Touches:
                # The request pattern of S3Source: the first 64 KiB, then the rest in one range.
                first = memoryview(await obstore.get_range_async(store, key, start=0, length=FIRST))
                n = int.from_bytes(first[:8], "little")
                entries = parse_entries(first[8 : 8 + n])
                rest = await obstore.get_range_async(store, key, start=FIRST, end=size)
                data = np.concatenate(  # the tensors start inside the first range
                    [np.frombuffer(first[8 + n :], np.uint8), np.frombuffer(rest, np.uint8)]
                )
                touches: Touches = {}
                for e in entries:
                    array = data[e.start : e.end].view(e.dtype).reshape(e.shape)
                    touches[e.name] = touch(array)
                    del array
                return touches

            variants += [
                Variant(
                    "obs", "obstore get_async, stream(1 MiB chunks) copied", obstore_get(CHUNK)
                ),
                Variant(
                    "ob10",
                    "obstore get_async, stream(10 MiB default) copied",
                    obstore_get(10 * MiB),
                ),
                Variant("obr", "obstore get_range_async 64 KiB + rest, one copy", obstore_ranges),
            ]
        else:
            note("obstore is not installed: its variants are skipped")
        return variants

    return build


async def bench_s3(files: Sequence[tuple[Prepared, int]], warmup: int) -> None:
    from tests.servers.s3_server import CREDENTIALS, MotoS3Server

    with MotoS3Server() as s3:
        client = s3.client()
        client.create_bucket(Bucket=BUCKET)
        for prepared, _ in files:
            started = time.perf_counter()
            with prepared.path.open("rb") as f:
                client.put_object(Bucket=BUCKET, Key=prepared.path.name, Body=f)
            print(
                f"\nuploaded {prepared.path.name} ({prepared.size / MiB:.0f} MiB) to moto in "
                f"{time.perf_counter() - started:.1f} s"
            )
        for prepared, repeat in files:
            async with contextlib.AsyncExitStack() as stack:
                build = s3_variants(
                    s3.endpoint_url, CREDENTIALS, prepared.path.name, prepared.size, stack
                )
                variants = await build()
                timings = await measure(prepared, variants, repeat, warmup)
            ratios = [Ratio("st", "b3i", 0.9), Ratio("st", "b3r", 0.9)] + [
                Ratio(v.key, "b3r", None) for v in variants if v.key not in ("st", "b3r")
            ]
            report("S3 (moto server)", prepared, variants, timings, ratios)


# --------------------------------------------------------------------------- parallel ranges


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} B"


def ranged_variants(url: str, configs: Sequence[tuple[int, int]]) -> list[Variant]:
    def make(concurrency: int, part_size: int) -> Callable[[], Awaitable[Touches]]:
        async def run() -> Touches:
            return await stream_touches(
                HttpSource(url, concurrency=concurrency, part_size=part_size)
            )

        return run

    variants = [Variant("one", "HttpSource(url): one stream", make(1, 8 * MiB))]
    for k, m in configs:
        variants.append(
            Variant(
                f"k{k}m{m // MiB}",
                f"HttpSource(url, concurrency={k}, part_size={size_label(m)})",
                make(k, m),
            )
        )
    return variants


def rss_child_main(url: str, concurrency: int, part_size: int) -> None:
    """``--rss-child URL K M``: stream ``url`` in a fresh process; print peak RSS as JSON."""

    async def noop() -> None:
        await anyio.lowlevel.checkpoint()

    anyio.run(noop)  # import the asyncio backend before the baseline
    reset = True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        reset = False
    baseline = _status_kib("VmRSS")
    touches = anyio.run(
        stream_touches, HttpSource(url, concurrency=concurrency, part_size=part_size)
    )
    result = {
        "baseline_kib": baseline,
        "hwm_kib": _status_kib("VmHWM"),
        "reset": reset,
        "tensors": len(touches),
    }
    print(json.dumps(result))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_rss(prepared: Prepared, url: str, concurrency: int, part_size: int) -> None:
    out = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--rss-child",
            url,
            str(concurrency),
            str(part_size),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if result["tensors"] != len(prepared.entries):
        raise RuntimeError(f"the RSS child read {result['tensors']} tensors")
    growth = (result["hwm_kib"] - result["baseline_kib"]) * 1024
    bound = prepared.spec.largest + concurrency * part_size + RSS_SLACK
    reset = "" if result["reset"] else " (VmHWM not reset: includes imports)"
    SUMMARY.append(
        f"  {'peak RSS':<16} {prepared.spec.label:<7} K={concurrency} M={size_label(part_size)}: "
        f"{growth / MiB:.0f} MiB <= {bound // MiB} MiB   {'PASS' if growth <= bound else 'MISS'}"
    )
    print(
        f"  peak RSS, fresh process, concurrency={concurrency} part_size={size_label(part_size)}:"
        f" {growth / MiB:.1f} MiB above baseline{reset}; bound largest tensor "
        f"{prepared.spec.largest // MiB} MiB + K x M {concurrency * part_size // MiB} MiB + "
        f"{RSS_SLACK // MiB} MiB = {bound // MiB} MiB   {'PASS' if growth <= bound else 'MISS'}"
    )


async def bench_ranged(
    files: Sequence[tuple[Prepared, int]],
    warmup: int,
    configs: Sequence[tuple[int, int]],
    rss: Sequence[tuple[int, int]],
) -> None:
    for prepared, repeat in files:
        shaped = ("--latency", str(SHAPED_LATENCY), "--rate", str(SHAPED_RATE))
        with http_server(prepared.path, *shaped) as server:
            url = f"http://127.0.0.1:{server.port}/{prepared.path.name}"
            variants = ranged_variants(url, configs)
            timings = await measure(prepared, variants, repeat, warmup)
            report(
                f"parallel ranges (shaped server: {SHAPED_LATENCY * 1000:.0f} ms to first byte, "
                f"{SHAPED_RATE / 1e6:.0f} MB/s per connection)",
                prepared,
                variants,
                timings,
                [Ratio(v.key, "one", 3.0) for v in variants[1:]],
            )
            for concurrency, part_size in rss:
                measure_rss(prepared, url, concurrency, part_size)


# --------------------------------------------------------------------------- main


def parse_parallel(text: str) -> list[tuple[int, int]]:
    """``"4x8,8x16"`` -> ``[(4, 8 MiB), (8, 16 MiB)]`` (concurrency x part size in MiB)."""
    configs = []
    for item in text.split(","):
        k, _, m = item.strip().partition("x")
        configs.append((int(k), int(float(m) * MiB)))
    return configs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds, large files (>= 5)")
    parser.add_argument("--kv-repeat", type=int, default=None, help="timed rounds, KV (3x)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--size-mib", type=int, default=2048, help="TCP/HTTP file (2048)")
    parser.add_argument("--s3-size-mib", type=int, default=512, help="S3 object (512)")
    parser.add_argument("--ranged-size-mib", type=int, default=512, help="shaped server (512)")
    parser.add_argument(
        "--parallel",
        type=parse_parallel,
        default=list(DEFAULT_PARALLEL),
        help="concurrency x part MiB for the ranged variants (default 8x8,8x16,16x8,16x4)",
    )
    parser.add_argument(
        "--rss-parallel",
        type=parse_parallel,
        default=list(DEFAULT_RSS_PARALLEL),
        help="concurrency x part MiB for the peak-RSS children (default 8x16,16x8)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="keep and reuse the files here")
    for name in ("tcp", "http", "s3", "ranged", "rss", "kv", "big"):
        parser.add_argument(f"--skip-{name}", action="store_true", help=f"skip {name}")
    parser.add_argument("--tcp-sender", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-rate", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rss-child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tcp_sender is None and args.rss_child is None and args.repeat < 5:
        parser.error("--repeat must be at least 5")
    if args.kv_repeat is None:
        args.kv_repeat = 3 * args.repeat
    return args


async def run_all(files: dict[str, Prepared], args: argparse.Namespace) -> None:
    def pick(*labels: str) -> list[tuple[Prepared, int]]:
        chosen = []
        for label in labels:
            if label in files:
                chosen.append((files[label], args.kv_repeat if label == "kv" else args.repeat))
        return chosen

    if not args.skip_tcp:
        await bench_tcp(pick("kv", "big"), args.warmup)
    if not args.skip_http:
        await bench_http(pick("kv", "big"), args.warmup)
    if not args.skip_s3:
        await bench_s3(pick("kv", "s3"), args.warmup)
    if not args.skip_ranged:
        rss = [] if args.skip_rss else args.rss_parallel
        await bench_ranged(pick("kv", "ranged"), args.warmup, args.parallel, rss)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tcp_sender is not None:
        tcp_sender_main(args.tcp_sender, args.tcp_rate)
        return
    if args.rss_child is not None:
        url, k, m = args.rss_child
        rss_child_main(url, int(k), int(m))
        return
    started = time.perf_counter()
    extras = ", ".join(
        f"{name} {version(name)}" if optional(name) is not None else f"{name} missing"
        for name in ("aiohttp", "httpx", "boto3", "aiobotocore", "obstore", "moto")
    )
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, anyio {version('anyio')}, "
        f"stream_st {stream_st.__version__} ({Path(stream_st.__file__).parent}), "
        f"{os.cpu_count()} CPUs, {platform.machine()}\n{extras}"
    )
    keep = args.dir is not None
    directory = Path(args.dir) if keep else Path(tempfile.mkdtemp(prefix="bench_network_"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        made = time.perf_counter()
        specs: dict[str, BenchFile] = {}
        if not args.skip_kv:
            specs["kv"] = KV
        if not args.skip_big:
            if not (args.skip_tcp and args.skip_http):
                specs["big"] = big_file("big", args.size_mib)
            if not args.skip_s3:
                specs["s3"] = big_file("big", args.s3_size_mib)
            if not args.skip_ranged:
                specs["ranged"] = big_file("big", args.ranged_size_mib)
        files = {
            label: Prepared.load(spec, ensure_file(directory, spec))
            for label, spec in specs.items()
        }
        print(f"files in {directory} ready in {time.perf_counter() - made:.1f} s")
        anyio.run(run_all, files, args)
        if SUMMARY:
            print("\n== targets (speed ratios)")
            print("\n".join(SUMMARY))
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

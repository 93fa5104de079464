"""The default concurrency of remote reads (``concurrency=None``): adaptive parallel ranged parts
where they can pay, one connection everywhere else; against real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gc
import math
import re
import socket
import threading
import tracemalloc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import SourceChangedError
from stream_st.transports.http import parts
from stream_st.transports.http.source import ADAPTIVE_LIMIT, ADAPTIVE_START, HttpSource
from stream_st.transports.s3.source import S3Source

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]

PART = 64 << 10  # part_size of these reads: the objects are many parts long
RATE = 2e6  # bytes per second per connection (paced in pieces of rate / 100): a store, scaled
MODEL: Arrays = {f"t{i}": np.random.default_rng(i).random(32_768) for i in range(8)}  # 2 MiB
SMALL: Arrays = {"w": np.arange(1000, dtype=np.float32)}


@dataclass
class CountingServer(RangeHTTPServer):
    """A :class:`RangeHTTPServer` that counts the connections made to it and the most requests
    it answered at once."""

    connections: int = 0
    peak: int = 0

    def _serve(self, connection: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        super()._serve(connection)

    def _answer(
        self, connection: socket.socket, reader: Any, method: str, target: str, headers: Any
    ) -> bool:
        with self._lock:
            self.peak = max(self.peak, self._busy)
        return super()._answer(connection, reader, method, target, headers)


@contextmanager
def serve(**options: Any) -> Iterator[CountingServer]:
    running = CountingServer(**options)
    running.objects["/model.safetensors"] = reference_numpy.save(MODEL)
    running.objects["/small.safetensors"] = reference_numpy.save(SMALL)
    with running:
        yield running


@pytest.fixture
def store() -> Iterator[CountingServer]:
    """Ranges, a strong ETag, a rate per connection: what an object store serves."""
    with serve(etag="strong", rate=RATE) as running:
        yield running


async def read(source: Any, **kwargs: Any) -> Arrays:
    stream = stream_st.open_stream(source, **kwargs)
    return {name: array async for name, array in stream}


@dataclass
class LinkClock:
    """The clock an adaptive window times its parts by (``parts.time``), replaced by a model
    link's: the bytes the window received so far took as long as they would at
    ``per_connection`` bytes per second on each of its K connections, all of them together at
    most ``link``. The rate the window measures for each K is then that model's, whatever a
    loaded machine does to the test server's pacing or to the client's turns; the window's own
    decisions (grow, go back to one stream) are what is tested."""

    source: HttpSource
    per_connection: float
    link: float = math.inf
    now: float = 0.0
    counted: int = 0  # the window's bytes received, as of the last reading

    def monotonic(self) -> float:
        window = self.source._parts
        if window is not None:
            rate = min(self.per_connection * window.concurrency, self.link)
            self.now += (window._received - self.counted) / rate
            self.counted = window._received
        return self.now


def ranges(server: RangeHTTPServer) -> list[str]:
    """The Range of every GET the server received (an answer cut short by the client counts)."""
    server.settle()
    seen = server.headers_seen
    return [headers.get("range", "") for method, _, headers in seen if method == "GET"]


async def test_a_big_object_is_read_over_several_connections_that_grow(
    store: CountingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object store: each connection has its own rate (timed as the model's, see
    :class:`LinkClock`; the server paces each connection too, so that parts overlap)."""
    source = HttpSource(store.url("/model.safetensors"), part_size=PART)
    monkeypatch.setattr(parts, "time", LinkClock(source, per_connection=RATE))
    assert_same_arrays(await read(source), MODEL)
    store.settle()
    # more connections while they paid, up to the limit and never more
    assert ADAPTIVE_START < store.peak <= ADAPTIVE_LIMIT
    assert store.connections <= ADAPTIVE_LIMIT + 1  # the first answer's closed when parts pay
    assert source.concurrency == ADAPTIVE_LIMIT
    got = ranges(store)
    assert got[0] == "bytes=0-" and len(got) > ADAPTIVE_START  # the first: one stream
    size = len(store.objects["/model.safetensors"])
    assert len(got) <= -(-size // PART) + 1  # parts of part_size: nothing asked twice


@pytest.mark.parametrize(
    "link", [2 * parts.FAST_STREAM, parts.FAST_STREAM / 10], ids=["fast", "slower"]
)
async def test_a_fast_link_goes_back_to_one_stream(
    link: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where one connection fills the link (timed as the model's, see :class:`LinkClock`), the
    first answer is fast enough (``FAST_STREAM``) and goes on to the end; or the parts tried
    once are no faster than it was, and the rest is one ranged request from where they end."""
    with serve(etag="strong") as server:
        source = HttpSource(server.url("/model.safetensors"), part_size=PART)
        monkeypatch.setattr(parts, "time", LinkClock(source, per_connection=link, link=link))
        assert_same_arrays(await read(source), MODEL)
        assert source.concurrency == 1
        got = ranges(server)
        size = len(server.objects["/model.safetensors"])
    if link >= parts.FAST_STREAM:
        assert got == ["bytes=0-"]  # no part tried
    else:
        assert got[0] == "bytes=0-"
        assert 1 + ADAPTIVE_START < len(got) <= 1 + 2 * ADAPTIVE_START + 1  # parts tried once
        start, end = (int(n) for n in got[-1].removeprefix("bytes=").split("-"))
        assert end == size - 1 and end + 1 - start >= size // 2  # the rest: one stream


async def test_explicit_one_keeps_one_connection() -> None:
    with serve(etag="strong") as store:
        source = HttpSource(store.url("/model.safetensors"), part_size=PART, concurrency=1)
        assert_same_arrays(await read(source), MODEL)
        assert ranges(store) == ["bytes=0-"]
        assert store.connections == 1 and source.concurrency == 1
        # the operation's option replaces the source's default
        assert_same_arrays(await read(store.url("/model.safetensors"), concurrency=1), MODEL)
        assert ranges(store) == ["bytes=0-"] * 2


async def test_a_small_object_is_one_request(store: CountingServer) -> None:
    assert_same_arrays(await read(HttpSource(store.url("/small.safetensors"))), SMALL)
    assert ranges(store) == ["bytes=0-"]  # one stream, as with concurrency=1
    assert store.connections == 1


@pytest.mark.parametrize(
    "options", [{"no_range": True}, {"etag": "weak"}, {"etag": ""}, {"last_modified": True}]
)
async def test_one_connection_without_ranges_or_a_strong_etag(options: dict[str, Any]) -> None:
    """A server ignoring ranges streams the whole body; one without a strong ETag (nothing to
    pin every part to the same version) is read as one stream, as with concurrency=1."""
    with serve(**options) as server:
        source = HttpSource(server.url("/model.safetensors"), part_size=PART)
        assert_same_arrays(await read(source), MODEL)
        assert server.connections == 1 and source.concurrency == 1
        got = ranges(server)
        assert got == ["bytes=0-"]


async def test_a_selection_opens_the_window_only_when_big(store: CountingServer) -> None:
    url = store.url("/model.safetensors")
    few = await read(HttpSource(url, part_size=PART), include=["t1"])  # 256 KiB
    assert_same_arrays(few, {"t1": MODEL["t1"]})
    assert store.peak > 1
    store.headers_seen.clear()
    source = HttpSource(url, part_size=1 << 20)
    one = await read(source, include=["t1", "t2"])  # 512 KiB
    assert_same_arrays(one, {k: MODEL[k] for k in ("t1", "t2")})
    assert source.concurrency == 1
    assert len(ranges(store)) == 2  # the header's, then the selection's


async def test_a_broken_part_is_resumed(store: CountingServer) -> None:
    """A part whose answer breaks half way is asked for again from the byte it reached (a
    window of a fixed size: resuming owes nothing to the adaptive growth)."""
    store.close_after = cut = PART // 2
    store.close_once = True
    source = HttpSource(store.url("/model.safetensors"), part_size=PART, concurrency=4)
    assert_same_arrays(await read(source), MODEL)
    assert store.close_after is None  # an answer was cut
    starts = [int(r.removeprefix("bytes=").split("-")[0]) for r in ranges(store)]
    assert any(start % PART == cut for start in starts)  # a part resumed where it broke
    assert source.concurrency == 4


async def test_a_replaced_object_is_never_mixed(store: CountingServer) -> None:
    changed = reference_numpy.save({k: v + 1 for k, v in MODEL.items()})
    store.replace_after["/model.safetensors"] = (2, changed)
    source = HttpSource(store.url("/model.safetensors"), part_size=PART)
    with pytest.raises(SourceChangedError):
        await read(source)
    assert any("if-match" in headers for _, _, headers in store.headers_seen[1:])


async def test_s3_objects_are_read_in_parallel_parts(
    moto_s3: MotoS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)
    client = moto_s3.client()
    client.create_bucket(Bucket="adaptive")
    client.put_object(Bucket="adaptive", Key="m.safetensors", Body=reference_numpy.save(MODEL))
    client.put_object(Bucket="adaptive", Key="s.safetensors", Body=reference_numpy.save(SMALL))
    big = S3Source("s3://adaptive/m.safetensors", part_size=PART)
    assert_same_arrays(await read(big), MODEL)
    # the window opened: it grew, or (moto on loopback is fast) went back to one stream
    assert big.concurrency >= ADAPTIVE_START or big._single
    small = S3Source("s3://adaptive/s.safetensors", part_size=PART)
    assert_same_arrays(await read(small), SMALL)
    assert small.concurrency == 1


async def test_a_huge_concurrency_asks_for_parts_no_smaller_than_the_least() -> None:
    """``concurrency=K`` spread the bytes over K parts however small: 300 parts of 7 KB for a
    2 MiB object, each on its own connection, all at once (100,000 on a 1 MiB object: 95,000
    connections of 11 bytes, the loop stuck connecting). Parts are now no smaller than
    ``SMALLEST_PART`` (the ``part_size`` asked for, where it is smaller)."""
    with serve(etag="strong") as server:
        source = HttpSource(server.url("/model.safetensors"), concurrency=300)
        assert_same_arrays(await read(source), MODEL)
        server.settle()
        size = len(server.objects["/model.safetensors"])
        most = 1 + -(-size // parts.SMALLEST_PART)  # the first answer's, then the parts
        assert len(ranges(server)) <= most
        assert server.connections <= most


async def test_a_huge_concurrency_is_held_to_the_most_parts_at_once(
    store: CountingServer,
) -> None:
    """``concurrency=K`` was K connections at once however many: 128 parts of an object, 128
    connections (a million parts, as many connections: the loop stuck connecting, gigabytes
    held); no more than ``MOST_PARTS`` now."""
    size = len(store.objects["/model.safetensors"])
    part_size = 16 << 10
    count = -(-size // part_size)
    assert count > parts.MOST_PARTS
    source = HttpSource(store.url("/model.safetensors"), part_size=part_size, concurrency=count)
    assert_same_arrays(await read(source), MODEL)
    store.settle()
    assert source.concurrency == parts.MOST_PARTS
    assert store.peak <= parts.MOST_PARTS
    assert store.connections <= parts.MOST_PARTS + 1  # and the first answer's


async def test_a_closed_stream_holds_no_part_buffer_until_a_collection() -> None:
    """A read with ``concurrency`` kept its part buffers in a reference cycle (the source and
    its window of parts) once its stream was closed, until the cyclic collector ran. With that
    collector off, the tensors dropped and the stream closed leave no numpy memory behind."""
    with serve(etag="strong") as server, numpy_memory_held() as held_since:
        source = HttpSource(server.url("/model.safetensors"), part_size=PART, concurrency=4)
        arrays = await read(source)
        assert_same_arrays(arrays, MODEL)
        del arrays, source
        held = held_since()
    assert held < PART  # not one part buffer


@dataclass
class HeldServer(CountingServer):
    """A :class:`CountingServer` that sends the body of a range from byte ``held_from`` on in
    part: half of it, then the rest once :attr:`gate` is set (from ``stalled_from`` on: never,
    the connection held open until the server stops)."""

    held_from: int = 0
    stalled_from: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.gate = threading.Event()
        self._start = threading.local()  # the range start of this connection's answer

    def _answer(
        self, connection: socket.socket, reader: Any, method: str, target: str, headers: Any
    ) -> bool:
        asked = re.fullmatch(r"bytes=(\d+)-\d*", headers.get("range", ""))
        self._start.at = int(asked.group(1)) if asked else 0
        return super()._answer(connection, reader, method, target, headers)

    def _send_body(self, connection: socket.socket, body: memoryview, chunked: bool) -> int:
        at = self._start.at
        if at < self.held_from:
            return super()._send_body(connection, body, chunked)
        half = len(body) // 2
        connection.sendall(body[:half])
        if at >= self.stalled_from:
            self._stopping.wait()
            return half
        self.gate.wait()
        connection.sendall(body[half:])
        return len(body)


def test_a_stopped_part_leaves_nothing_held_until_a_collection() -> None:
    """A read with ``concurrency`` stopped the parts still arriving after it (cancelled in
    their bodies) with an error that anyio's task group keeps in a reference cycle, with every
    frame it went through: the part buffers, the window and the caller's results stayed until
    the cyclic collector ran (a process reading a file after another grew by part_size x K and
    more each time). With that collector off, the read's results and its part buffers are
    freed as soon as they are dropped and the source is closed.

    The server keeps the second part's body until the first read is done (it must be read by
    the second read) and never finishes the third and fourth's: the second read stops them."""
    server = HeldServer(etag="strong", held_from=PART, stalled_from=2 * PART)
    server.objects["/model.safetensors"] = reference_numpy.save(MODEL)

    async def read_two_parts() -> np.ndarray[Any, Any]:
        source = HttpSource(server.url("/model.safetensors"), part_size=PART, concurrency=4)
        await source.start(read_all=True)
        first, second = np.empty(PART, np.uint8), np.empty(PART, np.uint8)
        assert await source.read_into_at(0, first.data) == PART
        server.gate.set()
        assert await source.read_into_at(PART, second.data) == PART
        await source.aclose()
        return second

    with server, numpy_memory_held() as held_since:
        result = asyncio.run(read_two_parts())
        assert bytes(result) == server.objects["/model.safetensors"][PART : 2 * PART]
        dropped = weakref.ref(result)
        del result
        kept = dropped() is not None
        held = held_since()
    assert not kept  # by a cycle through the loop's frames
    assert held < PART  # not one part buffer


async def test_a_cancelled_read_leaves_no_part_buffer_held_until_a_collection() -> None:
    """A read with ``concurrency`` cancelled by its caller (or failing) cancels its parts too:
    anyio's task group keeps their errors in reference cycles, and those held the frames the
    errors went through, with the part buffers they were received into, until the cyclic
    collector ran. With that collector off, they are freed once the source is closed."""
    server = HeldServer(etag="strong", held_from=PART, stalled_from=2 * PART)
    server.objects["/model.safetensors"] = reference_numpy.save(MODEL)
    with server, numpy_memory_held() as held_since:
        try:
            source = HttpSource(server.url("/model.safetensors"), part_size=PART, concurrency=4)
            await source.start(read_all=True)
            buffer = np.empty(2 * PART, np.uint8).data
            assert await source.read_into_at(0, buffer[:PART]) == PART
            async with anyio.create_task_group() as group:  # the parts' responses are open
                with anyio.CancelScope() as scope:
                    group.start_soon(cancel_when_blocked, scope)  # each part in its body
                    await source.read_into_at(PART, buffer[PART:])
            await source.aclose()
            del source, buffer
            held = held_since()
        finally:
            server.gate.set()
    assert held < PART  # not one part buffer


async def cancel_when_blocked(scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once every other task waits."""
    await anyio.wait_all_tasks_blocked()
    scope.cancel()


@contextmanager
def numpy_memory_held() -> Iterator[Callable[[], int]]:
    """Within the block, the cyclic collector off (after one collection) and tracemalloc on;
    what it yields gives the bytes of numpy's arrays allocated since the block began and still
    held."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        before = numpy_memory()
        yield lambda: numpy_memory() - before
    finally:
        tracemalloc.stop()
        if enabled:
            gc.enable()


def numpy_memory() -> int:
    """The bytes of numpy's arrays tracemalloc sees allocated now."""
    domain = tracemalloc.DomainFilter(inclusive=True, domain=np.lib.tracemalloc_domain)
    snapshot = tracemalloc.take_snapshot().filter_traces([domain])
    return sum(trace.size for trace in snapshot.traces)


async def test_a_long_read_holds_the_scopes_of_its_running_parts_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read with ``concurrency`` kept the cancel scope of every part it started until it
    ended (about 1.6 KB each: one read of 100 GiB in parts of 8 MiB held 21 MB more and more).
    One read of the whole object, many parts long, now holds those of the parts whose task
    still runs only, each time a part starts."""
    started = ended = 0
    held: list[tuple[int, int]] = []  # at each part started: the scopes held, the tasks running
    run_part, drive = parts.PartWindow._run_part, parts.PartWindow._drive

    def counted_run(window: parts.PartWindow, part: Any) -> None:
        nonlocal started
        run_part(window, part)
        started += 1
        held.append((len(window._stops), started - ended))

    async def counted_drive(window: parts.PartWindow, part: Any, stop: anyio.CancelScope) -> None:
        nonlocal ended
        try:
            await drive(window, part, stop)
        finally:
            ended += 1

    monkeypatch.setattr(parts.PartWindow, "_run_part", counted_run)
    monkeypatch.setattr(parts.PartWindow, "_drive", counted_drive)
    with serve(etag="strong") as server:
        data = server.objects["/model.safetensors"]
        source = HttpSource(server.url("/model.safetensors"), part_size=PART, concurrency=4)
        await source.start(read_all=True)
        buffer = bytearray(len(data))
        assert await source.read_into_at(0, memoryview(buffer)) == len(data)
        assert buffer == data
        window = source._parts
        assert window is not None and not window._stops
        await source.aclose()
    assert started > 4 * window.concurrency  # one read, many parts
    assert all(scopes == running for scopes, running in held), held

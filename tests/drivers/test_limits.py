"""Time limits on every entry point: deadline=, the low-speed guard, bad values, connects that
end early. Real peers on loopback: TCP and HTTP servers that trickle a byte at a time, a peer
that stops reading, a listener whose backlog is full."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
from stream_st import ReadTimeoutError, TensorSpec, UsageError, tools
from stream_st.cli.demo import run_demo
from stream_st.core import digests
from stream_st.transports.file import atomic, readahead
from stream_st.transports.file import mmap as mapping
from stream_st.transports.file.source import FileSource
from stream_st.transports.options import Limits

from .._util import sample_file, sample_tensors
from ..servers.http_server import RangeHTTPServer

HANG_GUARD = 10  # seconds: a limit that works stops each transfer long before this
TRICKLED = sample_file()  # a byte every TRICKLE_INTERVAL: about 30 s for the whole file
TRICKLE_INTERVAL = 0.1

Serve = Callable[[bytes], Awaitable[str]]


@pytest.fixture
async def trickle() -> AsyncIterator[Callable[[str], Awaitable[str]]]:
    """``await start(kind) -> url``: a peer on 127.0.0.1 that sends :data:`TRICKLED` one byte
    every :data:`TRICKLE_INTERVAL` seconds; ``kind`` "tcp" sends it raw, "http" answers a GET
    with it as the body of a 200."""
    servers: list[asyncio.Server] = []

    async def start(kind: str) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                if kind == "http":
                    await reader.readuntil(b"\r\n\r\n")
                    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(TRICKLED)}\r\n\r\n"
                    writer.write(head.encode())
                for index in range(len(TRICKLED)):
                    writer.write(TRICKLED[index : index + 1])
                    await writer.drain()
                    await asyncio.sleep(TRICKLE_INTERVAL)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass  # the client gave up: what the tests want
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return f"{kind}://127.0.0.1:{port}" + ("/m.safetensors" if kind == "http" else "")

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("kind", ["tcp", "http"])
async def test_deadline_stops_a_trickling_peer(
    trickle: Callable[[str], Awaitable[str]], kind: str
) -> None:
    url = await trickle(kind)
    with anyio.fail_after(HANG_GUARD), pytest.raises(ReadTimeoutError, match="deadline of 1 s"):
        await stream_st.load(url, timeout=2, deadline=1)


@pytest.mark.parametrize("kind", ["tcp", "http"])
async def test_speed_limit_stops_a_trickling_peer(
    trickle: Callable[[str], Awaitable[str]], kind: str
) -> None:
    url = await trickle(kind)
    with anyio.fail_after(HANG_GUARD), pytest.raises(ReadTimeoutError) as info:
        await stream_st.load(url, timeout=2, speed_limit=1000, speed_time=1)
    assert "below 1000 bytes/s for 1 s" in str(info.value)
    assert url in str(info.value)


async def test_a_slow_consumer_is_not_blamed_for_the_speed(
    tcp_sender: Callable[[bytes], Awaitable[int]],
) -> None:
    """The peer sends fast; the consumer dawdles between tensors far longer than speed_time.
    Only time spent waiting on the transport counts, and there is little of it."""
    tensors = {f"t{i}": np.full(4 << 20, i, dtype=np.uint8) for i in range(4)}
    port = await tcp_sender(reference_numpy.save(tensors))
    got = []
    stream = stream_st.open_stream(
        f"tcp://127.0.0.1:{port}", speed_limit=1 << 20, speed_time=0.3, deadline=HANG_GUARD
    )
    async for name, array in stream:
        got.append(name)
        assert int(array[0]) == int(name[1:])
        await anyio.sleep(0.5)
    assert got == list(tensors)


async def test_limits_given_to_an_http_source_itself_apply(
    trickle: Callable[[str], Awaitable[str]],
) -> None:
    """A source object built with its own limits keeps them when read without any."""
    url = await trickle("http")
    with anyio.fail_after(HANG_GUARD), pytest.raises(ReadTimeoutError, match="deadline"):
        await stream_st.load(stream_st.HttpSource(url, deadline=1))
    with pytest.raises(UsageError):
        stream_st.HttpSource(url, timeout=math.nan)


async def test_deadline_ends_a_local_read_between_tensors(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(sample_file())
    async with stream_st.open_stream(path, deadline=0.3) as stream:
        tensors = aiter(stream)
        await anext(tensors)
        await anyio.sleep(0.5)
        with pytest.raises(ReadTimeoutError, match=r"deadline of 0\.3 s passed") as info:
            await anext(tensors)
    assert info.value.url == str(path)


async def test_deadline_ends_a_local_read_within_a_big_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline was checked between tensors only: a file of one big tensor was read to its
    end past it (each piece's read here slowed down to 0.2 s, 0.4 s in all)."""
    path = tmp_path / "big.safetensors"
    reference_numpy.save_file({"x": np.ones(16 << 20, np.uint8)}, str(path))
    slow = readahead._preadv_fully

    def slowed(*args: Any) -> list[int]:
        time.sleep(0.2)
        return slow(*args)

    monkeypatch.setattr(readahead, "_preadv_fully", slowed)
    async with stream_st.open_stream(path, deadline=0.1) as stream:
        with pytest.raises(ReadTimeoutError, match=r"deadline of 0\.1 s passed") as info:
            async for _ in stream:
                pass
    assert info.value.position == stream.header.data_start
    alive = [thread.name for thread in threading.enumerate()]
    assert "stream_st read-ahead" not in alive  # the threads stopped and waited for


async def test_deadline_ends_the_population_of_a_mapped_big_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy=False: what the page cache lacks was populated by one worker thread's call for the
    whole tensor, past the deadline, and the view handed out. Windows of 1 MiB here, each
    slowed down to 0.1 s (the file taken as uncached): the deadline ends it between two."""
    path = tmp_path / "big.safetensors"
    reference_numpy.save_file({"x": np.ones(4 << 20, np.uint8)}, str(path))
    slow = mapping._advise

    def slowed(*args: Any) -> None:
        time.sleep(0.1)
        slow(*args)

    monkeypatch.setattr(mapping, "WINDOW", 1 << 20)
    monkeypatch.setattr(mapping, "_advise", slowed)
    monkeypatch.setattr(FileSource, "_cached", lambda self, offset: False)
    got: list[str] = []
    with pytest.raises(ReadTimeoutError, match=r"deadline of 0\.05 s passed"):
        async for name, _ in stream_st.open_stream(path, copy=False, deadline=0.05):
            got.append(name)
    assert got == []


async def test_deadline_ends_the_digest_check_of_a_mapped_big_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy=False on a checksummed file: a big tensor's digest was checked to its end past the
    deadline, and the tensor handed out. Each 1 MiB slice's hash slowed down to 0.05 s here."""
    path = tmp_path / "big.safetensors"
    stream_st.numpy.save_file({"x": np.ones(8 << 20, np.uint8)}, path, checksums=True)
    fresh = digests.Digests.hasher

    class Slow:
        def __init__(self, hasher: Any) -> None:
            self.hasher = hasher

        def update(self, data: Any) -> None:
            time.sleep(0.05)
            self.hasher.update(data)

        def digest(self) -> bytes:
            return bytes(self.hasher.digest())

    monkeypatch.setattr(digests, "HASH_SLICE", 1 << 20)
    monkeypatch.setattr(digests.Digests, "hasher", lambda self: Slow(fresh(self)))
    got: list[str] = []
    with pytest.raises(ReadTimeoutError, match=r"deadline of 0\.1 s passed"):
        async for name, _ in stream_st.open_stream(path, copy=False, deadline=0.1):
            got.append(name)
    assert got == []


async def test_deadline_counts_from_opening_across_every_shard(tmp_path: Path) -> None:
    async with stream_st.open_sharded_writer(tmp_path, max_shard_size=1) as writer:
        for name, array in sample_tensors().items():
            await writer.write(name, array)
    index = str(tmp_path / "model.safetensors.index.json")
    stream = stream_st.open_stream(index, deadline=0.3)
    with pytest.raises(ReadTimeoutError, match="deadline"):
        async for _ in stream:
            await anyio.sleep(0.2)


@pytest.mark.parametrize("many", [False, True], ids=["write", "write_many"])
async def test_deadline_aborts_a_file_write_and_leaves_nothing(tmp_path: Path, many: bool) -> None:
    """The error names the byte the tensor refused would have started at (a file is written
    at positions: its sink's own position stays 0)."""
    destination = tmp_path / "out.safetensors"
    plan = [TensorSpec("a", "F32", (4,)), TensorSpec("b", "F32", (4,))]
    with pytest.raises(ReadTimeoutError, match="deadline") as info:
        async with stream_st.open_writer(destination, plan, deadline=0.3) as writer:
            await writer.write("a", np.zeros(4, np.float32))
            await anyio.sleep(0.5)
            if many:
                await writer.write_many({"b": np.zeros(4, np.float32)})
            else:
                await writer.write("b", np.zeros(4, np.float32))
    assert info.value.url == str(destination)
    assert info.value.position == writer.header.data_start + writer.header["b"].start
    assert list(tmp_path.iterdir()) == []


async def test_deadline_aborts_a_big_tensors_write_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline was checked between tensors only: one big tensor was written to its end
    past it (each 256 KiB block's write here slowed down to 10 ms: 0.64 s for 32 MiB)."""
    slow = atomic.pwrite_fully

    def slowed(*args: Any) -> None:
        time.sleep(0.01)
        slow(*args)

    monkeypatch.setattr(atomic, "pwrite_fully", slowed)
    destination = tmp_path / "out.safetensors"
    with pytest.raises(ReadTimeoutError, match=r"deadline of 0\.2 s passed"):
        await stream_st.save(destination, {"a": np.ones(32 << 20, np.uint8)}, deadline=0.2)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def deaf_peer() -> Iterator[str]:
    """``tcp://`` address of a listener that takes connections but never reads a byte."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"tcp://127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.parametrize(
    "limits",
    [{"deadline": 1}, {"speed_limit": 1000, "speed_time": 0.5}],
    ids=["deadline", "speed"],
)
async def test_writer_to_a_peer_that_stops_reading(deaf_peer: str, limits: Any) -> None:
    big = np.zeros(64 << 20, dtype=np.uint8)  # far more than the socket buffers hold
    with anyio.fail_after(HANG_GUARD), pytest.raises(ReadTimeoutError) as info:
        await stream_st.save(deaf_peer, {"big": big}, **limits)
    assert info.value.url == deaf_peer
    assert 0 < (info.value.position or 0) < big.nbytes


async def test_anyio_stream_and_iterator_sources_obey_the_deadline() -> None:
    async def trickling() -> AsyncIterator[bytes]:
        for index in range(len(TRICKLED)):
            await anyio.sleep(TRICKLE_INTERVAL)
            yield TRICKLED[index : index + 1]

    with anyio.fail_after(HANG_GUARD), pytest.raises(ReadTimeoutError, match="deadline"):
        await stream_st.load(trickling(), deadline=0.5)
    send, receive = anyio.create_memory_object_stream[bytes](1)
    async with send, receive:
        stream = _BytesStream(receive)
        with anyio.fail_after(HANG_GUARD), pytest.raises(ReadTimeoutError, match="timeout"):
            await stream_st.load(stream, timeout=0.3)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("pause", [0.01, 0.0])
@pytest.mark.parametrize("sent", [20, len(TRICKLED)])
def test_empty_chunks_are_no_data_for_the_timeout(backend: str, pause: float, sent: int) -> None:
    """A producer that yields ``b""`` every 10 ms (or without suspending) within the header or
    past the file's last byte sends no data: timeout= ends the wait for the next bytes, where
    each empty chunk began a new wait and the read hung."""

    async def empties() -> AsyncIterator[bytes]:
        yield TRICKLED[:sent]
        while True:
            if pause:
                await anyio.sleep(pause)
            yield b""

    async def main() -> None:
        with anyio.fail_after(HANG_GUARD), pytest.raises(ReadTimeoutError) as info:
            await stream_st.load(empties(), timeout=0.3)
        assert "no data for 0.3 s (timeout)" in str(info.value)
        assert info.value.position == sent

    anyio.run(main, backend=backend)


class _BytesStream(anyio.abc.ByteReceiveStream):
    """An anyio byte stream over a memory channel that nobody writes to."""

    def __init__(self, channel: anyio.abc.ObjectReceiveStream[bytes]) -> None:
        self._channel = channel

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self._channel.receive()

    async def aclose(self) -> None:
        await self._channel.aclose()


# ---------------------------------------------------------------- connects that end early


@pytest.fixture
def full_backlog() -> Iterator[str]:
    """``tcp://`` address of a listener whose backlog is full: a connect there never finishes."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        address = server.getsockname()
        filler = socket.socket()
        filler.connect(address)
        try:
            yield f"tcp://{address[0]}:{address[1]}"
        finally:
            filler.close()


def _no_socket_left(action: Callable[[], Awaitable[None]]) -> Awaitable[None]:
    async def run() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await action()
            gc.collect()
        leaked = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert not leaked, [str(w.message) for w in leaked]

    return run()


async def test_a_connect_that_times_out_leaves_no_socket(full_backlog: str) -> None:
    async def connect() -> None:
        with pytest.raises(ReadTimeoutError, match="no answer to connect"):
            await stream_st.connect(full_backlog, timeout=0.3)

    await _no_socket_left(connect)


async def test_a_cancelled_connect_leaves_no_socket(full_backlog: str) -> None:
    async def connect() -> None:
        with anyio.move_on_after(0.3) as scope:
            await stream_st.load(full_backlog)
        assert scope.cancelled_caught

    await _no_socket_left(connect)


async def test_a_connect_past_the_deadline_leaves_no_socket(full_backlog: str) -> None:
    async def connect() -> None:
        with pytest.raises(ReadTimeoutError, match="deadline"):
            await stream_st.read_header(full_backlog, deadline=0.3)

    await _no_socket_left(connect)


# ---------------------------------------------------------------- option values

BAD_VALUES = [
    ("timeout", math.nan),
    ("timeout", -1),
    ("timeout", "1"),
    ("timeout", True),
    ("deadline", math.nan),
    ("deadline", -0.5),
    ("speed_limit", math.inf),
    ("speed_limit", math.nan),
    ("speed_limit", -1),
    ("speed_time", 0),
    ("speed_time", math.inf),
    ("speed_time", -1),
    ("timeout", -(10**400)),  # ints beyond a float: were a bare OverflowError
    ("speed_limit", 10**400),
    ("speed_time", 10**400),
    ("deadlin", 1),  # a misspelt option
]

MISSING = "no-such-file.safetensors"  # never opened: the values are refused first
PLAN = [TensorSpec("x", "U8", (1,))]


async def _layers() -> AsyncIterator[tuple[int, Any, Any]]:
    yield 0, np.zeros((1, 1, 1, 1), np.float16), np.zeros((1, 1, 1, 1), np.float16)


async def _enter(result: Any) -> None:
    """Await ``result`` or enter it, whichever it takes."""
    if hasattr(result, "__aenter__"):
        async with result:
            pass
    elif isinstance(result, Awaitable):
        await result


ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "open_stream": lambda **kw: stream_st.open_stream(MISSING, **kw),
    "read_header": lambda **kw: stream_st.read_header(MISSING, **kw),
    "load": lambda **kw: stream_st.load(MISSING, **kw),
    "save": lambda **kw: stream_st.save(MISSING, {"x": np.zeros(1, np.uint8)}, **kw),
    "open_writer": lambda **kw: stream_st.open_writer(MISSING, PLAN, **kw),
    "send_kv": lambda **kw: stream_st.send_kv(
        MISSING, stream_st.KVLayout(1, (1, 1, 1, 1)), _layers(), **kw
    ),
    "receive_kv": lambda **kw: stream_st.receive_kv(MISSING, **kw),
    "connect": lambda **kw: stream_st.connect("tcp://127.0.0.1:9", **kw),
    "listen": lambda **kw: stream_st.listen("127.0.0.1", 0, **kw),
    "inspect": lambda **kw: tools.inspect(MISSING, **kw),
    "hash": lambda **kw: tools.hash(MISSING, content=True, **kw),
    "diff": lambda **kw: tools.diff(MISSING, MISSING, **kw),
    "validate": lambda **kw: tools.validate(MISSING, **kw),
    "cp": lambda **kw: tools.cp(MISSING, "out.safetensors", **kw),
    "content_digests": lambda **kw: tools.content_digests(MISSING, **kw),
    "run_demo": lambda **kw: run_demo(1, 1, ("none",), **kw),
}


@pytest.mark.parametrize(("option", "value"), BAD_VALUES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
async def test_bad_values_are_usage_errors_everywhere(entry: str, option: str, value: Any) -> None:
    with pytest.raises(UsageError, match=option):
        await _enter(ENTRY_POINTS[entry](**{option: value}))


async def test_connection_messages_take_their_own_limits(tcp_sender: Any) -> None:
    port = await tcp_sender(sample_file())
    async with await stream_st.connect(f"tcp://127.0.0.1:{port}", timeout=5) as connection:
        with pytest.raises(UsageError, match="deadline"):
            connection.open_stream(deadline=math.nan)
        with pytest.raises(UsageError, match="speed_time"):
            connection.open_writer(PLAN, speed_time=0)
        async with connection.open_stream(deadline=HANG_GUARD) as stream:
            assert sorted(stream.header.names()) == sorted(sample_tensors())


def test_good_values_and_their_defaults() -> None:
    assert Limits(timeout=math.inf, deadline=math.inf) == Limits()
    assert Limits(timeout=10**400, deadline=10**400) == Limits()  # beyond a float: infinite
    assert Limits(speed_limit=100) == Limits(speed_limit=100.0, speed_time=30.0)
    assert Limits(speed_time=5) == Limits(speed_limit=1.0, speed_time=5.0)  # as curl
    assert Limits(speed_limit=0, speed_time=5) == Limits()  # 0 turns the guard off
    two: Any = np.float32(2)  # any real number type
    assert Limits(timeout=two, deadline=0) == Limits(timeout=2.0, deadline=0.0)
    assert not Limits().limited and Limits(timeout=1).limited


# ---------------------------------------------------------------- extreme but valid values

_TINY_WINDOWS = """
import anyio, stream_st
from tests._util import sample_file

async def chunks():
    data = sample_file()
    for start in range(0, len(data), 7):
        yield data[start : start + 7]  # no await: each wait ends at once, past many windows

async def main():
    found = await stream_st.load(chunks(), speed_limit=1e-300, speed_time=1e-30)
    print(len(found))

anyio.run(main)
"""


def test_speed_windows_far_shorter_than_a_wait_are_counted_at_once() -> None:
    """A wait spans about 10**24 windows of 1e-30 s, and the bytes a window needs (1e-330)
    round to 0: every window is fast enough, and counting them must not take one step each
    (a step that never ends, since subtracting 1e-30 from a microsecond changes nothing). In a
    child process: the loop it guards against would never yield to a timeout."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _TINY_WINDOWS],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD * 3,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(len(sample_tensors()))]


async def test_the_deadline_ends_an_http_read_without_retrying_past_it() -> None:
    """Every answer comes after 1 s: a deadline of 0.3 s ends the read when it passes, saying
    so. A failed request is retried after a growing back-off (1.75 s in all) only while the
    deadline has not passed; it used to retry past it, and to end on "cannot connect"."""
    with RangeHTTPServer(objects={"/slow.safetensors": sample_file()}, latency=1.0) as server:
        url = server.url("/slow.safetensors")
        with pytest.raises(ReadTimeoutError, match=r"deadline of 0\.3 s passed"):
            await stream_st.load(url, deadline=0.3)


async def test_a_passed_deadline_ends_a_local_header_read_too(tmp_path: Path) -> None:
    """``read_header`` of a local file with a deadline already passed raises as ``load`` does,
    where a local file's reads, which never wait, never looked at it."""
    path = tmp_path / "m.safetensors"
    path.write_bytes(sample_file())
    for read in (stream_st.read_header, stream_st.load):
        with pytest.raises(ReadTimeoutError, match="deadline of 0 s passed"):
            await read(path, deadline=0)

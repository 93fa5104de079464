"""Reads that wait less: parallel remote reads whose first parts are requested before the first
answer's body (the safetensors header) has arrived; producers that fill the reader's buffer."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.sharded.reader import ShardedStream
from stream_st.transports.http.source import FIRST_RANGE, HttpSource

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer

Arrays = dict[str, np.ndarray[Any, Any]]
KV: Arrays = {
    f"layer.{i}.{kind}": np.random.default_rng(i).random(25_000 + i).astype(np.float32)
    for i in range(8)
    for kind in ("key", "value")
}  # 16 tensors of ~100 KB: many small tensors, like a KV cache


class GatedServer(RangeHTTPServer):
    """Sends the head of a ``gated`` answer (by default: the one that starts at byte 0) at once,
    but its body only once ``others`` ``counted`` requests (by default: every other one) have
    arrived, or ``wait`` seconds have passed: ``gate_opened`` says which. A client that sends
    those requests only after reading that body gets it ``wait`` s late."""

    others = 0
    wait = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._local = threading.local()
        self._arrived = threading.Semaphore(0)
        self.gate_opened: bool | None = None

    def gated(self, path: str, headers: dict[str, str]) -> bool:
        return headers.get("range", "").startswith("bytes=0-")

    def counted(self, path: str, headers: dict[str, str]) -> bool:
        return not self.gated(path, headers)

    def _answer(self, connection: Any, reader: Any, method: str, target: str, headers: Any) -> bool:
        path = target.partition("?")[0]
        self._local.gated = self.gated(path, headers)
        if self.counted(path, headers):
            self._arrived.release()
        return super()._answer(connection, reader, method, target, headers)

    def _send_body(self, connection: Any, body: memoryview, chunked: bool) -> int:
        if self._local.gated and self.gate_opened is None:
            self.gate_opened = all(
                self._arrived.acquire(timeout=self.wait) for _ in range(self.others)
            )
        return super()._send_body(connection, body, chunked)


@pytest.fixture
def gated() -> Iterator[GatedServer]:
    with GatedServer() as started:
        running = cast(GatedServer, started)
        running.objects["/kv.safetensors"] = reference_numpy.save(KV)
        yield running


def gets(server: RangeHTTPServer) -> list[tuple[str, str, str, int]]:
    server.settle()
    return [r for r in server.requests if r[0] == "GET"]


async def test_first_parts_are_requested_before_the_header_arrives(gated: GatedServer) -> None:
    size = len(gated.objects["/kv.safetensors"])
    part = -(-size // 4)
    gated.others = 3  # the rest of the 1.6 MB file, spread over three more connections
    source = HttpSource(gated.url("/kv.safetensors"), concurrency=4, part_size=part)
    order = [name async for name, _ in stream_st.open_stream(source)]
    assert gated.gate_opened is True
    header = await stream_st.read_header(gated.url("/kv.safetensors"))
    assert order == header.names()  # offset order
    data = gets(gated)[:-1]  # the last: read_header's
    assert f"bytes=0-{FIRST_RANGE - 1}" in [r[2] for r in data]  # the header's request
    assert len(data) == 5 and sum(r[3] for r in data) == size  # every byte once


async def test_speculative_parts_deliver_the_same_arrays(gated: GatedServer) -> None:
    """Every split: parts smaller than a tensor, larger than the file, more than connections."""
    gated.wait = 0.0
    for concurrency, part in ((4, 70_000), (3, 10 << 20), (16, 64 << 10), (2, 100_000)):
        source = HttpSource(gated.url("/kv.safetensors"), concurrency=concurrency, part_size=part)
        got = {name: array async for name, array in stream_st.open_stream(source)}
        assert_same_arrays(got, KV)


async def test_header_longer_than_the_first_part(gated: GatedServer) -> None:
    many = {f"tensor.with.a.long.name.{i:05d}": np.full(3, i, np.int32) for i in range(3000)}
    gated.objects["/many.safetensors"] = reference_numpy.save(many)
    gated.wait = 0.0
    source = HttpSource(gated.url("/many.safetensors"), concurrency=4, part_size=1000)
    got = {name: array async for name, array in stream_st.open_stream(source)}
    assert_same_arrays(got, many)


class WindowGate(GatedServer):
    """Holds the body of the second GET (a part of the first window) until a GET beyond the
    first ``window`` ones has arrived, and counts the answers being sent at once. A reader that
    requests parts in batches, each waiting for its slowest part, sends no such GET."""

    window = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()
        self.most_at_once = 0

    def _answer(self, connection: Any, reader: Any, method: str, target: str, headers: Any) -> bool:
        with self._lock:
            self._local.number = next(self._numbers)
            self.most_at_once = max(self.most_at_once, self._busy)
        return super()._answer(connection, reader, method, target, headers)

    def gated(self, path: str, headers: dict[str, str]) -> bool:
        return bool(self._local.number == 2)

    def counted(self, path: str, headers: dict[str, str]) -> bool:
        return bool(self._local.number > self.window)


@pytest.mark.parametrize("iterate", ["directly", "async with"])
async def test_the_next_part_is_requested_while_an_earlier_one_still_arrives(iterate: str) -> None:
    """A window of K parts: as the reads pass a part, the next one is requested, while the
    parts after it are still arriving; never more than K requests at once."""
    with WindowGate() as started:
        server = cast(WindowGate, started)
        server.others = 1
        server.objects["/kv.safetensors"] = reference_numpy.save(KV)
        source = HttpSource(server.url("/kv.safetensors"), concurrency=3, part_size=100_000)
        if iterate == "directly":
            got = {name: array async for name, array in stream_st.open_stream(source)}
        else:
            async with stream_st.open_stream(source) as stream:
                got = {name: array async for name, array in stream}
        assert server.gate_opened is True
        assert_same_arrays(got, KV)
        data = gets(server)
        assert len(data) > 3 and sum(r[3] for r in data) == len(server.objects["/kv.safetensors"])
        assert server.most_at_once <= 3


class Producer:
    """Fills the reader's buffer itself, at most ``step`` bytes a call; records every buffer."""

    def __init__(self, data: bytes, step: int = 1 << 20) -> None:
        self.data = memoryview(data)
        self.step = step
        self.buffers: list[memoryview] = []

    async def readinto(self, buffer: memoryview) -> int:
        self.buffers.append(buffer)
        piece = self.data[: min(len(buffer), self.step)]
        buffer[: len(piece)] = piece
        self.data = self.data[len(piece) :]
        return len(piece)


async def test_a_readinto_producer_fills_the_arrays_themselves() -> None:
    producer = Producer(reference_numpy.save(KV), step=70_000)
    got: Arrays = {}
    async for name, array in stream_st.open_stream(producer):
        got[name] = array
        assert any(np.shares_memory(array, np.asarray(b)) for b in producer.buffers)
    assert_same_arrays(got, KV)


async def test_a_short_producer_is_a_truncated_stream() -> None:
    data = reference_numpy.save(KV)
    with pytest.raises(stream_st.TruncatedStreamError):
        async for _ in stream_st.open_stream(Producer(data[:-1])):
            pass


async def test_a_producer_that_claims_too_much_is_a_usage_error() -> None:
    class Liar(Producer):
        async def readinto(self, buffer: memoryview) -> int:
            return len(buffer) + 1

    with pytest.raises(stream_st.UsageError, match="readinto returned"):
        await stream_st.read_header(Liar(b""))


async def test_a_blocking_file_is_no_producer(tmp_path: Any) -> None:
    path = tmp_path / "kv.safetensors"
    path.write_bytes(reference_numpy.save(KV))
    with path.open("rb") as f, pytest.raises(stream_st.UnsupportedSourceError):
        await stream_st.read_header(f)


SHARDS: dict[str, Arrays] = {
    f"model-0000{i + 1}-of-00003.safetensors": {
        name: KV[name] for name in list(KV)[i * 5 : i * 5 + 5 + (i == 2)]
    }
    for i in range(3)
}


class ShardGate(GatedServer):
    """Holds the first shard's body until the second shard has been asked for."""

    def gated(self, path: str, headers: dict[str, str]) -> bool:
        return path.endswith("00001-of-00003.safetensors")

    def counted(self, path: str, headers: dict[str, str]) -> bool:
        return path.endswith("00002-of-00003.safetensors")


@pytest.mark.parametrize("concurrency", [2, 3, 5])
@pytest.mark.parametrize("via", ["ShardedStream", "open_stream"])
async def test_shards_are_read_at_once_and_yielded_in_order(concurrency: int, via: str) -> None:
    """The next shard is opened while one streams, each through ``concurrency`` parts."""
    weight_map = {name: shard for shard, arrays in SHARDS.items() for name in arrays}
    with ShardGate() as started:
        server = cast(ShardGate, started)
        server.others = 1
        for shard, arrays in SHARDS.items():
            server.objects[f"/m/{shard}"] = reference_numpy.save(arrays)
        server.objects["/m/model.safetensors.index.json"] = json.dumps(
            {"metadata": {}, "weight_map": weight_map}
        ).encode()
        url = server.url("/m/model.safetensors.index.json")
        stream = (
            ShardedStream(url, concurrency=concurrency)
            if via == "ShardedStream"
            else stream_st.open_stream(url, concurrency=concurrency)
        )
        assert isinstance(stream, ShardedStream)
        order = []
        async for name, array in stream:
            order.append(name)
            assert stream.header.names() == list(next(s for s in SHARDS.values() if name in s))
            np.testing.assert_array_equal(array, KV[name])
        assert server.gate_opened is True
    expected = [name for arrays in SHARDS.values() for name in arrays]
    assert order == expected  # the index's shard order, offset order within each
    assert list(stream.headers) == list(SHARDS)
    for shard in SHARDS:  # each shard: its header's request, then parts on other connections
        asked = [r for r in gets(server) if r[1].endswith(shard)]
        assert len(asked) >= min(concurrency, 2), asked


async def test_a_broken_shard_ahead_fails_only_when_reached() -> None:
    weight_map = {name: shard for shard, arrays in SHARDS.items() for name in arrays}
    with RangeHTTPServer() as server:
        first, second, _ = SHARDS
        server.objects[f"/m/{first}"] = reference_numpy.save(SHARDS[first])
        server.objects[f"/m/{second}"] = b"not a safetensors file"
        server.objects["/m/model.safetensors.index.json"] = json.dumps(
            {"metadata": {}, "weight_map": weight_map}
        ).encode()
        got = []
        with pytest.raises(stream_st.HeaderError, match=second):
            url = server.url("/m/model.safetensors.index.json")
            async for name, _ in stream_st.open_stream(url, concurrency=2):
                got.append(name)
    assert got == list(SHARDS[first])


@pytest.mark.parametrize("given", [False, True])
async def test_concurrency_reaches_the_source(gated: GatedServer, given: bool) -> None:
    """``open_stream(..., concurrency=K)``: K ranged requests at once, for a URL or a source
    given as it is (its own concurrency replaced)."""
    gated.wait = 0.0
    url = gated.url("/kv.safetensors")
    source: Any = HttpSource(url) if given else url
    got = {name: array async for name, array in stream_st.open_stream(source, concurrency=4)}
    assert_same_arrays(got, KV)
    ranges = [r[2] for r in gets(gated)]
    assert ranges[0] == f"bytes=0-{FIRST_RANGE - 1}" and len(ranges) == 4


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, True])
def test_shard_concurrency_must_be_a_positive_integer(concurrency: Any) -> None:
    with pytest.raises(stream_st.UsageError, match="concurrency"):
        ShardedStream("model.safetensors.index.json", concurrency=concurrency)

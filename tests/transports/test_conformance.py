"""One conformance suite that every transport runs: the same promises, checked on each medium.

Every source (a path, a ``file://`` URL, bytes, an async iterator of uneven chunks, a ``readinto``
producer, an anyio byte stream, an asyncio ``StreamReader``, a ``tcp://`` peer, an ``http://``
server, an ``s3://`` bucket on moto) serves the same files, and every sink (a path, a ``file://``
URL, an HTTP upload, an S3 upload, an anyio byte stream) takes the same writes. A new transport
adds one entry to :data:`SOURCES` or :data:`SINKS` and meets every promise here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
from anyio.streams.buffered import BufferedByteReceiveStream

import stream_st
from stream_st import TensorSpec
from stream_st.transports.registry import SinkLike, SourceLike
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.sink import S3Sink
from stream_st.transports.s3.source import S3Source

from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]

ARRAYS: Arrays = {
    "embed": np.arange(3 * 70_000, dtype=np.float32).reshape(3, 70_000),
    "bias": np.arange(7, dtype=np.int64),
    "scalar": np.array(2.5, dtype=np.float16),
    "empty": np.zeros((0, 4), dtype=np.uint8),
    "flags": np.array([True, False, True]),
}
DATA = reference_numpy.save(ARRAYS, metadata={"format": "np"})
"""The file every source serves, written by the reference."""

Serve = Callable[[bytes], contextlib.AbstractAsyncContextManager[SourceLike]]
"""A medium's source: serves the given bytes as one object for the ``async with`` body."""


class Media:
    """What the tests need of the media: a directory, an HTTP server and the S3 bucket."""

    def __init__(
        self, tmp_path: Path, http: RangeHTTPServer, s3: S3Config, moto: MotoS3Server
    ) -> None:
        self.tmp_path = tmp_path
        self.http = http
        self.s3 = s3
        self.moto = moto

    def get_object(self, key: str) -> bytes | None:
        client = self.moto.client()
        try:
            body: bytes = client.get_object(Bucket="conformance", Key=key)["Body"].read()
        except client.exceptions.NoSuchKey:
            return None
        return body

    def name(self) -> str:
        """A name no other test uses (the server and the bucket outlive one test)."""
        return f"object-{uuid.uuid4().hex}.safetensors"


@contextlib.asynccontextmanager
async def _path(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    path = media.tmp_path / media.name()
    path.write_bytes(data)
    yield path


@contextlib.asynccontextmanager
async def _file_url(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    path = media.tmp_path / media.name()
    path.write_bytes(data)
    yield path.as_uri()


@contextlib.asynccontextmanager
async def _bytes(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    yield data


@contextlib.asynccontextmanager
async def _chunks(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    async def chunks() -> AsyncIterator[bytes]:
        sizes = (1, 7, 8, 4096, 65_537)
        position = step = 0
        while position < len(data):
            size = sizes[step % len(sizes)]
            yield data[position : position + size]
            position += size
            step += 1

    yield chunks()


class _ReadInto:
    """A producer that fills the reader's buffer itself, a few bytes fewer than asked."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._position = 0

    async def readinto(self, buffer: memoryview, /) -> int:
        await anyio.lowlevel.checkpoint()
        count = min(len(buffer), len(self._data) - self._position, 100_003)
        buffer[:count] = self._data[self._position : self._position + count]
        self._position += count
        return count


@contextlib.asynccontextmanager
async def _readinto(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    yield _ReadInto(data)


@contextlib.asynccontextmanager
async def _anyio_stream(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    send, receive = anyio.create_memory_object_stream[bytes](len(data) + 1)
    for start in range(0, len(data), 50_000):
        send.send_nowait(data[start : start + 50_000])
    send.close()
    yield BufferedByteReceiveStream(receive)


@contextlib.asynccontextmanager
async def _asyncio_stream(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    yield reader


@contextlib.asynccontextmanager
async def _tcp(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def _http(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    path = "/" + media.name()
    media.http.objects[path] = data
    yield media.http.url(path)


@contextlib.asynccontextmanager
async def _s3(media: Media, data: bytes) -> AsyncIterator[SourceLike]:
    key = media.name()
    client = media.moto.client()
    await anyio.to_thread.run_sync(
        lambda: client.put_object(Bucket="conformance", Key=key, Body=data)
    )
    yield S3Source(f"s3://conformance/{key}", config=media.s3)


SOURCES: dict[str, Callable[[Media, bytes], contextlib.AbstractAsyncContextManager[SourceLike]]] = {
    "path": _path,
    "file-url": _file_url,
    "bytes": _bytes,
    "chunks": _chunks,
    "readinto": _readinto,
    "anyio-stream": _anyio_stream,
    "asyncio-stream": _asyncio_stream,
    "tcp": _tcp,
    "http": _http,
    "s3": _s3,
}
RANDOM_ACCESS = {"path", "file-url", "http", "s3"}
"""Sources that can read a selection without the bytes before it."""


@pytest.fixture(scope="module")
def http_server() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as server:
        yield server


@pytest.fixture(scope="module")
def s3_config(moto_s3: MotoS3Server) -> S3Config:
    client = moto_s3.client()
    with contextlib.suppress(Exception):
        client.create_bucket(Bucket="conformance")
    return moto_s3.config()


@pytest.fixture
def media(
    tmp_path: Path, http_server: RangeHTTPServer, s3_config: S3Config, moto_s3: MotoS3Server
) -> Media:
    return Media(tmp_path, http_server, s3_config, moto_s3)


def _same(got: Arrays, expected: Arrays) -> None:
    assert list(got) == list(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name


def _in_offset_order(arrays: Arrays) -> Arrays:
    header = stream_st.parse_header(DATA[8 : 8 + int.from_bytes(DATA[:8], "little")])
    return {info.name: arrays[info.name] for info in header.tensors if info.name in arrays}


@pytest.mark.parametrize("medium", SOURCES)
async def test_source_reads_every_tensor_in_offset_order(medium: str, media: Media) -> None:
    async with SOURCES[medium](media, DATA) as source, stream_st.open_stream(source) as stream:
        assert stream.header.metadata == {"format": "np"}
        got = {name: array async for name, array in stream}
    _same(got, _in_offset_order(ARRAYS))


@pytest.mark.parametrize("medium", SOURCES)
async def test_source_reads_a_selection(medium: str, media: Media) -> None:
    wanted = ["bias", "flags"]
    async with (
        SOURCES[medium](media, DATA) as source,
        stream_st.open_stream(source, include=wanted) as stream,
    ):
        got = {name: array async for name, array in stream}
    _same(got, _in_offset_order({name: ARRAYS[name] for name in wanted}))


@pytest.mark.parametrize("medium", SOURCES)
async def test_source_header_alone(medium: str, media: Media) -> None:
    async with SOURCES[medium](media, DATA) as source:
        header = await stream_st.read_header(source)
    assert sorted(info.name for info in header.tensors) == sorted(ARRAYS)
    assert header.metadata == {"format": "np"}


@pytest.mark.parametrize("medium", SOURCES)
async def test_source_that_ends_inside_a_tensor(medium: str, media: Media) -> None:
    cut = DATA[: len(DATA) - 100_000]
    with pytest.raises(stream_st.TruncatedStreamError):
        async with SOURCES[medium](media, cut) as source, stream_st.open_stream(source) as stream:
            async for _ in stream:
                pass


@pytest.mark.parametrize("medium", SOURCES)
async def test_source_with_a_broken_header(medium: str, media: Media) -> None:
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 9]}}).encode()
    bad = len(header).to_bytes(8, "little") + header + bytes(9)
    with pytest.raises(stream_st.HeaderError):
        async with SOURCES[medium](media, bad) as source, stream_st.open_stream(source) as stream:
            async for _ in stream:
                pass


Open = Callable[[Media], Awaitable[tuple[SinkLike, Callable[[], Awaitable[bytes | None]]]]]
"""A medium's sink: ``(destination, read_back)``, where ``read_back()`` gives the bytes that
arrived (None: nothing was committed)."""


async def _sink_path(media: Media) -> tuple[SinkLike, Callable[[], Awaitable[bytes | None]]]:
    path = media.tmp_path / media.name()

    async def back() -> bytes | None:
        return path.read_bytes() if path.exists() else None

    return path, back


async def _sink_file_url(media: Media) -> tuple[SinkLike, Callable[[], Awaitable[bytes | None]]]:
    path = media.tmp_path / media.name()

    async def back() -> bytes | None:
        return path.read_bytes() if path.exists() else None

    return path.as_uri(), back


async def _sink_http(media: Media) -> tuple[SinkLike, Callable[[], Awaitable[bytes | None]]]:
    path = "/up/" + media.name()

    async def back() -> bytes | None:
        await anyio.to_thread.run_sync(media.http.settle)
        data = media.http.objects.get(path)
        return bytes(data) if data is not None else None

    return media.http.url(path), back


async def _sink_s3(media: Media) -> tuple[SinkLike, Callable[[], Awaitable[bytes | None]]]:
    key = media.name()

    async def back() -> bytes | None:
        return await anyio.to_thread.run_sync(media.get_object, key)

    return S3Sink(f"s3://conformance/{key}", config=media.s3), back


async def _sink_anyio_stream(
    media: Media,
) -> tuple[SinkLike, Callable[[], Awaitable[bytes | None]]]:
    send, receive = anyio.create_memory_object_stream[bytes](1 << 20)
    wrote = bytearray()

    class Collect(anyio.abc.ByteSendStream):
        async def send(self, item: bytes) -> None:
            wrote.extend(item)

        async def send_eof(self) -> None:
            pass

        async def aclose(self) -> None:
            pass

    send.close()
    receive.close()

    async def back() -> bytes | None:
        return bytes(wrote)

    return Collect(), back


SINKS: dict[str, Open] = {
    "path": _sink_path,
    "file-url": _sink_file_url,
    "http": _sink_http,
    "s3": _sink_s3,
    "anyio-stream": _sink_anyio_stream,
}
COMMITTED = {"path", "file-url", "http", "s3"}
"""Sinks that commit a whole object or nothing (a stream's peer sees a message end early)."""


def _plan() -> list[TensorSpec]:
    return [TensorSpec(name, array.dtype, array.shape) for name, array in ARRAYS.items()]


@pytest.mark.parametrize("medium", SINKS)
async def test_sink_takes_a_file_identical_to_the_reference(medium: str, media: Media) -> None:
    destination, back = await SINKS[medium](media)
    await stream_st.save(destination, ARRAYS, metadata={"format": "np"})
    assert await back() == DATA


@pytest.mark.parametrize("medium", SINKS)
async def test_sink_takes_tensors_one_by_one(medium: str, media: Media) -> None:
    destination, back = await SINKS[medium](media)
    async with stream_st.open_writer(destination, _plan(), metadata={"format": "np"}) as writer:
        for name, array in ARRAYS.items():
            await writer.write(name, array)
    data = await back()
    assert data is not None
    loaded = reference_numpy.load(data)
    _same({name: loaded[name] for name in ARRAYS}, ARRAYS)


class Boom(Exception):
    pass


@pytest.mark.parametrize("medium", sorted(COMMITTED))
async def test_failed_write_leaves_nothing(medium: str, media: Media) -> None:
    destination, back = await SINKS[medium](media)
    with pytest.raises(Boom):
        async with stream_st.open_writer(destination, _plan()) as writer:
            await writer.write("embed", ARRAYS["embed"])
            raise Boom
    await anyio.sleep(0.05)
    assert await back() is None
    if medium in ("path", "file-url"):
        assert list(media.tmp_path.iterdir()) == []

"""Network sinks against real servers: TCP peers, HTTP uploads, S3 multipart uploads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import TensorSpec
from stream_st.transports.http import HTTPStatusError
from stream_st.transports.http.sink import HttpSink
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.sink import MIN_PART_SIZE, S3Sink

from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]

TENSORS: Arrays = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.arange(5, dtype=np.int64),
    "s": np.array(1.5, dtype=np.float16),
}
BIG: Arrays = {f"w{i}": np.random.default_rng(i).random(600_000) for i in range(3)}  # 3 x 4.8 MB


def plan_of(arrays: Arrays) -> list[TensorSpec]:
    return [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]


def same(got: Arrays, expected: Arrays) -> None:
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].tobytes() == array.tobytes()


class Boom(Exception):
    pass


# ---------------------------------------------------------------- TCP


async def test_tcp_url_writer_and_listener() -> None:
    received: list[Arrays] = []
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def receive() -> None:
            async with await listener.accept() as connection:
                async for stream in connection.messages():
                    received.append({n: a async for n, a in stream})

        async with anyio.create_task_group() as group:
            group.start_soon(receive)
            await stream_st.save(listener.url, TENSORS)
    same(received[0], TENSORS)


async def test_connection_session_both_directions() -> None:
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def echo() -> None:  # reads each message and sends it back doubled
            async with await listener.accept() as connection:
                async for stream in connection.messages():
                    arrays = {n: a * 2 async for n, a in stream}
                    async with connection.open_writer(plan_of(arrays)) as writer:
                        for name, array in arrays.items():
                            await writer.write(name, array)

        async with anyio.create_task_group() as group:
            group.start_soon(echo)
            async with await stream_st.connect(listener.url, timeout=10) as connection:
                for round_ in range(3):
                    arrays = {k: v + round_ for k, v in TENSORS.items()}
                    async with connection.open_writer(plan_of(arrays)) as writer:
                        for name, array in arrays.items():
                            await writer.write(name, array)
                    async with connection.open_stream() as stream:
                        back = {n: a async for n, a in stream}
                    same(back, {k: v * 2 for k, v in arrays.items()})


async def test_tcp_writer_failure_leaves_the_peer_an_incomplete_message() -> None:
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:
        errors: list[BaseException] = []
        got: list[str] = []

        async def receive() -> None:
            async with await listener.accept() as connection:
                try:
                    async with connection.open_stream() as stream:
                        async for name, _ in stream:
                            got.append(name)
                except stream_st.SafetensorsError as exc:
                    errors.append(exc)

        async with anyio.create_task_group() as group:
            group.start_soon(receive)
            with pytest.raises(Boom):
                async with stream_st.open_writer(listener.url, plan_of(BIG)) as writer:
                    await writer.write("w0", BIG["w0"])
                    raise Boom
    assert isinstance(errors[0], stream_st.TruncatedStreamError)
    assert "w1" not in got


# ---------------------------------------------------------------- HTTP


@pytest.fixture
def http() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as server:
        yield server


async def test_http_upload_then_read_back(http: RangeHTTPServer) -> None:
    url = http.url("/up/model.safetensors")
    await stream_st.save(url, BIG, metadata={"k": "v"})
    assert http.objects["/up/model.safetensors"] == reference_numpy.save(BIG, metadata={"k": "v"})
    same(await stream_st.load(url), BIG)


async def test_http_chunked_post(http: RangeHTTPServer) -> None:
    sink = HttpSink(http.url("/post.safetensors"), method="POST")

    class NoSize(HttpSink):
        async def allocate(self, size: int) -> None:
            pass  # as if the size were unknown: chunked transfer encoding

    for target in (sink, NoSize(http.url("/chunked.safetensors"))):
        async with stream_st.open_writer(target, plan_of(TENSORS)) as writer:
            for name, array in TENSORS.items():
                await writer.write(name, array)
    same(reference_numpy.load(http.objects["/post.safetensors"]), TENSORS)
    same(reference_numpy.load(http.objects["/chunked.safetensors"]), TENSORS)


async def test_http_aborted_upload_stores_nothing(http: RangeHTTPServer) -> None:
    with pytest.raises(Boom):
        async with stream_st.open_writer(http.url("/x.safetensors"), plan_of(BIG)) as writer:
            await writer.write("w0", BIG["w0"])
            raise Boom
    await anyio.sleep(0.1)
    assert "/x.safetensors" not in http.objects


async def test_http_upload_refused(http: RangeHTTPServer) -> None:
    with pytest.raises(HTTPStatusError) as info:
        await stream_st.save(http.url("/x.safetensors?reject"), TENSORS)
    assert info.value.status == 500


# ---------------------------------------------------------------- S3


@pytest.fixture
def s3(moto_s3: MotoS3Server) -> tuple[MotoS3Server, S3Config]:
    client = moto_s3.client()
    client.create_bucket(Bucket="uploads")
    config = moto_s3.config()
    return moto_s3, config


def pending_uploads(server: MotoS3Server) -> list[Any]:
    answer = server.client().list_multipart_uploads(Bucket="uploads")
    return list(answer.get("Uploads", []))


def test_s3_part_size_below_the_minimum_is_a_usage_error() -> None:
    with pytest.raises(stream_st.UsageError, match="at least 5242880 bytes"):
        S3Sink("s3://uploads/x.safetensors", part_size=MIN_PART_SIZE - 1)


async def test_s3_multipart_upload(s3: tuple[MotoS3Server, S3Config]) -> None:
    server, config = s3
    sink = S3Sink("s3://uploads/m/big.safetensors", config=config, part_size=MIN_PART_SIZE)
    async with stream_st.open_writer(sink, plan_of(BIG)) as writer:
        for name, array in BIG.items():
            await writer.write(name, array)
    body = server.client().get_object(Bucket="uploads", Key="m/big.safetensors")["Body"].read()
    assert body == reference_numpy.save(BIG)
    assert pending_uploads(server) == []


async def test_s3_parts_grow_to_stay_within_the_part_limit(
    s3: tuple[MotoS3Server, S3Config],
) -> None:
    """A message larger than ``max_parts`` parts hold (S3: 10,000; 2 here) is uploaded in larger
    parts, its size over ``max_parts`` rounded up to a MiB, instead of being refused at the
    part past the last once the rest went up."""
    server, config = s3
    sink = S3Sink("s3://uploads/m/grown.safetensors", config=config, part_size=MIN_PART_SIZE)
    sink.max_parts = 2
    async with stream_st.open_writer(sink, plan_of(BIG)) as writer:
        for name, array in BIG.items():
            await writer.write(name, array)
    client = server.client()
    body = client.get_object(Bucket="uploads", Key="m/grown.safetensors")["Body"].read()
    assert body == reference_numpy.save(BIG)
    assert client.head_object(Bucket="uploads", Key="m/grown.safetensors")["ETag"].endswith('-2"')
    assert pending_uploads(server) == []


async def test_s3_a_message_past_the_part_limit_fails_before_sending(
    s3: tuple[MotoS3Server, S3Config],
) -> None:
    """Announced, a size past ``max_parts`` parts of 5 GiB is refused before any request; not
    announced, the part past the last is refused before it is sent, and the upload aborted."""
    server, config = s3
    sink = S3Sink("s3://uploads/m/huge.safetensors", config=config, part_size=MIN_PART_SIZE)
    sink.max_parts = 2
    with pytest.raises(stream_st.UsageError, match=r"more than 2 parts .* of 5368709120 bytes"):
        await sink.allocate(2 * (5 << 30) + 1)
    sink = S3Sink("s3://uploads/m/huge.safetensors", config=config, part_size=MIN_PART_SIZE)
    sink.max_parts = 2
    with pytest.raises(stream_st.UsageError, match=r"more than 2 parts .* not announced"):
        await sink.send(memoryview(bytes(3 * MIN_PART_SIZE)))
    assert pending_uploads(server) == []
    listing = server.client().list_objects_v2(Bucket="uploads", Prefix="m/huge")
    assert listing.get("KeyCount", 0) == 0


async def test_s3_small_object_in_one_put(
    s3: tuple[MotoS3Server, S3Config], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server, _ = s3
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    monkeypatch.setenv("HOME", str(tmp_path))
    await stream_st.save("s3://uploads/small.safetensors", TENSORS)
    same(await stream_st.load("s3://uploads/small.safetensors"), TENSORS)


async def test_s3_key_ending_in_a_slash_is_refused_as_a_directory(
    s3: tuple[MotoS3Server, S3Config], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``s3://bucket/models/`` names a prefix, as ``models/`` names a directory: refused before
    any request, as a local path is, where an object named ``models/`` was stored."""
    server, config = s3
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    monkeypatch.setenv("HOME", str(tmp_path))
    url = "s3://uploads/models/"
    message = r"s3://uploads/models/ names a directory \(it ends in '/'\)"
    with pytest.raises(stream_st.UsageError, match=message):
        await stream_st.save(url, TENSORS)
    with pytest.raises(stream_st.UsageError, match=message):
        async with stream_st.open_writer(url, plan_of(TENSORS)):
            pass
    with pytest.raises(stream_st.UsageError, match=message):
        S3Sink(url, config=config)
    assert server.client().list_objects_v2(Bucket="uploads", Prefix="models").get("KeyCount") == 0


async def test_s3_sink_given_to_a_second_write_is_refused(
    s3: tuple[MotoS3Server, S3Config],
) -> None:
    """An S3Sink takes one message: a second save of it is a UsageError, the object left as the
    first wrote it and no upload pending, where it was written again from its own state."""
    server, config = s3
    sink = S3Sink("s3://uploads/m/once.safetensors", config=config, part_size=MIN_PART_SIZE)
    await stream_st.save(sink, BIG)
    with pytest.raises(stream_st.UsageError, match="given to another write already"):
        await stream_st.save(sink, TENSORS)
    body = server.client().get_object(Bucket="uploads", Key="m/once.safetensors")["Body"].read()
    assert body == reference_numpy.save(BIG)
    assert pending_uploads(server) == []


@pytest.mark.parametrize("how", ["exception", "cancel", "missing tensor"])
async def test_s3_failed_upload_leaves_nothing(s3: tuple[MotoS3Server, S3Config], how: str) -> None:
    server, config = s3
    key = f"fail/{how.replace(' ', '-')}.safetensors"
    sink = S3Sink(f"s3://uploads/{key}", config=config, part_size=MIN_PART_SIZE)
    with anyio.CancelScope() as scope:
        try:
            async with stream_st.open_writer(sink, plan_of(BIG)) as writer:
                await writer.write("w0", BIG["w0"])
                await writer.write("w1", BIG["w1"])  # past the first part: an upload is open
                assert pending_uploads(server)
                if how == "exception":
                    raise Boom
                if how == "cancel":
                    scope.cancel()
                    await anyio.sleep(1)
        except (Boom, stream_st.WriterError):
            pass
    assert pending_uploads(server) == []
    listing = server.client().list_objects_v2(Bucket="uploads", Prefix="fail/")
    assert listing.get("KeyCount", 0) == 0

"""HTTP(S) sources against a real HTTP server on 127.0.0.1 (tests/servers/http_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy
import trio

import stream_st
from stream_st import ReadTimeoutError, TruncatedStreamError
from stream_st.transports.http import HTTPNotFoundError, HTTPStatusError
from stream_st.transports.http.source import FIRST_RANGE, HttpSource
from stream_st.transports.hub import HubSource
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.source import S3Source

from .._util import assert_same_arrays, sample_file, sample_tensors
from ..servers.http_server import RangeHTTPServer

Arrays = dict[str, np.ndarray[Any, Any]]

BIG: Arrays = {f"t{i}": np.random.default_rng(i).random(40_000 + i) for i in range(6)}  # ~2 MB


@pytest.fixture
def server() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as running:
        running.objects["/small.safetensors"] = sample_file({"k": "v"})
        running.objects["/big.safetensors"] = reference_numpy.save(BIG)
        yield running


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


def gets(server: RangeHTTPServer) -> list[tuple[str, str, str, int]]:
    server.settle()
    return [r for r in server.requests if r[0] == "GET"]


async def test_iterating_reads_everything_in_one_request(server: RangeHTTPServer) -> None:
    assert_same_arrays(await read_all(server.url("/small.safetensors")), sample_tensors())
    assert_same_arrays(await read_all(server.url("/big.safetensors")), BIG)
    assert [r[2] for r in gets(server)] == ["bytes=0-", "bytes=0-"]


async def test_header_first_then_the_rest(server: RangeHTTPServer) -> None:
    """With 'async with' the header may be all that is wanted: 64 KiB first, then the rest."""
    async with stream_st.open_stream(server.url("/big.safetensors")) as stream:
        assert len(stream.header) == len(BIG)
        assert_same_arrays({n: a async for n, a in stream}, BIG)
    size = len(server.objects["/big.safetensors"])
    assert [r[2] for r in gets(server)] == [
        f"bytes=0-{FIRST_RANGE - 1}",
        f"bytes={FIRST_RANGE}-{size - 1}",
    ]
    assert sum(r[3] for r in gets(server)) == size


async def test_header_only_costs_one_request(server: RangeHTTPServer) -> None:
    header = await stream_st.read_header(server.url("/big.safetensors"))
    assert header.names() == sorted(BIG, key=lambda n: header[n].start)
    assert len(gets(server)) == 1
    assert sum(r[3] for r in gets(server)) <= FIRST_RANGE


async def test_large_header_costs_two_requests(server: RangeHTTPServer) -> None:
    many = {f"tensor.with.a.long.name.{i:05d}": np.zeros(1, np.uint8) for i in range(3000)}
    data = reference_numpy.save(many)
    server.objects["/many.safetensors"] = data
    header = await stream_st.read_header(server.url("/many.safetensors"))
    assert len(header) == 3000 and header.header_size > FIRST_RANGE
    transferred = sum(r[3] for r in gets(server))
    assert len(gets(server)) == 2
    assert transferred <= 8 + header.header_size + FIRST_RANGE


async def test_include_fetches_only_selected_ranges(server: RangeHTTPServer) -> None:
    url = server.url("/big.safetensors")
    header = await stream_st.read_header(url)
    server.settle()
    server.requests.clear()
    names = header.names()
    wanted = [names[1], names[2], names[4]]  # 1 and 2 are adjacent: one request
    got = await read_all(url, include=wanted)
    assert_same_arrays(got, {n: BIG[n] for n in wanted})
    base = header.data_start
    ranges = [r[2] for r in gets(server)][1:]
    assert ranges == [
        f"bytes={base + header[names[1]].start}-{base + header[names[2]].end - 1}",
        f"bytes={base + header[names[4]].start}-{base + header[names[4]].end - 1}",
    ]
    assert sum(r[3] for r in gets(server)[1:]) == sum(header[n].nbytes for n in wanted)


async def test_server_without_range_support(server: RangeHTTPServer) -> None:
    server.no_range = True
    assert_same_arrays(await read_all(server.url("/big.safetensors")), BIG)
    assert len(gets(server)) == 1
    names = list(BIG)
    got = await read_all(server.url("/big.safetensors"), include=[names[3]])
    assert_same_arrays(got, {names[3]: BIG[names[3]]})


async def test_chunked_body_without_length(server: RangeHTTPServer) -> None:
    server.no_range = server.chunked = True
    assert_same_arrays(await read_all(server.url("/big.safetensors")), BIG)
    with pytest.raises(stream_st.TrailingDataError):
        server.objects["/trail.safetensors"] = server.objects["/big.safetensors"] + b"x"
        await read_all(server.url("/trail.safetensors"))


async def test_status_errors(server: RangeHTTPServer) -> None:
    with pytest.raises(HTTPNotFoundError) as missing:
        await read_all(server.url("/nope.safetensors"))
    assert isinstance(missing.value, stream_st.SourceNotFoundError)
    assert missing.value.status == 404
    assert missing.value.url == server.url("/nope.safetensors")
    server.status_for["/small.safetensors"] = 403
    with pytest.raises(HTTPStatusError) as forbidden:
        await read_all(server.url("/small.safetensors"))
    assert forbidden.value.status == 403
    assert "403" in str(forbidden.value) and "/small.safetensors" in str(forbidden.value)


async def test_transient_errors_are_retried(server: RangeHTTPServer) -> None:
    server.fail_first = 2
    source = HttpSource(server.url("/small.safetensors"), backoff=0.01)
    assert_same_arrays(await read_all(source), sample_tensors())
    assert [r[2] for r in gets(server)].count("bytes=0-") == 3
    server.status_for["/small.safetensors"] = 500
    with pytest.raises(HTTPStatusError) as failed:
        await read_all(HttpSource(server.url("/small.safetensors"), retries=1, backoff=0.01))
    assert failed.value.status == 500


async def test_broken_transfer_is_resumed(server: RangeHTTPServer) -> None:
    server.close_after = 500_000
    server.close_once = True
    assert_same_arrays(await read_all(server.url("/big.safetensors")), BIG)
    ranges = [r[2] for r in gets(server)]
    assert ranges[0] == "bytes=0-" and ranges[1].startswith("bytes=500000-")
    assert len(ranges) == 2  # everything (broken at 500000), then the rest from there


async def test_server_closing_mid_body_is_a_truncation(server: RangeHTTPServer) -> None:
    server.no_range = True  # nothing to resume from
    server.close_after = 1_000_000
    got: Arrays = {}
    url = server.url("/big.safetensors")
    with pytest.raises(TruncatedStreamError) as info:
        async for name, array in stream_st.open_stream(url):
            got[name] = array
    assert info.value.offset == 1_000_000
    assert url in str(info.value)
    assert info.value.name not in got
    for name, array in got.items():
        assert array.tobytes() == BIG[name].tobytes()


async def test_ranged_truncation_after_retries(server: RangeHTTPServer) -> None:
    """Each read gets ``retries`` resumptions; a tensor that needs more is reported short."""
    server.objects["/one.safetensors"] = data = reference_numpy.save({"one": np.ones(250_000)})
    server.close_after = 300_000
    source = HttpSource(server.url("/one.safetensors"), retries=2, backoff=0.01)
    with pytest.raises(TruncatedStreamError) as info:
        await read_all(source)
    assert info.value.name == "one"
    assert info.value.offset == 3 * 300_000  # the first answer and two resumptions
    assert info.value.expected == len(data)


async def test_stalled_server_times_out(server: RangeHTTPServer) -> None:
    server.stall_after = 200_000
    server.no_range = True
    with pytest.raises(ReadTimeoutError) as info:
        await read_all(server.url("/big.safetensors"), timeout=0.3)
    assert info.value.url == server.url("/big.safetensors")


async def test_empty_object_and_bad_url(server: RangeHTTPServer) -> None:
    server.objects["/empty"] = b""
    with pytest.raises(stream_st.HeaderError, match="8-byte"):
        await read_all(server.url("/empty"))
    with pytest.raises(stream_st.TransportError):
        await read_all("http://127.0.0.1:1/x.safetensors")


def test_http_on_trio(server: RangeHTTPServer) -> None:
    async def main() -> Arrays:
        return await read_all(server.url("/big.safetensors"))

    assert_same_arrays(trio.run(main), BIG)


async def test_parallel_ranges_deliver_in_offset_order(server: RangeHTTPServer) -> None:
    url = server.url("/big.safetensors")
    header = await stream_st.read_header(url)
    server.settle()
    server.requests.clear()
    source = HttpSource(url, concurrency=4, part_size=100_000)
    order = []
    async for name, array in stream_st.open_stream(source):
        order.append(name)
        assert array.tobytes() == BIG[name].tobytes()
    assert order == header.names()
    data_gets = gets(server)[1:]
    assert len(data_gets) >= (header.file_size - FIRST_RANGE) // 100_000
    assert sum(r[3] for r in gets(server)) == header.file_size  # every byte fetched once


async def test_parallel_ranges_with_include(server: RangeHTTPServer) -> None:
    url = server.url("/big.safetensors")
    names = (await stream_st.read_header(url)).names()
    wanted = [names[0], names[3], names[5]]
    source = HttpSource(url, concurrency=3, part_size=64_000)
    assert_same_arrays(await read_all(source, include=wanted), {n: BIG[n] for n in wanted})


async def test_parallel_truncation(server: RangeHTTPServer) -> None:
    server.close_after = 50_000
    source = HttpSource(server.url("/big.safetensors"), concurrency=4, part_size=100_000, retries=0)
    got: Arrays = {}
    with pytest.raises(TruncatedStreamError) as info:
        async for name, array in stream_st.open_stream(source):
            got[name] = array
    assert info.value.name not in got
    assert info.value.offset == FIRST_RANGE + 50_000 or info.value.offset < FIRST_RANGE + 50_000


async def test_parallel_failure_is_our_error_not_a_group(server: RangeHTTPServer) -> None:
    source = HttpSource(server.url("/big.safetensors"), concurrency=4, part_size=100_000, retries=0)
    async with stream_st.open_stream(source) as stream:
        server.status_for["/big.safetensors"] = 404  # after the header: the parts fail
        with pytest.raises(stream_st.SourceNotFoundError, match="404"):
            async for _ in stream:
                pass


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("part_size", float("nan"), stream_st.ArgumentTypeError, "part_size must be an integer"),
        ("part_size", 1000.5, stream_st.ArgumentTypeError, "part_size must be an integer"),
        ("part_size", 0, stream_st.UsageError, r"part_size must be an integer >= 1"),
        ("retries", 2.5, stream_st.ArgumentTypeError, "retries must be an integer"),
        ("retries", float("nan"), stream_st.ArgumentTypeError, "retries must be an integer"),
        ("retries", -1, stream_st.UsageError, "retries must be an integer >= 0"),
        ("backoff", -1, stream_st.UsageError, "backoff must be a number >= 0"),
        ("backoff", float("nan"), stream_st.UsageError, "backoff must be a number >= 0"),
        ("backoff", float("inf"), stream_st.UsageError, "backoff must be finite"),
        ("backoff", None, stream_st.ArgumentTypeError, "backoff must be a number"),
        ("backoff", "1", stream_st.ArgumentTypeError, "backoff must be a number"),
        ("backoff", True, stream_st.ArgumentTypeError, "backoff must be a number"),
        ("backoff", [1], stream_st.ArgumentTypeError, "backoff must be a number"),
        ("concurrency", 1.5, stream_st.ArgumentTypeError, "concurrency must be an integer"),
    ],
)
@pytest.mark.parametrize("kind", ["http", "s3", "hf"])
def test_bad_numeric_options_are_refused_as_the_source_is_made(
    kind: str, option: str, value: object, error: type[Exception], message: str
) -> None:
    """A NaN part_size passed the old check (NaN < 1 is false) and the read then fetched 1-byte
    parts for ever; a float retries was a bare TypeError mid-read; a negative backoff passed."""
    made = {
        "http": lambda **kw: HttpSource("http://127.0.0.1:9/m.safetensors", **kw),
        "s3": lambda **kw: S3Source(
            "s3://b/m.safetensors", config=S3Config("http://127.0.0.1:9", "us-east-1"), **kw
        ),
        "hf": lambda **kw: HubSource("hf://org/repo/m.safetensors", token="", **kw),
    }[kind]
    with pytest.raises(error, match=message) as info:
        made(**{option: value})
    assert isinstance(info.value, stream_st.SafetensorsError)


async def test_an_aiohttp_response_body_is_read_as_chunks(server: RangeHTTPServer) -> None:
    """aiohttp's ``response.content`` is an async iterable of *lines*: given as a source it was
    read line by line, and a tensor of 512 KiB without a newline byte failed with aiohttp's own
    LineTooLong. Its chunks are read now, as they come."""
    aiohttp = pytest.importorskip("aiohttp")
    tensors = {"w": np.full(1 << 20, 11, np.uint8)}  # no newline byte at all
    server.objects["/w.safetensors"] = reference_numpy.save(tensors)
    async with (
        aiohttp.ClientSession() as session,
        session.get(server.url("/w.safetensors")) as response,
    ):
        assert_same_arrays(await stream_st.load(response.content), tensors)


async def test_an_aiohttp_body_cut_short_or_read_twice_is_our_error(
    server: RangeHTTPServer,
) -> None:
    """A body cut short raised aiohttp's own ClientPayloadError, and two streams over one
    ``response.content`` a bare RuntimeError ('readany() called while another coroutine is
    already waiting'): each ``iter_any()`` is a new iterator, so the claim never saw the second."""
    aiohttp = pytest.importorskip("aiohttp")
    tensors = {"w": np.full(1 << 20, 11, np.uint8)}
    data = reference_numpy.save(tensors)
    server.objects["/w.safetensors"] = data
    server.close_after = len(data) // 2
    async with (
        aiohttp.ClientSession() as session,
        session.get(server.url("/w.safetensors")) as response,
    ):
        with pytest.raises(stream_st.TransportError, match="read failed") as info:
            await stream_st.load(response.content)
        assert info.value.position is not None and 0 < info.value.position < len(data)
    async with (
        aiohttp.ClientSession() as session,
        session.get(server.url("/w.safetensors")) as response,
    ):
        first = stream_st.open_stream(response.content)
        await first.open()
        with pytest.raises(stream_st.UsageError, match="being read by another stream"):
            await stream_st.load(response.content)
        await first.aclose()

"""The streaming reader over every local source kind: paths, bytes, iterators, byte streams."""

from __future__ import annotations

import asyncio
import gc
import os
import pathlib
import time
import traceback
import tracemalloc
import warnings
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
import trio

import stream_st
import stream_st.compat._errors
from stream_st import (
    CacheMissError,
    DistributedError,
    HeaderError,
    HeaderTooLargeError,
    HTTPNotFoundError,
    HTTPStatusError,
    IntegrityError,
    RankFailedError,
    SafetensorsError,
    SourceNotFoundError,
    TensorNotFoundError,
    TrailingDataError,
    TransportError,
    TruncatedStreamError,
    UnsupportedSourceError,
    UsageError,
    WriterError,
)
from stream_st.compat._errors import FileClosedError, NoSuchFileError, UnencodableTextError
from stream_st.reader import merge_ranges
from stream_st.transports.base import TURN_EVERY, Waits
from stream_st.transports.file.source import FileSource
from stream_st.transports.inmemory import BytesSource, ChunkIteratorSource

from .._util import assert_same_arrays, chunked, raw_file, sample_file, sample_tensors
from ..conftest import StartSender

Arrays = dict[str, np.ndarray[Any, Any]]


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


@pytest.fixture
def sample_path(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "sample.safetensors"
    path.write_bytes(sample_file({"format": "np", "note": "ünïcode"}))
    return path


# ---------------------------------------------------------------- source kinds


async def test_path_kinds(sample_path: pathlib.Path) -> None:
    expected = sample_tensors()
    for source in (sample_path, str(sample_path), sample_path.as_uri()):
        assert_same_arrays(await read_all(source), expected)


async def test_bytes_kinds() -> None:
    data = sample_file()
    for source in (data, bytearray(data), memoryview(data)):
        assert_same_arrays(await read_all(source), sample_tensors())


@pytest.mark.parametrize(
    "given", [b"/models/m.safetensors", b"https://user:pw@host/m?token=T", b"m.safetensors"]
)
async def test_a_path_given_as_bytes_is_refused_as_such(given: bytes) -> None:
    """Bytes are a file's contents: a path or address given as bytes is named as the mistake
    (not "not a safetensors file"), its secrets masked."""
    with pytest.raises(stream_st.UsageError, match="given as bytes") as caught:
        await stream_st.read_header(given)
    assert "pw" not in str(caught.value) and "T'" not in str(caught.value)
    with pytest.raises(stream_st.HeaderError, match="not a safetensors file"):
        await stream_st.read_header(b"not a path, and no file")


async def test_header_and_metadata_before_data(sample_path: pathlib.Path) -> None:
    async with stream_st.open_stream(sample_path) as stream:
        assert stream.header.metadata == {"format": "np", "note": "ünïcode"}
        names = [t.name for t in stream.header.tensors]
        starts = [t.start for t in stream.header.tensors]
        assert starts == sorted(starts)
        got = [name async for name, _ in stream]
    assert got == names


async def test_empty_metadata_is_an_empty_dict() -> None:
    async with stream_st.open_stream(sample_file()) as stream:
        assert stream.header.metadata == {}


async def test_offset_order_and_fresh_writable_arrays() -> None:
    seen = []
    async for name, array in stream_st.open_stream(sample_file()):
        assert array.flags.writeable and array.flags.c_contiguous and array.flags.owndata is False
        array[...] = 0  # ours to change
        seen.append(name)
    header = await stream_st.read_header(sample_file())
    assert seen == header.names()


async def test_every_chunk_size_from_an_async_iterator() -> None:
    data = sample_file({"k": "v"})
    for size in range(1, 65):
        assert_same_arrays(await read_all(chunked(data, size)), sample_tensors())


async def test_chunks_of_mixed_types_and_empty_chunks() -> None:
    data = sample_file()

    async def mixed() -> Any:
        yield b""
        yield bytearray(data[:5])
        yield memoryview(data)[5:100]
        yield b""
        yield np.frombuffer(data[100:], dtype=np.uint8)

    assert_same_arrays(await read_all(mixed()), sample_tensors())


async def test_empty_buffers_of_any_shape_are_no_bytes() -> None:
    """An empty buffer of a shape with a 0 in it (0 by 3) is a chunk skipped as b"" is, and
    given as the whole file one too short as b"" is, where a bare TypeError escaped (memoryview
    cannot cast it to bytes)."""
    data = sample_file()

    async def chunks() -> AsyncIterator[Any]:
        yield np.zeros((0, 3), np.float32)
        yield data[:50]
        yield np.zeros((2, 0), np.uint8).data
        yield data[50:]

    assert_same_arrays(await read_all(chunks()), sample_tensors())
    for whole in (b"", np.zeros((0, 4), np.float32).data):
        with pytest.raises(HeaderError, match="got only 0 bytes"):
            await read_all(whole)


async def test_chunk_that_is_not_bytes() -> None:
    for chunk in ("text", np.zeros(2, "M8[s]")):  # datetime64 exports no buffer

        async def bad(chunk: Any = chunk) -> Any:
            yield chunk

        with pytest.raises(UnsupportedSourceError, match="bytes-like"):
            await read_all(bad())


class OneChunk:
    """An async iterator of one chunk, as a class: subclasses bend the protocol."""

    def __init__(self, data: bytes) -> None:
        self.data: bytes | None = data

    def __aiter__(self) -> OneChunk:
        return self

    async def __anext__(self) -> bytes:
        data, self.data = self.data, None
        if data is None:
            raise StopAsyncIteration
        return data


class PlainAclose(OneChunk):
    closed = False

    def aclose(self) -> None:  # a wrapper's close given that name
        self.closed = True


class AsyncAiter(OneChunk):
    async def __aiter__(self) -> OneChunk:  # type: ignore[override]  # the old protocol
        return self


class PlainAnext(OneChunk):
    def __anext__(self) -> bytes:  # type: ignore[override]  # the 'async' forgotten
        return self.data or b""


async def test_chunk_iterators_that_bend_the_protocol() -> None:
    """A plain ``aclose`` is called, not awaited (the file was read, then a bare TypeError at the
    close); an ``async def __aiter__`` or a plain ``__anext__`` is an UnsupportedSourceError
    naming the break, where both were bare TypeErrors."""
    data = sample_file()
    closing = PlainAclose(data)
    assert_same_arrays(await stream_st.load(closing), sample_tensors())
    assert closing.closed
    with pytest.raises(
        UnsupportedSourceError, match=r"AsyncAiter.__aiter__ must .* not 'async def'"
    ):
        await stream_st.load(AsyncAiter(data))  # type: ignore[arg-type]  # the point
    with pytest.raises(UnsupportedSourceError, match=r"PlainAnext.__anext__ returned a bytes, not"):
        await stream_st.load(PlainAnext(data))


async def test_a_released_memoryview_is_named_as_such() -> None:
    """Given as the file, as a chunk or as into= memory: a SafetensorsError saying it was
    released, where a bare ValueError escaped ('operation forbidden on released memoryview
    object'), and a chunk was 'not bytes-like'."""
    data = sample_file()
    released = memoryview(bytearray(data))
    released.release()

    async def chunks() -> AsyncIterator[memoryview]:
        yield released

    for source in (released, chunks()):
        with pytest.raises(UnsupportedSourceError, match="memoryview given was released"):
            await stream_st.read_header(source)
    with pytest.raises(UnsupportedSourceError, match="memoryview given was released"):
        await stream_st.load(released)
    name = next(iter(sample_tensors()))
    with pytest.raises(UsageError, match=f"into='{name}'.* a released memoryview"):
        await read_all(data, into={name: released})


async def test_into_names_that_are_no_strings_are_refused_as_such() -> None:
    """into= with names of mixed types escaped as a bare TypeError (sorting them for the names
    the header lacks), and a lone non-str name was "not in the header": refused as include=
    refuses one, naming its type."""
    data = sample_file()
    name = next(iter(sample_tensors()))
    for into in ({1: bytearray(4), name: bytearray(4)}, {1: bytearray(4)}):
        with pytest.raises(stream_st.ArgumentTypeError, match="into= names are str, got int 1"):
            await read_all(data, into=into)
    with pytest.raises(stream_st.ArgumentTypeError, match="got int <an integer of 16610 bits>"):
        await read_all(data, into={10**5000: bytearray(4)})  # too long for repr


async def test_non_contiguous_buffers_are_read_in_c_order() -> None:
    data = sample_file()
    assert len(data) % 4 == 0
    strided = np.zeros((len(data) // 4, 2), np.uint32)
    strided[:, 0] = np.frombuffer(data, np.uint32)
    column = strided[:, 0]
    assert not column.flags.c_contiguous

    async def chunks() -> Any:
        yield column[:4]
        yield column[4:].data

    for source in (column.data, chunks()):
        assert_same_arrays(await read_all(source), sample_tensors())


async def test_anyio_socket_stream(tcp_sender: StartSender) -> None:
    port = await tcp_sender(sample_file())
    async with await anyio.connect_tcp("127.0.0.1", port) as connection:
        assert_same_arrays(await read_all(connection), sample_tensors())


async def test_asyncio_stream_reader(tcp_sender: StartSender) -> None:
    port = await tcp_sender(sample_file())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert_same_arrays(await read_all(reader), sample_tensors())
    finally:
        writer.close()
        await writer.wait_closed()


async def test_messages_back_to_back_on_one_connection(tcp_sender: StartSender) -> None:
    first: Arrays = {"a": np.arange(10, dtype=np.int32)}
    second: Arrays = {"b": np.ones((2, 2), dtype=np.float32), "c": np.zeros(0, dtype=np.uint8)}
    payload = reference_numpy.save(first) + reference_numpy.save(second) + b"rest"
    port = await tcp_sender(payload)
    async with await anyio.connect_tcp("127.0.0.1", port) as connection:
        assert_same_arrays(await read_all(connection), first)
        assert_same_arrays(await read_all(connection, include=["c"]), {"c": second["c"]})
        assert await connection.receive() == b"rest"  # left unread for the next user


@pytest.mark.parametrize("kind", ["anyio", "asyncio"])
async def test_a_caller_stream_keeps_the_rules_of_a_connection(
    tcp_sender: StartSender, kind: str
) -> None:
    """As on a tcp:// connection: a second message opened while one is read, and any message
    after one left part way (a break), are a UsageError (the rest of the first message was
    parsed as a header: HeaderError, 'not a safetensors file'); whichever source is made for
    the caller's stream."""
    message = reference_numpy.save({f"t{i}": np.full(1000, i, np.float32) for i in range(3)})
    port = await tcp_sender(message * 3)
    if kind == "anyio":
        stream: Any = await anyio.connect_tcp("127.0.0.1", port)
    else:
        stream, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert len(await read_all(stream)) == 3  # read to its end: the next one may start
        async with stream_st.open_stream(stream) as first:
            with pytest.raises(UsageError, match="still being read"):
                await stream_st.open_stream(stream).open()
            async for _ in first:
                break
        with pytest.raises(UsageError, match="left at its byte"):
            await read_all(stream)
    finally:
        if kind == "anyio":
            await stream.aclose()
        else:
            writer.close()
            await writer.wait_closed()


async def test_connection_that_ends_mid_tensor(tcp_sender: StartSender) -> None:
    data = sample_file()
    port = await tcp_sender(data[:-3])
    async with await anyio.connect_tcp("127.0.0.1", port) as connection:
        got: Arrays = {}
        with pytest.raises(TruncatedStreamError) as info:
            async for name, array in stream_st.open_stream(connection):
                got[name] = array
    header = await stream_st.read_header(data)
    last = header.tensors[-1]
    assert info.value.name == last.name
    assert info.value.expected == header.data_start + last.end
    assert info.value.offset == len(data) - 3
    assert last.name not in got


def test_runs_on_trio(sample_path: pathlib.Path) -> None:
    async def main() -> Arrays:
        return await read_all(sample_path) | await read_all(chunked(sample_file(), 7))

    assert_same_arrays(trio.run(main), sample_tensors())


# ---------------------------------------------------------------- include=


async def test_include_names_predicate_and_single_name(sample_path: pathlib.Path) -> None:
    expected = sample_tensors()
    got = await read_all(sample_path, include=["bias", "empty"])
    assert_same_arrays(got, {k: expected[k] for k in ("bias", "empty")})
    got = await read_all(chunked(sample_file(), 3), include=lambda n: n.startswith("s"))
    assert_same_arrays(got, {"scalar": expected["scalar"]})
    assert list(await read_all(sample_path, include="weight")) == ["weight"]


async def test_include_an_iterator_is_taken_once(sample_path: pathlib.Path) -> None:
    """The stream looks at include= more than once (selected(), the iteration): an iterator's
    names are kept, where its first look spent it and the iteration handed out nothing."""
    names = iter(["bias", "weight"])  # an Iterable, not the Collection the type says
    async with stream_st.open_stream(sample_path, include=names) as stream:  # type: ignore[call-overload]
        assert [info.name for info in stream.selected()] == ["bias", "weight"]
        assert [info.name for info in stream.selected()] == ["bias", "weight"]
        assert [name async for name, _ in stream] == ["bias", "weight"]
    with pytest.raises(TensorNotFoundError, match="nope"):
        await read_all(sample_path, include=(name for name in ["weight", "nope"]))


async def test_include_unknown_name(sample_path: pathlib.Path) -> None:
    with pytest.raises(TensorNotFoundError, match="nope"):
        await read_all(sample_path, include=["weight", "nope"])


async def test_include_unknown_names_error_is_bounded(sample_path: pathlib.Path) -> None:
    """``include=`` naming 10**5 tensors the file lacks listed every one (a 2.9 MB message),
    through ``load`` and the stream's iteration; it now lists the first 8 and how many more. A
    short list is shown whole, as before."""
    wanted = [f"model.layers.{i}.weight" for i in range(10**5)]
    expected = f"include= names tensors not in the header: {sorted(wanted)[:8]} and 99992 more"
    for reading in (stream_st.load, read_all):
        with pytest.raises(TensorNotFoundError) as info:
            await reading(sample_path, include=wanted)
        assert str(info.value) == expected, str(info.value)[:500]
    with pytest.raises(TensorNotFoundError) as info:
        await stream_st.load(sample_path, include=["weight", "nope", "nix"])
    assert str(info.value) == "include= names tensors not in the header: ['nix', 'nope']"


async def test_into_unknown_names_error_tells_how_many_more(sample_path: pathlib.Path) -> None:
    """``into=`` naming tensors the file lacks lists the first 8 and how many more (it listed
    the first 8 alone, saying nothing of the rest), as ``include=`` does."""
    into = {f"x{i:02}": np.empty(1, np.float32) for i in range(20)}
    with pytest.raises(TensorNotFoundError) as info:
        await read_all(sample_path, into=into)
    expected = f"into= names tensors not in the header: {sorted(into)[:8]} and 12 more"
    assert str(info.value) == expected


@pytest.mark.parametrize("include", [5, 1.5, [["weight"]]], ids=["int", "float", "nested"])
async def test_include_neither_names_nor_a_predicate(
    sample_path: pathlib.Path, include: Any
) -> None:
    with pytest.raises(UsageError, match=r"^include= takes .* got ") as caught:
        await read_all(sample_path, include=include)
    assert isinstance(caught.value, TypeError)
    with pytest.raises(UsageError, match="include="):
        await stream_st.load(sample_path, include=include)


async def test_skipped_tensors_are_not_read_from_a_file(tmp_path: pathlib.Path) -> None:
    tensors = {f"t{i}": np.full(1000, i, dtype=np.float64) for i in range(10)}
    path = tmp_path / "f.safetensors"
    reference_numpy.save_file(tensors, str(path))
    reads: list[tuple[int, int]] = []

    class CountingFile(FileSource):
        async def read_into_at(self, offset: int, buffer: memoryview) -> int:
            reads.append((offset, len(buffer)))
            return await super().read_into_at(offset, buffer)

    source = CountingFile(path)
    got = await read_all(source, include=["t3", "t7"])
    assert_same_arrays(got, {k: tensors[k] for k in ("t3", "t7")})
    data_reads = [size for _, size in reads if size == 8000]
    assert data_reads == [8000, 8000]
    assert sum(size for _, size in reads) < 2 * 8000 + 1000


async def test_skipped_tensors_are_discarded_from_a_stream() -> None:
    tensors = {f"t{i}": np.full(300_000, i, dtype=np.float64) for i in range(4)}
    data = reference_numpy.save(tensors)
    got = await read_all(chunked(data, 1 << 16), include=["t2"])
    assert_same_arrays(got, {"t2": tensors["t2"]})
    with pytest.raises(TrailingDataError):  # the skipped tail is still checked
        await read_all(chunked(data + b"x", 1 << 16), include=["t0"])


# ---------------------------------------------------------------- truncation and trailing bytes


@pytest.mark.parametrize("include", [None, ["bias"], ["weight"], ["flags"]])
async def test_every_truncation_point(include: list[str] | None) -> None:
    """Cut anywhere, a source of known or unknown length names the tensor the bytes ran out
    in, also when it was skipped (before or after the ones asked for), never a later one."""
    data = sample_file({"k": "v"})
    header = await stream_st.read_header(data)
    assert header.names() == ["bias", "scalar", "weight", "empty", "bytes", "flags"]
    expected = sample_tensors()
    for cut in range(len(data)):
        for source in (data[:cut], chunked(data[:cut], 5)):
            got: Arrays = {}
            with pytest.raises((HeaderError, TruncatedStreamError)) as info:
                async for name, array in stream_st.open_stream(source, include=include):
                    got[name] = array
            for name, array in got.items():  # whatever was yielded is whole and right
                assert array.tobytes() == expected[name].tobytes()
            error = info.value
            if cut < 8:
                assert isinstance(error, HeaderError)
                continue
            assert isinstance(error, TruncatedStreamError)
            if cut < header.data_start:
                assert error.name is None
                assert error.expected == header.data_start
            else:
                short = next(t for t in header if header.data_start + t.end > cut)
                assert error.name == short.name
                assert error.expected == header.data_start + short.end
                assert short.name not in got
            assert error.offset == cut


async def test_trailing_bytes_refused_on_whole_objects(sample_path: pathlib.Path) -> None:
    data = sample_file() + b"\0"
    with pytest.raises(TrailingDataError, match="1 bytes follow"):
        await read_all(data)
    with pytest.raises(TrailingDataError):
        await read_all(chunked(data, 4))
    await anyio.Path(sample_path).write_bytes(data)
    with pytest.raises(TrailingDataError):
        await read_all(sample_path)


async def test_huge_claim_fails_without_allocating() -> None:
    terabyte = 1 << 40
    data = raw_file(
        {"big": {"dtype": "U8", "shape": [terabyte], "data_offsets": [0, terabyte]}}, b"0123456789"
    )
    tracemalloc.start()
    try:
        with pytest.raises(TruncatedStreamError, match="'big'"):
            await read_all(data)
        with pytest.raises(stream_st.SafetensorsError):
            await read_all(chunked(data, 4096))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


async def test_oversized_header_length_refused_before_reading() -> None:
    data = raw_file("{}", pad=2000)
    with pytest.raises(stream_st.HeaderTooLargeError):
        await read_all(data, max_header_size=1000)
    assert await read_all(data, max_header_size=4096) == {}


async def test_header_past_the_end_of_a_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(raw_file('{"a": 1}')[:-2])
    with pytest.raises(TruncatedStreamError, match="header"):
        await read_all(path)


@pytest.mark.parametrize(
    ("shape", "message"),
    [([1] * 65, "65 dimensions"), ([0, 2**64 - 1], "too large for a numpy array")],
)
async def test_shape_numpy_cannot_hold_is_refused_before_any_tensor(
    shape: list[int], message: str
) -> None:
    size = 0 if 0 in shape else 1
    data = raw_file(
        {
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "b": {"dtype": "U8", "shape": shape, "data_offsets": [1, 1 + size]},
        },
        bytes(1 + size),
    )
    got: list[str] = []
    with pytest.raises(HeaderError, match=message):
        async for name, _ in stream_st.open_stream(data):
            got.append(name)
    assert got == []


async def test_bad_header_is_refused_before_any_tensor() -> None:
    good = sample_file()
    bad = good.replace(b'"F32"', b'"F33"')
    got: list[str] = []
    with pytest.raises(HeaderError, match="F33"):
        async for name, _ in stream_st.open_stream(chunked(bad, 1)):
            got.append(name)
    assert got == []


# ---------------------------------------------------------------- every dtype, packed types


async def test_every_dtype_comes_out_with_its_numpy_dtype() -> None:
    obj: dict[str, Any] = {}
    data = bytearray()
    for code, dtype in stream_st.DTYPES.items():
        size = 12 * dtype.bits // 8
        obj[code] = {"dtype": code, "shape": [3, 4], "data_offsets": [len(data), len(data) + size]}
        data += bytes((len(data) + i) % 251 for i in range(size))
    got = await read_all(raw_file(obj, bytes(data)))
    for code, dtype in stream_st.DTYPES.items():
        array = got[code]
        assert array.dtype == dtype.numpy
        start, end = obj[code]["data_offsets"]
        assert array.tobytes() == bytes(data[start:end])
        if dtype.packed:
            assert array.shape == ((3, 2) if code == "F4" else (9,))
        else:
            assert array.shape == (3, 4)


# ---------------------------------------------------------------- misuse


async def test_header_before_open_and_double_iteration() -> None:
    stream = stream_st.open_stream(sample_file())
    with pytest.raises(UsageError):
        _ = stream.header
    async with stream:
        async for _ in stream:
            pass
        with pytest.raises(UsageError):
            stream.__aiter__()


async def test_a_closed_stream_does_not_open_again(sample_path: pathlib.Path) -> None:
    """open() and 'async with' after aclose() are a UsageError, also once the header was read
    (they gave the header, and the iteration then said 'not open')."""
    stream = stream_st.open_stream(sample_path)
    async with stream:
        pass
    with pytest.raises(UsageError, match="the stream is closed"):
        await stream.open()
    with pytest.raises(UsageError, match="the stream is closed"):
        async with stream:
            pass


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_source_given_is_closed_by_a_read_cancelled_before_its_first_step(
    sample_path: pathlib.Path, backend: str
) -> None:
    """A Source object given to a read cancelled before its first step (``load``, a stream in
    ``async with``, ``read_header``) is closed as the read would have closed it: it kept its
    file open until the garbage collector came, with a ResourceWarning. A stream closed before
    it opened its Source leaves it to its owner (another stream may read it)."""

    async def main() -> tuple[list[FileSource], dict[str, Any]]:
        given = []
        for how in ("load", "stream", "header"):
            source = FileSource(sample_path)
            given.append(source)
            with anyio.CancelScope() as scope:
                scope.cancel()
                if how == "load":
                    await stream_st.load(source)
                elif how == "stream":
                    async with stream_st.open_stream(source):
                        pass
                else:
                    await stream_st.read_header(source)
        shared = FileSource(sample_path)
        used = stream_st.open_stream(shared)
        await stream_st.open_stream(shared).aclose()  # never opened: not its to close
        async with used:
            return given, {name: array async for name, array in used}

    given, arrays = anyio.run(main, backend=backend)
    for source in given:
        assert source._fd < 0, source
    assert_same_arrays(arrays, sample_tensors())


def test_a_stream_used_with_plain_with_or_for_says_async(sample_path: pathlib.Path) -> None:
    """A UsageError naming the async form, where Python's was a bare TypeError ('does not
    support the context manager protocol', 'is not iterable')."""
    message = "TensorStream is an async context manager: use `async with`"
    with pytest.raises(UsageError, match=message), stream_st.open_stream(sample_path):
        pass
    with pytest.raises(UsageError, match="TensorStream is an async iterator: use `async for`"):
        for _ in stream_st.open_stream(sample_path):
            pass


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_mapped_stream_closed_from_another_task(tmp_path: pathlib.Path, backend: str) -> None:
    """copy=False: the loop's next step is a TransportError ("closed on this side"), never a
    bare OSError from the closed descriptor, nor views handed out of a closed stream. 24 MiB:
    populating the mapping gives the loop two turns at least, so the close comes mid-step (one
    would not do under trio, which may run the step on first)."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file({f"t{i}": np.full(1 << 18, i, np.float32) for i in range(24)}, path)

    async def main() -> None:
        stream = stream_st.open_stream(path, copy=False)
        async with stream, anyio.create_task_group() as group:
            group.start_soon(stream.aclose)
            with pytest.raises(stream_st.TransportError, match="closed on this side"):
                async for _ in stream:
                    pass

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stream_closed_while_its_selection_is_checked(
    tmp_path: pathlib.Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closed from another task while the loop's first step checked the tensors ``include=``
    takes (a turn for the loop after each slice of a big header: a sharded stream's shards are
    read so), the step failed with a UsageError "the stream is not open", where a close in any
    other step is a TransportError ("closed on this side"). A turn at each slice here."""
    monkeypatch.setattr(stream_st.transports.base, "TURN_EVERY", 0.0)
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file({f"t{i}": np.full(1, i, np.float32) for i in range(5000)}, path)

    async def main() -> None:
        stream = stream_st.open_stream(path, include=lambda name: name.endswith("7"))
        async with stream, anyio.create_task_group() as group:

            async def close() -> None:
                generator = stream._generator() if stream._generator is not None else None
                while generator is None or not getattr(generator, "ag_running", False):
                    await anyio.lowlevel.checkpoint()
                    generator = stream._generator() if stream._generator is not None else None
                await stream.aclose()

            group.start_soon(close)
            with pytest.raises(stream_st.TransportError, match="closed on this side"):
                async for _ in stream:
                    pass

    anyio.run(main, backend=backend)


class _HeldProducer:
    """A ``readinto`` producer of ``data`` whose read after the length prefix waits for
    ``go``."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.position = 0
        self.go = anyio.Event()

    async def readinto(self, buffer: memoryview) -> int:
        if self.position == 8:
            await self.go.wait()
        count = min(len(buffer), len(self.data) - self.position, 8 if not self.position else 4096)
        buffer[:count] = self.data[self.position : self.position + count]
        self.position += count
        return count


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stream_closed_while_a_producer_gives_its_header(backend: str) -> None:
    """A producer's read is let finish (it writes into the stream's memory): the open then fails
    with a TransportError ("closed on this side"), where the loop's next step met the source
    gone and failed with a UsageError "the stream is not open"."""

    async def main() -> None:
        producer = _HeldProducer(sample_file())
        stream = stream_st.open_stream(producer)

        async def close() -> None:
            await anyio.wait_all_tasks_blocked()
            await stream.aclose()
            producer.go.set()

        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(close)
                with pytest.raises(TransportError, match=r"open failed: .* closed on this side"):
                    async for _ in stream:
                        pass

    anyio.run(main, backend=backend)


async def test_a_loop_waiting_for_another_tasks_open_meets_the_close_after_it() -> None:
    """A loop waiting for the open another task began, which closes the stream right after it
    (before the loop's task runs again), fails with a TransportError ("closed on this side"),
    where it met the source gone ("the stream is not open")."""
    producer = _HeldProducer(sample_file())
    stream = stream_st.open_stream(producer)

    async def open_then_close() -> None:
        await stream.open()
        await stream.aclose()

    async def loop() -> None:
        with pytest.raises(TransportError, match="closed on this side before its end"):
            async for _ in stream:
                pass

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(open_then_close)
            await anyio.wait_all_tasks_blocked()  # the open waits for the producer
            group.start_soon(loop)
            await anyio.wait_all_tasks_blocked()  # the loop waits for that open
            producer.go.set()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stream_of_chunks_closed_while_its_producer_waits(backend: str) -> None:
    """The loop fails at once with a TransportError ("closed on this side"), the generator
    ended where it waited (its ``finally`` ran), where the close was seen only once the
    producer gave its next chunk (never, here)."""
    data = sample_file()
    ended: list[bool] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield data[:20]  # the length prefix and some of the header
            await anyio.sleep_forever()
        finally:
            ended.append(True)

    async def main() -> None:
        stream = stream_st.open_stream(chunks())

        async def close() -> None:
            await anyio.wait_all_tasks_blocked()
            await stream.aclose()

        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(close)
                with pytest.raises(TransportError, match="closed on this side"):
                    async for _ in stream:
                        pass
        assert ended == [True]

    anyio.run(main, backend=backend)


async def test_a_source_of_chunks_read_after_its_close_is_no_end() -> None:
    """A read of a chunk source closed meanwhile (from another task, while the reader was busy
    elsewhere) is a TransportError ("closed on this side"): its generator closed, it ended the
    read as if the producer had, and the stream blamed the source with a TruncatedStreamError."""
    source = ChunkIteratorSource(chunked(sample_file(), 16))
    buffer = memoryview(bytearray(32))
    assert await source.fill(buffer) == 32
    await source.aclose()
    for read in (source.fill, source.receive_into):
        with pytest.raises(TransportError, match="closed on this side"):
            await read(buffer)


def test_bytes_at_hand_are_read_without_a_cancel_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of a chunk source or an asyncio reader whose bytes are at hand enters no cancel
    scope (one costs about as much as the read of a small tensor): only a wait for the producer
    or the peer does, where every tensor's read took one (twice the cost per small tensor)."""
    scopes: list[None] = []
    reading = Waits.reading

    def counted(waits: Waits, source: Any) -> Any:
        scopes.append(None)
        return reading(waits, source)

    monkeypatch.setattr(Waits, "reading", counted)
    data = reference_numpy.save({f"t{i}": np.ones(4, np.float32) for i in range(50)})

    async def one_chunk() -> AsyncIterator[bytes]:
        yield data

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        for source in (one_chunk(), reader):
            scopes.clear()
            async with stream_st.open_stream(source) as stream:
                assert len([name async for name, _ in stream]) == 50
            assert len(scopes) <= 2, source  # the chunk's wait, the end's

    anyio.run(main, backend="asyncio")


async def test_one_iteration_stepped_from_two_tasks() -> None:
    """A step taken while another task's step waits for data is a UsageError for that task
    alone: the first task's iteration goes on to the end (it was failed too, 'iteration failed',
    and the second got a bare RuntimeError)."""
    tensors = {f"t{i}": np.full(1000, i, np.float32) for i in range(4)}
    data = reference_numpy.save(tensors)
    data_start = 8 + int.from_bytes(data[:8], "little")
    more = anyio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield data[:data_start]  # the header: the first step waits for the rest
        await more.wait()
        yield data[data_start:]

    names: list[str] = []
    async with stream_st.open_stream(chunks()) as stream:
        iteration = aiter(stream)

        async def first() -> None:
            names.extend([name async for name, _ in iteration])

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(first)
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(UsageError, match="iterated from two tasks at once"):
                    await anext(iteration)
                more.set()
    assert names == list(tensors)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_iteration_stepped_from_one_event_loop_after_another(
    sample_path: pathlib.Path, backend: str
) -> None:
    """Each step in an event loop of its own (a synchronous bridge running each with
    ``asyncio.run``): the first loop's end finalizes the iteration, and the next step is a
    UsageError saying so, never the end of the tensors (it ended quietly after the first)."""
    iteration = aiter(stream_st.open_stream(sample_path))

    async def step() -> tuple[str, np.ndarray[Any, Any]]:
        return await anext(iteration)

    assert anyio.run(step, backend=backend)[0] in sample_tensors()
    with pytest.raises(UsageError, match=r"closed by its event loop \(finalized\) before its end"):
        anyio.run(step, backend=backend)


async def test_an_iteration_closed_by_its_aclose_ends_quietly(sample_path: pathlib.Path) -> None:
    """Closed with its own ``aclose()`` part way, as an async generator is: a later step ends
    the iteration, with no error (the caller closed it)."""
    iteration = aiter(stream_st.open_stream(sample_path))
    await anext(iteration)
    await iteration.aclose()  # type: ignore[attr-defined]
    with pytest.raises(StopAsyncIteration):
        await anext(iteration)


def gated_chunks(data: bytes, gate: anyio.Event) -> AsyncIterator[bytes]:
    """``data`` in one chunk, yielded once ``gate`` is set."""

    async def chunks() -> AsyncIterator[bytes]:
        await gate.wait()
        yield data

    return chunks()


async def open_from_tasks(stream: stream_st.TensorStream, gate: anyio.Event) -> list[object]:
    """What ``stream.open()`` called from two tasks at once gives each (a header or an error),
    ``gate`` set once both wait."""
    outcomes: list[object] = []

    async def opener() -> None:
        try:
            outcomes.append(await stream.open())
        except Exception as exc:
            outcomes.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(opener)
            group.start_soon(opener)
            await anyio.wait_all_tasks_blocked()
            gate.set()
    return outcomes


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_open_from_two_tasks_at_once_opens_the_source_once(backend: str) -> None:
    """The second call waits for the first one's open and gets its header, or its error: the
    second opened the source again, and over a chunk iterator failed with 'being read by
    another stream' and closed the stream under the first ('the stream is closed')."""

    async def main() -> None:
        gate = anyio.Event()
        stream = stream_st.open_stream(gated_chunks(sample_file(), gate))
        first, second = await open_from_tasks(stream, gate)
        assert isinstance(first, stream_st.Header) and first is second
        assert_same_arrays({name: array async for name, array in stream}, sample_tensors())

        gate = anyio.Event()
        stream = stream_st.open_stream(gated_chunks(b"\xff" * 64, gate))
        first, second = await open_from_tasks(stream, gate)
        assert isinstance(first, HeaderError) and type(second) is type(first)
        assert second.__cause__ is first and str(second) == str(first)

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_open_waiting_for_an_iteration_s_open_gets_its_header(backend: str) -> None:
    """An iteration without 'async with' opens the stream, read to its end and closed before
    the open() waiting for that open resumes: the call gets the header read, where it was a
    UsageError ('the stream is closed') for an open that went well."""

    async def main() -> None:
        gate = anyio.Event()
        stream = stream_st.open_stream(gated_chunks(sample_file(), gate))
        arrays: Arrays = {}
        headers: list[stream_st.Header] = []

        async def iterate() -> None:
            arrays.update({name: array async for name, array in stream})

        async def opener() -> None:
            headers.append(await stream.open())

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(iterate)
                await anyio.wait_all_tasks_blocked()
                group.start_soon(opener)
                await anyio.wait_all_tasks_blocked()
                gate.set()
        assert_same_arrays(arrays, sample_tensors())
        assert len(headers) == 1 and headers[0] is stream.header

    anyio.run(main, backend=backend)


def failing_chunks(error: Exception, gate: anyio.Event) -> AsyncIterator[bytes]:
    """Chunks that raise ``error`` once ``gate`` is set."""

    async def chunks() -> AsyncIterator[bytes]:
        await gate.wait()
        raise error
        yield b""  # pragma: no cover  # an async generator

    return chunks()


OPEN_ERRORS: list[partial[Any]] = [
    partial(SafetensorsError, "plain"),
    partial(HeaderTooLargeError, 1 << 40, 100),
    partial(TruncatedStreamError, "the header", name=None, offset=3, expected=8, source="s"),
    partial(TensorNotFoundError, "no tensor 'w'"),
    partial(TransportError, "connection reset", url="http://h/m", position=5),
    partial(
        HTTPStatusError, 503, "Service Unavailable", url="http://h/m", detail="busy", body=b"busy"
    ),
    partial(HTTPNotFoundError, 404, "Not Found", url="http://h/m"),
    partial(CacheMissError, "no copy", url="hf://o/m/f"),
    partial(WriterError, "wrong shape", name="w"),
    partial(IntegrityError, "digest mismatch", name="w", source="s", layer=2),
    partial(DistributedError, "failed", rank=None, cause="x"),
    partial(RankFailedError, "failed", rank=1, cause="x"),
    partial(FileClosedError),
    partial(NoSuchFileError, "/nope"),
    partial(
        UnencodableTextError, "a name", UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates")
    ),
    partial(FileNotFoundError, 2, "No such file or directory", "f.safetensors"),
]
"""How to make an error of each constructor the library's errors have (and a built-in one
with fields): made in the test, not held by the module (a test looks for errors left over)."""

FIELDS = ("errno", "strerror", "filename", "encoding", "object", "start", "end", "reason")
"""What built-in bases (OSError, UnicodeError) keep outside an error's ``__dict__``."""


def test_the_errors_copied_cover_every_constructor() -> None:
    """OPEN_ERRORS makes an error of each class with a constructor of its own."""
    built = {
        kind
        for module in (stream_st.errors, stream_st.compat._errors)
        for kind in vars(module).values()
        if isinstance(kind, type)
        and issubclass(kind, SafetensorsError)
        and "__init__" in vars(kind)
    }
    assert built <= {made.func for made in OPEN_ERRORS}


@pytest.mark.parametrize("made", OPEN_ERRORS, ids=lambda made: made.func.__name__)
def test_each_task_waiting_for_a_failed_open_raises_an_error_of_its_own(
    made: partial[Any],
) -> None:
    """The tasks that waited for the open raise an error of its class, message and attributes,
    from it, each its own: they raised the one error, each raise adding its frames to its
    traceback and setting its context (the first task's report said the error happened while
    another task's KeyError was handled)."""
    error = made()
    error.add_note("a note")

    async def main() -> dict[int, Exception]:
        gate = anyio.Event()
        stream = stream_st.open_stream(failing_chunks(error, gate))
        raised: dict[int, Exception] = {}

        async def opener(task: int) -> None:
            try:
                try:
                    raise KeyError(task)
                except KeyError:
                    await stream.open()
            except Exception as exc:
                raised[task] = exc

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                for task in range(3):
                    group.start_soon(opener, task)
                await anyio.wait_all_tasks_blocked()
                gate.set()
        return raised

    raised = anyio.run(main)
    assert raised[0] is error  # the opening task's, its context that task's
    assert isinstance(error.__context__, KeyError) and error.__context__.args == (0,)
    assert [frame.name for frame in traceback.extract_tb(error.__traceback__)].count("open") == 1
    for task in (1, 2):
        own = raised[task]
        assert type(own) is type(error) and own is not error and own.__cause__ is error
        assert own.args == error.args and str(own) == str(error) and vars(own) == vars(error)
        assert own.__notes__ is not error.__notes__  # a note added to one: not the other's
        assert isinstance(own.__context__, KeyError) and own.__context__.args == (task,)
        for field in FIELDS:
            assert getattr(own, field, None) == getattr(error, field, None)
    assert raised[1] is not raised[2]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_open_waiting_for_a_cancelled_open(backend: str) -> None:
    """The open another task waits for is cancelled (closing the stream, as any failed open):
    the waiting call is a UsageError at once, not left waiting for it, nor cancelled with it."""

    async def main() -> None:
        stream = stream_st.open_stream(gated_chunks(sample_file(), anyio.Event()))
        scope = anyio.CancelScope()

        async def cancelled() -> None:
            with scope:
                await stream.open()

        async def waiting() -> None:
            with pytest.raises(UsageError, match="the stream is closed"):
                await stream.open()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(cancelled)
                await anyio.wait_all_tasks_blocked()
                group.start_soon(waiting)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()

    anyio.run(main, backend=backend)


def test_a_file_opened_from_two_tasks_at_once_is_opened_once(sample_path: pathlib.Path) -> None:
    """Both calls get the one header; the file is opened once (the second call opened it again
    and dropped the first, closed by its finalizer: a ResourceWarning)."""
    anyio.run(stream_st.read_header, sample_path)  # the loop's turns counted from here: the
    time.sleep(2 * TURN_EVERY)  # first open gives the loop a turn before it opens the file

    async def main() -> tuple[stream_st.Header, stream_st.Header]:
        stream = stream_st.open_stream(sample_path)
        first, second = await asyncio.gather(stream.open(), stream.open())
        await stream.aclose()
        return first, second

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = anyio.run(main)
        gc.collect()
    assert first is second
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


async def test_missing_file_and_unsupported_sources(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SourceNotFoundError) as info:
        await read_all(tmp_path / "nope.safetensors")
    assert isinstance(info.value, FileNotFoundError)
    assert str(tmp_path / "nope.safetensors") in str(info.value)
    with pytest.raises(UnsupportedSourceError):
        await read_all(12345)
    with pytest.raises(UnsupportedSourceError, match="gopher"):
        await read_all("gopher://example/x")
    with pytest.raises(UnsupportedSourceError, match="remote host"):
        await read_all("file://otherhost/x")


async def test_path_with_a_nul_byte_is_a_usage_error(tmp_path: pathlib.Path) -> None:
    for path in (tmp_path / "a\0b.safetensors", "file:///tmp/a%00b.safetensors"):
        with pytest.raises(UsageError, match="invalid path"):
            await read_all(path)


async def test_breaking_out_closes_the_file(sample_path: pathlib.Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    async with stream_st.open_stream(sample_path) as stream:
        async for _ in stream:
            break
    assert len(os.listdir("/proc/self/fd")) == before


def test_merge_ranges() -> None:
    assert merge_ranges([(0, 4), (4, 8), (8, 8), (10, 12), (12, 13)]) == [(0, 8), (10, 13)]
    assert merge_ranges([]) == []


async def test_source_learns_the_merged_read_plan() -> None:
    data = sample_file()
    header = await stream_st.read_header(data)
    plans: list[list[tuple[int, int]]] = []

    class PlanningBytes(BytesSource):
        async def plan_reads(self, ranges: Sequence[tuple[int, int]]) -> None:
            plans.append(list(ranges))

    await read_all(PlanningBytes(data), include=["weight", "bias", "empty"])
    base = header.data_start
    spans = sorted((base + header[n].start, base + header[n].end) for n in ("weight", "bias"))
    assert plans == [merge_ranges(spans)]


def test_an_error_rebuilt_with_a_message_of_its_own_keeps_its_class() -> None:
    """``errors.rebuilt`` with new ``args`` (a header error naming its source): a class whose
    built-in base takes other arguments (a UnicodeError's five) is rebuilt with the message
    alone, where its base's constructor raised TypeError."""
    from stream_st.compat._errors import UnencodableTextError
    from stream_st.errors import rebuilt

    try:
        "\udcff".encode("utf-8")
    except UnicodeEncodeError as cause:
        error = UnencodableTextError("tensor name", cause)
    copy = rebuilt(error, "m.safetensors: bad text")
    assert type(copy) is UnencodableTextError and copy.args == ("m.safetensors: bad text",)
    assert str(copy) == str(error)  # its message is its own attribute, kept


def test_an_asyncio_stream_is_refused_off_its_own_loop() -> None:
    """An asyncio StreamReader read under trio, or on another asyncio loop than its own, failed
    at its first wait with that library's bare error (trio's TypeError "unrecognized yield
    message", asyncio's RuntimeError "attached to a different loop"); a StreamWriter written
    there too. Both are a UsageError now, before any byte."""
    data = reference_numpy.save({"t": np.ones(4, np.float32)})
    made: dict[str, Any] = {}
    transport = _Transport()

    async def make() -> None:
        made["reader"] = asyncio.StreamReader()
        made["writer"] = asyncio.StreamWriter(transport, asyncio.Protocol(), None, made["loop"])

    made["loop"] = asyncio.new_event_loop()
    made["loop"].run_until_complete(make())
    made["loop"].close()

    async def read_on_another() -> None:
        with pytest.raises(UsageError, match="on the asyncio event loop it belongs to"):
            await stream_st.load(made["reader"])
        with pytest.raises(UsageError, match="on the asyncio event loop it belongs to"):
            await stream_st.save(made["writer"], {"t": np.ones(4, np.float32)})

    async def read_under_trio() -> None:
        reader = asyncio.StreamReader(loop=made["loop"])
        reader.feed_data(data[:20])  # a wait would follow
        with pytest.raises(UsageError, match="not under another event loop library"):
            await stream_st.load(reader)

    asyncio.run(read_on_another())
    trio.run(read_under_trio)
    # closed: its writer, collected whenever a reference cycle lets it go (in another test's
    # gc.collect()), would warn "loop is closed" (a ResourceWarning) there
    transport.closing = True


class _Transport(asyncio.WriteTransport):
    """A transport taking every write (the writer is refused before one)."""

    closing = False

    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

"""The streaming writer: byte-identical to the reference, every dtype, every sink, and fail-closed.

Every misuse and failure must raise a SafetensorsError and leave nothing at the destination: no
file (or its previous content) and no temporary file; a stream is closed so its peer sees an
incomplete message.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as reference_numpy
import trio
from anyio.abc import ByteSendStream, SocketStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from hypothesis import HealthCheck, given, settings

import stream_st
import stream_st.numpy
from stream_st import (
    DTYPES,
    HeaderError,
    HeaderTooLargeError,
    SafetensorsError,
    TensorSpec,
    TruncatedStreamError,
    UnsupportedSinkError,
    UsageError,
    WriterError,
)
from stream_st.core import dtypes as core_dtypes
from stream_st.core.header import DEFAULT_MAX_HEADER_SIZE
from stream_st.transports.base import Sink
from stream_st.transports.file import atomic
from stream_st.transports.file.sink import FileSink
from stream_st.transports.registry import open_sink
from stream_st.transports.streams import AnyioStreamSink, AsyncioStreamSink
from stream_st.writer import Order

from .._util import REFERENCE_DTYPES

Arrays = dict[str, np.ndarray[Any, Any]]

SERIALIZE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "F4": "float4_e2m1fn_x2",
}
"""The dtype names ``safetensors.serialize`` takes: every code but the two F6 (20 of 22)."""

SHAPES: dict[str, list[tuple[int, ...]]] = {
    "F4": [(3, 4), (2, 3), (0,), (1, 0, 2)],  # (2, 3): odd last dim -> 1-D packed bytes
    "F6_E2M3": [(4,), (2, 4), (0, 4)],
    "F6_E3M2": [(8,), (3, 4)],
}
DEFAULT_SHAPES: list[tuple[int, ...]] = [(), (3, 5), (0,), (2, 0, 3), (7,)]


def random_array(code: str, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    """An array of the delivered dtype and shape for a tensor ``code`` x ``shape``."""
    info = DTYPES[code]
    array_shape = core_dtypes.array_shape(info, shape)
    if code == "BOOL":
        return rng.integers(0, 2, size=array_shape).astype(np.bool_)
    count = math.prod(array_shape) * info.numpy.itemsize
    raw = rng.integers(0, 256, size=count, dtype=np.uint8)
    return raw.view(info.numpy).reshape(array_shape)


def every_dtype_plan(rng: np.random.Generator) -> tuple[list[TensorSpec], Arrays]:
    """All 22 dtypes, each in several shapes (scalars, empties, packed layouts)."""
    plan: list[TensorSpec] = []
    arrays: Arrays = {}
    for code in DTYPES:
        for index, shape in enumerate(SHAPES.get(code, DEFAULT_SHAPES)):
            name = f"{code.lower()}·{index}"
            plan.append(TensorSpec(name, code, shape))
            arrays[name] = random_array(code, shape, rng)
    return plan, arrays


def leftovers(directory: pathlib.Path, *expected: str) -> list[str]:
    """Files in ``directory`` other than ``expected``: must be none (no temporary files)."""
    return sorted(set(os.listdir(directory)) - set(expected))


async def read_back(source: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source)}


def assert_same(got: Arrays, expected: Arrays) -> None:
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        assert got[name].tobytes() == np.ascontiguousarray(array).tobytes(), name


async def write_plan(dst: Any, plan: list[TensorSpec], arrays: Arrays, **options: Any) -> None:
    async with stream_st.open_writer(dst, plan, **options) as writer:
        for info in writer.header.tensors:
            await writer.write(info.name, arrays[info.name])


class MemorySink(ByteSendStream):
    """An anyio ``ByteSendStream`` over an anyio memory object stream (a generic stream)."""

    def __init__(self, send: MemoryObjectSendStream[bytes]) -> None:
        self._send = send

    async def send(self, item: bytes) -> None:
        await self._send.send(item)

    async def send_eof(self) -> None:
        await self._send.aclose()

    async def aclose(self) -> None:
        await self._send.aclose()


@asynccontextmanager
async def memory_pipe() -> AsyncIterator[tuple[MemorySink, MemoryObjectReceiveStream[bytes]]]:
    send, receive = anyio.create_memory_object_stream[bytes](math.inf)
    async with send, receive:
        yield MemorySink(send), receive


async def drain(receive: MemoryObjectReceiveStream[bytes]) -> bytes:
    """Everything sent so far (the sender must be closed, or done)."""
    chunks = []
    while True:
        try:
            chunks.append(receive.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return b"".join(chunks)


async def to_bytes(plan: list[TensorSpec], arrays: Arrays, **options: Any) -> bytes:
    async with memory_pipe() as (sink, receive):
        await write_plan(sink, plan, arrays, **options)
        return await drain(receive)


@asynccontextmanager
async def tcp_pair() -> AsyncIterator[tuple[SocketStream, SocketStream]]:
    """A connected pair of anyio TCP streams on 127.0.0.1: ``(client, server)``."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        client = await anyio.connect_tcp("127.0.0.1", port)
        server = await listener.listeners[0].accept()  # type: ignore[attr-defined]
        async with client, server:
            yield client, server


@asynccontextmanager
async def asyncio_pair() -> AsyncIterator[tuple[asyncio.StreamWriter, asyncio.StreamReader]]:
    """An asyncio ``StreamWriter`` connected over TCP to a ``StreamReader``."""
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put((reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, client_writer = await asyncio.open_connection("127.0.0.1", port)
    server_reader, server_writer = await accepted.get()
    try:
        yield client_writer, server_reader
    finally:
        for writer in (client_writer, server_writer):
            writer.close()
            with contextlib.suppress(OSError):  # an aborted connection may report its reset
                await writer.wait_closed()
        server.close()
        await server.wait_closed()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ---------------------------------------------------------------- the reference, both directions


def reference_arrays(rng: np.random.Generator) -> Arrays:
    """Every dtype the reference numpy backend has, with scalars, empties and unicode names."""
    arrays: Arrays = {}
    for dtype in REFERENCE_DTYPES:
        code = stream_st.dtype_for(dtype).code
        for index, shape in enumerate(DEFAULT_SHAPES):
            arrays[f"{code}/{index}-ünï😀"] = random_array(code, shape, rng)
    arrays[""] = np.arange(3, dtype=np.float32)  # the empty name is a valid name
    return arrays


def assert_same_file(ours: bytes, reference: bytes) -> None:
    """Byte-identical, except that the reference orders several metadata keys at random.

    (It keeps ``__metadata__`` in a Rust ``HashMap``, so even two of its own runs differ.)
    """
    if ours == reference:
        return
    ours_header = stream_st.parse_header(ours[8 : 8 + int.from_bytes(ours[:8], "little")])
    ref_header = stream_st.parse_header(reference[8 : 8 + int.from_bytes(reference[:8], "little")])
    assert len(ref_header.metadata) > 1, "differ although the metadata order cannot explain it"
    assert ours_header.metadata == ref_header.metadata
    assert ours_header.tensors == ref_header.tensors
    assert ours_header.header_size == ref_header.header_size
    assert ours[ours_header.data_start :] == reference[ref_header.data_start :]


METADATA_CASES = [
    None,
    {"ключ ✓": 'värde\n\t"\\\x01\x7f\u2028'},
    {"format": "np", "b": "", "": "x"},
]


@pytest.mark.parametrize("metadata", METADATA_CASES, ids=["none", "one key", "several keys"])
async def test_save_is_byte_identical_to_the_reference(
    tmp_path: pathlib.Path, rng: np.random.Generator, metadata: dict[str, str] | None
) -> None:
    arrays = reference_arrays(rng)
    expected = reference_numpy.save(arrays, metadata=metadata)
    path = tmp_path / "ours.safetensors"
    header = await stream_st.save(path, arrays, metadata=metadata)
    assert_same_file(path.read_bytes(), expected)
    assert header.file_size == len(expected)
    assert leftovers(tmp_path, "ours.safetensors") == []
    # and the same through open_writer with plan_order, written in any order
    plan = stream_st.plan_order(TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items())
    other = tmp_path / "other.safetensors"
    async with stream_st.open_writer(other, plan, metadata=metadata) as writer:
        for name in sorted(arrays, reverse=True):
            await writer.write(name, arrays[name])
    assert other.read_bytes() == path.read_bytes()
    # the reference reads ours
    assert_same(reference_numpy.load_file(str(path)), arrays)


async def test_reference_files_round_trip_through_us(
    tmp_path: pathlib.Path, rng: np.random.Generator
) -> None:
    arrays = reference_arrays(rng)
    metadata = {"source": "reference ✓"}
    original = tmp_path / "reference.safetensors"
    reference_numpy.save_file(arrays, str(original), metadata=metadata)
    loaded = await stream_st.load(original)
    assert_same(loaded, arrays)
    header = await stream_st.read_header(original)
    copy = tmp_path / "copy.safetensors"
    await stream_st.save(copy, loaded, metadata=header.metadata)
    assert copy.read_bytes() == original.read_bytes()


async def test_every_serializable_dtype_matches_reference_serialize(
    rng: np.random.Generator,
) -> None:
    """20 of 22 dtypes (all but F6), incl. ml_dtypes and packed F4, against ``serialize``."""
    plan, arrays = every_dtype_plan(rng)
    plan = [spec for spec in plan if spec.dtype in SERIALIZE_NAMES]
    specs = {}
    alive = []  # serialize reads raw pointers: keep every array alive
    for spec in plan:
        array = np.array(arrays[spec.name], order="C")  # (ascontiguousarray makes 0-d 1-d)
        alive.append(array)
        assert isinstance(spec.dtype, str)
        specs[spec.name] = safetensors.TensorSpec(
            dtype=SERIALIZE_NAMES[spec.dtype],
            shape=list(array.shape),  # F4: the storage shape; the reference doubles the last dim
            data_ptr=array.ctypes.data,
            data_len=array.nbytes,
        )
    if any(s.dtype == "F4" and s.shape == (2, 3) for s in plan):  # odd: no storage shape for it
        plan = [s for s in plan if not (s.dtype == "F4" and s.shape == (2, 3))]
        specs = {name: spec for name, spec in specs.items() if name in {s.name for s in plan}}
    metadata = {"all": "dtypes"}
    expected = safetensors.serialize(specs, metadata=metadata)
    ours = await to_bytes(plan, arrays, metadata=metadata, order="reference")
    assert ours == expected


async def test_plan_order_ranks_match_the_reference() -> None:
    """Shuffled names and all 20 dtypes ``serialize`` knows: the same layout order."""
    rng = np.random.default_rng(7)
    codes = list(SERIALIZE_NAMES)
    names = [f"n{i:02d}" for i in range(len(codes) * 2)]
    rng.shuffle(names)
    buffer = np.zeros(64, dtype=np.uint8)
    plan = []
    specs = {}
    for name, code in zip(names, codes * 2, strict=True):
        shape = (2, 2)
        info = DTYPES[code]
        storage = core_dtypes.array_shape(info, shape)
        nbytes = info.nbytes(4)
        assert nbytes is not None
        plan.append(TensorSpec(name, code, shape))
        specs[name] = safetensors.TensorSpec(
            dtype=SERIALIZE_NAMES[code],
            shape=list(storage),
            data_ptr=buffer.ctypes.data,
            data_len=nbytes,
        )
    reference = await stream_st.read_header(safetensors.serialize(specs))
    ordered = stream_st.plan_order(plan)
    assert [s.name for s in ordered] == reference.names()


# ---------------------------------------------------------------- all 22 dtypes through our reader


@pytest.mark.parametrize("order", ["plan", "reference"])
async def test_every_dtype_round_trips_through_a_file(
    tmp_path: pathlib.Path, rng: np.random.Generator, order: Order
) -> None:
    plan, arrays = every_dtype_plan(rng)
    assert {spec.dtype for spec in plan} == set(DTYPES)  # all 22
    path = tmp_path / "all.safetensors"
    async with stream_st.open_writer(path, plan, metadata={"n": "22"}, order=order) as writer:
        header = writer.header
        for name in reversed(list(arrays)):  # any order on a file
            await writer.write(name, arrays[name])
    assert_same(await read_back(path), arrays)
    read = await stream_st.read_header(path)
    assert read.tensors == header.tensors and read.metadata == {"n": "22"}
    assert read.header_size % 8 == 0
    assert leftovers(tmp_path, "all.safetensors") == []


async def test_every_dtype_round_trips_through_streams(rng: np.random.Generator) -> None:
    plan, arrays = every_dtype_plan(rng)
    data = await to_bytes(plan, arrays)
    assert_same(await read_back(data), arrays)
    async with tcp_pair() as (client, server), anyio.create_task_group() as group:
        results: list[Arrays] = []

        async def receive() -> None:
            results.append(await read_back(server))

        group.start_soon(receive)
        await write_plan(client, plan, arrays)
    assert_same(results[0], arrays)


async def test_ml_dtypes_arrays_and_numpy_dtypes_in_the_plan(tmp_path: pathlib.Path) -> None:
    arrays: Arrays = {
        "bf16": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3),
        "f8": np.linspace(-2, 2, 5).astype(ml_dtypes.float8_e4m3fn),
        "f16": np.ones(3, dtype=np.float16),
    }
    plan = [TensorSpec(name, array.dtype, array.shape) for name, array in arrays.items()]
    plan[2] = TensorSpec("f16", np.float16, (3,))  # a dtype class works too
    path = tmp_path / "ml.safetensors"
    await write_plan(path, plan, arrays)
    got = await stream_st.load(path)
    assert_same(got, arrays)
    header = await stream_st.read_header(path)
    assert [header[n].dtype for n in arrays] == ["BF16", "F8_E4M3", "F16"]


# ---------------------------------------------------------------- property test


names = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00"), min_size=0, max_size=10
).filter(lambda n: n != "__metadata__")


@st.composite
def tensor_dicts(draw: st.DrawFn) -> Arrays:
    keys = draw(st.lists(names, min_size=0, max_size=6, unique=True))
    result: Arrays = {}
    for key in keys:
        dtype = np.dtype(draw(st.sampled_from(REFERENCE_DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        size = math.prod(shape) * dtype.itemsize
        raw = draw(st.binary(min_size=size, max_size=size))
        array = np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape)
        if draw(st.booleans()) and array.dtype.itemsize > 1:
            array = array.astype(array.dtype.newbyteorder(">"))  # big-endian input
        result[key] = array
    return result


metadata_maps = st.one_of(
    st.none(), st.dictionaries(names, st.text(max_size=8), min_size=1, max_size=3)
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=tensor_dicts(), metadata=metadata_maps)
async def test_generated_plans_match_the_reference(
    tensors: Arrays, metadata: dict[str, str] | None
) -> None:
    little = {name: array.astype(array.dtype.newbyteorder("<")) for name, array in tensors.items()}
    expected = reference_numpy.save(little, metadata=metadata)
    async with memory_pipe() as (sink, receive):
        await stream_st.save(sink, tensors, metadata=metadata)
        assert_same_file(await drain(receive), expected)
    assert_same(await read_back(expected), little)


# ---------------------------------------------------------------- arrays of every layout


async def test_non_contiguous_and_big_endian_arrays(tmp_path: pathlib.Path) -> None:
    base = np.arange(48, dtype=np.float64).reshape(6, 8)
    arrays: Arrays = {
        "strided": base[::2, 1::3],
        "fortran": np.asfortranarray(base),
        "transposed": base.T,
        "big": np.arange(10, dtype=">i4"),
        "big_strided": np.arange(20, dtype=">f8")[::3],
        "negative": base[::-1],
        "broadcast": np.broadcast_to(np.arange(4, dtype=np.int16), (3, 4)),
        "readonly": np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),
    }
    path = tmp_path / "layouts.safetensors"
    await stream_st.save(path, arrays)
    got = await stream_st.load(path)
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)
        assert got[name].dtype == array.dtype.newbyteorder("=")
    expected = {
        n: np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for n, a in arrays.items()
    }
    assert path.read_bytes() == reference_numpy.save(expected)


async def test_scalars_empties_and_an_empty_plan(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty.safetensors"
    await stream_st.save(path, {})
    assert path.read_bytes() == reference_numpy.save({})
    arrays: Arrays = {
        "scalar": np.array(3.5, dtype=np.float32),
        "numpy scalar": np.float64(2.0),  # type: ignore[dict-item]
        "empty": np.zeros((0, 3), dtype=np.int64),
    }
    await stream_st.save(path, arrays)
    got = await stream_st.load(path)
    assert got["scalar"].shape == () and got["scalar"] == 3.5
    assert got["numpy scalar"].shape == () and got["numpy scalar"].dtype == np.float64
    assert got["empty"].shape == (0, 3)


# ---------------------------------------------------------------- the header, before any data


async def test_header_is_known_and_written_on_open(tmp_path: pathlib.Path) -> None:
    plan = [TensorSpec("layer_0_key", "F16", (1, 4, 128, 64)), TensorSpec("b", np.int8, (3,))]
    unused = tmp_path / "unused.safetensors"
    writer = stream_st.open_writer(unused, plan, metadata={"compression": "none"})
    header = writer.header  # known before anything is opened
    assert [t.start for t in header.tensors] == [0, 65536]
    assert header.metadata == {"compression": "none"}
    with pytest.raises(UsageError):
        await writer.write("b", np.zeros(3, np.int8))
    assert os.listdir(tmp_path) == []

    async with tcp_pair() as (client, server):
        stream = stream_st.open_stream(server)
        async with stream_st.open_writer(client, plan, metadata={"compression": "none"}) as w:
            await stream.open()  # the peer has the header while no tensor is written yet
            assert stream.header.tensors == w.header.tensors
            assert stream.header.metadata == {"compression": "none"}
            await w.write("layer_0_key", np.ones((1, 4, 128, 64), np.float16))
            tensors = aiter(stream)
            name, first = await anext(tensors)  # delivered before the writer closes
            assert name == "layer_0_key" and first.shape == (1, 4, 128, 64)
            await w.write("b", np.array([1, 2, 3], np.int8))
        # the message's last byte is sent on commit: the last tensor arrives after the block
        name, last = await anext(tensors)
        await stream.aclose()
    assert name == "b" and last.tolist() == [1, 2, 3]


@pytest.mark.parametrize("kind", ["anyio", "asyncio"])
async def test_one_message_written_at_a_time_on_a_caller_stream(kind: str) -> None:
    """As on a tcp:// connection: a second writer opened on the caller's stream while a first
    one writes is a UsageError, and leaves the first one's message whole (it mixed its bytes
    in); once the first is closed the next message may start."""
    plan = [TensorSpec("a", np.int32, (4,))]
    arrays: Arrays = {"a": np.arange(4, dtype=np.int32)}
    pair = tcp_pair() if kind == "anyio" else asyncio_pair()
    async with pair as (client, server):
        async with stream_st.open_writer(client, plan) as writer:
            with pytest.raises(UsageError, match="still being written"):
                await write_plan(client, plan, arrays)
            await writer.write("a", arrays["a"])
        await write_plan(client, plan, arrays)
        assert_same(await read_back(server), arrays)
        assert_same(await read_back(server), arrays)


def test_spec_example_header_matches_reference_layout() -> None:
    plan = [
        TensorSpec(f"layer_{i}_{kind}", "F16", (1, 4, 128, 64))
        for i in range(2)
        for kind in ("key", "value")
    ]
    prefix, _ = stream_st.build_header(plan, {"compression": "none"})
    assert len(prefix) % 8 == 0
    assert prefix[8:].startswith(b'{"__metadata__":{"compression":"none"},"layer_0_key"')


# ---------------------------------------------------------------- parts


async def test_parts_rows_single_rows_and_tensor_blocks(tmp_path: pathlib.Path) -> None:
    full = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    plan = [
        TensorSpec("x", "F32", (5, 3)),
        TensorSpec("y", "F32", (5, 3)),
        TensorSpec("s", "I8", ()),
    ]
    path = tmp_path / "parts.safetensors"
    for dst in (path, "memory"):
        async with memory_pipe() as (sink, receive):
            target: Any = sink if dst == "memory" else dst
            async with stream_st.open_writer(target, plan) as writer:
                await writer.write_part("x", full[:2])
                await writer.write_part("x", full[2])  # one row
                await writer.write_part("x", full[3:3])  # no rows
                await writer.write_part("x", full[3:])
                async with writer.tensor("y") as part:
                    assert part.remaining == 60
                    for row in full:
                        await part.write(row)
                    assert part.written == 60 and part.remaining == 0
                async with writer.tensor("s") as part:
                    await part.write(np.int8(-1))
                assert writer.remaining == []
            data = await drain(receive) if dst == "memory" else path.read_bytes()
        got = await read_back(data)
        assert_same(got, {"x": full, "y": full, "s": np.array(-1, np.int8)})


async def test_file_parts_interleaved_across_tensors_and_tasks(tmp_path: pathlib.Path) -> None:
    tensors = {
        f"t{i}": np.arange(i * 100, i * 100 + 64, dtype=np.uint16).reshape(8, 8) for i in range(6)
    }
    plan = [TensorSpec(n, "U16", (8, 8)) for n in tensors]
    path = tmp_path / "interleaved.safetensors"
    async with stream_st.open_writer(path, plan) as writer:
        for row in range(8):  # row by row, every tensor in turn
            for name, array in reversed(tensors.items()):
                await writer.write_part(name, array[row : row + 1])
    assert_same(await stream_st.load(path), tensors)

    path2 = tmp_path / "concurrent.safetensors"
    async with stream_st.open_writer(path2, plan) as writer, anyio.create_task_group() as group:
        for name, array in tensors.items():
            group.start_soon(writer.write, name, array)
    assert path2.read_bytes() == path.read_bytes()


async def test_stream_tasks_writing_in_order_concurrently() -> None:
    """On a stream, bytes go out in the order the writes were claimed, even across tasks."""
    tensors = {f"t{i}": np.full((64, 1024), i, dtype=np.float32) for i in range(4)}
    plan = [TensorSpec(n, "F32", (64, 1024)) for n in tensors]
    async with tcp_pair() as (client, server), anyio.create_task_group() as group:
        received: list[Arrays] = []

        async def receive() -> None:
            received.append(await read_back(server))

        group.start_soon(receive)
        async with (
            stream_st.open_writer(client, plan) as writer,
            anyio.create_task_group() as inner,
        ):
            for name, array in tensors.items():
                inner.start_soon(writer.write, name, array)
                await anyio.lowlevel.checkpoint()
    assert_same(received[0], tensors)


# ---------------------------------------------------------------- streams


async def test_two_messages_back_to_back_on_one_connection() -> None:
    first: Arrays = {"a": np.arange(10, dtype=np.int32)}
    second: Arrays = {"b": np.ones((2, 2), dtype=np.float32), "c": np.zeros(0, dtype=np.uint8)}
    async with tcp_pair() as (client, server):
        await stream_st.save(client, first)
        await stream_st.save(client, second)  # the stream stays open after a message
        await client.send_eof()
        assert_same(await read_back(server), first)
        assert_same(await read_back(server), second)


@pytest.mark.parametrize("kind", ["anyio", "asyncio"])
async def test_a_stream_sink_object_takes_message_after_message(kind: str) -> None:
    """A stream sink given as it is (not a file or an upload) takes one message after another,
    each holding the stream's turn, where it was claimed as a sink of one message and the
    second save was a UsageError."""
    first: Arrays = {"x": np.arange(3, dtype=np.uint8)}
    second: Arrays = {"y": np.arange(2, dtype=np.uint8)}
    pair = tcp_pair() if kind == "anyio" else asyncio_pair()
    async with pair as (client, server):
        sink = (
            AsyncioStreamSink(client)
            if isinstance(client, asyncio.StreamWriter)
            else AnyioStreamSink(client)
        )
        await stream_st.save(sink, first)
        await stream_st.save(sink, second)
        assert_same(await read_back(server), first)
        assert_same(await read_back(server), second)


async def test_asyncio_stream_writer() -> None:
    big = np.arange(3 << 20, dtype=np.uint8)
    arrays: Arrays = {"big": big, "small": np.arange(5, dtype=np.float64)}
    async with asyncio_pair() as (writer, reader), anyio.create_task_group() as group:
        received: list[Arrays] = []

        async def receive() -> None:
            received.append(await read_back(reader))
            received.append(await read_back(reader))

        group.start_soon(receive)
        await stream_st.save(writer, arrays, order="plan")
        await stream_st.save(writer, {"again": np.ones(3, np.int8)})
    assert_same(received[0], arrays)
    assert_same(received[1], {"again": np.ones(3, np.int8)})


@pytest.mark.parametrize("kind", ["anyio", "asyncio", "memory"])
async def test_array_may_change_once_write_returns(kind: str) -> None:
    """Zero-copy sends never leave the transport holding the caller's memory; a stream that keeps
    the items it is sent (here a memory object stream, read only after the message) gets copies."""
    shape = (3 << 20) + 12345
    plan = [TensorSpec(f"t{i}", "U8", (shape,)) for i in range(3)]
    buffer = np.empty(shape, dtype=np.uint8)
    expected = {spec.name: np.full(shape, i + 1, dtype=np.uint8) for i, spec in enumerate(plan)}

    async def produce(dst: Any) -> None:
        async with stream_st.open_writer(dst, plan) as writer:
            for i, spec in enumerate(plan):
                buffer.fill(i + 1)
                await writer.write(spec.name, buffer)
                buffer.fill(0xEE)  # reuse the buffer at once

    received: list[Arrays] = []
    if kind == "anyio":
        async with tcp_pair() as (client, server), anyio.create_task_group() as group:

            async def receive_anyio() -> None:
                await anyio.sleep(0.05)  # let the sender's transport buffer fill up
                received.append(await read_back(server))

            group.start_soon(receive_anyio)
            await produce(client)
    elif kind == "memory":
        async with memory_pipe() as (sink, receive):
            await produce(sink)
            buffer.fill(0xDD)
            received.append(reference_numpy.load(await drain(receive)))
    else:
        async with asyncio_pair() as (writer, reader), anyio.create_task_group() as group:

            async def receive_asyncio() -> None:
                await anyio.sleep(0.05)
                received.append(await read_back(reader))

            group.start_soon(receive_asyncio)
            await produce(writer)
    assert_same(received[0], expected)


# ---------------------------------------------------------------- dispatch


async def test_destination_kinds(tmp_path: pathlib.Path) -> None:
    arrays: Arrays = {"x": np.arange(4, dtype=np.int16)}
    for dst in (tmp_path / "a.st", str(tmp_path / "b.st"), (tmp_path / "c d.st").as_uri()):
        await stream_st.save(dst, arrays)
    assert sorted(os.listdir(tmp_path)) == ["a.st", "b.st", "c d.st"]
    data = (tmp_path / "a.st").read_bytes()
    assert all((tmp_path / n).read_bytes() == data for n in ("b.st", "c d.st"))


async def test_unsupported_destinations(tmp_path: pathlib.Path) -> None:
    for dst in (
        *(42, b"bytes", object(), "ftp://x/y", "file://remote/x"),
        *("tcp://127.0.0.1", "tcp://:80", "tcp://h:1/path", "http://", "https:///x"),  # no peer
    ):
        with pytest.raises(UnsupportedSinkError):
            await stream_st.save(dst, {"x": np.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(stream_st.TransportError, match="directory"):
        await stream_st.save(tmp_path, {"x": np.zeros(1)})
    with pytest.raises(stream_st.SourceNotFoundError):
        await stream_st.save(tmp_path / "missing" / "x.st", {"x": np.zeros(1)})
    assert os.listdir(tmp_path) == []


async def test_a_sink_object_is_used_as_is(tmp_path: pathlib.Path) -> None:
    sink = await open_sink(tmp_path / "direct.st", fsync=True)
    assert isinstance(sink, FileSink)
    await stream_st.save(sink, {"x": np.arange(3, dtype=np.uint8)})
    assert (await stream_st.load(tmp_path / "direct.st"))["x"].tolist() == [0, 1, 2]
    assert leftovers(tmp_path, "direct.st") == []
    given = FileSink(tmp_path / "other.st")  # one message each: open_sink takes it
    assert await open_sink(given) is given
    await given.abort()


async def test_bad_plans_fail_before_anything_is_created(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "never.st"
    bad_plans: list[tuple[list[TensorSpec], dict[str, str] | None, type[Exception]]] = [
        ([TensorSpec("a", "F32", (1,)), TensorSpec("a", "F32", (1,))], None, HeaderError),
        ([TensorSpec("a", "F99", (1,))], None, stream_st.DtypeError),
        ([TensorSpec("a", np.object_, (1,))], None, stream_st.DtypeError),
        ([TensorSpec("a", "F4", (3,))], None, HeaderError),  # 12 bits
        ([TensorSpec("__metadata__", "F32", (1,))], None, HeaderError),
        ([TensorSpec("a", "F32", (-1,))], None, HeaderError),
        ([TensorSpec("a", "F32", (1,))], {"k": 1}, HeaderError),  # type: ignore[dict-item]
        ([TensorSpec("\udcff", "F32", (1,))], None, HeaderError),
    ]
    for plan, metadata, error in bad_plans:
        with pytest.raises(error):
            stream_st.open_writer(path, plan, metadata=metadata)
    with pytest.raises(UsageError):
        stream_st.open_writer(path, [], order="sorted")  # type: ignore[arg-type]
    for order in ("plan", "reference"):
        with pytest.raises(UsageError, match="TensorSpec"):
            stream_st.open_writer(path, [("a", "F32", (2,))], order=order)  # type: ignore[list-item]
    with pytest.raises(UsageError, match="metadata must be a mapping"):
        stream_st.open_writer(path, PLAN, metadata=[("k", "v")])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="cannot make an array"):
        await stream_st.save(path, {"a": [[1, 2], [3]]})
    with pytest.raises(UsageError, match="mapping of names to arrays"):
        await stream_st.save(path, [np.zeros(2)])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="invalid path"):
        await stream_st.save(tmp_path / "a\0b.st", {"a": np.zeros(2)})
    assert os.listdir(tmp_path) == []


async def test_a_header_no_reader_takes_is_refused_before_anything_is_created(
    tmp_path: pathlib.Path,
) -> None:
    """A header over 100,000,000 bytes (padded) is refused as the reference refuses it ("header
    too large"): no reader with its default limit would read it back. One at the limit is
    laid out."""
    member = len('{"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}')
    name = "n" * (DEFAULT_MAX_HEADER_SIZE - member)
    prefix, header = stream_st.build_header([TensorSpec(name, "F32", (1,))])
    assert header.header_size == len(prefix) - 8 == DEFAULT_MAX_HEADER_SIZE
    del prefix, header
    name += "n"  # padded to 8 bytes more
    arrays = {name: np.zeros(1, np.float32)}
    path = tmp_path / "never.st"
    too_large = pytest.raises(HeaderTooLargeError, match="100000008 bytes, over the 100000000")
    with too_large:
        stream_st.open_writer(path, [TensorSpec(name, "F32", (1,))])
    with too_large:
        await stream_st.save(path, arrays)
    with too_large:
        stream_st.numpy.save_file(arrays, path)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- misuse and failure: fail closed

PLAN = [TensorSpec("a", "F32", (2, 3)), TensorSpec("b", "I64", (4,)), TensorSpec("c", "U8", (0,))]
GOOD: Arrays = {
    "a": np.ones((2, 3), np.float32),
    "b": np.arange(4, dtype=np.int64),
    "c": np.zeros(0, np.uint8),
}

Misuse = Callable[[stream_st.TensorWriter], Awaitable[None]]


class Boom(Exception):
    pass


async def _wrong_shape(w: stream_st.TensorWriter) -> None:
    await w.write("a", np.ones((3, 2), np.float32))


async def _wrong_dtype(w: stream_st.TensorWriter) -> None:
    await w.write("a", np.ones((2, 3), np.float64))


async def _same_size_wrong_dtype(w: stream_st.TensorWriter) -> None:
    await w.write("b", np.arange(4, dtype=np.float64))


async def _unknown_name(w: stream_st.TensorWriter) -> None:
    await w.write("nope", np.ones(1))


async def _written_twice(w: stream_st.TensorWriter) -> None:
    await w.write("a", GOOD["a"])
    await w.write("a", GOOD["a"])


async def _part_after_whole(w: stream_st.TensorWriter) -> None:
    await w.write("a", GOOD["a"])
    await w.write_part("a", GOOD["a"][:1])


async def _whole_after_part(w: stream_st.TensorWriter) -> None:
    await w.write_part("a", GOOD["a"][:1])
    await w.write("a", GOOD["a"])


async def _more_bytes_than_planned(w: stream_st.TensorWriter) -> None:
    await w.write_part("a", GOOD["a"])
    await w.write_part("a", GOOD["a"][:1])


async def _wrong_part_shape(w: stream_st.TensorWriter) -> None:
    await w.write_part("a", np.ones((1, 2), np.float32))


async def _fewer_bytes_in_a_block(w: stream_st.TensorWriter) -> None:
    async with w.tensor("a") as part:
        await part.write(GOOD["a"][:1])


async def _fewer_bytes_at_close(w: stream_st.TensorWriter) -> None:
    await w.write("b", GOOD["b"])
    await w.write("c", GOOD["c"])  # out of order on a stream: fails there already
    await w.write_part("a", GOOD["a"][:1])


async def _never_written(w: stream_st.TensorWriter) -> None:
    await w.write("a", GOOD["a"])
    await w.write("b", GOOD["b"])


async def _empty_never_written(w: stream_st.TensorWriter) -> None:
    await w.write("a", GOOD["a"])
    await w.write("b", GOOD["b"])  # "c" holds no bytes but must still be written


async def _exception_in_body(w: stream_st.TensorWriter) -> None:
    await w.write("a", GOOD["a"])
    raise Boom


async def _exception_in_tensor_block(w: stream_st.TensorWriter) -> None:
    async with w.tensor("a") as part:
        await part.write(GOOD["a"][:1])
        raise Boom


async def _caught_misuse_then_clean_exit(w: stream_st.TensorWriter) -> None:
    with pytest.raises(WriterError):
        await w.write("a", np.ones(7, np.float32))
    with pytest.raises(UsageError):  # the writer is aborted: no later write goes through
        await w.write("a", GOOD["a"])


async def _ragged_whole(w: stream_st.TensorWriter) -> None:
    await w.write("a", [[1, 2, 3], [4, 5]])


async def _ragged_part(w: stream_st.TensorWriter) -> None:
    await w.write_part("a", [[1.0], [2.0, 3.0]])


async def _out_of_order(w: stream_st.TensorWriter) -> None:
    await w.write("b", GOOD["b"])
    await w.write("a", GOOD["a"])
    await w.write("c", GOOD["c"])


MISUSES: dict[str, tuple[Misuse, type[BaseException], str | None]] = {
    "wrong shape": (_wrong_shape, WriterError, r"shape \(2, 3\), got \(3, 2\)"),
    "wrong dtype": (_wrong_dtype, WriterError, "dtype float32, got float64"),
    "same size wrong dtype": (_same_size_wrong_dtype, WriterError, "got float64"),
    "unknown name": (_unknown_name, WriterError, "no tensor named 'nope'"),
    "written twice": (_written_twice, WriterError, "'a' is already written"),
    "part after whole": (_part_after_whole, WriterError, "more than the 24 bytes"),
    "whole after part": (_whole_after_part, WriterError, "being written in parts"),
    "more bytes than planned": (_more_bytes_than_planned, WriterError, "36 bytes, more"),
    "wrong part shape": (_wrong_part_shape, WriterError, "a part of F32"),
    "fewer bytes in a block": (_fewer_bytes_in_a_block, WriterError, "12 bytes, fewer"),
    "never written": (_never_written, WriterError, r"\['c'\] \(written: 0 of 0 bytes\)"),
    "empty never written": (_empty_never_written, WriterError, "not completely written"),
    "exception in body": (_exception_in_body, Boom, None),
    "exception in tensor block": (_exception_in_tensor_block, Boom, None),
    "caught misuse": (_caught_misuse_then_clean_exit, WriterError, "aborted"),
    "ragged list": (_ragged_whole, UsageError, "'a': cannot make an array of the list"),
    "ragged list part": (_ragged_part, UsageError, "'a': cannot make an array of the list"),
}


@pytest.mark.parametrize("previous", [None, b"previous content"], ids=["new", "existing"])
@pytest.mark.parametrize("case", [*MISUSES, "fewer bytes at close"])
async def test_misuse_on_a_file_leaves_nothing(
    tmp_path: pathlib.Path, case: str, previous: bytes | None
) -> None:
    path = tmp_path / "out.safetensors"
    if previous is not None:
        path.write_bytes(previous)
    if case == "fewer bytes at close":
        action: Misuse = _fewer_bytes_at_close
        error: type[BaseException] = WriterError
        match: str | None = r"\['a'\] \(written: 12 of 24 bytes\)"
    else:
        action, error, match = MISUSES[case]
    fds = open_fds()
    with pytest.raises(error, match=match) as info:
        async with stream_st.open_writer(path, PLAN) as writer:
            await action(writer)
    if error is WriterError:
        assert isinstance(info.value, SafetensorsError)
    assert leftovers(tmp_path, "out.safetensors") == []
    if previous is None:
        assert not path.exists()
    else:
        assert path.read_bytes() == previous
    assert open_fds() == fds


@pytest.mark.parametrize("case", [*MISUSES, "out of order"])
async def test_misuse_on_a_stream_closes_it_incomplete(case: str) -> None:
    action, error, match = (
        (_out_of_order, WriterError, "out of order.*next one is 'a'")
        if case == "out of order"
        else MISUSES[case]
    )
    async with tcp_pair() as (client, server):
        with pytest.raises(error, match=match):
            async with stream_st.open_writer(client, PLAN) as writer:
                await action(writer)
        with pytest.raises(TruncatedStreamError):  # the peer never sees a complete message
            await read_back(server)
        with pytest.raises(anyio.ClosedResourceError):
            await client.send(b"x")


async def test_misuse_on_a_memory_stream_closes_it() -> None:
    async with memory_pipe() as (sink, receive):
        with pytest.raises(WriterError, match="out of order"):
            async with stream_st.open_writer(sink, PLAN) as writer:
                await _out_of_order(writer)
        data = await drain(receive)
        with pytest.raises(anyio.EndOfStream):
            await receive.receive()
    with pytest.raises(TruncatedStreamError):
        await read_back(data)


async def test_misuse_on_an_asyncio_stream_closes_it() -> None:
    async with asyncio_pair() as (writer, reader):
        with pytest.raises(WriterError, match="already written"):
            async with stream_st.open_writer(writer, PLAN) as w:
                await _written_twice(w)
        assert writer.is_closing()
        with pytest.raises(TruncatedStreamError):
            await read_back(reader)


async def test_writer_used_after_it_closed(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "done.st"
    async with stream_st.open_writer(path, PLAN) as writer:
        for name, array in GOOD.items():
            await writer.write(name, array)
    with pytest.raises(UsageError, match="closed"):
        await writer.write("a", GOOD["a"])
    with pytest.raises(UsageError):
        await writer.open()
    await writer.aclose()  # idempotent
    assert_same(await stream_st.load(path), GOOD)
    assert leftovers(tmp_path, "done.st") == []


def test_writers_entered_with_plain_with_say_async(tmp_path: pathlib.Path) -> None:
    """A UsageError naming `async with`, where Python's was a bare TypeError; nothing written."""
    writers = [
        stream_st.open_writer(tmp_path / "x.st", PLAN),
        stream_st.open_sharded_writer(tmp_path / "ckpt", max_shard_size=100),
    ]
    for writer in writers:
        message = f"{type(writer).__name__} is an async context manager: use `async with`"
        with pytest.raises(UsageError, match=message), writer:
            pass
    assert os.listdir(tmp_path) == []


async def test_explicit_abort(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "aborted.st"
    writer = stream_st.open_writer(path, PLAN)
    await writer.open()
    await writer.write("a", GOOD["a"])
    assert writer.remaining == ["b", "c"]
    await writer.abort()
    with pytest.raises(WriterError, match="aborted"):
        await writer.aclose()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- cancellation


@pytest.mark.parametrize("previous", [None, b"old"], ids=["new", "existing"])
async def test_cancelled_mid_write_on_a_file(
    tmp_path: pathlib.Path, previous: bytes | None
) -> None:
    path = tmp_path / "cancelled.st"
    if previous is not None:
        path.write_bytes(previous)
    rows = np.ones((1024, 1024), dtype=np.float32)  # 4 MiB per part
    plan = [TensorSpec("big", "F32", (64 * 1024, 1024)), TensorSpec("after", "F32", (1,))]
    fds = open_fds()
    written = 0
    with anyio.CancelScope() as scope:
        async with stream_st.open_writer(path, plan) as writer, anyio.create_task_group() as group:

            async def cancel_soon() -> None:
                await anyio.sleep(0.02)
                scope.cancel()

            group.start_soon(cancel_soon)
            for _ in range(64):
                await writer.write_part("big", rows)
                written += 1
    assert scope.cancelled_caught and written < 64
    assert leftovers(tmp_path, "cancelled.st") == []
    assert (path.read_bytes() == previous) if previous is not None else not path.exists()
    assert open_fds() == fds


async def test_cancelled_before_the_first_write(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.st"
    with anyio.CancelScope() as scope:
        async with stream_st.open_writer(path, PLAN) as writer:
            scope.cancel()
            await writer.write("a", GOOD["a"])
    assert scope.cancelled_caught
    assert os.listdir(tmp_path) == []


async def test_concurrent_write_running_when_another_fails(tmp_path: pathlib.Path) -> None:
    """An abort while a worker thread is still writing: no temp file, no fd leaked."""
    path = tmp_path / "race.st"
    plan = [TensorSpec("big", "U8", (64 << 20,)), TensorSpec("small", "U8", (1,))]
    big = np.ones(64 << 20, dtype=np.uint8)
    fds = open_fds()
    with pytest.raises(BaseExceptionGroup) as info:
        async with stream_st.open_writer(path, plan) as writer, anyio.create_task_group() as group:
            group.start_soon(writer.write, "big", big)
            await anyio.lowlevel.checkpoint()
            await writer.write("small", np.ones(2, np.uint8))  # wrong shape: aborts
    assert info.group_contains(WriterError)
    assert os.listdir(tmp_path) == []
    assert open_fds() == fds


async def test_cancelled_while_a_stream_peer_does_not_read() -> None:
    """The send blocks on full socket buffers; cancelling aborts and closes the connection."""
    plan = [TensorSpec("huge", "U8", (1 << 30,))]
    chunk = np.zeros(1 << 20, dtype=np.uint8)
    sent = 0
    async with tcp_pair() as (client, server):
        with anyio.move_on_after(0.3) as scope:
            async with stream_st.open_writer(client, plan) as writer:
                for _ in range(1024):
                    await writer.write_part("huge", chunk)
                    sent += 1
        assert scope.cancelled_caught and sent < 1024
        with pytest.raises(TruncatedStreamError):
            await read_back(server)


async def test_transport_failure_is_a_transport_error() -> None:
    plan = [TensorSpec("huge", "U8", (1 << 30,))]
    chunk = np.zeros(1 << 20, dtype=np.uint8)
    async with tcp_pair() as (client, server):
        await server.aclose()  # the peer goes away: sends fail once the kernel notices
        with pytest.raises(stream_st.TransportError, match="send failed") as info:
            async with stream_st.open_writer(client, plan) as writer:
                for _ in range(1024):
                    await writer.write_part("huge", chunk)
        assert info.value.position is not None and info.value.position > 0


# ---------------------------------------------------------------- fsync and misc


async def test_fsync_option(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "durable.st"
    async with stream_st.open_writer(path, PLAN, fsync=True) as writer:
        for name in ("c", "b", "a"):
            await writer.write(name, GOOD[name])
    assert_same(await stream_st.load(path), GOOD)


def test_runs_on_trio(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "trio.st"

    async def main() -> Arrays:
        async with stream_st.open_writer(path, PLAN) as writer:
            await writer.write("c", GOOD["c"])
            async with writer.tensor("a") as part:
                await part.write(GOOD["a"][0])
                await part.write(GOOD["a"][1:])
            await writer.write("b", GOOD["b"])
        with pytest.raises(WriterError):
            async with stream_st.open_writer(tmp_path / "bad.st", PLAN) as writer:
                await writer.write("a", GOOD["b"])
        return await stream_st.load(path)

    assert_same(trio.run(main), GOOD)
    assert os.listdir(tmp_path) == ["trio.st"]


# ---------------------------------------------------------------- many small tensors at once


def small_tensors(count: int = 600) -> Arrays:
    """Tiny tensors of several dtypes, scalars and empties among them, one big one."""
    rng = np.random.default_rng(7)
    codes = ["F32", "BF16", "U8", "I64", "BOOL", "F8_E4M3"]
    arrays: Arrays = {}
    for i in range(count):
        shape = [(), (0,), (3,), (2, 5)][i % 4]
        arrays[f"t{i:04d}"] = random_array(codes[i % len(codes)], shape, rng)
    arrays["big"] = rng.standard_normal(300_000).astype(np.float32)  # past GATHER_BELOW
    return arrays


class CountingSink(Sink):
    """A random-access sink into memory that counts the writes it is given."""

    random_access = True
    name = "<counting>"

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()
        self.writes = 0

    async def allocate(self, size: int) -> None:
        self.data = bytearray(size)

    async def send(self, buffer: memoryview) -> None:
        raise AssertionError("a random-access sink is written with write_at")

    async def write_at(self, offset: int, buffer: memoryview) -> None:
        self.writes += 1
        self.data[offset : offset + len(buffer)] = buffer

    async def aclose(self) -> None:
        pass

    async def abort(self) -> None:
        self.data = bytearray()


async def test_write_many_gathers_small_tensors_into_few_writes() -> None:
    arrays = small_tensors()
    plan = stream_st.plan_order(TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items())
    sink = CountingSink()
    async with stream_st.open_writer(sink, plan) as writer:
        await writer.write_many((info.name, arrays[info.name]) for info in writer.header.tensors)
    assert sink.writes <= 4  # the header, the small ones gathered (a few KiB), the big one
    assert bytes(sink.data) == await to_bytes(plan, arrays)


async def test_write_many_copies_each_tensor_before_the_next(tmp_path: pathlib.Path) -> None:
    """A caller may refill the same array for each tensor: the gathered bytes are copies."""
    plan = [TensorSpec(f"r{i}", "I32", (4,)) for i in range(50)]
    buffer = np.zeros(4, np.int32)

    def refilled() -> Any:
        for i in range(50):
            buffer[:] = i
            yield f"r{i}", buffer

    path = tmp_path / "r.safetensors"
    async with stream_st.open_writer(path, plan) as writer:
        await writer.write_many(refilled())
    got = reference_numpy.load_file(str(path))
    assert all((got[f"r{i}"] == i).all() for i in range(50))


@pytest.mark.parametrize("checksums", [False, True])
async def test_write_many_on_a_file_and_a_stream(tmp_path: pathlib.Path, checksums: bool) -> None:
    arrays = small_tensors(200)
    plan = stream_st.plan_order(TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items())
    path = tmp_path / "m.safetensors"
    async with stream_st.open_writer(path, plan, checksums=checksums) as writer:
        await writer.write_many(arrays)  # a mapping, here in another order than the file's
    in_order = {info.name: arrays[info.name] for info in writer.header.tensors}
    digests = stream_st.Digests.compute(arrays) if checksums else False
    async with memory_pipe() as (sink, receive):
        async with stream_st.open_writer(sink, plan, checksums=digests) as streamed:
            await streamed.write_many(in_order)
        assert await drain(receive) == path.read_bytes()
    assert_same(await read_back(path), arrays)  # digests checked, if any


async def test_write_many_holds_a_streams_last_byte_until_the_commit() -> None:
    arrays = small_tensors(40)
    plan = stream_st.plan_order(TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items())
    in_order = [(spec.name, arrays[spec.name]) for spec in plan]
    async with memory_pipe() as (sink, receive):
        with pytest.raises(RuntimeError):
            async with stream_st.open_writer(sink, plan) as writer:
                await writer.write_many(in_order)
                raise RuntimeError("the caller fails after the last tensor")
        sent = await drain(receive)
    assert len(sent) == writer.header.file_size - 1


@pytest.mark.parametrize("fault", ["unknown", "twice", "shape", "out of order"])
async def test_write_many_misuse_aborts(tmp_path: pathlib.Path, fault: str) -> None:
    arrays = small_tensors(30)
    plan = stream_st.plan_order(TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items())
    pairs = [(spec.name, arrays[spec.name]) for spec in plan]
    if fault == "unknown":
        pairs[5] = ("nope", pairs[5][1])
    elif fault == "twice":
        pairs[5] = pairs[4]
    elif fault == "shape":
        pairs[5] = (pairs[5][0], np.zeros(99, np.int8))
    else:
        pairs[4], pairs[5] = pairs[5], pairs[4]
    if fault == "out of order":  # only a stream takes tensors in header order
        async with memory_pipe() as (sink, _):
            with pytest.raises(WriterError):
                async with stream_st.open_writer(sink, plan) as writer:
                    await writer.write_many(pairs)
        return
    path = tmp_path / "bad.safetensors"
    with pytest.raises(WriterError):
        async with stream_st.open_writer(path, plan) as writer:
            await writer.write_many(pairs)
    assert leftovers(tmp_path) == []


async def test_small_writes_are_staged_then_written_together(tmp_path: pathlib.Path) -> None:
    """write() of many small tensors to a file: the sink writes them a batch at a time, every
    byte in place, and a read back sees what was staged."""
    arrays = small_tensors(300)
    plan = stream_st.plan_order(TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items())
    path = tmp_path / "s.safetensors"
    async with stream_st.open_writer(path, plan) as writer:
        for info in writer.header.tensors:
            await writer.write(info.name, arrays[info.name])
    assert path.read_bytes() == await to_bytes(plan, arrays)
    sink = FileSink(tmp_path / "back.safetensors")
    await sink.write_at(0, memoryview(b"abc"))
    await sink.write_at(3, memoryview(b"def"))
    back = bytearray(6)
    assert await sink.read_at(0, memoryview(back)) == 6
    assert back == b"abcdef"
    await sink.abort()
    assert leftovers(tmp_path, "s.safetensors") == []


def four_kib_tensors(count: int) -> Arrays:
    """``count`` tensors of 4 KiB (F32), each filled with its index."""
    return {f"t{i:05d}": np.full(1024, i, dtype=np.float32) for i in range(count)}


async def test_small_writes_give_the_loop_a_turn_a_block(tmp_path: pathlib.Path) -> None:
    """write() of 4 KiB tensors to a file stages them with no await, but the event loop runs
    other tasks each time a block of the file is written: 8 MiB make 32 blocks."""
    arrays = four_kib_tensors(2048)
    plan = [TensorSpec(name, "F32", (1024,)) for name in arrays]
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            await anyio.lowlevel.checkpoint()
            turns += 1

    path = tmp_path / "turns.safetensors"
    async with anyio.create_task_group() as group:
        group.start_soon(count_turns)
        await anyio.lowlevel.checkpoint()
        before = turns
        async with stream_st.open_writer(path, plan) as writer:
            for name, array in arrays.items():
                await writer.write(name, array)
        during = turns - before
        group.cancel_scope.cancel()
    assert during >= (8 << 20) // atomic.WRITE_CALL - 1
    assert path.read_bytes() == reference_numpy.save(arrays)


@pytest.mark.parametrize("cancel_after", [1000, 2048], ids=["mid-way", "after-the-last"])
@pytest.mark.parametrize("many", [False, True], ids=["write", "write_many"])
async def test_small_writes_cancelled_leave_nothing(
    tmp_path: pathlib.Path, cancel_after: int, many: bool
) -> None:
    """A cancellation while small tensors are staged, or once all are, commits nothing."""
    arrays = four_kib_tensors(2048)
    plan = [TensorSpec(name, "F32", (1024,)) for name in arrays]
    path = tmp_path / "cancelled.safetensors"
    written = 0

    def pairs() -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
        nonlocal written
        for name, array in arrays.items():
            yield name, array
            written += 1
            if written == cancel_after:
                scope.cancel()

    with anyio.CancelScope() as scope:
        async with stream_st.open_writer(path, plan) as writer:
            if many:
                await writer.write_many(pairs())
            else:
                for name, array in pairs():
                    await writer.write(name, array)
    assert scope.cancelled_caught and written < cancel_after + atomic.WRITE_CALL // 4096
    assert leftovers(tmp_path) == []

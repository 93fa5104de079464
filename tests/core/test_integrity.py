"""Per-tensor digests end to end: written with ``checksums=``, checked by every reader, and
faults injected on the wire never deliver a wrong tensor."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import random
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import Digests, IntegrityError, SafetensorsError, TensorSpec, tools
from stream_st.cli import main
from stream_st.core.digests import ALGORITHM_KEY, DIGEST_KEY_PREFIX
from stream_st.core.steps import SLICE
from stream_st.transports.http.source import HttpSource
from stream_st.transports.s3.sink import MIN_PART_SIZE, S3Sink
from stream_st.transports.s3.source import S3Source

from ..fuzz.fault_suite import PAYLOAD, Sender, Suite
from ..servers.fault_proxy import Fault, FaultKind, FaultProxy
from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]
BUCKET = "integrity"


def tensors() -> Arrays:
    """The fault suite's payload: several dtypes, a scalar, an empty tensor, one of 150 kB."""
    return dict(PAYLOAD)


def same(got: Arrays, want: Arrays) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[n], want[n]) for n in want)


async def saved(tmp_path: Path, arrays: Arrays, **options: Any) -> bytes:
    path = tmp_path / "checked.safetensors"
    await stream_st.save(path, arrays, checksums=options.pop("checksums", True), **options)
    return path.read_bytes()


def flipped(data: bytes, offset: int) -> bytes:
    raw = bytearray(data)
    raw[offset] ^= 0x40
    return bytes(raw)


async def chunks_of(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


# ---------------------------------------------------------------------- the key scheme


async def test_save_records_a_digest_per_tensor_the_reference_still_loads(
    tmp_path: Path,
) -> None:
    arrays = tensors()
    header = await stream_st.save(
        tmp_path / "m.safetensors", arrays, metadata={"k": "v"}, checksums=True
    )
    data = (tmp_path / "m.safetensors").read_bytes()
    expected = Digests.compute(arrays)
    assert header.metadata == {
        "k": "v",
        ALGORITHM_KEY: "xxh3-128",
        **{DIGEST_KEY_PREFIX + name: value for name, value in expected.values.items()},
    }
    assert (await stream_st.read_header(data)).metadata == header.metadata
    assert same(reference_numpy.load(data), arrays)
    assert same(await stream_st.load(data), arrays)
    # The data section is the reference's: only the header differs.
    plain = reference_numpy.save(arrays)
    assert data.endswith(plain[8 + int.from_bytes(plain[:8], "little") :])


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256", "blake3"])
async def test_each_algorithm_is_the_plain_digest_of_the_bytes(
    tmp_path: Path, algorithm: str
) -> None:
    arrays: Arrays = {"a": np.arange(1000, dtype="<u4"), "b": np.ones((3, 3), np.float64)}
    header = await stream_st.save(tmp_path / "m.safetensors", arrays, checksums=algorithm)
    assert header.metadata[ALGORITHM_KEY] == algorithm
    if algorithm == "sha256":
        assert (
            header.metadata[DIGEST_KEY_PREFIX + "a"]
            == hashlib.sha256(arrays["a"].tobytes()).hexdigest()
        )
    assert same(await stream_st.load(tmp_path / "m.safetensors"), arrays)


async def test_unknown_algorithm_and_reserved_keys_are_usage_errors(tmp_path: Path) -> None:
    named = "checksums= names an unknown digest algorithm 'md4'"  # the argument said
    with pytest.raises(stream_st.UsageError, match=named):
        await stream_st.save(tmp_path / "m.safetensors", tensors(), checksums="md4")
    with pytest.raises(stream_st.UsageError, match=named):
        stream_st.open_sharded_writer(tmp_path / "ckpt", max_shard_size=100, checksums="md4")
    with pytest.raises(stream_st.UsageError, match="reserved"):
        await stream_st.save(
            tmp_path / "m.safetensors", tensors(), metadata={ALGORITHM_KEY: "x"}, checksums=True
        )
    assert not list(tmp_path.iterdir())


async def test_numpy_booleans_are_taken_as_verify_takes_them(tmp_path: Path) -> None:
    """checksums=np.True_ was refused as "checksums must be True, False, an algorithm name or a
    Digests, got bool" (and by cp as an unknown algorithm), where verify=np.False_ is taken."""
    arrays = {"a": np.arange(4, dtype=np.float32)}
    source, copy = tmp_path / "m.safetensors", tmp_path / "c.safetensors"
    yes: Any = np.True_
    no: Any = np.False_
    header = await stream_st.save(source, arrays, checksums=yes)
    assert Digests.from_header(header) == Digests.compute(arrays)
    header = await stream_st.save(source, arrays, checksums=no)
    assert Digests.from_header(header) is None
    header = (await tools.cp(source, copy, checksums=yes)).header
    assert Digests.from_header(header) == Digests.compute(arrays)
    header = (await tools.cp(copy, source, checksums=no)).header
    assert Digests.from_header(header) is None
    wrong: Any = 1
    with pytest.raises(stream_st.UsageError, match=r"an algorithm name or a Digests, got int$"):
        await stream_st.save(source, arrays, checksums=wrong)
    wrong = np.array([True])
    with pytest.raises(stream_st.UsageError, match=r"^checksums must be .* or None, got ndarray$"):
        await tools.cp(source, copy, checksums=wrong)


async def test_only_the_records_keys_are_reserved(tmp_path: Path) -> None:
    """Keys that merely start as the record's do (``stream_st.digestion``) are the caller's:
    kept with checksums= as without, as the manual reserves only the record's own keys."""
    metadata = {"stream_st.digestion": "x", "stream_st.digest_note": "y"}
    await stream_st.save(tmp_path / "m.safetensors", tensors(), metadata=metadata, checksums=True)
    header = await stream_st.read_header(tmp_path / "m.safetensors")
    assert {k: header.metadata[k] for k in metadata} == metadata
    for key in (ALGORITHM_KEY, DIGEST_KEY_PREFIX + "note"):
        with pytest.raises(stream_st.UsageError, match=f"metadata key '{key}' is reserved"):
            await stream_st.save(
                tmp_path / "n.safetensors", tensors(), metadata={key: "x"}, checksums=True
            )
    assert os.listdir(tmp_path) == ["m.safetensors"]


@pytest.mark.parametrize("metadata", [[("k", "v")], [], "kv", "", 5, [1, 2]])
@pytest.mark.parametrize("how", ["save", "open_writer"])
async def test_metadata_that_is_no_mapping_is_refused_with_checksums_as_without(
    tmp_path: Path, metadata: Any, how: str
) -> None:
    """With checksums= a list of pairs was written as its dict (an empty one as no metadata), and
    a str or an int raised a bare ValueError or TypeError, where without it each is refused."""
    path = tmp_path / "m.safetensors"
    for checksums in (False, True):
        with pytest.raises(stream_st.UsageError, match="metadata must be a mapping of strings"):
            if how == "save":
                await stream_st.save(
                    path, {"a": np.zeros(2, "f4")}, metadata=metadata, checksums=checksums
                )
            else:
                specs = [TensorSpec("a", "F32", (2,))]
                async with stream_st.open_writer(
                    path, specs, metadata=metadata, checksums=checksums
                ) as w:
                    await w.write("a", np.zeros(2, "f4"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("checksums", [False, True])
async def test_copies_keep_keys_that_only_start_as_the_records(
    tmp_path: Path, checksums: bool
) -> None:
    """cp (as it is, converted, quantized) and serve keep the caller's keys that merely start as
    the record's (``stream_st.digestion``), where they dropped every key starting with
    ``stream_st.digest``; a plain cp is still the same bytes."""
    mine = {"stream_st.digestion": "mine", "stream_st.digests_note": "also", "other": "x"}
    arrays = {"a": np.arange(4, dtype=np.float32)}
    source = tmp_path / "src.safetensors"
    await stream_st.save(source, arrays, metadata=mine, checksums=checksums)
    variants: list[dict[str, Any]] = [{}, {"dtype": "bf16"}, {"quantize": "int8"}]
    for options in variants:
        out = tmp_path / "out.safetensors"
        await tools.cp(source, out, **options)
        metadata = (await stream_st.read_header(out)).metadata
        assert {k: metadata.get(k) for k in mine} == mine, options
        if not options:
            assert out.read_bytes() == source.read_bytes()
    for served_checksums in ("sha256", False):
        async with stream_st.serving(source, checksums=served_checksums) as server:
            metadata = (await stream_st.read_header(server.url)).metadata
        assert {k: metadata.get(k) for k in mine} == mine, served_checksums


@pytest.mark.parametrize(
    ("values", "got"),
    [([("a", "00")], "list"), ({"a": 1}, "'a': int"), ({1: "00"}, "1: str"), (None, "NoneType")],
)
async def test_digests_given_must_map_names_to_text(tmp_path: Path, values: Any, got: str) -> None:
    digests = Digests("sha256", values)
    with pytest.raises(stream_st.ArgumentTypeError, match=f"str to str\\), got {got}$"):
        await stream_st.save(tmp_path / "m.safetensors", {"a": np.ones(2)}, checksums=digests)
    with pytest.raises(stream_st.ArgumentTypeError, match="values must map tensor names"):
        stream_st.open_writer(tmp_path / "m.safetensors", [], checksums=digests)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("tensors", "error", "message"),
    [
        (
            [("a", np.ones(2))],
            stream_st.ArgumentTypeError,
            "a mapping of names to arrays, got list",
        ),
        (None, stream_st.ArgumentTypeError, "a mapping of names to arrays, got NoneType"),
        ({"a": None}, stream_st.DtypeError, "tensor 'a': numpy dtype object has no"),
        ({"a": np.array([object()])}, stream_st.DtypeError, "tensor 'a': numpy dtype object"),
        ({"a": "xyz"}, stream_st.DtypeError, "tensor 'a': numpy dtype <U3 has no"),
        ({"a": [[1], [2, 3]]}, stream_st.UsageError, "tensor 'a': cannot make an array"),
        ({1: np.ones(2)}, stream_st.ArgumentTypeError, "a tensor name must be a string"),
    ],
    ids=["pairs", "no-mapping", "none", "objects", "str", "ragged", "name"],
)
async def test_compute_refuses_what_save_refuses(
    tmp_path: Path, tensors: Any, error: type[Exception], message: str
) -> None:
    """Digests.compute refuses what save refuses, with the same error (a bare TypeError or
    AttributeError escaped; a str was given a digest save would never record; save refused a
    non-mapping with a UsageError that is no TypeError)."""
    with pytest.raises(error, match=message) as computed:
        Digests.compute(tensors)
    with pytest.raises(error, match=message) as saved:
        await stream_st.save(tmp_path / "m.safetensors", tensors, checksums=True)
    assert type(saved.value) is type(computed.value)
    assert not list(tmp_path.iterdir())


async def test_an_empty_tensor_finished_with_no_part_has_its_digest(tmp_path: Path) -> None:
    """``async with w.tensor(name): pass`` completes a tensor of 0 bytes: its digest is the
    empty one, computed or checked against the one given."""
    arrays: Arrays = {"e": np.zeros((0, 3), np.float32), "a": np.ones(2, np.float32)}
    plan = [TensorSpec(n, "F32", a.shape) for n, a in arrays.items()]
    for checksums in (True, Digests.compute(arrays), Digests.compute(arrays, "sha256")):
        path = tmp_path / "m.safetensors"
        async with stream_st.open_writer(path, plan, checksums=checksums) as w:
            await w.write("a", arrays["a"])
            async with w.tensor("e"):
                pass
        header = await stream_st.read_header(path)
        assert Digests.from_header(header) == Digests.compute(
            arrays, header.metadata[ALGORITHM_KEY]
        )
        assert same(await stream_st.load(path), arrays)  # every digest checked


# ---------------------------------------------------------------------- readers


@pytest.mark.parametrize("kind", ["path", "mapped", "bytes", "chunks"])
async def test_a_flipped_byte_stops_the_stream_at_that_tensor(tmp_path: Path, kind: str) -> None:
    arrays = tensors()
    data = await saved(tmp_path, arrays)
    header = await stream_st.read_header(data)
    victim = header["w1"]
    bad = flipped(data, header.data_start + victim.start + 77)
    src: Any = {"bytes": bad, "chunks": chunks_of(bad)}.get(kind)
    if src is None:
        src = tmp_path / "bad.safetensors"
        src.write_bytes(bad)
    delivered = []
    with pytest.raises(IntegrityError, match=r"tensor 'w1' .* does not match its xxh3-128") as info:
        async for name, _ in stream_st.open_stream(src, copy=kind != "mapped"):
            delivered.append(name)
    assert info.value.name == "w1"
    order = [t.name for t in header.tensors]
    assert delivered == order[: order.index("w1")]


async def test_verify_false_delivers_without_checking(tmp_path: Path) -> None:
    data = await saved(tmp_path, tensors())
    header = await stream_st.read_header(data)
    bad = flipped(data, header.data_start + header["big"].start)
    got = await stream_st.load(bad, verify=False)
    assert got["big"][0] != tensors()["big"][0]
    with pytest.raises(IntegrityError):
        await stream_st.load(bad)


async def test_a_big_tensor_is_checked_across_read_chunks(tmp_path: Path) -> None:
    big = {"x": np.random.default_rng(3).integers(0, 256, (40 << 20) + 5, dtype=np.uint8)}
    data = await saved(tmp_path, big)
    header = await stream_st.read_header(data)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(flipped(data, header.data_start + (33 << 20)))
    with pytest.raises(IntegrityError):
        await stream_st.load(path)
    assert same(await stream_st.load(tmp_path / "checked.safetensors"), big)


def with_metadata(arrays: Arrays, metadata: dict[str, str]) -> bytes:
    return reference_numpy.save(arrays, metadata=metadata)


async def test_a_damaged_digest_record_is_refused_before_any_tensor(tmp_path: Path) -> None:
    arrays: Arrays = {"a": np.zeros(4, np.float32), "b": np.ones(2, np.int8)}
    good = Digests.compute(arrays).add_to(None, ["a", "b"])
    cases = {
        "has no digest": {k: v for k, v in good.items() if k != DIGEST_KEY_PREFIX + "b"},
        "digest for no tensor": {**good, DIGEST_KEY_PREFIX + "c": good[DIGEST_KEY_PREFIX + "a"]},
        "which this version cannot check": {**good, ALGORITHM_KEY: "md4"},
        "is not 32 lowercase hex digits": {**good, DIGEST_KEY_PREFIX + "a": "zz"},
        "no 'stream_st.digest' key": {k: v for k, v in good.items() if k != ALGORITHM_KEY},
    }
    for message, metadata in cases.items():
        delivered = []
        with pytest.raises(IntegrityError, match=message):
            async for name, _ in stream_st.open_stream(with_metadata(arrays, metadata)):
                delivered.append(name)
        assert delivered == []
        assert same(
            await stream_st.load(with_metadata(arrays, metadata), verify=False), arrays
        )  # still an ordinary file


async def test_a_big_headers_digest_record_is_checked_a_slice_at_a_time() -> None:
    # A reader on an event loop gives the loop its turn between two steps: the record of a
    # header of 200,000 tensors, checked in one go, held the loop for over half a second.
    arrays: Arrays = {f"t{i:05d}": np.zeros(1, np.int8) for i in range(4 * SLICE)}
    good = Digests.compute(arrays).add_to(None, list(arrays))
    header = await stream_st.read_header(with_metadata(arrays, good))
    assert sum(1 for _ in Digests.from_header_steps(header)) >= 2 * 4  # metadata, then names
    assert Digests.from_header(header) == Digests.compute(arrays)
    first = DIGEST_KEY_PREFIX + "t00000"
    for message, metadata in {
        "digest for no tensor: 'zz'": {**good, DIGEST_KEY_PREFIX + "zz": good[first]},
        "is not 32 lowercase hex digits": {**good, first: good[first].upper()},
    }.items():
        header = await stream_st.read_header(with_metadata(arrays, metadata))
        with pytest.raises(IntegrityError, match=message):
            Digests.from_header(header)


async def test_a_renamed_tensor_loses_its_digest(tmp_path: Path) -> None:
    data = await saved(tmp_path, {"alpha": np.zeros(8, np.float32)})
    with pytest.raises(IntegrityError, match="'alpho' has no digest"):
        await stream_st.load(data.replace(b'"alpha":{', b'"alpho":{'))


async def test_include_checks_only_what_it_reads(tmp_path: Path) -> None:
    data = await saved(tmp_path, tensors())
    header = await stream_st.read_header(data)
    bad = flipped(data, header.data_start + header["big"].start)
    got = await stream_st.load(bad, include={"w1", "b1"})
    assert same(got, {n: tensors()[n] for n in ("w1", "b1")})


async def test_sharded_index_verifies_each_shard(tmp_path: Path) -> None:
    arrays = tensors()
    for index, name in enumerate(("embed", "w1")):
        await stream_st.save(
            tmp_path / f"m-{index}.safetensors", {name: arrays[name]}, checksums=True
        )
    weight_map = {"embed": "m-0.safetensors", "w1": "m-1.safetensors"}
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = await stream_st.load(tmp_path / "m.safetensors.index.json")
    assert same(got, {n: arrays[n] for n in ("embed", "w1")})
    shard = tmp_path / "m-1.safetensors"
    shard.write_bytes(flipped(shard.read_bytes(), shard.stat().st_size - 1))
    with pytest.raises(IntegrityError, match="'w1'"):
        await stream_st.load(tmp_path / "m.safetensors.index.json")


# ---------------------------------------------------------------------- writers


async def test_parts_in_any_order_on_a_file_are_hashed_in_place_order(tmp_path: Path) -> None:
    a = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    b = np.arange(50, dtype=np.int16)
    plan = [TensorSpec("a", "F32", (100, 100)), TensorSpec("b", "I16", (50,))]
    async with stream_st.open_writer(tmp_path / "m.safetensors", plan, checksums=True) as w:
        await w.write("b", b)
        # Pieces placed in order, then written at once.
        async with w.tensor("a") as part, anyio.create_task_group() as group:
            for rows in range(0, 100, 10):
                group.start_soon(part.write, a[rows : rows + 10])
    assert w.header.metadata == Digests.compute({"a": a, "b": b}).add_to(None, ["a", "b"])
    assert same(await stream_st.load(tmp_path / "m.safetensors"), {"a": a, "b": b})


async def test_a_front_to_back_sink_needs_digests_up_front() -> None:
    arrays: Arrays = {"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.uint8)}
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    with pytest.raises(stream_st.UsageError, match="give them up front"):
        async with stream_st.open_writer(_ByteSend(), plan, checksums=True):
            pass

    # Given up front they are written at once, and checked against the bytes before the commit.
    sink = _ByteSend()
    async with stream_st.open_writer(sink, plan, checksums=Digests.compute(arrays)) as w:
        for name, array in arrays.items():
            await w.write(name, array)
    assert same(await stream_st.load(sink.data), arrays)

    wrong = Digests.compute({"a": arrays["a"], "b": np.zeros(3, np.uint8)})
    sink = _ByteSend()
    with pytest.raises(stream_st.WriterError, match="'b': the bytes written do not match"):
        async with stream_st.open_writer(sink, plan, checksums=wrong) as w:
            for name, array in arrays.items():
                await w.write(name, array)
    assert len(sink.data) < w.header.file_size  # the peer never got a complete message


class _ByteSend(anyio.abc.ByteSendStream):
    """An anyio byte stream that keeps what it is sent."""

    def __init__(self) -> None:
        self.data = b""

    async def send(self, item: bytes) -> None:
        self.data += bytes(item)

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_save_to_a_socket_computes_the_digests_first() -> None:
    arrays = tensors()
    got: dict[str, Any] = {}
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)

        async def receive(connection: anyio.abc.SocketStream) -> None:
            async with connection:
                got.update(await stream_st.load(connection))
                group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(listener.serve, receive)
            await stream_st.save(f"tcp://127.0.0.1:{port}", arrays, checksums=True)
            await anyio.sleep(10)
    assert same(got, arrays)


# ---------------------------------------------------------------------- S3 and HTTP


@pytest.fixture(scope="module")
def s3(moto_s3: MotoS3Server) -> MotoS3Server:
    moto_s3.client().create_bucket(Bucket=BUCKET)
    return moto_s3


s3_config = Suite.s3_config


@pytest.mark.parametrize("size", [1000, 3 * MIN_PART_SIZE + 123], ids=["put", "multipart"])
async def test_s3_holds_the_header_part_back_and_patches_it(s3: MotoS3Server, size: int) -> None:
    arrays: Arrays = {
        "head": np.arange(10, dtype=np.float32),
        "blob": np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8),
    }
    url = f"s3://{BUCKET}/patched-{size}"
    sink = S3Sink(url, config=s3_config(s3.port), part_size=MIN_PART_SIZE)
    await stream_st.save(sink, arrays, checksums=True, order="plan")
    stored = s3.client().get_object(Bucket=BUCKET, Key=f"patched-{size}", ChecksumMode="ENABLED")
    data = stored["Body"].read()
    # Every part went with its CRC32 for the store to check (moto records it, S3 also checks).
    parts = "-4" if size > MIN_PART_SIZE else ""
    assert stored["ChecksumCRC32"].endswith(parts)
    if not parts:
        assert (
            stored["ChecksumCRC32"]
            == base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
        )
    assert same(reference_numpy.load(data), arrays)
    header = await stream_st.read_header(data)
    assert header.metadata == Digests.compute(arrays).add_to(None, ["head", "blob"])
    source = S3Source(url, config=s3_config(s3.port))
    assert same(await stream_st.load(source), arrays)


async def test_http_upload_with_checksums() -> None:
    arrays = tensors()
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    with RangeHTTPServer() as server:
        with pytest.raises(stream_st.UsageError, match="give them up front"):
            async with stream_st.open_writer(server.url("/up"), plan, checksums=True):
                pass
        await stream_st.save(server.url("/up"), arrays, checksums=True)
        server.settle()
        assert same(await stream_st.load(server.objects["/up"]), arrays)


# ---------------------------------------------------------------------- whole-object checks


def _plain_file(size: int) -> tuple[Arrays, bytes]:
    """A file with no digests of its own, ``size`` bytes of data."""
    arrays: Arrays = {
        "head": np.arange(10, dtype=np.float32),
        "blob": np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8),
    }
    return arrays, reference_numpy.save(arrays)


async def _read(src: Any, mode: str) -> tuple[Arrays, stream_st.TensorStream]:
    """Every tensor of ``src``: iterated directly (one GET of everything), or opened first
    (a first range, then the rest)."""
    stream = stream_st.open_stream(src)
    if mode == "direct":
        return {name: array async for name, array in stream}, stream
    async with stream:
        return {name: array async for name, array in stream}, stream


@pytest.mark.parametrize("mode", ["direct", "opened", "parallel"])
@pytest.mark.parametrize("upload", ["crc32", "sha256", "multipart"])
async def test_a_whole_s3_read_checks_the_stores_checksum(
    s3: MotoS3Server, upload: str, mode: str
) -> None:
    size = MIN_PART_SIZE + 123 if upload == "multipart" else 5000
    arrays, data = _plain_file(size)
    key = f"whole-{upload}"
    if upload == "multipart":  # our uploads send a CRC32 per part: a checksum of 2 checksums
        await stream_st.save(
            S3Sink(f"s3://{BUCKET}/{key}", config=s3_config(s3.port), part_size=MIN_PART_SIZE),
            arrays,
        )
    else:
        s3.client().put_object(Bucket=BUCKET, Key=key, Body=data, ChecksumAlgorithm=upload.upper())
    concurrency = 4 if mode == "parallel" else 1
    source = S3Source(f"s3://{BUCKET}/{key}", config=s3_config(s3.port), concurrency=concurrency)
    got, stream = await _read(source, "direct" if mode == "parallel" else mode)
    assert same(got, arrays)
    algorithm = "CRC32" if upload == "multipart" else upload.upper()
    assert stream.object_check is not None
    assert stream.object_check.startswith(f"the store's {algorithm} checksum")
    assert stream.object_check.endswith(": verified")
    assert ("2 parts" in stream.object_check) == (upload == "multipart")


async def test_validate_checks_the_stores_checksum(s3: MotoS3Server) -> None:
    """An object whose stored bytes do not match its stored CRC32 (moto keeps a PUT whose
    checksum does not match its body): validate reports it as an error, as load refuses it."""
    arrays, data = _plain_file(5000)
    checksum = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    for key, body in (("validated", data), ("damaged", flipped(data, len(data) - 7))):
        s3.client().put_object(
            Bucket=BUCKET, Key=key, Body=body, ChecksumAlgorithm="CRC32", ChecksumCRC32=checksum
        )
    for key, ok in (("validated", True), ("damaged", False)):
        source = S3Source(f"s3://{BUCKET}/{key}", config=s3_config(s3.port))
        result = await tools.validate(source)
        assert [t.name for t in result.tensors] == list(arrays)  # every tensor summarised
        assert result.ok == ok, result.errors
    assert len(result.errors) == 1
    assert "the object does not match the store's CRC32 checksum" in result.errors[0]
    with pytest.raises(IntegrityError, match="does not match the store's CRC32"):
        await stream_st.load(S3Source(f"s3://{BUCKET}/damaged", config=s3_config(s3.port)))


async def test_s3_parts_of_unequal_sizes_are_not_checked_and_say_why(s3: MotoS3Server) -> None:
    arrays, data = _plain_file(2 * MIN_PART_SIZE + 2000)
    client = s3.client()
    upload = client.create_multipart_upload(Bucket=BUCKET, Key="uneven", ChecksumAlgorithm="CRC32")
    cuts = [0, MIN_PART_SIZE + 1000, len(data) - 10, len(data)]  # big, bigger, 10 bytes
    parts = []
    for number, (start, end) in enumerate(itertools.pairwise(cuts), 1):
        answer = client.upload_part(
            Bucket=BUCKET,
            Key="uneven",
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=data[start:end],
            ChecksumAlgorithm="CRC32",
        )
        parts.append(
            {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32": answer["ChecksumCRC32"]}
        )
    client.complete_multipart_upload(
        Bucket=BUCKET, Key="uneven", UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )
    got, stream = await _read(S3Source(f"s3://{BUCKET}/uneven", config=s3_config(s3.port)), "x")
    assert same(got, arrays)
    assert stream.object_check == (
        "the store's CRC32 checksum (x-amz-checksum-crc32, a checksum of 3 parts' checksums): "
        "not checked, its parts are not all of one size but the last"
    )


async def test_a_plain_file_damaged_on_the_wire_raises_after_its_last_tensor(
    s3: MotoS3Server, tmp_path: Path
) -> None:
    arrays, data = _plain_file(200_000)
    s3.client().put_object(Bucket=BUCKET, Key="plain", Body=data, ChecksumAlgorithm="CRC32")
    url = f"s3://{BUCKET}/plain"
    rng = random.Random(14)
    with FaultProxy(("127.0.0.1", s3.port), Fault()) as proxy:  # a clean run: its traffic
        assert same(await stream_st.load(S3Source(url, config=s3_config(proxy.port))), arrays)
        traffic = proxy.carried["down"]
    for kind in CORRUPTIONS:
        for _ in range(4):
            fault = Fault(kind, "down", traffic - rng.randrange(1, 150_000), rng.choice((1, 7)))
            with FaultProxy(("127.0.0.1", s3.port), fault) as proxy:
                source = S3Source(url, config=s3_config(proxy.port), backoff=0.01)
                delivered = []
                with pytest.raises(SafetensorsError) as info:
                    async for name, _ in stream_st.open_stream(source, timeout=1):
                        delivered.append(name)
            assert proxy.fired
            if kind == "flip":  # the length still fits: every tensor arrives, then the check
                assert isinstance(info.value, IntegrityError), fault
                assert delivered == ["head", "blob"]
                assert "does not match the store's CRC32 checksum" in str(info.value)
    # load and cp check before they return or commit.
    fault = Fault("flip", "down", traffic - 1000)
    with FaultProxy(("127.0.0.1", s3.port), fault) as proxy, pytest.raises(IntegrityError):
        await stream_st.load(S3Source(url, config=s3_config(proxy.port)))
    with FaultProxy(("127.0.0.1", s3.port), fault) as proxy, pytest.raises(IntegrityError):
        await tools.cp(S3Source(url, config=s3_config(proxy.port)), tmp_path / "c.safetensors")
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------- faults on the wire

CORRUPTIONS: tuple[FaultKind, ...] = ("flip", "drop", "duplicate")
FAULT_CASES = 12  # per medium and kind


@pytest.fixture(scope="module")
def wire(s3: MotoS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    arrays = tensors()
    path = tmp_path_factory.mktemp("wire") / "m.safetensors"
    anyio.run(lambda: stream_st.save(path, arrays, checksums=True))
    data = path.read_bytes()
    assert same(reference_numpy.load(data), arrays)
    s3.client().put_object(Bucket=BUCKET, Key="wire", Body=data)
    sender = Sender(data)
    with RangeHTTPServer(objects={"/m": data}) as http:
        yield {"arrays": arrays, "data": data, "http": http, "sender": sender}
    sender.stop()


def _reader(medium: str, port: int) -> Any:
    if medium == "http":
        return HttpSource(f"http://127.0.0.1:{port}/m", backoff=0.01)
    if medium == "s3":
        return S3Source(f"s3://{BUCKET}/wire", config=s3_config(port), backoff=0.01)
    return f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize("medium", ["http", "s3", "tcp"])
async def test_corrupted_bytes_in_tensor_data_never_reach_the_caller(
    wire: dict[str, Any], s3: MotoS3Server, medium: str
) -> None:
    target = {"http": wire["http"].port, "s3": s3.port, "tcp": wire["sender"].port}[medium]
    with FaultProxy(("127.0.0.1", target), Fault()) as proxy:  # a clean run: its traffic
        assert same(await stream_st.load(_reader(medium, proxy.port), timeout=1), wire["arrays"])
        traffic = proxy.carried["down"]
    data_part = len(wire["data"]) - 100_000  # the last bytes of every answer are tensor data
    rng = random.Random(medium)
    outcomes: dict[str, int] = {}
    for kind in CORRUPTIONS:
        for _ in range(FAULT_CASES):
            offset = traffic - rng.randrange(1, data_part)
            fault = Fault(kind, "down", offset, rng.choice((1, 2, 7)), rng.randrange(1, 256))
            with FaultProxy(("127.0.0.1", target), fault) as proxy:
                try:
                    got = await stream_st.load(_reader(medium, proxy.port), timeout=1)
                except SafetensorsError as exc:
                    outcome = type(exc).__name__
                else:
                    assert not proxy.fired or same(got, wire["arrays"])
                    outcome = "correct"
            if kind == "flip" and proxy.fired:
                assert outcome == "IntegrityError", f"{medium} {fault}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert "IntegrityError" in outcomes


async def test_an_upload_damaged_on_the_wire_is_never_read_back_as_good(
    s3: MotoS3Server,
) -> None:
    """The fault proxy between the writer and the store, damaging bytes of the uploaded tensor
    data. moto stores a PUT whose x-amz-checksum-crc32 does not match its body (S3 refuses it
    with BadDigest), with that checksum: the damaged object is committed there, but the tensor
    digests recorded by checksums= (and the stored checksum) catch it on every read."""
    arrays = tensors()
    url = f"s3://{BUCKET}/uploaded"
    with FaultProxy(("127.0.0.1", s3.port), Fault()) as proxy:  # a clean run: its traffic
        await stream_st.save(S3Sink(url, config=s3_config(proxy.port)), arrays, checksums=True)
        traffic = proxy.carried["up"]
    rng = random.Random("upload")
    outcomes: dict[str, int] = {}
    for kind in CORRUPTIONS:
        for _ in range(4):
            fault = Fault(kind, "up", traffic - rng.randrange(1, 100_000), rng.choice((1, 7)))
            with FaultProxy(("127.0.0.1", s3.port), fault) as proxy:
                try:
                    sink = S3Sink(url, config=s3_config(proxy.port), timeout=1)
                    await stream_st.save(sink, arrays, checksums=True)
                except SafetensorsError as exc:
                    outcome = f"upload failed: {type(exc).__name__}"
                else:
                    try:
                        got = await stream_st.load(S3Source(url, config=s3_config(s3.port)))
                    except IntegrityError:
                        outcome = "stored damaged, read raised IntegrityError"
                    else:
                        assert same(got, arrays), fault  # never wrong tensors, no error
                        outcome = "stored intact"
            assert proxy.fired
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert "stored damaged, read raised IntegrityError" in outcomes, outcomes


async def test_sharded_and_dataset_writers_record_digests(tmp_path: Path) -> None:
    arrays = tensors()
    async with stream_st.open_sharded_writer(
        tmp_path / "ckpt", max_shard_size=70_000, checksums=True
    ) as writer:
        for name, array in arrays.items():
            await writer.write(name, array)
    async with stream_st.open_dataset_writer(
        tmp_path / "data", target_shard_size=70_000, checksums="sha256"
    ) as dataset:
        await dataset.write_batch({"x": arrays["embed"]}, samples=1)  # KV rows: batches hold
        await dataset.write_batch({"y": arrays["w1"]}, samples=1)  # the same columns
    shards = sorted((tmp_path / "ckpt").glob("*.safetensors")) + sorted(
        (tmp_path / "data").glob("*.safetensors")
    )
    assert len(shards) >= 4
    for shard in shards:
        header = await stream_st.read_header(shard)
        digests = Digests.from_header(header)
        assert digests is not None
        assert digests.algorithm == ("sha256" if shard.parent.name == "data" else "xxh3-128")
        assert digests == Digests.compute(reference_numpy.load_file(shard), digests.algorithm)
    assert same(await stream_st.load(tmp_path / "ckpt" / "model.safetensors.index.json"), arrays)
    victim = shards[0]
    victim.write_bytes(flipped(victim.read_bytes(), victim.stat().st_size - 1))
    with pytest.raises(IntegrityError):
        await stream_st.load(tmp_path / "ckpt" / "model.safetensors.index.json")


# ---------------------------------------------------------------------- the command


def test_cp_checksums_validate_and_hash_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arrays = tensors()
    plain, copy = tmp_path / "plain.safetensors", tmp_path / "copy.safetensors"
    reference_numpy.save_file(arrays, str(plain))
    assert main(["cp", "-q", "--checksums", str(plain), str(copy)]) == 0
    header = anyio.run(stream_st.read_header, copy)
    assert Digests.from_header(header) == Digests.compute(arrays)

    capsys.readouterr()
    assert main(["validate", "-q", str(copy)]) == 0
    assert f"digests: xxh3-128: {len(arrays)} tensors verified" in capsys.readouterr().out
    assert main(["validate", "-q", str(plain)]) == 0
    assert "digests: none" in capsys.readouterr().out

    assert main(["hash", "-q", "--file", str(copy)]) == 0
    sha = hashlib.sha256(copy.read_bytes()).hexdigest()
    assert f"{sha}  {copy}\n" == capsys.readouterr().out  # sha256sum's line

    data = copy.read_bytes()
    copy.write_bytes(flipped(data, header.data_start + header["w1"].start))
    assert main(["validate", "-q", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "error: w1: does not match" in out and "digests: xxh3-128: FAILED" in out
    # A copy of a file that fails its check leaves nothing at the destination.
    assert main(["cp", "-q", str(copy), str(tmp_path / "again.safetensors")]) == 2
    assert "does not match its xxh3-128 digest" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.safetensors", "plain.safetensors"]


def test_cp_checksums_keeps_the_source_algorithm_and_its_digests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """cp --checksums (checksums=True) of a file with sha256 digests recorded xxh3-128 digests
    instead, where cp without it keeps the source's; an algorithm named still records its own."""
    arrays = tensors()
    source = tmp_path / "src.safetensors"
    anyio.run(lambda: stream_st.save(source, arrays, checksums="sha256"))
    recorded = Digests.from_header(anyio.run(stream_st.read_header, source))
    assert recorded is not None and recorded.algorithm == "sha256"

    def copied(name: str, **options: Any) -> Digests | None:
        copy = anyio.run(lambda: tools.cp(source, tmp_path / name, **options))
        return Digests.from_header(copy.header)

    assert copied("kept.safetensors", checksums=True) == recorded
    assert main(["cp", "-q", "--checksums", str(source), str(tmp_path / "cli.safetensors")]) == 0
    assert Digests.from_header(anyio.run(stream_st.read_header, tmp_path / "cli.safetensors")) == (
        recorded
    )
    assert copied("named.safetensors", checksums="xxh3-128") == Digests.compute(arrays)
    half = copied("half.safetensors", checksums=True, dtype="f16")  # computed, of sha256
    assert half == Digests.compute(
        reference_numpy.load_file(str(tmp_path / "half.safetensors")), "sha256"
    )
    data = source.read_bytes()  # checked as read: a tensor that fails leaves nothing
    header = anyio.run(stream_st.read_header, source)
    source.write_bytes(flipped(data, header.data_start + header["w1"].start))
    capsys.readouterr()
    assert main(["cp", "-q", "--checksums", str(source), str(tmp_path / "bad.safetensors")]) == 2
    assert "does not match its sha256 digest" in capsys.readouterr().err
    assert not (tmp_path / "bad.safetensors").exists()


async def test_cp_keeps_the_source_digests_even_to_a_stream(tmp_path: Path) -> None:
    arrays = tensors()
    data = await saved(tmp_path, arrays)
    sink = _ByteSend()
    await tools.cp(data, sink, include=["w1", "big"])  # the digests go out with the header
    got = await stream_st.read_header(sink.data)
    assert Digests.from_header(got) == Digests.compute({n: arrays[n] for n in ("w1", "big")})
    assert same(await stream_st.load(sink.data), {n: arrays[n] for n in ("w1", "big")})
    with pytest.raises(stream_st.UsageError, match="cannot take them there"):
        await tools.cp(data, _ByteSend(), dtype="f32", checksums=True)  # would need a patch
    converted = _ByteSend()
    await tools.cp(data, converted, dtype="f32")  # only inherited: left out, not a failure
    assert Digests.from_header(await stream_st.read_header(converted.data)) is None
    header = (await tools.cp(data, tmp_path / "f32.safetensors", dtype="f32")).header
    assert Digests.from_header(header) is not None
    await stream_st.load(tmp_path / "f32.safetensors")


def test_check_names_given_a_name_twice_checks_it_once() -> None:
    """A name given twice made the count differ from the digests' and the search for the
    digest of no tensor find none: "generator raised StopIteration" (a RuntimeError)."""
    digests = Digests.compute({"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)})
    digests.check_names(["a", "b", "a"])
    for names in (["a", "a"], ["a", "a", "a"]):
        with pytest.raises(IntegrityError, match="a digest for no tensor: 'b'"):
            digests.check_names(names)

"""stream_st.numpy against the reference safetensors.numpy: the same calls, the same results, on
local files and over HTTP, S3 (moto) and tcp://, and from inside running event loops."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as reference
import trio
from safetensors import safe_open as reference_open

import stream_st
import stream_st.numpy as sn
from stream_st.compat import _checkpoint
from stream_st.errors import (
    ArgumentTypeError,
    HeaderError,
    IntegrityError,
    SafetensorsError,
    TensorNotFoundError,
    UsageError,
)

from .._util import raw_file
from ..fuzz.fault_suite import Collector, Sender
from ..memory.test_zero_copy import linux_only, modify_in_place
from ..servers.http_server import RangeHTTPServer
from ..transports import test_s3 as s3_tests

if TYPE_CHECKING:
    import torch

Arrays = dict[str, np.ndarray[Any, Any]]

s3 = s3_tests.s3
aws_env = s3_tests.aws_env


@pytest.fixture
def aws(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The moto server of ``tests/transports/test_s3.py`` (its bucket ``models``), credentials
    from the environment, no instance metadata."""
    request.getfixturevalue("aws_env")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def in_mapping_of(path: Path, tensor: torch.Tensor | np.ndarray[Any, Any]) -> bool:
    """Whether the memory of ``tensor`` (an array, or a torch tensor) lies in this process's
    mapping of ``path``."""
    address = tensor.ctypes.data if isinstance(tensor, np.ndarray) else tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split(maxsplit=5)
            low, high = (int(part, 16) for part in span.split("-"))
            if low <= address < high and len(rest) == 5 and rest[4].strip() == str(path):
                return True
    return False


def corrupt(path: Path, name: str) -> None:
    """Flip one byte in the middle of tensor ``name``'s data."""
    header = asyncio.run(stream_st.read_header(path))
    info = header[name]
    modify_in_place(path, header.data_start + (info.start + info.end) // 2, b"\xa5")


def arrays() -> Arrays:
    """One array of each dtype the reference's numpy API reads, a scalar and an empty one."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 5))
    found: Arrays = {
        code: (base * 100).astype(code)
        for code in ("f8", "f4", "f2", "i8", "i4", "i2", "i1", "u8", "u4", "u2", "u1", "c8")
    }
    found["bool"] = base > 0
    found["big_endian"] = base.astype(">f4")
    found["scalar"] = np.array(2.5, dtype=np.float32)
    found["empty"] = np.zeros((0, 3), dtype=np.float32)
    return found


def assert_same(got: Arrays, expected: Arrays) -> None:
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].shape == array.shape, name
        assert got[name].dtype.newbyteorder("=") == array.dtype.newbyteorder("="), name
        assert np.array_equal(got[name], array), name


@pytest.fixture
def ref_file(tmp_path: Path) -> Path:
    path = tmp_path / "ref.safetensors"
    reference.save_file(arrays(), str(path), metadata={"format": "np"})
    return path


SLICES: list[Any] = [np.s_[2:5], np.s_[1], np.s_[-2], np.s_[...], np.s_[:, 1], np.s_[1:4, ::2]]


def test_save_is_byte_identical_to_the_reference(tmp_path: Path) -> None:
    sn.save_file(arrays(), tmp_path / "ours.safetensors", metadata={"a": "b"})
    reference.save_file(arrays(), str(tmp_path / "ref.safetensors"), metadata={"a": "b"})
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "ref.safetensors").read_bytes()
    assert sn.save(arrays()) == reference.save(arrays())


def test_load_and_safe_open_match_the_reference(ref_file: Path) -> None:
    assert_same(sn.load_file(ref_file), reference.load_file(str(ref_file)))
    assert_same(sn.load(ref_file.read_bytes()), reference.load(ref_file.read_bytes()))
    with reference_open(ref_file, framework="np") as ref, sn.safe_open(ref_file, "np") as ours:
        assert (ours.keys(), ours.offset_keys()) == (ref.keys(), ref.offset_keys())
        assert ours.metadata() == ref.metadata()
        names = ours.keys()
        for name in names:
            assert np.array_equal(ours.get_tensor(name), ref.get_tensor(name)), name
        for name in ("f4", "i8", "bool"):
            for key in SLICES:
                assert np.array_equal(ours.get_slice(name)[key], ref.get_slice(name)[key])
        with pytest.raises(TensorNotFoundError):
            ours.get_slice("nope")


def test_bf16_and_f8_read_where_the_reference_cannot(tmp_path: Path) -> None:
    bf16 = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    f8 = np.arange(6, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
    sn.save_file({"bf16": bf16, "f8": f8}, tmp_path / "x.safetensors")
    with pytest.raises((TypeError, AttributeError)):  # no such numpy dtype
        reference.load_file(str(tmp_path / "x.safetensors"))
    loaded = sn.load_file(tmp_path / "x.safetensors")
    assert loaded["bf16"].dtype == ml_dtypes.bfloat16 and np.array_equal(loaded["bf16"], bf16)
    assert np.array_equal(
        sn.safe_open(tmp_path / "x.safetensors", "np").get_slice("bf16")[1], bf16[1]
    )


# ---------------------------------------------------------------------- slice steps

STEPPED: Arrays = {
    "i4": np.arange(7, dtype=np.int32),
    "f2": np.arange(12).reshape(4, 3).astype(np.float16),
    "u1": np.arange(6, dtype=np.uint8).reshape(2, 3),
    "bool": np.array([True, False, True, True]),
    "empty": np.zeros((0, 3), dtype=np.float64),
    "none": np.zeros((0,), dtype=np.int8),
    "scalar": np.array(2.5, dtype=np.float32),
}
"""1-D, 2-D, 0-size and 0-d tensors of several dtypes, to slice with steps."""

PAST_64_BITS = [2**63, 2**64, 2**70, -(2**63) - 1, -(2**64), -(2**70)]
"""Slice steps the reference cannot take: it takes a step as a signed 64-bit integer."""

INSIDE: list[tuple[int | None, int | None]] = [(None, None), (0, 3), (0, 0), (1, None)]
"""Slice bounds (start, stop) inside 64 bits."""

OUTSIDE: list[tuple[int | None, int | None]] = [
    (None, 2**64 - 1),
    (2**70, None),
    (None, 2**70),
    (-(2**70), 3),
    (2**64, 2**70),
]
"""Slice bounds the reference refuses, or not (``2**64 - 1``) before the step."""


def step_keys(steps: list[int], bounds: list[tuple[int | None, int | None]]) -> list[Any]:
    """Keys that cut with each of ``steps`` from and to each of ``bounds``: alone, before or
    after another index, after ``...``, before bounds past 64 bits, after a step of 0."""
    keys: list[Any] = []
    for step in steps:
        for start, stop in bounds:
            cut = slice(start, stop, step)
            keys += [cut, (cut, 0), (0, cut), (slice(None), cut), (..., cut)]
            keys += [(cut, slice(None, 2**64)), (slice(None, None, 0), cut)]
    return keys


def test_a_slice_step_past_64_bits_is_refused_as_the_reference_refuses_it(
    tmp_path: Path,
) -> None:
    """The reference reads a numpy slice's start, then its stop (unsigned 64-bit integers), then
    its step (a signed one) before the next index and before it counts dimensions: a step past
    64 bits (``[::2**63]``, ``[0:3:2**70]``, ``[::-2**64]``) is an OverflowError there. Here it
    was taken (``[::2**63]`` gave the first row), or refused later, as an index past the
    dimensions (an IndexError that ``except OverflowError`` missed); it is refused where the
    reference refuses it, an OverflowError too. A step of 0 is refused after the bounds, as
    there. Steps inside 64 bits give what the reference gives (negative ones what numpy gives:
    the reference refuses them)."""
    path = tmp_path / "stepped.safetensors"
    reference.save_file(STEPPED, str(path))
    refused = step_keys([0, *PAST_64_BITS], [*INSIDE, *OUTSIDE])
    taken = step_keys([2**63 - 1, 2**62, 3], INSIDE)
    with reference_open(path, framework="np") as ref, sn.safe_open(path, "np") as ours:
        for name, whole in STEPPED.items():
            for key in refused:
                with pytest.raises(Exception) as expected:
                    ref.get_slice(name)[key]
                with pytest.raises(SafetensorsError) as caught:
                    ours.get_slice(name)[key]
                for kind in (OverflowError, IndexError, TypeError, ValueError):
                    if isinstance(expected.value, kind):
                        assert isinstance(caught.value, kind), (name, key, caught.value)
            for key in taken:
                try:
                    want = ref.get_slice(name)[key]
                except Exception:  # refused for its bounds or dimensions, not the step
                    continue
                got = ours.get_slice(name)[key]
                assert got.dtype == want.dtype and got.shape == want.shape, (name, key)
                assert np.array_equal(got, want), (name, key)
            if whole.ndim and whole.shape[0]:  # beyond the reference: negative steps
                for step in (-(2**63), -(2**63) + 1):
                    key = (slice(None, None, step), *[slice(2, 0, step)] * (whole.ndim - 1))
                    assert np.array_equal(ours.get_slice(name)[key], whole[key]), (name, key)


@linux_only
def test_load_file_and_safe_open_map_a_local_file_writably(ref_file: Path) -> None:
    original = ref_file.read_bytes()
    expected = reference.load_file(str(ref_file))
    with sn.safe_open(ref_file, "np") as f:
        names = f.keys()
        opened = {name: f.get_tensor(name) for name in names}
    for loaded in (sn.load_file(ref_file), opened):
        assert_same(loaded, expected)
        # load_file hands each tensor out once, a view; safe_open's are copies, as the
        # reference's (a second get_tensor must not see what the caller wrote to the first)
        assert in_mapping_of(ref_file, loaded["f4"]) == (loaded is not opened)
        assert loaded["f4"].flags.writeable
        loaded["f4"][...] = 0
    assert ref_file.read_bytes() == original
    fresh = sn.load_file(ref_file, backend="pread")
    assert_same(fresh, expected)
    assert not in_mapping_of(ref_file, fresh["f4"])


def test_checksums_are_opt_in_and_verified_by_default(tmp_path: Path) -> None:
    path = tmp_path / "sum.safetensors"
    sn.save_file(arrays(), path, checksums=True)
    assert sn.save(arrays(), checksums=True) == path.read_bytes() != reference.save(arrays())
    assert_same(sn.load_file(path), arrays())
    corrupt(path, "i8")
    with pytest.raises(IntegrityError, match="'i8'"):
        sn.load_file(path)
    with pytest.raises(IntegrityError, match="'i8'"):
        sn.load(path.read_bytes())
    with (
        sn.safe_open(path, "np", backend="pread") as f,
        pytest.raises(IntegrityError, match="'i8'"),
    ):
        f.get_tensor("i8")
    assert not np.array_equal(sn.load_file(path, verify=False)["i8"], arrays()["i8"])


@pytest.mark.parametrize("verify", ["", [], None, 0, "yes"])
def test_verify_that_is_no_bool_is_refused(tmp_path: Path, verify: Any) -> None:
    """verify= is True or False, as stream_st.load takes it: a falsy value read a corrupted
    checksummed file unchecked, mapped (load_file) or through safe_open."""
    path = tmp_path / "sum.safetensors"
    sn.save_file(arrays(), path, checksums=True)
    corrupt(path, "i8")
    message = "verify must be True or False"
    with pytest.raises(ArgumentTypeError, match=message):
        sn.load_file(path, verify=verify)
    with pytest.raises(ArgumentTypeError, match=message):
        sn.load_file(path, verify=verify, backend="pread")
    with pytest.raises(ArgumentTypeError, match=message):
        sn.safe_open(path, "np", verify=verify)


async def test_safe_open_entered_with_async_with_says_with(ref_file: Path) -> None:
    """A UsageError naming `with`, where Python's was a bare TypeError."""
    with pytest.raises(UsageError, match="safe_open is a context manager: use `with`"):
        async with sn.safe_open(ref_file, "np"):
            pass


def test_bad_arguments_are_safetensors_errors(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError):
        sn.save_file({"o": np.array([object()])}, tmp_path / "x.safetensors")
    with pytest.raises(UsageError):
        sn.save_file([np.zeros(2)], tmp_path / "x.safetensors")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        sn.load("not bytes")  # type: ignore[arg-type]
    assert not (tmp_path / "x.safetensors").exists()


def test_inside_asyncio_and_trio(ref_file: Path) -> None:
    expected = reference.load_file(str(ref_file))

    async def cell() -> Arrays:
        with sn.safe_open(ref_file, "np") as f:
            assert np.array_equal(f.get_slice("f4")[2:4], expected["f4"][2:4])
        return sn.load_file(ref_file)

    assert_same(asyncio.run(cell()), expected)
    assert_same(trio.run(cell), expected)


def test_sharded_index_with_safe_open_and_load_file(tmp_path: Path) -> None:
    parts = {"a-1.safetensors": {"x": np.arange(4.0)}, "a-2.safetensors": {"y": np.ones(3)}}
    for name, content in parts.items():
        reference.save_file(content, str(tmp_path / name))
    weight_map = {tensor: name for name, content in parts.items() for tensor in content}
    index = tmp_path / "a.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 56}, "weight_map": weight_map}))
    assert_same(sn.load_file(index), {"x": np.arange(4.0), "y": np.ones(3)})
    with sn.safe_open(index, "np") as f:
        assert f.keys() == ["x", "y"] and f.offset_keys() == ["x", "y"]
        assert f.metadata() == {"total_size": 56}
        assert np.array_equal(f.get_slice("y")[1:], np.ones(2))


def test_safe_open_of_an_index_lists_tensors_in_shard_order_whatever_was_read(
    tmp_path: Path,
) -> None:
    """offset_keys() and get_tensors() of an index go shard after shard in the shards' name
    order, as load_file reads them, not in the weight_map's order or the order the shards were
    first read in."""
    reference.save_file({"b": np.zeros(2)}, str(tmp_path / "a-1.safetensors"))
    reference.save_file({"a": np.ones(2), "c": np.ones(1)}, str(tmp_path / "a-2.safetensors"))
    index = tmp_path / "a.safetensors.index.json"
    weight_map = {"c": "a-2.safetensors", "a": "a-2.safetensors", "b": "a-1.safetensors"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    order = ["b", "a", "c"]
    assert list(sn.load_file(index)) == order
    with sn.safe_open(index, "np") as f:
        assert f.offset_keys() == order
    with sn.safe_open(index, "np") as f:
        f.get_tensor("c")
        assert f.offset_keys() == order and list(f.get_tensors()) == order


def test_safe_open_refuses_a_shard_failing_the_index_check_every_time(tmp_path: Path) -> None:
    """A shard that differs from what the index assigns it is refused at each read, not kept
    open after the first refusal for the next read to take unchecked (its data, or a tensor
    the index does not name in offset_keys() and get_tensors())."""
    reference.save_file(
        {"x": np.arange(4.0), "extra": np.ones(2)}, str(tmp_path / "a-1.safetensors")
    )
    reference.save_file({"y": np.ones(3)}, str(tmp_path / "a-2.safetensors"))
    index = tmp_path / "a.safetensors.index.json"
    weight_map = {"x": "a-1.safetensors", "y": "a-2.safetensors"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    not_assigned = (
        r"a-1\.safetensors: the shard's tensors differ .* \(it holds tensors not assigned"
    )
    with sn.safe_open(index, "np") as f:
        for read in [lambda: f.get_tensor("x")] * 2 + [f.offset_keys, f.get_tensors]:
            with pytest.raises(HeaderError, match=not_assigned):
                read()
        assert f.keys() == ["x", "y"]
        assert np.array_equal(f.get_tensor("y"), np.ones(3))
    index.write_text(json.dumps({"weight_map": {"x": "a-2.safetensors", "y": "a-2.safetensors"}}))
    with sn.safe_open(index, "np") as f:
        for _ in range(2):  # the second was a TensorNotFoundError
            with pytest.raises(HeaderError, match=r"a-2\.safetensors: .* \(it lacks \['x'\]\)"):
                f.get_tensor("x")


def open_in(folder: Path) -> set[str]:
    """What the process's descriptors are open on in ``folder``."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own, closed since
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{folder}{os.sep}"):
                found.add(target)
    return found


@linux_only
def test_safe_open_of_a_refused_manifest_leaves_no_shard_open(tmp_path: Path) -> None:
    """A dataset manifest refused by safe_open (a batch-mode dataset repeats its columns in
    every shard; a shard of another size than the manifest says) closes the shards it opened
    before the refusal, where they stayed open until a garbage collection."""

    async def write() -> None:
        async with stream_st.open_dataset_writer(tmp_path, target_shard_size=16) as writer:
            for i in range(3):
                await writer.write_batch({"x": np.full((1, 4), i, np.float32)}, samples=1)

    asyncio.run(write())
    manifest = tmp_path / "dataset_manifest.json"
    repeated = manifest.read_text()
    document = json.loads(repeated)
    document["shards"][1]["bytes"] += 1
    resized = json.dumps(document)
    gc.disable()  # what a refusal left open stays open, not collected by chance
    try:
        assert open_in(tmp_path) == set()
        for text, error in [(repeated, UsageError), (resized, HeaderError)]:
            manifest.write_text(text)
            for _ in range(3):
                with pytest.raises(error):
                    sn.safe_open(manifest, "np")
                assert open_in(tmp_path) == set()
    finally:
        gc.enable()


@linux_only
def test_a_refused_manifest_closes_every_shard_though_closes_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing the shards opened before a refusal stopped at the first close that raised,
    leaving the others open, and its error replaced the refusal: each is closed on its own and
    the refusal goes on."""

    async def write() -> None:
        async with stream_st.open_dataset_writer(tmp_path, target_shard_size=16) as writer:
            for i in range(3):
                await writer.write_batch({"x": np.full((1, 4), i, np.float32)}, samples=1)

    asyncio.run(write())
    manifest = tmp_path / "dataset_manifest.json"  # refused at the second shard (x repeated)
    close = _checkpoint._File.aclose

    async def failing_close(file: Any) -> None:
        await close(file)
        raise OSError("close failed")

    monkeypatch.setattr(_checkpoint._File, "aclose", failing_close)
    gc.disable()  # what a refusal left open stays open, not collected by chance
    try:
        with pytest.raises(UsageError, match="more than one shard"):
            sn.safe_open(manifest, "np")
        assert open_in(tmp_path) == set()
    finally:
        gc.enable()


# ---------------------------------------------------------------------- remote


@pytest.fixture
def http() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as server:
        yield server


def check_remote(address: str, ref_file: Path) -> None:
    expected = reference.load_file(str(ref_file))
    assert_same(sn.load_file(address), expected)
    with reference_open(ref_file, framework="np") as ref, sn.safe_open(address, "np") as ours:
        assert ours.keys() == ref.keys() and ours.metadata() == ref.metadata()
        for key in SLICES:
            assert np.array_equal(ours.get_slice("i4")[key], ref.get_slice("i4")[key]), key


def test_http(http: RangeHTTPServer, ref_file: Path) -> None:
    http.objects["/ref.safetensors"] = ref_file.read_bytes()
    check_remote(http.url("/ref.safetensors"), ref_file)
    sn.save_file(arrays(), http.url("/up.safetensors"))
    assert http.objects["/up.safetensors"] == reference.save(arrays())


@pytest.mark.usefixtures("aws")
def test_s3(ref_file: Path) -> None:
    address = "s3://models/numpy-api/ref.safetensors"
    sn.save_file(arrays(), address, metadata={"format": "np"})
    check_remote(address, ref_file)


def test_tcp(ref_file: Path) -> None:
    sender = Sender(ref_file.read_bytes())
    try:
        check_remote(f"tcp://127.0.0.1:{sender.port}", ref_file)
    finally:
        sender.stop()
    collector = Collector()
    try:
        sn.save_file(arrays(), f"tcp://127.0.0.1:{collector.port}", metadata={"format": "np"})
    finally:
        collector.stop()
    assert collector.received == [ref_file.read_bytes()]


# ---------------------------------------------------------------------- packed tensors

PACKED = {
    "f6": ("F6_E2M3", [4, 4], 12),
    "f4_odd": ("F4", [4, 3], 6),
    "f6_odd": ("F6_E3M2", [4, 2], 6),
}
"""Tensors delivered as their packed bytes in one dimension: F6 rows of 3 bytes, F4 rows of 1.5
and F6 rows of 1.5 (dtype, shape, bytes)."""


def packed_file() -> bytes:
    header: dict[str, Any] = {}
    data = b""
    for name, (code, shape, size) in PACKED.items():
        header[name] = {
            "dtype": code,
            "shape": shape,
            "data_offsets": [len(data), len(data) + size],
        }
        data += bytes(range(len(data), len(data) + size))
    return raw_file(header, data)


def check_packed_slices(address: str | Path, backend: str = "mmap") -> None:
    """A slice of a tensor delivered as its bytes is the bytes of the rows taken; rows that are
    not whole bytes only as a run from and to a byte boundary."""
    with sn.safe_open(address, "np", backend=backend) as f:
        rows = f.get_tensor("f6").reshape(4, 3)  # 3 bytes a row
        for key, taken in [
            (np.s_[1:3], [1, 2]),
            (np.s_[1], [1]),
            (np.s_[-1], [3]),
            (np.s_[0:2, ...], [0, 1]),
            (np.s_[::-2], [3, 1]),
            (np.s_[2:2], []),
            (np.s_[:, :], [0, 1, 2, 3]),
        ]:
            got = f.get_slice("f6")[key]
            assert got.dtype == np.uint8 and got.ndim == 1, key
            assert np.array_equal(got, rows[taken].reshape(-1)), key
        for name in ("f4_odd", "f6_odd"):
            whole = f.get_tensor(name)  # 1.5 bytes a row
            assert np.array_equal(f.get_slice(name)[0:2], whole[:3]), name
            assert np.array_equal(f.get_slice(name)[-2:], whole[3:]), name
            assert np.array_equal(f.get_slice(name)[...], whole), name
            for key in (np.s_[1:3], np.s_[1], np.s_[0:4:2], np.s_[1::-1]):
                with pytest.raises(IndexError, match="not whole bytes") as caught:
                    f.get_slice(name)[key]
                assert isinstance(caught.value, SafetensorsError)
        for key in (np.s_[:, 1:], np.s_[..., 0], np.s_[0:2, 0]):
            with pytest.raises(IndexError, match=r"'f6' is F6_E2M3.*first dimension"):
                f.get_slice("f6")[key]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_packed_tensors_slice_as_the_bytes_of_whole_rows(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "packed.safetensors"
    path.write_bytes(packed_file())
    check_packed_slices(path, backend)
    with sn.safe_open(path, "np", backend=backend) as f:
        assert np.array_equal(f.get_slice("f6")[1:3], np.arange(3, 9))  # rows 1 and 2


def test_packed_tensors_slice_alike_over_http_and_tcp(http: RangeHTTPServer) -> None:
    http.objects["/packed.safetensors"] = packed_file()
    check_packed_slices(http.url("/packed.safetensors"))
    sender = Sender(packed_file())
    try:
        check_packed_slices(f"tcp://127.0.0.1:{sender.port}")
    finally:
        sender.stop()

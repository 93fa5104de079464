"""On a file whose digests are recorded, a ``get_slice`` part of a tensor not yet checked whole
is a copy (docs/dropin.md, Slicing), however the file is reached: an index's local shard, or a
remote file's complete cache copy, as a local file. Writing into such a part changes nothing
the tensor's later check reads: no false :class:`~stream_st.IntegrityError`, the values read
whole are the file's, and the cache keeps its (good) copy. Once the tensor is checked, and on a
file without digests, a torch part is a view of the mapping, as the reference's is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

pytest.importorskip("torch")

import stream_st
import stream_st.numpy
import stream_st.torch as st

from ..servers.http_server import RangeHTTPServer
from ..transports.test_cache_refuted import kept

A = np.arange(1024, dtype=np.float32).reshape(32, 32)
ARRAYS = {"a": A, "b": A + 1}
"""Two tensors of 4 KiB: one to a shard with ``max_shard_size=4096``."""


def plain(value: Any) -> np.ndarray[Any, Any]:
    """A torch tensor's or numpy array's values as a numpy array."""
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def sharded(directory: Path, checksums: bool) -> Path:
    """:data:`ARRAYS` written to ``directory`` as two shards (with their digests recorded with
    ``checksums``); the checkpoint's index."""

    async def write() -> None:
        async with stream_st.open_sharded_writer(
            directory, max_shard_size=4096, checksums=checksums
        ) as writer:
            for name, array in ARRAYS.items():
                await writer.write(name, array)

    anyio.run(write)
    assert len(list(directory.glob("*.safetensors"))) == 2
    return directory / "model.safetensors.index.json"


def write_into_a_part(f: Any) -> None:
    """Take rows 0 and 1 of tensor ``a``, not checked yet, and write into them."""
    part = f.get_slice("a")[0:2]
    part[0, 0] = 99.0
    assert float(part[0, 0]) == 99.0


@pytest.fixture
def http() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer(etag="strong") as server:
        yield server


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_part_of_an_unchecked_tensor_of_an_index_shard_is_a_copy(
    tmp_path: Path, framework: str
) -> None:
    index = sharded(tmp_path, checksums=True)
    with st.safe_open(index, framework) as f:
        write_into_a_part(f)
        assert np.array_equal(plain(f.get_slice("a")[0:2]), A[0:2])
        assert np.array_equal(plain(f.get_tensor("a")), A)  # checked: it passes
        got = f.get_tensors()
        assert {name: plain(value).tolist() for name, value in got.items()} == {
            name: array.tolist() for name, array in ARRAYS.items()
        }
    with st.safe_open(index, framework) as f:  # get_tensors checks it too
        write_into_a_part(f)
        assert np.array_equal(plain(f.get_tensors()["a"]), A)


def test_a_torch_part_of_a_checked_tensor_of_an_index_shard_is_a_view(tmp_path: Path) -> None:
    """Checked whole, a tensor's torch parts are views of the mapping again, as the reference's
    are: a write into one is in later reads on the handle (and not checked again)."""
    index = sharded(tmp_path, checksums=True)
    with st.safe_open(index, "pt") as f:
        assert np.array_equal(plain(f.get_tensor("a")), A)
        write_into_a_part(f)
        assert float(f.get_slice("a")[0:1][0, 0]) == 99.0
        assert float(f.get_tensor("a")[0, 0]) == 99.0


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_part_of_an_unchecked_tensor_of_a_cache_copy_is_a_copy(
    tmp_path: Path, http: RangeHTTPServer, framework: str
) -> None:
    """A write into a part of a tensor of a cached copy (mapped) fails no check of the tensor,
    so the cache does not throw the good copy away."""
    path = tmp_path / "m.safetensors"
    stream_st.numpy.save_file(ARRAYS, path, checksums=True)
    data = path.read_bytes()
    http.objects["/m.safetensors"] = data
    url = http.url("/m.safetensors")
    cache = tmp_path / "cache"
    anyio.run(lambda: stream_st.load(url, cache=cache))  # a complete copy
    assert kept(cache) == ["m.safetensors"]
    with st.safe_open(url, framework, cache=cache) as f:
        write_into_a_part(f)
        assert np.array_equal(plain(f.get_slice("a")[0:2]), A[0:2])
        assert np.array_equal(plain(f.get_tensor("a")), A)
        assert np.array_equal(plain(f.get_tensor("b")), A + 1)
    assert kept(cache) == ["m.safetensors"]
    (copy,) = cache.rglob("*.safetensors")
    assert copy.read_bytes() == data


def test_without_digests_a_torch_part_of_an_index_shard_is_a_view(tmp_path: Path) -> None:
    """No check pending (no digest recorded): a torch part is a view of the shard's private
    mapping, as the reference's is, a write into it seen by later reads on the handle; a numpy
    part is a copy of its own, as the reference's is (docs/dropin.md, Slicing)."""
    index = sharded(tmp_path, checksums=False)
    with st.safe_open(index, "pt") as f:
        write_into_a_part(f)
        assert float(f.get_slice("a")[0:1][0, 0]) == 99.0
        assert float(f.get_tensor("a")[0, 0]) == 99.0
    with st.safe_open(index, "np") as f:
        write_into_a_part(f)
        assert np.array_equal(f.get_slice("a")[0:2], A[0:2])
        assert np.array_equal(f.get_tensor("a"), A)
    assert all(
        np.array_equal(plain(value), ARRAYS[name])  # the files themselves untouched
        for name, value in stream_st.numpy.load_file(index).items()
    )

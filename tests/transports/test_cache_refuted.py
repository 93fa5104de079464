"""A copy whose bytes fail the file's own digests (a tensor's) is never kept nor served again:
a byte flipped on the way during the read that fills the cache fails that read, and the next
read fetches the object again, rather than failing for ever on a server whose file is intact.
``stream-st validate`` reports such bytes rather than raising, and keeps nothing of them either."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import stream_st
import stream_st.numpy
from stream_st import IntegrityError
from stream_st.cli import main
from stream_st.core.digests import DIGEST_KEY_PREFIX
from stream_st.transports.cache.store import Record, fingerprint, hash_file, new_hasher

from .._util import assert_same_arrays
from ..servers.fault_proxy import Fault, FaultProxy
from ..servers.http_server import RangeHTTPServer

ARRAYS = {
    "first": np.random.default_rng(0).standard_normal(50_000).astype(np.float32),
    "last": np.random.default_rng(1).standard_normal(50_000).astype(np.float32),
}


def checksummed(tmp_path: Path, arrays: dict[str, Any] = ARRAYS) -> bytes:
    path = tmp_path / "m.safetensors"
    anyio.run(lambda: stream_st.save(path, arrays, checksums=True))
    return path.read_bytes()


def header_of(data: bytes) -> tuple[int, dict[str, Any]]:
    """The size of ``data``'s header and the header."""
    size = int(struct.unpack("<Q", data[:8])[0])
    header: dict[str, Any] = json.loads(data[8 : 8 + size])
    return size, header


def offset_in(data: bytes, name: str) -> int:
    """The file offset of a byte inside tensor ``name``."""
    size, header = header_of(data)
    return 8 + size + int(header[name]["data_offsets"][0]) + 1000


def flipped(data: bytes, name: str) -> bytes:
    """``data`` with a bit of tensor ``name`` flipped: the tensor fails its digest."""
    damaged = bytearray(data)
    damaged[offset_in(data, name)] ^= 1
    return bytes(damaged)


def unreadable_record(data: bytes, name: str) -> bytes:
    """``data`` with tensor ``name``'s recorded digest made no hex: a record that cannot be
    checked (the header's size and every offset unchanged)."""
    digest = header_of(data)[1]["__metadata__"][DIGEST_KEY_PREFIX + name]
    return data.replace(digest.encode(), b"z" + digest[1:].encode(), 1)


DAMAGES = {"a tensor": flipped, "a digest record": unreadable_record}
"""Ways bytes of a checksummed file arrive damaged, each taking the file and a tensor's name."""


def kept(cache: Path) -> list[str]:
    """The names of the files whose copies ``cache`` keeps (from the copies' records)."""
    records = [Record.load(p) for p in cache.rglob("*.json")]
    return sorted(r.shown.rsplit("/", 1)[-1] for r in records if r is not None)


def damage_kept_copy(cache: Path, data: bytes, name: str) -> Path:
    """Flip a bit of tensor ``name`` in the one copy ``cache`` keeps, its record made to vouch
    for the damaged bytes (as one kept before copies were checked against the file's digests);
    the copy's path."""
    (copy,) = cache.rglob("*.safetensors")
    record_path = copy.with_suffix(".json")
    record = Record.load(record_path)
    assert record is not None
    copy.write_bytes(flipped(copy.read_bytes(), name))
    record.digest = hash_file(copy, new_hasher(record.algorithm, record.size)).digest().hex()
    record.fingerprint = fingerprint(copy)
    record.save(record_path)
    return copy


@contextmanager
def a_damaged_kept_copy(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """A server of a checksummed file for the block, whose copy a stream's read kept in
    ``tmp_path / "cache"`` (it fetched) and :func:`damage_kept_copy` then damaged in ``last``:
    the file's URL, the cache, the copy."""
    data = checksummed(tmp_path)
    cache = tmp_path / "cache"
    with RangeHTTPServer(objects={"/m.safetensors": data}, etag="strong") as server:
        url = server.url("/m.safetensors")
        assert read_stream(url, cache)[1] == "fetch"
        yield url, cache, damage_kept_copy(cache, data, "last")


def read_stream(url: str, cache: Path) -> tuple[dict[str, Any], str | None]:
    async def main() -> tuple[dict[str, Any], str | None]:
        async with stream_st.open_stream(url, cache=cache) as stream:
            got = {name: np.array(array) async for name, array in stream}
            return got, getattr(stream, "cache_state", None)

    return anyio.run(main)


def read_file(url: str, cache: Path) -> tuple[dict[str, Any], str | None]:
    return stream_st.numpy.load_file(url, cache=cache), None


def read_handle(url: str, cache: Path) -> tuple[dict[str, Any], str | None]:
    with stream_st.numpy.safe_open(url, "np", cache=cache) as handle:
        names = handle.keys()
        return {name: handle.get_tensor(name) for name in names}, None


@pytest.mark.parametrize("damaged", ["first", "last"])
@pytest.mark.parametrize(
    "read", [read_stream, read_file, read_handle], ids=["open_stream", "load_file", "safe_open"]
)
def test_a_copy_failing_a_tensor_digest_is_not_kept(
    tmp_path: Path, damaged: str, read: Any
) -> None:
    data = checksummed(tmp_path)
    cache = tmp_path / "cache"
    with RangeHTTPServer(objects={"/m.safetensors": data}, etag="strong") as server:
        with FaultProxy(("127.0.0.1", server.port)) as dry:
            anyio.run(lambda: stream_st.load(dry.url(path="/m.safetensors")))
            head = dry.carried["down"] - len(data)  # the answer's status line and headers
        flip = Fault("flip", "down", offset=head + offset_in(data, damaged), mask=1)
        with FaultProxy(("127.0.0.1", server.port), flip) as proxy:
            url = proxy.url(path="/m.safetensors")
            with pytest.raises(IntegrityError, match=damaged):
                read(url, cache)
            assert proxy.fired
            records = [Record.load(p) for p in cache.rglob("*.json")]
            assert not [r for r in records if r is not None], "a copy was kept"
            got, state = read(url, cache)  # the server's file is intact: fetched again
            assert_same_arrays(got, ARRAYS)
            assert state in (None, "fetch")
            if read is not read_handle:  # a whole read keeps a whole copy
                assert [p for p in cache.rglob("*.json") if Record.load(p) is not None]
            server.settle()
            sent = sum(each for _, _, _, each in server.requests)
            got, state = read(url, cache)
            assert_same_arrays(got, ARRAYS)
            assert state in (None, "hit")
            server.settle()
            if read is not read_handle:  # served from the copy: no byte of the body again
                assert sum(each for _, _, _, each in server.requests) == sent


def test_a_kept_copy_failing_a_tensor_digest_is_removed(tmp_path: Path) -> None:
    """A copy the cache's own record vouches for (as one kept before copies were checked
    against the file's digests) whose tensor fails its digest: the read fails, the copy goes,
    the next read fetches the object again."""
    with a_damaged_kept_copy(tmp_path) as (url, cache, copy):
        with pytest.raises(IntegrityError, match="last"):
            read_stream(url, cache)
        assert not copy.exists() and not copy.with_suffix(".json").exists()
        got, state = read_stream(url, cache)
        assert_same_arrays(got, ARRAYS)
        assert state == "fetch"


def validate(url: str, cache: Path) -> int:
    """``stream-st validate --cache-dir cache url``'s exit status."""
    return main(["validate", "-q", "--cache-dir", str(cache), url])


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("damaged", ["first", "last"])
def test_validate_keeps_no_copy_of_bytes_failing_the_digests(
    tmp_path: Path, damage: str, damaged: str
) -> None:
    """``validate --cache-dir`` of a file whose bytes arrived damaged reported its digests
    FAILED yet kept the bytes as a complete copy: the next read was served from it and failed.
    Nothing of it is kept now: the next read fetches the object again."""
    data = checksummed(tmp_path)
    path = "/m.safetensors"
    with RangeHTTPServer(objects={path: DAMAGES[damage](data, damaged)}, etag="strong") as server:
        url = server.url(path)
        assert validate(url, tmp_path / "cache") == 1
        assert kept(tmp_path / "cache") == []
        server.objects[path] = data  # the same version (ETag), intact this time
        got, state = read_stream(url, tmp_path / "cache")
    assert_same_arrays(got, ARRAYS)
    assert state == "fetch"


def test_validate_removes_a_kept_copy_failing_a_tensor_digest(tmp_path: Path) -> None:
    """A copy damaged on disk behind a record vouching for it: ``validate`` reported it and left
    it in place. It is removed now, and the next read fetches the object again."""
    with a_damaged_kept_copy(tmp_path) as (url, cache, copy):
        assert validate(url, cache) == 1
        assert not copy.exists() and kept(cache) == []
        got, state = read_stream(url, cache)
    assert_same_arrays(got, ARRAYS)
    assert state == "fetch"


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("damaged", ["a", "b"])
def test_validate_of_an_index_keeps_no_copy_of_a_shard_failing_the_digests(
    tmp_path: Path, damage: str, damaged: str
) -> None:
    """``validate --cache-dir`` of a sharded checkpoint one of whose shards arrived damaged: that
    shard's copy is not kept (the others are), and the next read of the checkpoint fetches it
    again rather than failing on the copy."""
    names = {"a": "first", "b": "last"}
    shards = {shard: checksummed(tmp_path, {name: ARRAYS[name]}) for shard, name in names.items()}
    index = {
        "metadata": {},
        "weight_map": {name: f"{shard}.safetensors" for shard, name in names.items()},
    }
    objects = {f"/{shard}.safetensors": data for shard, data in shards.items()}
    objects["/m.safetensors.index.json"] = json.dumps(index).encode()
    path = f"/{damaged}.safetensors"
    objects[path] = DAMAGES[damage](shards[damaged], names[damaged])
    cache = tmp_path / "cache"
    with RangeHTTPServer(objects=objects, etag="strong") as server:
        url = server.url("/m.safetensors.index.json")
        assert validate(url, cache) == 1
        intact = "b" if damaged == "a" else "a"
        assert kept(cache) == [f"{intact}.safetensors", "m.safetensors.index.json"]
        server.objects[path] = shards[damaged]  # the same version (ETag), intact this time

        async def load() -> dict[str, Any]:
            return await stream_st.load(url, cache=cache)

        got = anyio.run(load)
    assert_same_arrays(got, ARRAYS)
    assert sorted(kept(cache)) == ["a.safetensors", "b.safetensors", "m.safetensors.index.json"]

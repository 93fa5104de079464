"""A copy whose bytes fail the file's own digests (a tensor's) is never kept nor served again:
a byte flipped on the way during the read that fills the cache fails that read, and the next
read fetches the object again, rather than failing for ever on a server whose file is intact."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import stream_st
import stream_st.numpy
from stream_st import IntegrityError
from stream_st.transports.cache.store import Record, fingerprint, hash_file, new_hasher

from .._util import assert_same_arrays
from ..servers.fault_proxy import Fault, FaultProxy
from ..servers.http_server import RangeHTTPServer

ARRAYS = {
    "first": np.random.default_rng(0).standard_normal(50_000).astype(np.float32),
    "last": np.random.default_rng(1).standard_normal(50_000).astype(np.float32),
}


def checksummed(tmp_path: Path) -> bytes:
    path = tmp_path / "m.safetensors"
    anyio.run(lambda: stream_st.save(path, ARRAYS, checksums=True))
    return path.read_bytes()


def offset_in(data: bytes, name: str) -> int:
    """The file offset of a byte inside tensor ``name``."""
    size = int(struct.unpack("<Q", data[:8])[0])
    begin = int(json.loads(data[8 : 8 + size])[name]["data_offsets"][0])
    return 8 + size + begin + 1000


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
    data = checksummed(tmp_path)
    cache = tmp_path / "cache"
    with RangeHTTPServer(objects={"/m.safetensors": data}, etag="strong") as server:
        url = server.url("/m.safetensors")
        assert read_stream(url, cache)[1] == "fetch"
        (copy,) = cache.rglob("*.safetensors")
        record_path = copy.with_suffix(".json")
        record = Record.load(record_path)
        assert record is not None
        damaged = bytearray(copy.read_bytes())
        damaged[offset_in(data, "last")] ^= 1
        copy.write_bytes(damaged)
        record.digest = hash_file(copy, new_hasher(record.algorithm, record.size)).digest().hex()
        record.fingerprint = fingerprint(copy)
        record.save(record_path)
        with pytest.raises(IntegrityError, match="last"):
            read_stream(url, cache)
        assert not copy.exists() and not record_path.exists()
        got, state = read_stream(url, cache)
        assert_same_arrays(got, ARRAYS)
        assert state == "fetch"

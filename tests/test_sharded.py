"""Sharded checkpoints: an index.json read as one stream, locally and over HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import tools
from stream_st.sharded import ShardedStream, shard_address

from ._util import assert_same_arrays
from .http_server import RangeHTTPServer

Arrays = dict[str, np.ndarray[Any, Any]]

SHARDS: dict[str, Arrays] = {
    "model-00001-of-00002.safetensors": {
        "embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "layers.0.w": np.ones((2, 2), dtype=np.float16),
    },
    "model-00002-of-00002.safetensors": {
        "layers.1.w": np.full((2, 2), 7, dtype=np.float16),
        "lm_head.weight": np.arange(6, dtype=np.int64),
    },
}
ALL: Arrays = {name: array for shard in SHARDS.values() for name, array in shard.items()}


def index_bytes(shards: dict[str, Arrays] = SHARDS) -> bytes:
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    return json.dumps({"metadata": {"total_size": 123}, "weight_map": weight_map}).encode()


def write_checkpoint(directory: Path) -> Path:
    for shard, arrays in SHARDS.items():
        reference_numpy.save_file(arrays, str(directory / shard))
    index = directory / "model.safetensors.index.json"
    index.write_bytes(index_bytes())
    return index


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


async def test_local_index_yields_every_shard_in_order(tmp_path: Path) -> None:
    index = write_checkpoint(tmp_path)
    names = []
    async with stream_st.open_stream(index) as stream:
        assert isinstance(stream, ShardedStream)
        assert stream.index.metadata == {"total_size": 123}
        async for name, _ in stream:
            names.append(name)
        assert sorted(stream.headers) == sorted(SHARDS)
    assert names == ["embed.weight", "layers.0.w", "lm_head.weight", "layers.1.w"]  # offset order
    assert_same_arrays(await read_all(str(index)), ALL)


async def test_include_across_shards_opens_only_needed_shards(tmp_path: Path) -> None:
    index = write_checkpoint(tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").unlink()  # never opened below
    got = await read_all(index, include=["lm_head.weight"])
    assert_same_arrays(got, {"lm_head.weight": ALL["lm_head.weight"]})
    with pytest.raises(stream_st.TensorNotFoundError, match="nope"):
        await read_all(index, include=["nope"])


async def test_index_over_http() -> None:
    with RangeHTTPServer() as server:
        for shard, arrays in SHARDS.items():
            server.objects[f"/repo/{shard}"] = reference_numpy.save(arrays)
        server.objects["/repo/model.safetensors.index.json"] = index_bytes()
        got = await read_all(server.url("/repo/model.safetensors.index.json"))
    assert_same_arrays(got, ALL)


async def test_bad_indexes(tmp_path: Path) -> None:
    index = write_checkpoint(tmp_path)
    bad = tmp_path / "bad.index.json"
    for content, message in [
        (b"{nope", "not valid JSON"),
        (b'{"weight_map": [1]}', "weight_map"),
        (b'{"weight_map": {"a": "../x.safetensors"}}', "next to the index"),
        (b'{"weight_map": {"a": "x\\u0000.safetensors"}}', "NUL byte"),
        (b"[" * 100_000 + b"]" * 100_000, "the index JSON is nested too deeply"),
        (b'{"metadata": {"total_size": 1' + b"0" * 5000 + b"}}", "not valid JSON"),
    ]:
        bad.write_bytes(content)
        with pytest.raises(stream_st.HeaderError, match=message):
            await read_all(bad)
        with pytest.raises(stream_st.HeaderError, match=message):
            await tools.inspect(str(bad))
    # An index that assigns a shard tensors it does not hold.
    wrong = json.loads(index.read_bytes())
    wrong["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    bad.write_text(json.dumps(wrong))
    with pytest.raises(stream_st.HeaderError, match="differ"):
        await read_all(bad)
    with pytest.raises(stream_st.SourceNotFoundError):
        await read_all(tmp_path / "missing.index.json")


def test_shard_addresses() -> None:
    assert shard_address("/m/model.safetensors.index.json", "a.safetensors") == "/m/a.safetensors"
    assert shard_address("s3://b/m/i.index.json", "a.safetensors") == "s3://b/m/a.safetensors"
    assert (
        shard_address("http://h:1/r/i.index.json?x=1", "a.safetensors")
        == "http://h:1/r/a.safetensors?x=1"
    )

"""Caps on what a read may allocate: ``max_tensor_bytes`` and ``max_total_bytes``, refused
before any allocation with an AllocationError, on every reader entry point."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
import stream_st.numpy
from stream_st.sharded.reader import ShardedStream
from stream_st.sharded.writer import open_sharded_writer


def claiming(size: int) -> bytes:
    """A header declaring one U8 tensor of ``size`` bytes."""
    blob = json.dumps({"big": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    return struct.pack("<Q", len(blob)) + blob.encode()


async def peer(header: bytes, then: int) -> AsyncIterator[bytes]:
    """A peer that sends ``header`` and then ``then`` bytes in 1 MiB chunks, and ends."""
    yield header
    chunk = bytes(1 << 20)
    for _ in range(then >> 20):
        yield chunk


async def test_a_declared_64_gib_tensor_is_refused_before_any_allocation() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(stream_st.AllocationError, match=r"'big'.*max_tensor_bytes=1048576"):
            async for _ in stream_st.open_stream(
                peer(claiming(64 << 30), 8 << 20), max_tensor_bytes=1 << 20
            ):
                pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


@pytest.fixture
def two(tmp_path: Path) -> Path:
    path = tmp_path / "two.safetensors"
    stream_st.numpy.save_file({"a": np.zeros(256, np.float32), "b": np.ones(256, np.float32)}, path)
    return path


async def test_load_caps(two: Path) -> None:
    with pytest.raises(
        stream_st.AllocationError, match="2048 bytes, more than max_total_bytes=1500"
    ):
        await stream_st.load(two, max_total_bytes=1500)
    with pytest.raises(stream_st.AllocationError, match="max_tensor_bytes=1023"):
        await stream_st.load(two, max_tensor_bytes=1023)
    assert sorted(await stream_st.load(two, max_total_bytes=2048, max_tensor_bytes=1024)) == [
        "a",
        "b",
    ]
    assert list(await stream_st.load(two, include=["b"], max_total_bytes=1500)) == ["b"]


async def test_tensor_stream_and_read_header_caps(two: Path) -> None:
    stream = stream_st.TensorStream(two, max_tensor_bytes=100)
    async with stream:  # the header alone is no allocation: refused when the read starts
        with pytest.raises(stream_st.AllocationError):
            async for _ in stream:
                pass
    with pytest.raises(stream_st.AllocationError, match="max_total_bytes=2047"):
        await stream_st.read_header(two, max_total_bytes=2047)
    assert (await stream_st.read_header(two, max_total_bytes=2048)).names() == ["a", "b"]


async def test_sharded_caps_count_every_shard(tmp_path: Path) -> None:
    async with open_sharded_writer(tmp_path, max_shard_size=1500) as writer:
        for name in "abc":
            await writer.write(name, np.zeros(256, np.float32))
    index = tmp_path / "model.safetensors.index.json"
    seen: list[str] = []
    with pytest.raises(stream_st.AllocationError, match="3072 bytes, more than max_total_bytes"):
        async for name, _ in stream_st.open_stream(index, max_total_bytes=3000):
            seen.append(name)
    assert seen == ["a", "b"]  # the third shard refused before its tensor was allocated
    with pytest.raises(stream_st.AllocationError, match="max_tensor_bytes"):
        await stream_st.load(index, max_tensor_bytes=1000)
    async with ShardedStream(index, max_total_bytes=3072) as stream:
        assert [name async for name, _ in stream] == ["a", "b", "c"]


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
async def test_a_bad_cap_is_a_usage_error(two: Path, value: Any) -> None:
    with pytest.raises(stream_st.UsageError, match="max_tensor_bytes"):
        await stream_st.load(two, max_tensor_bytes=value)

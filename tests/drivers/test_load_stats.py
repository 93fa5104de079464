"""``TensorStream.stats``: the bytes, tensors and times of a read, on real files and streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import LoadStats, tools

Arrays = dict[str, np.ndarray[Any, Any]]

TENSORS: Arrays = {
    "a": np.arange(1000, dtype=np.float32),
    "b": np.ones((30, 40), dtype=np.float16),
    "c": np.arange(7, dtype=np.int64),
}


def write(path: Path, tensors: Arrays = TENSORS) -> Path:
    reference_numpy.save_file(tensors, str(path))
    return path


async def test_a_whole_read_counts_every_byte_of_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "m.safetensors")
    async with stream_st.open_stream(path) as stream:
        assert stream.stats.tensors == 0
        assert stream.stats.bytes_read == stream.header.data_start  # the prefix and header
        assert stream.stats.first_tensor_seconds is None
        async for _name, _array in stream:
            pass
    stats = stream.stats
    assert stats.bytes_read == path.stat().st_size
    assert stats.tensors == 3
    assert stats.first_tensor_seconds is not None
    assert 0 <= stats.first_tensor_seconds <= stats.seconds
    assert 0 <= stats.wait_seconds <= stats.seconds
    assert stats.throughput == stats.bytes_read / stats.seconds
    record = stats.to_json()
    assert json.loads(json.dumps(record)) == record
    assert set(record) == {
        "bytes_read",
        "tensors",
        "seconds",
        "throughput",
        "first_tensor_seconds",
        "wait_seconds",
    }
    assert stats.summary().startswith(f"3 tensors, {stats.bytes_read / 1e3:.3g} kB in ")


async def test_only_tensors_handed_out_count(tmp_path: Path) -> None:
    path = write(tmp_path / "m.safetensors")
    async with stream_st.open_stream(path, include=["b"]) as stream:
        async for _name, _array in stream:
            pass
    assert stream.stats.tensors == 1
    assert stream.stats.bytes_read == stream.header.data_start + TENSORS["b"].nbytes


async def test_time_the_caller_spends_is_not_waiting(tmp_path: Path) -> None:
    """The caller's own work between tensors counts in ``seconds``, not in ``wait_seconds``."""
    path = write(tmp_path / "m.safetensors")
    async with stream_st.open_stream(path) as stream:
        async for _name, _array in stream:
            await anyio.sleep(0.05)
    stats = stream.stats
    assert stats.seconds >= 0.1  # two sleeps between the three tensors at least
    assert stats.seconds - stats.wait_seconds >= 0.1


async def test_a_byte_stream_counts_too(tmp_path: Path) -> None:
    raw = write(tmp_path / "m.safetensors").read_bytes()

    async def chunks() -> Any:
        for at in range(0, len(raw), 1000):
            yield raw[at : at + 1000]

    async with stream_st.open_stream(chunks()) as stream:
        names = [name async for name, _ in stream]
    assert sorted(names) == ["a", "b", "c"]
    assert stream.stats.bytes_read == len(raw)
    assert stream.stats.tensors == 3


async def test_a_sharded_stream_counts_every_shard(tmp_path: Path) -> None:
    shards: dict[str, Arrays] = {
        "model-00001-of-00002.safetensors": {"x": np.zeros(100, np.float32)},
        "model-00002-of-00002.safetensors": {"y": np.zeros(50, np.float64), "z": np.ones(3)},
    }
    for shard, arrays in shards.items():
        write(tmp_path / shard, arrays)
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    async with stream_st.open_stream(index) as stream:
        async for _name, _array in stream:
            pass
    sizes = sum((tmp_path / shard).stat().st_size for shard in shards)
    assert stream.stats.tensors == 3
    assert stream.stats.bytes_read == sizes


def test_fresh_stats_are_zero_and_summarise() -> None:
    stats = LoadStats()
    assert (stats.bytes_read, stats.tensors, stats.throughput) == (0, 0, 0.0)
    assert "no tensor" in stats.summary()
    stats.begin()
    stats.received(8)
    stats.asked()
    stats.handed(2_000_000)
    assert stats.tensors == 1 and stats.bytes_read == 2_000_008
    assert stats.first_tensor_seconds == stats.seconds
    assert "2 MB" in stats.summary()


async def test_calls_without_a_stream_leave_their_stats_for_last_stats(tmp_path: Path) -> None:
    path = write(tmp_path / "m.safetensors")
    await stream_st.load(path)
    stats = stream_st.last_stats()
    assert stats is not None and stats.tensors == 3
    assert stats.bytes_read == path.stat().st_size
    copied = await tools.cp(path, str(tmp_path / "copy.safetensors"), include=["a"])
    assert copied.load.tensors == 1 and copied.load is stream_st.last_stats()


async def test_a_mirrored_checkpoint_reports_its_shards_together(tmp_path: Path) -> None:
    shards = {"m-1.safetensors": {"x": np.zeros(100, np.float32)}, "m-2.safetensors": TENSORS}
    for shard, arrays in shards.items():
        write(tmp_path / shard, arrays)
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    await tools.mirror(str(index), str(tmp_path / "out") + "/")
    stats = stream_st.last_stats()
    assert stats is not None and stats.tensors == 4
    assert stats.bytes_read == sum((tmp_path / shard).stat().st_size for shard in shards)
    assert stats.first_tensor_seconds is not None
    assert stats.first_tensor_seconds <= stats.seconds


def test_total_of_no_tensor_then_some() -> None:
    empty, full = LoadStats(seconds=1.0), LoadStats(seconds=2.0, first_tensor_seconds=0.5)
    total = LoadStats.total([empty, full])
    assert (total.seconds, total.first_tensor_seconds) == (3.0, 1.5)
    assert LoadStats.total([empty]).first_tensor_seconds is None


def test_the_drop_in_s_load_file_leaves_its_stats(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import stream_st.numpy
    import stream_st.torch

    path = write(tmp_path / "m.safetensors")
    for load_file in (stream_st.numpy.load_file, stream_st.torch.load_file):
        before = stream_st.last_stats()
        load_file(path)
        stats = stream_st.last_stats()
        assert stats is not None and stats is not before
        assert (stats.tensors, stats.bytes_read) == (3, path.stat().st_size)

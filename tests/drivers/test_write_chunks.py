"""Every writer of a local file issues ``pwritev`` calls of at most ``WRITE_CALL`` bytes, cut at
multiples of it in the file, shared by two threads for a large tensor and made on the event
loop's thread for a small one: the bytes are right wherever the data starts and whatever the
sizes, and the calls never pass a block's end. Small tensors are gathered: many make few calls."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
from stream_st import writer
from stream_st.compat import _save
from stream_st.tools.cp import cp
from stream_st.transports.file import atomic, sink

BLOCK = 4096


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int, int]]]:
    """The ``(offset, length, thread)`` of every ``os.pwritev`` call, each still made (after 2 ms,
    so that both threads of a shared write take blocks); blocks of 4 KiB, worker threads from
    8 KiB and a split from 16 KiB so that small tensors exercise every path; tensors under 8 KiB
    gathered by ``write_many``, 16 KiB at most in one write. The drop-ins' ``save_file`` writes
    every file the Python way, whose calls these are (the compiled module's, for small files,
    are made in C: ``tests/compat/test_small_save.py``)."""
    seen: list[tuple[int, int, int]] = []
    real = os.pwritev

    def pwritev(fd: int, buffers: list[Any], offset: int, *flags: int) -> int:
        seen.append((offset, sum(len(memoryview(b)) for b in buffers), threading.get_ident()))
        time.sleep(0.002)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(atomic, "WRITE_CALL", BLOCK)
    monkeypatch.setattr(sink, "SPLIT_THRESHOLD", 4 * BLOCK)
    monkeypatch.setattr(sink, "WRITE_INLINE", 2 * BLOCK)
    monkeypatch.setattr(writer, "GATHER_BELOW", 2 * BLOCK)
    monkeypatch.setattr(writer, "GATHER_MAX", 4 * BLOCK)
    monkeypatch.setattr(_save, "SMALL", 0)
    yield seen


def check_calls(calls: list[tuple[int, int, int]], size: int) -> None:
    """The calls cover ``size`` bytes once, none crossing a block's end."""
    covered = 0
    for offset, length, _ in sorted(calls):
        assert offset == covered, "a gap or an overlap between calls"
        assert 0 < length <= BLOCK - offset % BLOCK, (offset, length)
        covered += length
    assert covered == size


def arrays(seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    """Tensors of odd sizes: under a block, across a few, and large enough to be shared."""
    rng = np.random.default_rng(seed)
    return {
        "big": rng.standard_normal(40_003).astype(np.float32),
        "mid": rng.standard_normal(2_001).astype(np.float64),
        "odd": rng.integers(0, 255, 7, dtype=np.uint8),
        "row": rng.standard_normal((37, 513)).astype(np.float16),
    }


async def test_open_writer_cuts_calls_at_blocks(
    tmp_path: Path, calls: list[tuple[int, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large tensor's blocks are shared by two worker threads (each given them: on a loaded
    machine the first may take every block before the second starts), a mid-sized one's
    written in a worker thread, a small one's on the event loop's thread."""
    given: list[tuple[Any, int]] = []  # each set of blocks (kept: its id is not reused) and
    real = atomic.write_blocks  # a thread it was given to

    def write_blocks(fd: int, blocks: Any, *args: Any) -> None:
        given.append((blocks, threading.get_ident()))
        real(fd, blocks, *args)

    monkeypatch.setattr(sink, "write_blocks", write_blocks)
    tensors = arrays()
    path = tmp_path / "w.safetensors"
    plan = [stream_st.TensorSpec(name, array.dtype, array.shape) for name, array in tensors.items()]
    async with stream_st.open_writer(path, plan, order="reference") as writer:
        await writer.write_many(tensors)
    header = writer.header
    assert header.data_start % BLOCK  # the data does not start on a block: cut there too
    assert path.read_bytes() == reference_numpy.save(tensors)
    check_calls(calls, header.file_size)

    def threads(name: str) -> set[int]:
        info = header[name]
        start, end = header.data_start + info.start, header.data_start + info.end
        return {thread for offset, _, thread in calls if start <= offset < end}

    loop = threading.get_ident()
    shared = [{t for b, t in given if b is blocks} for blocks, _ in given]
    assert max(map(len, shared)) == 2, "a large tensor is given to two threads"
    assert threads("big") and loop not in threads("big"), "it is written in worker threads"
    assert threads("row") and loop not in threads("row"), "a mid-sized one in worker threads"
    assert threads("odd") == {loop}, "a small tensor is written on the event loop's thread"


async def test_parts_at_any_offset(tmp_path: Path, calls: list[tuple[int, int, int]]) -> None:
    values = np.arange(20_000, dtype=np.int32).reshape(1000, 20)
    plan = [stream_st.TensorSpec("x", "I32", (1000, 20))]
    path = tmp_path / "p.safetensors"
    async with stream_st.open_writer(path, plan) as writer, writer.tensor("x") as parts:
        for start, stop in ((0, 3), (3, 300), (300, 301), (301, 1000)):
            await parts.write(values[start:stop])
    assert path.read_bytes() == reference_numpy.save({"x": values})
    check_calls(calls, writer.header.file_size)


def test_drop_ins_cut_calls_at_blocks(tmp_path: Path, calls: list[tuple[int, int, int]]) -> None:
    pytest.importorskip("torch")
    import safetensors.torch as reference_torch
    import torch

    import stream_st.torch

    tensors = arrays(1)
    path = tmp_path / "n.safetensors"
    stream_st.numpy.save_file(tensors, str(path))
    assert path.read_bytes() == reference_numpy.save(tensors)
    check_calls(calls, path.stat().st_size)
    calls.clear()
    torch_tensors = {name: torch.from_numpy(array) for name, array in tensors.items()}
    stream_st.torch.save_file(torch_tensors, str(path))
    assert path.read_bytes() == reference_torch.save(torch_tensors)
    check_calls(calls, path.stat().st_size)


async def test_cp_cuts_calls_at_blocks(tmp_path: Path, calls: list[tuple[int, int, int]]) -> None:
    """From a source the kernel cannot copy from (bytes in memory; a local file's are copied by
    the kernel, see tests/uses/test_cp_kernel.py), cp writes as every writer does."""
    source = tmp_path / "in.safetensors"
    reference_numpy.save_file(arrays(2), str(source))
    calls.clear()
    await cp(source.read_bytes(), tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == source.read_bytes()
    check_calls(calls, source.stat().st_size)


async def test_shards_are_written_once(tmp_path: Path, calls: list[tuple[int, int, int]]) -> None:
    """A shard's data goes straight into its file, after room for the header (spaces pad the
    header to fill it, page-aligning the data): each byte is written once, nothing is copied."""
    tensors = arrays(3)
    async with stream_st.open_sharded_writer(tmp_path, max_shard_size=200_000) as writer:
        for name, array in tensors.items():
            await writer.write(name, array)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) == 2
    assert sum(length for _, length, _ in calls) == sum(p.stat().st_size for p in shards) + len(
        (tmp_path / "model.safetensors.index.json").read_bytes()
    )
    got: dict[str, np.ndarray[Any, Any]] = {}
    for shard in shards:
        got.update(reference_numpy.load_file(str(shard)))
        header = await stream_st.read_header(shard)
        assert header.data_start % BLOCK == 0
    assert sorted(got) == sorted(tensors)
    for name, array in tensors.items():
        assert np.array_equal(got[name], array)


async def test_a_header_outgrowing_its_room_is_rewritten(tmp_path: Path) -> None:
    """A shard of many tiny tensors: its header passes the room left for it, and the shard is
    written again behind the whole header, with nothing left behind."""
    tensors = {f"column-{i:04d}-with-a-long-name": np.full(3, i % 100, np.int8) for i in range(300)}
    async with stream_st.open_dataset_writer(tmp_path, target_shard_size=1 << 20) as writer:
        for name, array in tensors.items():
            await writer.write_batch({name: array}, 1)
    (shard,) = tmp_path.glob("*.safetensors")
    header = await stream_st.read_header(shard)
    assert header.data_start > 2 * BLOCK  # past the room of the first group's header
    assert sorted(os.listdir(tmp_path)) == sorted([shard.name, "dataset_manifest.json"])
    got = reference_numpy.load_file(str(shard))
    assert got.keys() == tensors.keys()
    for name, array in tensors.items():
        assert np.array_equal(got[name], array)


@pytest.mark.parametrize("how", ["save_file", "save", "open_writer"])
async def test_many_small_tensors_make_few_calls(
    tmp_path: Path, calls: list[tuple[int, int, int]], how: str
) -> None:
    """300 tensors of 20 bytes (6 KiB): the drop-in's direct path, save() and write() one by
    one each write them in a handful of calls, cut at blocks, the bytes the reference's."""
    tensors = {f"s{i:03d}": np.full(5, i, np.float32) for i in range(300)}
    path = tmp_path / "small.safetensors"
    if how == "save_file":
        stream_st.numpy.save_file(tensors, str(path))
    elif how == "save":
        await stream_st.save(path, tensors)
    else:
        plan = [stream_st.TensorSpec(name, "F32", (5,)) for name in tensors]
        async with stream_st.open_writer(path, plan) as writer:
            for name, array in tensors.items():
                await writer.write(name, array)
    assert path.read_bytes() == reference_numpy.save(tensors)
    size = path.stat().st_size
    check_calls(calls, size)
    assert len(calls) <= size // BLOCK + 3

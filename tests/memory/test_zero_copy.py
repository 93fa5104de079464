"""``copy=False``: a local file's tensors as read-only views of one mapping of the file, populated
ahead of the consumer; every other source still reads fresh arrays."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio.to_thread
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import TruncatedStreamError

from .._util import REFERENCE_DTYPES, chunked, sample_tensors

Arrays = dict[str, np.ndarray[Any, Any]]

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def write(path: Path, tensors: Arrays) -> Path:
    reference_numpy.save_file(tensors, str(path))
    return path


def mapped_bytes(path: Path) -> int | None:
    """The resident bytes of this process's mapping of ``path`` (``/proc/self/smaps``), or None
    when the file is not mapped."""
    resident = None
    current = False
    target = str(path)
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's own line
                current = line.rstrip("\n").endswith(target)
            elif current and first == "Rss:":
                resident = (resident or 0) + int(line.split()[1]) * 1024
    return resident


def cached(path: Path, start: int, stop: int) -> bool:
    """Whether the page cache holds every byte of ``path[start:stop]``."""
    return all(resident(path, start, stop))


def resident(path: Path, start: int, stop: int) -> list[bool]:
    """Whether the page cache holds each page of ``path[start:stop]``: ``mincore`` over a
    mapping of it, which (unlike a read) starts no read-ahead."""
    libc = ctypes.CDLL(None, use_errno=True)
    first = start - start % mmap.PAGESIZE
    pages = -(-(stop - first) // mmap.PAGESIZE)
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
    try:
        address = np.frombuffer(mapping, np.uint8).ctypes.data + first
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(stop - first), vector):
            raise OSError(ctypes.get_errno(), "mincore")
        return [bool(byte & 1) for byte in vector]
    finally:
        gc.collect()  # the array over the mapping
        mapping.close()


def evicted(path: Path) -> Path:
    """``path`` with every page dropped from the page cache (a page left cached, as under
    writeback on a busy machine, would let a read find its first window cached), and still so
    a moment later: a read-ahead in flight when the pages were dropped (one a read of the
    header started) lands its pages after; skips where that cannot be done."""
    for _ in range(10):
        with open(path, "rb") as file:
            os.fsync(file.fileno())
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        time.sleep(0.05)
        if not any(resident(path, 0, path.stat().st_size)):
            return path
    pytest.skip("this file system keeps pages of the file cached")


def thread_hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions this test's code hands to worker threads from now on."""
    hops: list[str] = []
    run_sync = anyio.to_thread.run_sync

    async def counted(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(function, "__name__", repr(function)))
        return await run_sync(function, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    return hops


def modify_in_place(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


async def test_load_matches_the_reference_and_hands_out_read_only_views(tmp_path: Path) -> None:
    values = np.arange(24).reshape(2, 3, 4) % 2
    tensors: Arrays = {f"t{i}": values.astype(dtype) for i, dtype in enumerate(REFERENCE_DTYPES)}
    tensors |= sample_tensors()
    path = write(tmp_path / "m.safetensors", tensors)
    got = await stream_st.load(path, copy=False)
    assert list(got) == list(reference_numpy.load_file(str(path)))
    for name, array in got.items():
        assert array.dtype == tensors[name].dtype and array.shape == tensors[name].shape
        np.testing.assert_array_equal(array, tensors[name])
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 0


async def test_arrays_are_the_file_itself(tmp_path: Path) -> None:
    """A change to the file shows in arrays already handed out: nothing was copied."""
    path = write(tmp_path / "m.safetensors", {"a": np.zeros(1000, np.float32)})
    header = await stream_st.read_header(path)
    got = await stream_st.load(path, copy=False)
    copied = await stream_st.load(path)
    modify_in_place(path, header.data_start + 4 * 7, np.float32(3.5).tobytes())
    assert got["a"][7] == 3.5 and copied["a"][7] == 0
    assert copied["a"].flags.writeable


async def test_views_outlive_the_stream_and_the_file_name(tmp_path: Path) -> None:
    tensors: Arrays = {"w": np.arange(100_000, dtype=np.float64), "b": np.ones(3, np.int8)}
    path = write(tmp_path / "m.safetensors", tensors)
    async with stream_st.open_stream(str(path), copy=False) as stream:
        assert [t.name for t in stream.header.tensors] == ["w", "b"]
        got = {name: array async for name, array in stream}
    path.unlink()
    gc.collect()
    for name, array in tensors.items():
        np.testing.assert_array_equal(got[name], array)


@linux_only
async def test_the_mapping_goes_when_the_last_view_does(tmp_path: Path) -> None:
    path = write(tmp_path / "m.safetensors", {"w": np.ones(50_000, np.float32)})
    got = await stream_st.load(path, copy=False)
    assert mapped_bytes(path) is not None
    del got
    gc.collect()
    assert mapped_bytes(path) is None


@linux_only
async def test_the_wanted_bytes_are_populated_before_they_are_touched(tmp_path: Path) -> None:
    """The first tensor comes out with the window after it already mapped, so touching those
    pages costs no fault; tensors left out by ``include=`` are not populated."""
    tensors = {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(8)}  # 8 x 1 MiB
    path = write(tmp_path / "m.safetensors", tensors)
    wanted = ["w0", "w1", "w2", "w3"]
    stream = stream_st.open_stream(path, include=wanted, copy=False)
    names = []
    async for name, array in stream:
        names.append(name)
        if name == "w0":
            resident = mapped_bytes(path)
            assert resident is not None
            assert 4 << 20 <= resident < 5 << 20
        del array
    assert names == wanted


async def test_windows_walk_the_wanted_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Populated one small window at a time: ranges split and joined across windows and gaps."""
    monkeypatch.setattr("stream_st.transports.file.mmap.WINDOW", 3 * 4096 + 5)
    rng = np.random.default_rng(0)
    tensors = {f"t{i:02}": rng.random(int(rng.integers(0, 3000))) for i in range(40)}
    path = write(tmp_path / "m.safetensors", tensors)
    wanted = {name for i, name in enumerate(tensors) if i % 3}
    got = await stream_st.load(path, include=wanted.__contains__, copy=False)
    assert set(got) == wanted
    for name in wanted:
        np.testing.assert_array_equal(got[name], tensors[name])


async def test_unaligned_and_extended_dtypes(tmp_path: Path) -> None:
    """Offsets the reference writer would not produce still view correctly."""
    data = np.arange(5, dtype=np.uint8).tobytes() + np.arange(6, dtype=ml_dtypes.bfloat16).tobytes()
    header = {
        "odd": {"dtype": "U8", "shape": [5], "data_offsets": [0, 5]},
        "bf": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [5, 17]},
        "__metadata__": {"k": "v"},
    }
    text = json.dumps(header).encode() + b"  "
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    got = await stream_st.load(path, copy=False)
    np.testing.assert_array_equal(got["odd"], np.arange(5, dtype=np.uint8))
    assert got["bf"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["bf"], np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3))


async def test_a_truncated_file_fails_before_any_view(tmp_path: Path) -> None:
    path = write(tmp_path / "m.safetensors", {"a": np.ones(1000, np.float32)})
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(TruncatedStreamError, match="'a'"):
        await stream_st.load(path, copy=False)


async def test_other_sources_still_read_fresh_arrays(tmp_path: Path) -> None:
    tensors = sample_tensors()
    data = reference_numpy.save(tensors)
    for source in (data, chunked(data, 7)):
        got = await stream_st.load(source, copy=False)
        for name, array in got.items():
            assert array.flags.writeable
            np.testing.assert_array_equal(array, tensors[name])


async def test_sharded_checkpoints_map_every_shard(tmp_path: Path) -> None:
    shards: dict[str, Arrays] = {
        "a.safetensors": {"x": np.arange(4.0)},
        "b.safetensors": {"y": np.ones(2, np.int16)},
    }
    for shard, tensors in shards.items():
        write(tmp_path / shard, tensors)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    got = await stream_st.load(index, copy=False)
    assert sorted(got) == ["x", "y"]
    assert not any(array.flags.writeable for array in got.values())
    np.testing.assert_array_equal(got["y"], np.ones(2, np.int16))


def damaged_checkpoint(folder: Path) -> Path:
    """The index of three one-tensor shards, the last one cut short: a load maps the first two,
    then fails."""
    weight_map = {}
    for index, shard in enumerate(["a", "b", "c"]):
        weight_map[f"t{index}"] = f"{shard}.safetensors"
        write(folder / f"{shard}.safetensors", {f"t{index}": np.full(10_000, index, np.float32)})
    os.truncate(folder / "c.safetensors", 1000)
    index_path = folder / "model.safetensors.index.json"
    index_path.write_text(json.dumps({"weight_map": weight_map}))
    return index_path


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextmanager
def collector_off() -> Iterator[int]:
    """The cyclic garbage collector off (after one collection) in the block: what a failed
    call keeps only through a reference cycle stays. Gives the open descriptors at its start."""
    gc.collect()
    gc.disable()
    try:
        yield open_descriptors()
    finally:
        gc.enable()


@linux_only
def test_a_failed_load_under_asyncio_run_closes_what_it_mapped(tmp_path: Path) -> None:
    """asyncio.run keeps a failed call's frames until the cyclic garbage collector runs (its
    task and the error hold each other): the load lets go of the views it mapped before its
    error leaves, so no descriptor stays open after it (each failed call kept one)."""
    index = damaged_checkpoint(tmp_path)
    with collector_off() as before:
        for _ in range(3):
            with pytest.raises(TruncatedStreamError, match=r"c\.safetensors"):
                asyncio.run(stream_st.load(index, copy=False))
            assert open_descriptors() == before


@linux_only
async def test_a_failed_load_leaves_no_reference_cycle(
    tmp_path: Path,
) -> None:
    """The error of a failed load is in no reference cycle (a shard's error held by the frame
    that raised it, a step's error by the iteration it left): dropped, it goes at once, with
    the frames of its traceback and what they held."""
    index = damaged_checkpoint(tmp_path)
    with pytest.raises(TruncatedStreamError):  # whatever the event loop opens on first use
        await stream_st.load(index, copy=False)
    with collector_off() as before:
        for _ in range(3):
            with pytest.raises(TruncatedStreamError, match=r"c\.safetensors"):
                await stream_st.load(index)
            with pytest.raises(TruncatedStreamError, match=r"c\.safetensors"):
                await stream_st.load(index, copy=False)
            assert open_descriptors() == before
            assert not [o for o in gc.get_objects() if isinstance(o, TruncatedStreamError)]


@linux_only
async def test_a_cached_file_is_populated_without_a_thread_hop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file in the page cache (just written) is mapped and populated on the event loop's
    thread: no worker thread, whose start alone costs more than a small file's load."""
    tensors = {f"k{i}": np.full(1 << 17, i, np.float16) for i in range(12)}  # 12 x 256 KiB
    path = write(tmp_path / "kv.safetensors", tensors)
    hops = thread_hops(monkeypatch)
    got = await stream_st.load(path, copy=False)
    assert hops == []
    resident = mapped_bytes(path)
    assert resident is not None and resident >= 3 << 20
    for name, array in tensors.items():
        np.testing.assert_array_equal(got[name], array)


@linux_only
async def test_an_evicted_file_is_populated_in_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not cached, a window is populated in a worker thread: the event loop never waits for
    the disk. The pages are dropped again once the header is read, whose read-ahead may have
    brought the whole small file back (a device with a large read-ahead does)."""
    tensors = {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(4)}  # 4 x 1 MiB
    path = write(tmp_path / "m.safetensors", tensors)
    hops = thread_hops(monkeypatch)
    async with stream_st.open_stream(evicted(path), copy=False) as stream:
        evicted(path)
        async for name, array in stream:
            if name == "w0":
                assert "_advise" in hops
            np.testing.assert_array_equal(array, tensors[name])

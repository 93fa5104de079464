"""Reads straight from the disk (``O_DIRECT``) of what the page cache does not hold
(stream_st/sources/_direct.py): the same bytes as the reference into fresh arrays (read into
their frames), small arrays and the caller's memory (through a bounce buffer), a file that ends
off a block boundary, half a file cached, a file system that refuses, a file that shrinks; the
setting ``STREAM_ST_DIRECT_IO``; the frames the recycler gives."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference

import stream_st
from stream_st.memory.fresh import ALIGN
from stream_st.memory.recycle import RECYCLE_FROM, Recycler
from stream_st.transports.file import direct as _direct
from stream_st.transports.file.direct import Direct, NotDirect, Residency

from ..memory.test_zero_copy import cached, evicted
from .test_read_ahead import mixed, shrinks_and_never_yields_short

pytestmark = pytest.mark.anyio

Arrays = dict[str, np.ndarray[Any, Any]]


@pytest.fixture
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The mixed file (12 MiB, odd sizes and offsets, 3 bytes past a block boundary at its
    end), evicted, with direct reads on for every file; skips where they cannot be had."""
    monkeypatch.setenv("STREAM_ST_DIRECT_IO", "1")
    target = tmp_path / "mixed.safetensors"
    tensors = mixed()
    tensors["tail"] = np.arange(3, dtype=np.uint8)  # the file's size: not whole blocks
    reference.save_file(tensors, target)
    fd = os.open(target, os.O_RDONLY)
    try:
        direct = Direct.open(fd)
        if direct is None:
            pytest.skip("no O_DIRECT or cachestat here")
        direct.close()
    finally:
        os.close(fd)
    return evicted(target)


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(start, length) of every read done straight from the disk from now on."""
    reads: list[tuple[int, int]] = []
    read = Direct._read

    def counted(self: Direct, buffered: int, area: memoryview, start: int, offset: int) -> int:
        reads.append((start, len(area)))
        return read(self, buffered, area, start, offset)

    monkeypatch.setattr(Direct, "_read", counted)
    return reads


def same_as_reference(path: Path, got: dict[str, Any]) -> None:
    expected = reference.load_file(path)
    assert list(got) == list(expected) or sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert np.asarray(got[name]).tobytes() == array.tobytes(), name


async def test_an_evicted_file_is_read_from_the_disk_and_gives_the_reference_s_bytes(
    path: Path, direct_reads: list[tuple[int, int]]
) -> None:
    assert os.path.getsize(path) % ALIGN != 0
    got = {name: array async for name, array in stream_st.open_stream(path)}
    middle = os.path.getsize(path) // 2
    assert not cached(path, middle, middle + 16 * ALIGN)  # not read into the page cache
    same_as_reference(path, got)
    assert direct_reads  # the test would pass through the page cache otherwise
    assert all(start % ALIGN == 0 and length % ALIGN == 0 for start, length in direct_reads)


async def test_the_caller_s_memory_and_small_arrays_go_through_a_bounce_buffer(
    path: Path, monkeypatch: pytest.MonkeyPatch, direct_reads: list[tuple[int, int]]
) -> None:
    bounced: list[int] = []
    read_bounced = Direct.read_bounced

    def counted(self: Direct, buffered: int, views: list[memoryview], *rest: Any) -> list[int]:
        bounced.append(len(views))
        return read_bounced(self, buffered, views, *rest)

    monkeypatch.setattr(Direct, "read_bounced", counted)
    into: dict[str, Any] = {
        "big.b": np.empty((1024, 1023), np.float32),  # the caller's: not aligned as the file is
        "small.05": bytearray(1 + 977 * 5),
    }
    got = {name: array async for name, array in stream_st.open_stream(path, into=into)}
    assert got["big.b"] is into["big.b"]
    same_as_reference(path, got)
    assert bounced and max(bounced) > 1  # adjacent small tensors read in one go


async def test_a_load_keeps_every_array_read_from_the_disk(
    path: Path, direct_reads: list[tuple[int, int]]
) -> None:
    same_as_reference(path, await stream_st.load(path))
    assert direct_reads


async def test_half_a_file_cached_reads_the_cached_half_through_the_cache(
    path: Path, direct_reads: list[tuple[int, int]]
) -> None:
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead beyond
        os.pread(fd, size // 2, 0)  # the first half into the page cache
    finally:
        os.close(fd)
    got = {name: array async for name, array in stream_st.open_stream(path)}
    same_as_reference(path, got)
    assert direct_reads
    assert min(start for start, _ in direct_reads) >= size // 2 - 8 * ALIGN - (8 << 20)


async def test_a_file_system_that_refuses_direct_reads_is_read_through_the_cache(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused: list[int] = []

    def refuse(self: Direct, *args: Any) -> int:
        refused.append(1)
        raise NotDirect

    monkeypatch.setattr(Direct, "_read", refuse)
    got = {name: array async for name, array in stream_st.open_stream(path)}
    same_as_reference(path, got)
    assert refused


async def test_a_file_that_shrinks_never_yields_short_when_read_from_the_disk(
    path: Path, direct_reads: list[tuple[int, int]]
) -> None:
    await shrinks_and_never_yields_short(path)
    assert direct_reads


def test_the_setting_and_the_default_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_direct, "_available_memory", lambda: 1000)
    monkeypatch.delenv("STREAM_ST_DIRECT_IO", raising=False)
    assert not _direct.enabled(500)  # fits in the page cache: left to it
    assert _direct.enabled(501)  # more than half the memory available
    monkeypatch.setenv("STREAM_ST_DIRECT_IO", "auto")
    assert _direct.enabled(501)
    monkeypatch.setenv("STREAM_ST_DIRECT_IO", "0")
    assert not _direct.enabled(10**12)
    monkeypatch.setenv("STREAM_ST_DIRECT_IO", " On ")
    assert _direct.enabled(1)
    monkeypatch.setattr(_direct, "_available_memory", lambda: None)
    monkeypatch.delenv("STREAM_ST_DIRECT_IO")
    assert not _direct.enabled(10**12)  # unknown: as the kernel does


def test_cached_pages_are_told_from_evicted_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAM_ST_DIRECT_IO", "1")
    target = tmp_path / "f"
    target.write_bytes(b"x" * (3 * ALIGN))
    fd = os.open(target, os.O_RDONLY)
    try:
        os.read(fd, 3 * ALIGN)
        direct = Direct.open(fd)
        if direct is None:
            pytest.skip("no O_DIRECT or cachestat here")
        assert not direct.uncached(0, 3 * ALIGN)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert direct.uncached(0, 3 * ALIGN) or cached(target, 0, 3 * ALIGN)
        direct.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("answer", [0, None])
def test_a_kernel_whose_page_cache_count_means_nothing_is_not_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: int | None
) -> None:
    """Where ``cachestat`` counts no page of a file whose first byte was just read (an overlay
    file system counts its own file's pages, which hold none) or fails (a file the caller may
    not write), neither the cold path nor direct reads ask it: every piece would look cold."""
    monkeypatch.setenv("STREAM_ST_DIRECT_IO", "1")
    target = tmp_path / "f"
    target.write_bytes(b"x" * (3 * ALIGN))
    fd = os.open(target, os.O_RDONLY)
    try:
        if Residency.of(fd) is None:
            pytest.skip("no cachestat here")
        monkeypatch.setattr(Residency, "_cached", lambda self, offset, length: answer)
        assert Residency.of(fd) is None
        assert Direct.open(fd) is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("phase", [0, 1, 7, ALIGN - 1])
def test_a_framed_array_lies_as_its_bytes_lie_in_the_file_s_blocks(phase: int) -> None:
    recycler = Recycler()
    nbytes = RECYCLE_FROM + 5
    array, frame = recycler.take_framed(nbytes, phase)
    assert frame is not None and array.nbytes == nbytes
    start = np.frombuffer(frame, np.uint8).ctypes.data
    assert start % ALIGN == 0
    assert array.ctypes.data - start == phase
    assert len(frame) >= -(-(phase + nbytes) // ALIGN) * ALIGN  # whole blocks after the end
    where = start
    del array
    _, frame = recycler.take_framed(nbytes, (phase + 3) % ALIGN)  # another phase: same memory
    assert frame is not None and np.frombuffer(frame, np.uint8).ctypes.data == where
    assert recycler.take_framed(RECYCLE_FROM - 1, 0)[1] is None  # small: malloc's, no frame


async def test_the_uncached_rest_of_a_partly_cached_file_stays_out_of_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_reads: list[tuple[int, int]]
) -> None:
    """A buffered read that reaches past what the page cache holds (the piece where the cached
    part ends) must not set off the kernel's own read-ahead: it would pull the following
    megabytes into the cache, the pieces there would then look cached and be read through it,
    setting off more, and the rest of the file would never be read directly."""
    monkeypatch.setenv("STREAM_ST_DIRECT_IO", "1")
    target = tmp_path / "m.safetensors"
    tensors = {f"t{i:02}": np.full(1 << 20, i, np.uint8) for i in range(32)}
    reference.save_file(tensors, target)
    evicted(target)
    size = os.path.getsize(target)
    fd = os.open(target, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead beyond
        os.pread(fd, 7 << 20, 0)  # the first 7 MiB into the page cache
    finally:
        os.close(fd)
    got = {name: array async for name, array in stream_st.open_stream(target)}
    assert all(got[name].tobytes() == array.tobytes() for name, array in tensors.items())
    assert direct_reads
    assert not cached(target, size - (8 << 20), size)  # read from the disk, not the cache

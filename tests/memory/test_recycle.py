"""A stream's fresh memory used again (stream_st/_recycle.py): only once no array over it is
alive, never beyond its bound; and a caller that keeps some arrays finds them intact."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference
import torch

import stream_st
from stream_st.memory import fresh as _fresh
from stream_st.memory import recycle as _recycle
from stream_st.memory.recycle import IDLE_BYTES, KEPT_BYTES, RECYCLE_FROM, Recycler

from .._util import mapping_of

pytestmark = pytest.mark.anyio

SIZE = 1 << 20


def address(array: np.ndarray[Any, Any]) -> int:
    return int(array.__array_interface__["data"][0])


def test_memory_comes_back_once_every_array_over_it_is_gone() -> None:
    recycler = Recycler()
    first = recycler.take(SIZE)
    where = address(first)
    derived = [
        first.view(np.float32).reshape(256, 1024),
        first[4096:],
        torch.from_numpy(first.view(np.int16)),
        memoryview(first.data),
    ]
    del first
    held = []  # kept, so that the only idle memory is the first array's once it is free
    while derived:  # any one of them keeps the memory in use
        held.append(recycler.take(SIZE))
        assert address(held[-1]) != where
        derived.pop()
    again = recycler.take(SIZE)
    assert address(again) == where  # nothing over it any more: used again
    assert address(recycler.take(SIZE)) != where  # in use again now


def test_small_arrays_are_not_kept_and_other_sizes_get_fresh_memory() -> None:
    recycler = Recycler()
    recycler.take(RECYCLE_FROM - 1)
    assert not recycler._kept  # malloc's business
    big = recycler.take(SIZE)
    where = address(big)
    del big
    assert address(recycler.take(2 * SIZE)) != where  # another size: not this memory


def test_idle_memory_kept_stays_within_its_bound() -> None:
    recycler = Recycler()
    sizes = [3 * SIZE, 5 * SIZE, 7 * SIZE, 11 * SIZE, 13 * SIZE]
    for _ in range(3):
        for size in sizes * 2:
            recycler.take(size)  # dropped at once: idle
            kept = sum(len(mapping) for mapping, _, _ in recycler._kept)
            assert kept <= IDLE_BYTES


async def test_arrays_a_streaming_caller_keeps_stay_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every third array kept across the whole stream, the others dropped (their memory used
    again for later tensors): the kept ones still hold their own bytes at the end."""
    monkeypatch.setattr(_recycle, "IDLE_BYTES", 4 * SIZE)
    rng = np.random.default_rng(3)
    tensors = {f"t{i:02}": rng.random(SIZE // 8 + 512 * (i % 3)) for i in range(30)}
    reference.save_file(tensors, tmp_path / "m.safetensors")
    kept = {}
    async for index, (name, array) in _enumerate(stream_st.open_stream(tmp_path / "m.safetensors")):
        assert np.array_equal(array, tensors[name])
        if index % 3 == 0:
            kept[name] = array.reshape(-1)[1:]  # a view, not the array handed out
    for name, view in kept.items():
        assert np.array_equal(view, tensors[name][1:]), name


async def _enumerate(stream: Any) -> Any:
    index = 0
    async for item in stream:
        yield index, item
        index += 1


def test_a_caller_that_keeps_every_array_then_drops_them_leaves_little_kept() -> None:
    """A load keeps every array, then drops them all at once: the recycler tracked only the
    recent ones (so each allocation looks at few entries), and keeps at most KEPT_BYTES idle
    until its next allocation, which brings that back to IDLE_BYTES."""
    recycler = Recycler()
    arrays = [recycler.take(SIZE) for _ in range(200)]
    assert sum(len(mapping) for mapping, _, _ in recycler._kept) <= KEPT_BYTES
    del arrays
    assert sum(len(mapping) for mapping, _, _ in recycler._kept) <= KEPT_BYTES
    recycler.take(2 * SIZE)
    assert (
        sum(len(mapping) for mapping, alive, _ in recycler._kept if alive() is None) <= IDLE_BYTES
    )


async def test_a_closed_stream_keeps_no_memory_for_reuse(tmp_path: Path) -> None:
    """Once the stream is closed no tensor comes any more: the memory of the arrays the
    caller dropped is not kept by the stream object (which the caller may keep)."""
    tensors = {f"t{i:02}": np.full(SIZE, i, np.uint8) for i in range(12)}
    reference.save_file(tensors, tmp_path / "m.safetensors")
    async with stream_st.open_stream(tmp_path / "m.safetensors") as stream:
        kept = {name: array async for name, array in stream}
    del kept
    assert not stream._recycler._kept


def flags(where: int) -> list[str]:
    """The ``VmFlags`` of the mapping holding ``where``, which must be one."""
    found = mapping_of(where)
    assert found is not None, f"no mapping holds {where:#x}"
    return found


needs_huge_pages = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="no /proc/self/smaps or no transparent huge pages to ask for",
)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A count of the memory advised for huge pages of this test's own (none held before it),
    with room for 12 MiB."""
    monkeypatch.setattr(_fresh, "_huge_held", _fresh._Held())
    monkeypatch.setattr(_fresh, "HUGE_PAGES_HELD", 12 << 20)


@needs_huge_pages
async def test_large_fresh_arrays_ask_for_huge_pages(tmp_path: Path, held: None) -> None:
    """A read tensor of 4 MiB or more lands in memory advised for transparent huge pages: with
    4 KiB pages, faulting them in was most of a warm read's time (0.33x a plain loop into
    ``np.empty`` arrays, which numpy advises so)."""
    path = tmp_path / "m.safetensors"
    reference.save_file({"big": np.ones(2 << 20, np.float32), "small": np.ones(4)}, str(path))
    loaded = await stream_st.load(path)
    assert "hg" in flags(address(loaded["big"]))
    assert np.array_equal(loaded["big"], np.ones(2 << 20, np.float32))


@needs_huge_pages
async def test_memory_advised_for_huge_pages_is_bounded_while_in_use(
    tmp_path: Path, held: None
) -> None:
    """Huge pages carved from memory not used lately wait for the host of a virtual machine at
    their first touch (a 2 GiB load kept took 1.8x as long): mappings so advised hold at most
    HUGE_PAGES_HELD bytes while in use, and count no more once unmapped."""
    path = tmp_path / "m.safetensors"
    reference.save_file({f"t{i}": np.full(2 << 20, i, np.float32) for i in range(2)}, str(path))
    first = await stream_st.load(path)
    assert ["hg" in flags(address(first[f"t{i}"])) for i in range(2)] == [True, False]
    del first
    gc.collect()
    again = await stream_st.load(path)
    assert "hg" in flags(address(again["t0"]))
    assert [int(again[f"t{i}"][-1]) for i in range(2)] == [0, 1]

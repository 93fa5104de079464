"""The event loop under many small files: reads of cached local files give the loop turns (a
ticker keeps running, a cancellation arrives) as one big read does; and leaving ``async with``
releases what the stream held, at once."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import stream_st
import stream_st.numpy
import stream_st.transports.base
from stream_st.core.steps import SLICE
from stream_st.errors import ReadTimeoutError
from stream_st.reader.turns import TURN_EVERY, give_turn
from stream_st.sharded.writer import open_sharded_writer

READS = 1500


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """A 1 MiB file of four tensors: under every per-source pause, cached once read."""
    path = tmp_path / "small.safetensors"
    stream_st.numpy.save_file({f"t{i}": np.full(1 << 16, i, np.float32) for i in range(4)}, path)
    return path


async def test_a_ticker_keeps_running_beside_many_small_reads(small: Path) -> None:
    # Each gap between two ticks, in wall-clock time and in the loop thread's CPU time: a busy
    # machine takes the process off the CPU now and then (on two loaded cores, two thirds of a
    # run's wall time fell in gaps over 50 ms), which lengthens a gap but adds no CPU time to
    # it; work that holds the loop does, on any machine.
    gaps: list[tuple[float, float]] = []
    done = anyio.Event()

    async def ticker() -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not done.is_set():
            await anyio.sleep(0.005)
            now, cpu = time.perf_counter(), time.thread_time()
            gaps.append((now - last, cpu - last_cpu))
            last, last_cpu = now, cpu

    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        await anyio.sleep(0.01)  # the ticker is running
        began = time.thread_time()
        for _ in range(READS):
            await stream_st.load(small)
        took = time.thread_time() - began
        done.set()
    # The promise is 50 ms (benchmarks/bench_header.py measures it). Without turns given between
    # files the ticker waits for all the reads: one gap as long as they are, their whole CPU
    # time. Other work of the process may hold the loop now and then (a garbage collection), so
    # what is checked is that such holds are exceptions: most of the loop thread's work was done
    # in stretches of a few ms; and no gap, off the CPU or not, lasted seconds.
    held = sum(cpu for _, cpu in gaps if cpu > 0.05)
    longest = max(wall for wall, _ in gaps)
    assert held < 0.5 * took and longest < 2.0, (
        f"the loop was held for {held * 1000:.0f} ms of the loop thread's {took * 1000:.0f} ms "
        f"of CPU time, at most {longest * 1000:.0f} ms at once"
    )


async def test_a_cancellation_reaches_many_small_reads(small: Path) -> None:
    done = 0
    with anyio.move_on_after(0.02) as scope:
        for _ in range(READS):
            async with stream_st.open_stream(small) as stream:
                async for _ in stream:
                    pass
            done += 1
    assert scope.cancelled_caught and done < READS


async def test_a_cancellation_reaches_a_read_of_chunks_that_never_suspend() -> None:
    """An async iterator of chunks that never suspends (slices of a file in memory) gives the
    loop its turns within a tensor, as a local file does: a cancellation arrives (one 64 MiB
    tensor held the loop, and kept the cancellation out, for its whole read)."""
    data = stream_st.numpy.save({"x": np.ones(16 << 20, np.float32)})

    async def slices() -> AsyncIterator[memoryview]:
        view = memoryview(data)
        for start in range(0, len(view), 16 << 10):
            yield view[start : start + (16 << 10)]

    with anyio.move_on_after(0.02) as scope:
        await stream_st.load(slices())
    assert scope.cancelled_caught


class _InMemory:
    """A ``readinto`` producer over bytes in memory: it never suspends."""

    def __init__(self, data: bytes) -> None:
        self._view, self._at = memoryview(data), 0

    async def readinto(self, buffer: memoryview) -> int:
        count = min(len(buffer), 16 << 10, len(self._view) - self._at)
        buffer[:count] = self._view[self._at : self._at + count]
        self._at += count
        return count


@pytest.mark.parametrize("kind", ["readinto", "asyncio StreamReader"])
async def test_a_cancellation_reaches_a_read_of_a_stream_that_never_suspends(kind: str) -> None:
    """A ``readinto`` producer over memory, and an asyncio ``StreamReader`` fed the whole file
    ahead, answer every read without suspending: the read still gives the loop its turns."""
    data = stream_st.numpy.save({"x": np.ones(16 << 20, np.float32)})
    if kind == "readinto":
        source: Any = _InMemory(data)
    else:
        source = asyncio.StreamReader(limit=len(data) + 1)
        source.feed_data(data)
        source.feed_eof()
    with anyio.move_on_after(0.02) as scope:
        await stream_st.load(source)
    assert scope.cancelled_caught


@pytest.mark.parametrize("cut", [1000, None], ids=["in the header", "after the file"])
async def test_a_cancellation_reaches_a_read_of_empty_chunks_for_ever(cut: int | None) -> None:
    """An iterator that yields ``b""`` for ever without suspending (``yield await
    reader.read(n)`` past its end) never ends the read; a cancellation still stops it (the read
    spun on the loop for ever, deaf to it: here the read's own deadline stopped it)."""
    data = stream_st.numpy.save({f"t{i}": np.full(1000, i, np.float32) for i in range(4)})

    async def empty_for_ever() -> AsyncIterator[bytes]:
        yield data[:cut]
        while True:
            yield b""

    with anyio.move_on_after(0.05) as scope:
        try:
            await stream_st.load(empty_for_ever(), deadline=5)
        except ReadTimeoutError:
            pytest.fail("the read held the loop until its deadline: no cancellation reached it")
    assert scope.cancelled_caught


def base_of(array: np.ndarray[Any, Any]) -> Any:
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


@pytest.mark.parametrize(
    ("mb", "sharded"), [(1, False), (32, False), (1, True)], ids=["inline", "read ahead", "index"]
)
async def test_leaving_async_with_releases_the_abandoned_iteration(
    tmp_path: Path, mb: int, sharded: bool
) -> None:
    """``async for ...: break`` inside ``async with``: once out of the block, nothing the stream
    handed out or read ahead is held by it, without waiting for the loop to finalise the
    abandoned iteration."""
    count = 8
    arrays = {f"t{i}": np.full((mb << 20) // 4 // count, i, np.float32) for i in range(count)}
    if sharded:
        async with open_sharded_writer(tmp_path, max_shard_size=mb << 19) as writer:
            for name, value in arrays.items():
                await writer.write(name, value)
        path = tmp_path / "model.safetensors.index.json"
    else:
        path = tmp_path / "f.safetensors"
        stream_st.numpy.save_file(arrays, path)
    gc.disable()  # no cycle collection: what is freed is freed by reference counts
    try:
        refs = []
        for _ in range(20):
            async with stream_st.open_stream(path) as stream:
                async for _name, array in stream:
                    refs.append(weakref.ref(base_of(array)))
                    break
            del array, stream
            assert refs[-1]() is None, "the stream still holds the first array"
    finally:
        gc.enable()


async def test_a_task_woken_during_the_work_runs_in_the_turn_that_follows() -> None:
    """A task whose ``sleep`` ended during a stretch of work runs in the turn the work gives
    next, before the work goes on: not after its next stretch."""
    order: list[str] = []

    async def sleeper() -> None:
        await anyio.sleep(0.001)
        order.append("woken")

    async with anyio.create_task_group() as group:
        group.start_soon(sleeper)
        await anyio.lowlevel.checkpoint()  # the sleeper waits on its timer
        await give_turn()  # a piece of work begins (a thread's first call owes no turn)
        time.sleep(TURN_EVERY + 0.002)  # noqa: ASYNC251  # work that holds the loop: the timer expires
        await give_turn()
        order.append("work goes on")
    assert order == ["woken", "work goes on"]


def test_a_threads_first_turn_only_starts_the_count() -> None:
    """No work of the reader held a fresh thread's loop before its first ``give_turn``: that call
    owes no turn and returns at once; the count starts there."""
    order: list[str] = []

    async def reads() -> None:
        async def other() -> None:
            order.append("other task")

        async with anyio.create_task_group() as group:
            group.start_soon(other)
            await give_turn()  # the thread's first: no turn
            order.append("first call")
            time.sleep(TURN_EVERY + 0.002)  # noqa: ASYNC251  # work that holds the loop
            await give_turn()  # a turn is owed now
            order.append("second call")

    thread = threading.Thread(target=anyio.run, args=(reads,))
    thread.start()
    thread.join()
    assert order == ["first call", "other task", "second call"]


@pytest.fixture(scope="module")
def many_tensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file of many small tensors, digests recorded: its header is many slices long."""
    path = tmp_path_factory.mktemp("many") / "many.safetensors"
    tensors = {f"t{i:06d}": np.full(1, i, np.float32) for i in range(MANY)}
    stream_st.numpy.save_file(tensors, path, checksums=True)
    return path


MANY = 16 * SLICE


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"verify": False},
        {"include": lambda name: name.endswith("7")},
        {"max_total_bytes": 1 << 30},
    ],
    ids=["digests", "plain", "predicate", "capped"],
)
async def test_the_passes_over_a_big_header_give_the_loop_turns(
    many_tensors: Path, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between the header and the first tensor the reader selects, checks and plans every tensor
    # (and checks its digests' record): one pass each over the whole header held the loop for
    # hundreds of milliseconds at 200,000 tensors. Each gives the loop a turn between two
    # slices now: with a turn owed at every chance, a ticker runs once a slice at least.
    monkeypatch.setattr(stream_st.transports.base, "TURN_EVERY", 0)
    ticks = 0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            await anyio.lowlevel.checkpoint()
            ticks += 1

    async with (
        stream_st.open_stream(many_tensors, **options) as stream,
        anyio.create_task_group() as group,
    ):
        group.start_soon(ticker)
        await anyio.lowlevel.checkpoint()  # the ticker is running
        ticks = 0
        async for _ in stream:
            break
        done.set()
    assert ticks >= MANY // SLICE, f"the loop got {ticks} turns in {MANY // SLICE} slices' work"

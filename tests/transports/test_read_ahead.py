"""A local file's tensors read ahead by worker threads (stream_st/sources/_ahead.py): the same
bytes as the reference, nothing short after a file shrinks, fresh arrays ahead bounded, no
thread left writing into the caller's memory after the stream is left, a file read from the
disk (not the page cache) as from the cache."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference

import stream_st
import stream_st.reader.ahead as reader_module
from stream_st import TruncatedStreamError
from stream_st.memory import fresh as fresh_memory
from stream_st.transports.file import readahead as _ahead
from stream_st.transports.file.direct import Direct, NotDirect, Residency
from stream_st.transports.file.readahead import _preadv_fully, read_ahead

from ..ctrl_c import run_script
from ..memory.test_zero_copy import evicted

pytestmark = pytest.mark.anyio

Arrays = dict[str, np.ndarray[Any, Any]]


def mixed() -> Arrays:
    """Big and tiny tensors, empty ones, odd sizes: 12 MiB in all, so the file is read ahead."""
    rng = np.random.default_rng(7)
    tensors: Arrays = {}
    for i in range(40):
        tensors[f"small.{i:02}"] = rng.integers(0, 255, size=1 + 977 * i, dtype=np.uint8)
    tensors["empty"] = np.zeros((0, 3), np.float32)
    tensors["big.a"] = rng.random(1_000_003).astype(np.float64)  # 8 MB, cut in pieces
    tensors["big.b"] = rng.random((1024, 1023)).astype(np.float32)
    return tensors


@pytest.fixture
def path(tmp_path: Path) -> Path:
    target = tmp_path / "mixed.safetensors"
    reference.save_file(mixed(), target)
    return target


async def test_read_ahead_gives_the_reference_s_tensors(path: Path) -> None:
    expected = reference.load_file(path)
    header = await stream_st.read_header(path)
    got = {name: array async for name, array in stream_st.open_stream(path)}
    assert list(got) == [info.name for info in header.tensors]  # offset order
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        assert got[name].tobytes() == array.tobytes(), name


async def test_read_ahead_into_given_memory_and_fresh_arrays_together(path: Path) -> None:
    expected = reference.load_file(path)
    into: dict[str, Any] = {
        "big.b": np.empty((1024, 1023), np.float32),
        "small.05": bytearray(1 + 977 * 5),
    }
    got = {name: array async for name, array in stream_st.open_stream(path, into=into)}
    assert got["big.b"] is into["big.b"]
    assert bytes(into["small.05"]) == expected["small.05"].tobytes()
    for name, array in expected.items():
        assert np.asarray(got[name]).tobytes() == array.tobytes(), name


async def test_fresh_arrays_read_ahead_stay_within_their_bound(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arrays read but not yet handed out never hold more than READ_AHEAD_BYTES (or one
    tensor); counted at every allocation while the caller holds each tensor for a while."""
    monkeypatch.setattr(reader_module, "READ_AHEAD_BYTES", 1 << 20)
    monkeypatch.setattr(reader_module, "READ_AHEAD_MOST", 1 << 20)
    allocate = reader_module._allocate_framed
    live: dict[str, int] = {}
    peaks: list[int] = []

    def counting(info: Any, *rest: Any) -> Any:
        live[info.name] = info.nbytes
        peaks.append(sum(live.values()))
        return allocate(info, *rest)

    monkeypatch.setattr(reader_module, "_allocate_framed", counting)
    async for name, _ in stream_st.open_stream(path):
        live.pop(name)
        await anyio.sleep(0.001)
    largest = max(array.nbytes for array in mixed().values())
    assert max(peaks) <= max(1 << 20, largest)  # read all at once: 12 MB
    assert len(peaks) == len(mixed())


async def test_a_file_that_shrinks_after_open_raises_and_never_yields_short(path: Path) -> None:
    await shrinks_and_never_yields_short(path)


async def shrinks_and_never_yields_short(path: Path) -> None:
    """Truncate ``path`` (the mixed file) inside ``big.a`` once open: the tensors before it come
    whole, then a TruncatedStreamError names it."""
    async with stream_st.open_stream(path) as stream:
        names = stream.header.names()
        big_a = stream.header["big.a"]
        os.truncate(path, stream.header.data_start + big_a.start + 1000)
        seen = []
        with pytest.raises(TruncatedStreamError, match=r"big\.a"):
            async for name, array in stream:
                assert array.nbytes == stream.header[name].nbytes
                seen.append(name)
    assert seen == names[: names.index("big.a")]


def running(ahead: _ahead.ReadAhead) -> int:
    """The worker threads of ``ahead`` not yet ended."""
    return len(set(ahead._threads) - ahead._ended)


async def test_leaving_early_stops_the_threads_before_returning(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the loop is left, no worker can write into the caller's memory any more: every
    worker has returned by the time the stream is closed, its remaining pieces dropped."""
    monkeypatch.setattr(_ahead, "PIECE", 4096)  # many pieces: most are still queued at the break
    monkeypatch.setattr(reader_module, "READ_AHEAD_BYTES", 0)  # no fresh array queued ahead
    monkeypatch.setattr(reader_module, "READ_AHEAD_MOST", 0)
    readers: set[_ahead.ReadAhead] = set()
    pieces_read = [0]
    take = _ahead.ReadAhead._take

    def counted_take(self: _ahead.ReadAhead) -> Any:
        readers.add(self)
        batch, direct = take(self)
        pieces_read[0] += len(batch)
        return batch, direct

    monkeypatch.setattr(_ahead.ReadAhead, "_take", counted_take)
    into = {"big.b": np.zeros((1024, 1023), np.float32)}
    async with stream_st.open_stream(path, into=into) as stream:
        async for _name, _ in stream:
            assert [running(ahead) for ahead in readers] == [_ahead.WORKERS]
            break
    assert [running(ahead) for ahead in readers] == [0]
    total = sum(-(-array.nbytes // 4096) for array in mixed().values())
    assert pieces_read[0] < total  # stopped early, not read to the end


async def test_a_failed_read_is_a_transport_error(tmp_path: Path) -> None:
    """A read the kernel refuses (a directory's descriptor: EISDIR) fails every later wait."""
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        async with read_ahead(fd, "dir") as ahead:
            job = ahead.add(0, memoryview(bytearray(10)))
            with pytest.raises(stream_st.TransportError, match="read failed"):
                await ahead.wait(job)
            with pytest.raises(stream_st.TransportError):
                await ahead.wait(ahead.add(10, memoryview(bytearray(10))))
    finally:
        os.close(fd)


async def test_a_worker_failing_outside_its_read_fails_the_wait_rather_than_hangs(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Choosing the next pieces can fail too (more threads for direct reads that the system
    will not start, the kernel asked what it caches): every worker failing so must fail the
    waits, never leave the caller waiting for threads that are gone."""

    def refused(self: _ahead.ReadAhead) -> Any:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_ahead.ReadAhead, "_take", refused)
    fd = os.open(path, os.O_RDONLY)
    try:
        async with read_ahead(fd, str(path)) as ahead:
            job = ahead.add(0, memoryview(bytearray(10)))
            with anyio.fail_after(10), pytest.raises(stream_st.TransportError, match="new thread"):
                await ahead.wait(job)
    finally:
        os.close(fd)


class _Uncached:
    """A :class:`~stream_st.transports.file.direct.Direct` that finds nothing cached, and
    reads through the page cache all the same: every piece starts the direct reads' threads."""

    def uncached(self, offset: int, length: int) -> bool:
        return True

    def read_framed(self, *args: Any) -> int:
        raise NotDirect()

    def read_bounced(self, *args: Any) -> list[int]:
        raise NotDirect()

    def close(self) -> None:
        pass


async def test_a_thread_the_system_refuses_fails_the_read_and_the_close_ends(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third read-ahead thread refused (a limit on threads): the wait raises, and leaving
    the block neither joins the thread that never started nor waits for it."""
    monkeypatch.setattr(Direct, "open", classmethod(lambda cls, fd: _Uncached()))
    started = [0]
    start = threading.Thread.start

    def limited(thread: threading.Thread) -> None:
        if thread.name == "stream_st read-ahead":
            started[0] += 1
            if started[0] > 2:
                raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", limited)
    fd = os.open(path, os.O_RDONLY)
    try:
        with anyio.fail_after(10):
            async with read_ahead(fd, str(path)) as ahead:
                job = ahead.add(0, memoryview(bytearray(4096)))
                with pytest.raises(stream_st.TransportError, match="new thread"):
                    await ahead.wait(job)
        assert running(ahead) == 0
    finally:
        os.close(fd)


async def test_a_failed_feed_keeps_no_view_of_the_caller_s_memory(path: Path) -> None:
    """The error of a failed read is kept (every later wait raises it), but not the views the
    threads read into: the caller may free its memory (a mapping closes without BufferError)."""

    def feed(piece: memoryview) -> None:
        raise ValueError("hash failed")

    memory = mmap.mmap(-1, 2 * _ahead.FEED_PIECE)
    fd = os.open(path, os.O_RDONLY)
    try:
        async with read_ahead(fd, str(path)) as ahead:
            job = ahead.add(0, memoryview(memory), feed=feed)
            with anyio.fail_after(10), pytest.raises(stream_st.TransportError, match="hash"):
                await ahead.wait(job)
        gc.collect()
        memory.close()
    finally:
        os.close(fd)


async def test_a_worker_ended_by_a_base_exception_fails_the_wait(path: Path) -> None:
    """Not only an Exception: whatever ends a worker (a feed's SystemExit) ends the wait."""

    def feed(piece: memoryview) -> None:
        raise SystemExit(3)

    fd = os.open(path, os.O_RDONLY)
    try:
        async with read_ahead(fd, str(path)) as ahead:
            job = ahead.add(0, memoryview(bytearray(2 * _ahead.FEED_PIECE)), feed=feed)
            with anyio.fail_after(10), pytest.raises(stream_st.TransportError):
                await ahead.wait(job)
    finally:
        os.close(fd)


async def test_every_wait_after_a_stop_raises_rather_than_hangs(path: Path) -> None:
    """Once stopped (the stream closed from another task), no thread will read a job: waiting
    for one queued or finished since must raise at once, not wait for a wake-up that never
    comes (the caller would hang for good)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        async with read_ahead(fd, str(path)) as ahead:
            done = ahead.add(0, memoryview(bytearray(10)))
            assert await ahead.wait(done) == 10
            ahead.stop()
            for job in (done, ahead.add(10, memoryview(bytearray(10)))):
                with anyio.fail_after(10), pytest.raises(stream_st.TransportError, match="closed"):
                    await ahead.wait(job)
    finally:
        os.close(fd)


def test_read_ahead_advice_refused_is_no_failure() -> None:
    """The kernel refusing the sequential advice (here a pipe: ESPIPE) leaves reads as they
    were: no exception escapes to the reader."""
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(OSError):  # what the helper must swallow
            os.posix_fadvise(read_end, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        _ahead._advise_sequential(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_adjacent_views_are_filled_in_order_up_to_the_end(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    file = tmp_path / "bytes"
    file.write_bytes(data)
    fd = os.open(file, os.O_RDONLY)
    try:
        views = [memoryview(bytearray(n)) for n in (3, 0, 5000, 7000)]
        assert _preadv_fully(fd, views, 100) == [3, 0, 5000, len(data) - 5103]
        assert bytes(views[2]) == data[103:5103]
        assert bytes(views[3][: len(data) - 5103]) == data[5103:]
    finally:
        os.close(fd)


async def test_pieces_of_one_tensor_go_to_both_threads(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With small pieces every tensor is read in many calls; the result is unchanged."""
    monkeypatch.setattr(_ahead, "PIECE", 4096)
    expected = reference.load_file(path)
    got = {name: array async for name, array in stream_st.open_stream(path)}
    for name, array in expected.items():
        assert got[name].tobytes() == array.tobytes(), name


async def test_a_file_evicted_from_the_page_cache_reads_right(path: Path) -> None:
    """The read-ahead threads wait for the disk here, and deliver the same bytes."""
    expected = mixed()
    evicted(path)
    got = {name: array async for name, array in stream_st.open_stream(path)}
    for name, array in expected.items():
        assert got[name].tobytes() == array.tobytes(), name


@pytest.mark.parametrize("keep", [True, False])
async def test_a_caller_that_keeps_every_array_gets_more_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """Fresh arrays read ahead and not yet handed out: up to READ_AHEAD_MOST for a caller that
    has kept everything so far (a load), READ_AHEAD_BYTES for one that drops what it gets."""
    monkeypatch.setattr(reader_module, "READ_AHEAD_BYTES", 4 << 20)
    monkeypatch.setattr(reader_module, "READ_AHEAD_MOST", 16 << 20)
    size = 1 << 20
    tensors = {f"t{i:02}": np.full(size, i, np.uint8) for i in range(40)}
    reference.save_file(tensors, tmp_path / "m.safetensors")
    allocate = reader_module._allocate_framed
    ahead: set[str] = set()
    peaks: list[int] = []

    def counting(info: Any, *rest: Any) -> Any:
        ahead.add(info.name)
        peaks.append(len(ahead) * size)
        return allocate(info, *rest)

    monkeypatch.setattr(reader_module, "_allocate_framed", counting)
    kept = []
    async for name, array in stream_st.open_stream(tmp_path / "m.safetensors"):
        ahead.discard(name)
        assert np.array_equal(array, tensors[name])
        if keep:
            kept.append(array)
        del array
    if keep:
        assert max(peaks) == 16 << 20
    else:
        assert max(peaks) <= 4 << 20


def reading_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "stream_st read-ahead"]


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def until(condition: Callable[[], object]) -> None:
    """Return once ``condition()`` holds, looked at between short sleeps (bounded: what never
    comes fails the test rather than hanging the run)."""
    for _ in range(5000):
        if condition():
            return
        await anyio.sleep(0.002)
    raise AssertionError("never came")


async def test_a_break_outside_async_with_frees_the_file_and_threads_without_the_collector(
    path: Path,
) -> None:
    """An iteration left with ``break`` and no ``async with`` is closed by the event loop's
    finalizer hook on its next turns (the stream must not hold it in a reference cycle, which
    only the cycle collector would break): its file and read-ahead threads go then."""
    before = open_descriptors()
    gc.disable()
    try:
        async for _ in stream_st.open_stream(path):
            break
        await until(lambda: not reading_threads() and open_descriptors() == before)
    finally:
        gc.enable()


async def test_memory_given_for_several_tensors_holds_each_when_handed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One staging buffer given for every tensor (each copied elsewhere in the loop), and
    slices of a pool that overlap the next tensor's: each holds the tensor handed out, as
    without read-ahead. Checked once the threads have read everything queued, so a tensor read
    ahead into that memory would certainly show."""
    tensors = {f"t{i:02}": np.full(1 << 20, i, np.uint8) for i in range(12)}
    reference.save_file(tensors, tmp_path / "m.safetensors")
    readers: list[_ahead.ReadAhead] = []
    start = _ahead.ReadAhead.start

    def recorded_start(self: _ahead.ReadAhead) -> None:
        readers.append(self)
        start(self)

    monkeypatch.setattr(_ahead.ReadAhead, "start", recorded_start)
    staging = np.empty(1 << 20, np.uint8)
    pool = np.empty(3 << 19, np.uint8)  # tensor i at (i % 2) * 512 KiB: neighbours overlap
    for into in (
        dict.fromkeys(tensors, staging),
        {name: pool[(i % 2) << 19 :][: 1 << 20] for i, name in enumerate(tensors)},
    ):
        seen = []
        async with stream_st.open_stream(tmp_path / "m.safetensors", into=into) as stream:
            async for name, array in stream:
                await until(lambda: not any(readers[-1]._left))  # all queued are read
                assert array is into[name]
                assert np.array_equal(array, tensors[name]), name
                seen.append(name)
        assert seen == list(tensors)


async def test_a_stream_closed_from_another_task_stops_its_threads_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task waits for a tensor whose read a worker holds (a slow disk); another task closes
    the stream. The close stops the threads and waits for them before the descriptor goes, so
    no thread reads the file that next gets the descriptor's number (the waiting task gets a
    TransportError, never another file's bytes)."""
    tensors = {f"t{i}": np.full(1 << 20, i, np.uint8) for i in range(10)}
    reference.save_file(tensors, tmp_path / "m.safetensors")
    (tmp_path / "other").write_bytes(b"\xff" * (12 << 20))
    gate = threading.Event()  # the slow disk: reads after the first tensor wait for it
    readers: list[_ahead.ReadAhead] = []
    take = _ahead.ReadAhead._take

    def slow_take(self: _ahead.ReadAhead) -> Any:
        batch, direct = take(self)
        if batch and batch[0][0] > 0:
            readers.append(self)
            while not (gate.wait(0.001) or self._stopped):
                pass
        return batch, direct

    monkeypatch.setattr(_ahead.ReadAhead, "_take", slow_take)
    monkeypatch.setattr(_ahead, "PIECE", 1 << 20)  # a tensor a read
    received: dict[str, np.ndarray[Any, Any]] = {}
    stream = stream_st.open_stream(tmp_path / "m.safetensors")

    async def consume() -> None:
        with pytest.raises(stream_st.TransportError, match="closed"):
            async with stream:
                async for name, array in stream:
                    received[name] = array

    others: list[int] = []
    try:  # a wait never woken fails the test rather than hanging the run
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(consume)
                await until(lambda: readers and (readers[0]._waiting or ())[:1] == (1,))  # t1
                number = stream.source._fd  # type: ignore[attr-defined]
                await stream.aclose()
                while (fd := os.open(tmp_path / "other", os.O_RDONLY)) != number:
                    others.append(fd)  # the lowest free number comes, as the next open's
                others.append(fd)
                gate.set()
    finally:
        gate.set()
        for fd in others:
            os.close(fd)
    assert list(received) == ["t0"]


BREAK_AND_RETURN = """
import sys, anyio, stream_st
async def main():
    async for name, array in stream_st.open_stream(sys.argv[1]):
        break  # no 'async with': the loop closes the iteration left here
anyio.run(main, backend=sys.argv[2])
print("returned")
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("direct", ["0", "1"])
def test_a_break_right_before_the_event_loop_ends_closes_cleanly(
    path: Path, backend: str, direct: str
) -> None:
    """``asyncio.run`` closes the loop without waiting for the task that closes an iteration
    left by a ``break``: the read-ahead threads' close must not suspend, or that task is
    destroyed part way ("asynchronous generator is already running", "no running event
    loop") and the threads are never waited for."""
    done = subprocess.run(
        [sys.executable, "-c", BREAK_AND_RETURN, str(path), backend],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STREAM_ST_DIRECT_IO": direct},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "returned"
    assert done.stderr == ""


CTRL_C_EVERYWHERE = """
import sys, anyio, numpy as np, safetensors.numpy as reference, stream_st
from stream_st.transports.file import readahead
from tests.ctrl_c import assert_threads_end, everywhere

path = sys.argv[1]
reference.save_file({f"t{i}": np.full(3 << 20, i, np.uint8) for i in range(3)}, path)

async def read(at):
    async with stream_st.open_stream(path) as stream:
        async for name, array in stream:
            pass

print(anyio.run(everywhere, read, readahead.__file__, backend="trio"))
assert_threads_end("stream_st read-ahead")
"""


def test_ctrl_c_anywhere_in_the_read_ahead_under_trio_never_hangs(tmp_path: Path) -> None:
    """Ctrl-C under trio raises KeyboardInterrupt wherever the event loop's thread runs, in
    Python code too (``threading.Condition.__enter__``): a stream read ahead, interrupted at
    each such place in turn, ends every time, and its threads with it. Raised in that
    ``__enter__`` after the acquire, the lock stayed held and the close waited for it for ever;
    right as a thread's ``start()`` returned, the close waited for a thread never counted."""
    tried = run_script(CTRL_C_EVERYWHERE, str(tmp_path / "m.safetensors"))
    assert tried >= 20  # the trace reached the read-ahead


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_threads_wake_the_loop_through_its_own_public_call(
    path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-ahead threads wake the event loop with asyncio's or trio's own thread-safe call,
    not anyio's backend classes: a read still ends where those lack ``run_sync_soon`` (a
    release of anyio without it made every such read wait forever)."""
    import importlib

    backend_class = importlib.import_module(f"anyio._backends._{backend}").backend_class
    monkeypatch.delattr(backend_class, "run_sync_soon", raising=False)
    expected = reference.load_file(path)

    async def read() -> Arrays:
        with anyio.fail_after(60):
            return {name: array async for name, array in stream_st.open_stream(path)}

    for direct in ("0", "1"):
        monkeypatch.setenv("STREAM_ST_DIRECT_IO", direct)
        evicted(path)
        got = anyio.run(read, backend=backend)
        assert all(np.array_equal(got[name], array) for name, array in expected.items())


class _AllCold:
    """A page cache that never holds the file (what cachestat says of an evicted one)."""

    def uncached(self, offset: int, length: int) -> bool:
        return True


async def test_cold_pieces_are_read_one_thread_at_a_time_while_fresh_memory_is_populated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cold pieces go to one reading thread at a time (the kernel sees one sequential read);
    the other thread faults in the fresh memory of pieces further on, and only fresh memory:
    every byte lands as in the file."""
    data = np.random.default_rng(3).integers(0, 255, 24 << 20, dtype=np.uint8)
    file = tmp_path / "bytes"
    file.write_bytes(data.tobytes())
    monkeypatch.setattr(_ahead, "PIECE", 1 << 20)
    active, most = [0], [0]
    populated: list[memoryview] = []
    lock = threading.Lock()
    read = _ahead._preadv_fully

    def counted(fd: int, views: list[memoryview], offset: int) -> list[int]:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return read(fd, views, offset)
        finally:
            with lock:
                active[0] -= 1

    populate = fresh_memory.populate

    def populating(view: memoryview) -> bool:
        populated.append(view)
        return populate(view)

    monkeypatch.setattr(_ahead, "_preadv_fully", counted)
    monkeypatch.setattr(_ahead, "populate", populating)
    fresh = [memoryview(mmap.mmap(-1, 8 << 20)) for _ in range(2)]
    given = memoryview(bytearray(8 << 20))  # not fresh: never populated
    fd = os.open(file, os.O_RDONLY)
    try:
        async with read_ahead(fd, str(file)) as ahead:
            ahead._residency = _AllCold()  # type: ignore[assignment]
            jobs = [
                ahead.add(0, fresh[0], fresh=True),
                ahead.add(8 << 20, given),
                ahead.add(16 << 20, fresh[1], fresh=True),
            ]
            assert [await ahead.wait(job) for job in jobs] == [8 << 20] * 3
    finally:
        os.close(fd)
    assert most[0] == 1
    assert bytes(fresh[0]) + bytes(given) + bytes(fresh[1]) == data.tobytes()
    assert populated  # some of the fresh memory, none of the given
    assert all(view.obj in (fresh[0].obj, fresh[1].obj) for view in populated)


async def test_a_load_of_a_file_evicted_from_the_page_cache_reads_it_as_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end, on a file the page cache lacks (where the kernel says what it caches): the
    load takes the cold path and gives the file's tensors."""
    tensors = {f"t{i:02}": np.full(1 << 20, i, np.uint8) for i in range(24)}
    file = tmp_path / "m.safetensors"
    reference.save_file(tensors, file)
    fd = os.open(file, os.O_RDONLY)
    try:
        if Residency.of(fd) is None:
            pytest.skip("the kernel cannot say what it caches (cachestat)")
    finally:
        os.close(fd)
    hows: list[int] = []
    take = _ahead.ReadAhead._take

    def taking(self: _ahead.ReadAhead) -> tuple[list[Any], int]:
        batch, how = take(self)
        hows.append(how)
        return batch, how

    monkeypatch.setattr(_ahead.ReadAhead, "_take", taking)
    evicted(file)
    got = await stream_st.load(file)
    assert all(np.array_equal(got[name], array) for name, array in tensors.items())
    assert _ahead._COLD in hows

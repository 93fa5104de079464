"""``cache=``: the copy is read while the request that checks it is in flight, and nothing of it
is handed out before the answer says it is the object (stream_st._api.CachedStream).

A real HTTP server on 127.0.0.1 that holds each answer back (``latency``); what the reading
process has open is looked at in ``/proc/self/fd`` while the answer is awaited.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from ..servers.hub_server import FakeHub
from .test_cache import read

Arrays = dict[str, np.ndarray[Any, Any]]
# Over the read-ahead threshold (8 MiB): the copy is read by worker threads
OLD: Arrays = {f"t{i}": np.full(5 << 18, i, dtype=np.float32) for i in range(3)}
NEW: Arrays = {name: array + 100 for name, array in OLD.items()}  # same names and shapes
HELD = 0.4  # seconds each answer is held back once the copy is in the cache


@pytest.fixture
def server() -> Iterator[RangeHTTPServer]:
    data = reference_numpy.save(OLD)
    with RangeHTTPServer(objects={"/m.safetensors": data}, etag="strong") as running:
        yield running


def copy_path(cache: Path) -> str:
    (copy,) = (cache / "objects").rglob("*.safetensors")
    return str(copy)


def opened(path: str) -> list[str]:
    """The descriptors of this process open on ``path`` or a file under it (also once it was
    removed)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        except OSError:
            continue
        if target == path or target.startswith(path.rstrip("/") + "/"):
            found.append(fd)
    return found


async def cached(server: RangeHTTPServer, cache: Path) -> tuple[str, str]:
    """The object's address, read once through ``cache``, and its copy's path there."""
    url = server.url("/m.safetensors")
    await read_watched(url, cache, Watch(server, ""))
    return url, copy_path(cache)


def reading_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "stream_st read-ahead"]


class Watch:
    """Looks, every few milliseconds while a read goes on, whether the copy is open before the
    server has answered the read's request (the server logs a request as it answers)."""

    def __init__(self, server: RangeHTTPServer, path: str) -> None:
        self.server = server
        self.path = path
        self.answered_before = len(server.requests)
        self.open_before_answer = False

    def answered(self) -> bool:
        return len(self.server.requests) > self.answered_before

    async def run(self) -> None:
        while True:
            if not self.answered() and opened(self.path):
                self.open_before_answer = True
            await asyncio.sleep(0.002)


async def read_watched(url: str, cache: Path, watch: Watch) -> tuple[Arrays, str | None, bool]:
    """Read ``url`` through ``cache`` while ``watch`` looks; also whether the first tensor came
    only after the server answered."""
    looking = asyncio.create_task(watch.run())
    try:
        stream = stream_st.open_stream(url, cache=cache)
        arrays: Arrays = {}
        after_answer = True
        async for name, array in stream:
            if not arrays:
                after_answer = watch.answered()
            arrays[name] = array
    finally:
        looking.cancel()
    return arrays, getattr(stream, "cache_state", None), after_answer


async def read_opened_first(url: str, cache: Path, watch: Watch) -> tuple[Arrays, str, bool]:
    """:func:`read_watched` through ``async with`` (as the drop-ins open), the header (as the
    first tensor there) asked to have come only after the server answered."""
    looking = asyncio.create_task(watch.run())
    try:
        async with stream_st.open_stream(url, cache=cache) as stream:
            header_after_answer = watch.answered()
            assert list(stream.header.names()) == list(OLD)  # NEW has the same names
            arrays = {name: array async for name, array in stream}
    finally:
        looking.cancel()
    return arrays, stream.cache_state, header_after_answer  # type: ignore[attr-defined]


Reader = Any  # read_watched or read_opened_first


@pytest.fixture(params=["iterated", "opened first"])
def reader(request: pytest.FixtureRequest) -> Reader:
    """A stream iterated at once, or opened with ``async with`` first (as the drop-ins open)."""
    return read_watched if request.param == "iterated" else read_opened_first


async def test_a_hit_reads_the_copy_while_the_check_is_in_flight(
    server: RangeHTTPServer, tmp_path: Path, reader: Reader
) -> None:
    url = server.url("/m.safetensors")
    assert (await read_watched(url, tmp_path, Watch(server, "")))[1] == "fetch"
    path = copy_path(tmp_path)
    server.latency = HELD
    watch = Watch(server, path)
    arrays, state, after_answer = await reader(url, tmp_path, watch)
    assert state == "hit"
    assert_same_arrays(arrays, OLD)
    assert watch.open_before_answer  # read ahead while the request was in flight
    assert after_answer  # but handed out only once the answer came
    assert opened(path) == [] and reading_threads() == []


async def test_a_copy_read_ahead_takes_the_names_of_an_include_iterator(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    """The copy read ahead is read with the stream's include= as the stream took it: an
    iterator's names, where it was given the iterator the stream had spent (nothing handed
    out)."""
    url = server.url("/m.safetensors")
    assert (await read_watched(url, tmp_path, Watch(server, "")))[1] == "fetch"
    names = iter(["t1"])  # an Iterable, not the Collection the type says
    stream = stream_st.open_stream(url, cache=tmp_path, include=names)  # type: ignore[call-overload]
    arrays = {name: array async for name, array in stream}
    assert stream.cache_state == "hit"
    assert_same_arrays(arrays, {"t1": OLD["t1"]})


async def test_a_changed_object_read_ahead_from_its_copy_is_read_new(
    server: RangeHTTPServer, tmp_path: Path, reader: Reader
) -> None:
    url, path = await cached(server, tmp_path)
    server.replace_after["/m.safetensors"] = (0, reference_numpy.save(NEW))
    server.latency = HELD
    watch = Watch(server, path)
    arrays, state, _ = await reader(url, tmp_path, watch)
    assert watch.open_before_answer  # the old copy was read ahead...
    assert state == "fetch"
    assert_same_arrays(arrays, NEW)  # ...and none of it handed out
    assert opened(path) == [] and reading_threads() == []  # its file closed, its threads gone
    assert not os.path.exists(path)  # the new version replaced it
    server.latency = 0.0
    arrays, state, _ = await read_watched(url, tmp_path, Watch(server, ""))
    assert (state, list(arrays)) == ("hit", list(NEW))
    assert_same_arrays(arrays, NEW)


async def test_a_read_cancelled_while_reading_ahead_leaves_nothing_open(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    url, path = await cached(server, tmp_path)
    server.latency = HELD
    tasks = asyncio.all_tasks()
    watch = Watch(server, path)
    looking = asyncio.create_task(watch.run())
    with anyio.move_on_after(HELD / 2) as scope:
        await stream_st.load(url, cache=tmp_path)
    looking.cancel()
    await asyncio.sleep(0)
    assert scope.cancelled_caught and watch.open_before_answer
    assert opened(path) == [] and reading_threads() == []
    assert asyncio.all_tasks() <= tasks  # no task left behind
    server.latency = 0.0
    arrays = await stream_st.load(url, cache=tmp_path)  # the entry's lock was let go
    assert_same_arrays(arrays, OLD)


async def test_a_copy_that_fails_while_read_ahead_fails_as_read_without_it(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    url, path = await cached(server, tmp_path)
    server.latency = HELD / 4
    cap = OLD["t0"].nbytes - 1
    with pytest.raises(stream_st.SafetensorsError) as raised:
        await stream_st.load(url, cache=tmp_path, max_tensor_bytes=cap)
    with pytest.raises(type(raised.value)) as plain:
        await stream_st.load(path, max_tensor_bytes=cap)
    assert str(raised.value) == str(plain.value)
    assert opened(path) == [] and reading_threads() == []


async def test_a_hit_on_a_file_of_no_tensor(tmp_path: Path) -> None:
    data = reference_numpy.save({})
    with RangeHTTPServer(objects={"/e.safetensors": data}, etag="strong") as running:
        url = running.url("/e.safetensors")
        for expected in ("fetch", "hit"):
            assert await read(url, cache=tmp_path) == ({}, expected)


async def test_hub_a_new_commit_is_read_new_though_its_old_blob_was_read_ahead(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.push("org/model", {"model.safetensors": reference_numpy.save(OLD)})
    address = "hf://org/model/model.safetensors"
    for expected in ("fetch", "hit"):
        arrays, state = await read(address, cache=True)
        assert state == expected
        assert_same_arrays(arrays, OLD)
    (old,) = (tmp_path / "hub-cache").rglob("blobs/*")
    hub.push("org/model", {"model.safetensors": reference_numpy.save(NEW)})
    arrays, state = await read(address, cache=True)
    assert state == "fetch"
    assert_same_arrays(arrays, NEW)
    assert opened(str(old)) == [] and reading_threads() == []


def test_trio_a_hit_and_a_changed_object(server: RangeHTTPServer, tmp_path: Path) -> None:
    import trio

    url = server.url("/m.safetensors")

    async def main() -> list[tuple[Arrays, str | None]]:
        seen = [await read(url, cache=tmp_path), await read(url, cache=tmp_path)]
        server.latency = HELD / 4
        server.replace_after["/m.safetensors"] = (0, reference_numpy.save(NEW))
        return [*seen, await read(url, cache=tmp_path)]

    (_, first), (old, second), (new, third) = trio.run(main)
    assert (first, second, third) == ("fetch", "hit", "fetch")
    assert_same_arrays(old, OLD)
    assert_same_arrays(new, NEW)
    assert opened(copy_path(tmp_path)) == [] and reading_threads() == []

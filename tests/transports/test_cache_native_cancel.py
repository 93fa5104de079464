"""A cached read cancelled by asyncio's own cancellation (``Task.cancel``: ``asyncio.timeout``,
``wait_for``) as its copy is committed, linked or closed (stream_st.transports.cache.tee).

That cancellation goes through anyio's shields: one landing as the copy's last bytes were in left
the whole object as a partial copy with no record of its ranges (no copy, and nothing a later
read could resume from); one landing once an ``hf://`` blob was moved into place left it with no
snapshot link nor ref (an offline read then said the file was not in the cache); one landing as a
partial copy was flushed left its file open and its ranges unrecorded. Now each step is seen to
its end, then the cancellation reaches the caller. The cancellation is made to land in the step
by hooks (no timing); the servers are real (the Python test server, the fake Hub).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.transports.cache import Cache
from stream_st.transports.cache.store import Record, partial_ranges
from stream_st.transports.cache.tee import CopyWriter, Destination

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from ..servers.hub_server import FakeHub

Arrays = dict[str, np.ndarray[Any, Any]]
ARRAYS: Arrays = {f"t{i}": np.random.default_rng(i).random(40_000 + i) for i in range(4)}
DATA = reference_numpy.save(ARRAYS)
ADDRESS = "hf://org/model/model.safetensors"

STEPS = ("as it commits", "once it is moved into place")
"""Where a whole read's cancellation lands: as its copy's commit begins (every byte in), and
once the copy is moved into place (before an ``hf://`` blob is linked to its revision)."""


@pytest.fixture
def server() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        yield running


async def read(source: str, **options: Any) -> tuple[Arrays, str | None]:
    stream = stream_st.open_stream(source, **options)
    async with stream:
        arrays = {name: array async for name, array in stream}
    return arrays, getattr(stream, "cache_state", None)


def open_under(root: Path) -> list[str]:
    """The files under ``root`` this process holds open."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own)
            continue
        if target.startswith(str(root)):
            held.append(target)
    return held


async def cancelled_read(
    source: str, step: str, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> None:
    """Read ``source`` in a task of its own, cancelled as :func:`asyncio.timeout` cancels (the
    task's ``cancel``) at ``step`` of its copy (one of :data:`STEPS`, or ``"as it closes"``): the
    cancellation reaches the read's caller."""
    loop = asyncio.get_running_loop()
    reading: list[asyncio.Task[Any]] = []

    def cancel(told: threading.Event | None = None) -> None:
        reading[0].cancel()
        if told is not None:
            told.set()

    with monkeypatch.context() as patch:
        if step == "as it commits":
            complete = CopyWriter.complete

            async def completing(self: CopyWriter) -> None:
                cancel()  # lands at the commit's first wait
                await complete(self)

            patch.setattr(CopyWriter, "complete", completing)
        elif step == "once it is moved into place":
            init = CopyWriter.__init__

            def started(self: CopyWriter, destination: Destination, *args: Any) -> None:
                commit = destination.commit

                def committing(part: Path, record: Record) -> None:  # in a worker thread
                    commit(part, record)
                    told = threading.Event()
                    loop.call_soon_threadsafe(cancel, told)
                    told.wait()  # the task is cancelled before the commit's thread returns

                destination.commit = committing
                init(self, destination, *args)

            patch.setattr(CopyWriter, "__init__", started)
        else:
            close = CopyWriter.close

            async def closing(self: CopyWriter) -> None:
                cancel()  # lands at the flush of the partial copy
                await close(self)

            patch.setattr(CopyWriter, "close", closing)
        reading.append(asyncio.create_task(read(source, **options)))
        with pytest.raises(asyncio.CancelledError):
            await reading[0]
    assert reading[0].cancelled()


@pytest.mark.parametrize("step", STEPS)
async def test_a_read_cancelled_as_its_copy_is_committed_keeps_the_copy(
    server: RangeHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """Cancelled as its commit began, the read left the whole object as a partial copy with
    no record of its ranges, and no copy; now the copy is committed, then the read cancelled,
    there and once the copy is in place alike."""
    url = server.url("/m.safetensors")
    await cancelled_read(url, step, monkeypatch, cache=tmp_path)
    assert open_under(tmp_path) == []
    assert not list(tmp_path.rglob("*.part*"))
    offline = Cache(tmp_path, tmp_path / "hub", offline=True)
    arrays, state = await read(url, cache=offline)
    assert state == "offline"
    assert_same_arrays(arrays, ARRAYS)


@pytest.mark.parametrize("step", STEPS)
async def test_a_hub_read_cancelled_as_its_blob_is_committed_links_it(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """Cancelled as its commit began, the read left no blob; once its blob was moved into
    place, no snapshot link nor ref: an offline read raised CacheMissError. Now the blob is
    committed and linked, then the read cancelled."""
    hub.push("org/model", {"model.safetensors": DATA})
    await cancelled_read(ADDRESS, step, monkeypatch, cache=True)
    assert open_under(tmp_path) == []
    assert not list(tmp_path.rglob("*.part*"))
    hub.log.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    arrays, state = await read(ADDRESS, cache=True)
    assert state == "offline"
    assert_same_arrays(arrays, ARRAYS)
    assert hub.seen() == []


async def test_a_partial_read_cancelled_as_it_closes_keeps_its_ranges(
    server: RangeHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of one tensor (``include=``), cancelled as its partial copy was flushed, left the
    copy's file open and its ranges unrecorded: now they are recorded, the file closed."""
    url = server.url("/m.safetensors")
    await cancelled_read(url, "as it closes", monkeypatch, cache=tmp_path, include=["t2"])
    assert open_under(tmp_path) == []
    (part,) = tmp_path.rglob("*.part")
    held = partial_ranges(part, part.with_name(part.name + ".json"), len(DATA))
    assert held.ranges  # the record is sealed and matches the copy
    arrays, state = await read(url, cache=tmp_path)
    assert state == "fetch"
    assert_same_arrays(arrays, ARRAYS)

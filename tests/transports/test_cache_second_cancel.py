"""A cached read cancelled twice by asyncio's own cancellation (``Task.cancel``: an
``asyncio.timeout`` inside another, a task group cancelling a task that a timeout cancelled)
while the copy's thread still writes pieces of the caller's memory
(stream_st.transports.cache.tee).

A read cancelled waits for the copy's thread to be done with the caller's memory before it
returns; that wait was shielded by anyio only, which asyncio's own cancellation goes through: a
second ``Task.cancel`` arriving during it handed the memory back while the thread still read
it. A caller reusing its memory then (as it may once the read has returned) had its new bytes
written into the copy as the object's: the next read through the same copy recorded them as
held and committed them, and later reads of the cache were served them. Now the wait is seen to
its end, then the cancellation reaches the caller. The cancellations land where the test puts
them (no timing); the server is real (the Python test server).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

from stream_st.transports.cache import Cache
from stream_st.transports.cache.resolve import resolve
from stream_st.transports.cache.tee import INLINE, PIECE, CopyWriter, TeeSource
from stream_st.transports.options import UNLIMITED

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from .test_cache_native_cancel import Arrays, open_under, read

ARRAYS: Arrays = {f"t{i}": np.random.default_rng(i).random(PIECE // 8) for i in range(3)}
DATA = reference_numpy.save(ARRAYS)
"""Three pieces' worth: the first read lands one, the second reads the rest (more than is
written on the event loop's thread: handed to the copy's thread too)."""


@pytest.fixture
def server() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        yield running


async def test_a_read_cancelled_twice_returns_once_the_copy_is_done_with_its_memory(
    server: RangeHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read lands one piece (handed to the copy's thread, held there) and is
    cancelled twice; the caller overwrites its memory once the read returns. The read returned
    while the thread still held the piece, whose bytes became the caller's new ones in the
    copy, committed by the next read (of the rest of the object) and served from the cache
    later. Now the read returns once the thread is done, and the copy holds the object's
    bytes."""
    assert len(DATA) - PIECE > INLINE
    holding, let_go = threading.Event(), threading.Event()
    write = CopyWriter._write

    def writing(self: CopyWriter, offset: int, view: memoryview, fresh: bool) -> None:
        if threading.current_thread() is not threading.main_thread() and not holding.is_set():
            holding.set()  # the copy's thread has the first piece ...
            let_go.wait(30)  # ... and reads it once the test has cancelled the read twice
        write(self, offset, view, fresh)

    monkeypatch.setattr(CopyWriter, "_write", writing)
    url = server.url("/m.safetensors")
    resolved = await resolve(url, Cache.at(tmp_path), UNLIMITED, read_all=False)
    tee = resolved.target
    assert isinstance(tee, TeeSource)
    inner = tee.inner
    landing = inner.read_landing

    async def stalled(offset: int, buffer: memoryview, landed: Any) -> int | None:
        inner.read_landing = landing  # type: ignore[method-assign]  # the first read only
        await inner.read_into_at(offset, buffer)
        landed(offset, offset + PIECE)  # the first piece in: handed to the copy's thread
        await anyio.sleep_forever()  # the rest on its way when the read is cancelled
        return None

    inner.read_landing = stalled  # type: ignore[method-assign]
    memory = bytearray(len(DATA))
    reading = asyncio.create_task(tee.read_into_at(0, memoryview(memory)))
    held_then: list[bool] = []  # whether the thread held the piece as the read returned

    def reuse(_: object) -> None:  # the caller's memory, reused once the read has returned
        held_then.append(holding.is_set() and not let_go.is_set())
        memory[:] = b"\xff" * len(memory)

    reading.add_done_callback(reuse)
    try:
        await anyio.to_thread.run_sync(holding.wait, 30)
        for _ in range(2):  # the read's cancellation, then a second during its clean-up
            reading.cancel()
            for _ in range(10):
                await asyncio.sleep(0)
        let_go.set()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert held_then == [False]  # the memory came back once the thread was done with it
        rest = memoryview(bytearray(len(DATA) - PIECE))
        assert await tee.read_into_at(PIECE, rest) == len(rest)
        assert rest == DATA[PIECE:]
    finally:
        let_go.set()
        await tee.aclose()
    assert tee.writer.committed
    assert open_under(tmp_path) == []
    (copy,) = (tmp_path / "objects").rglob("*.safetensors")
    assert copy.read_bytes() == DATA
    arrays, state = await read(url, cache=tmp_path)
    assert state == "hit"
    assert_same_arrays(arrays, ARRAYS)

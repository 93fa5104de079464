"""A cached read cancelled by asyncio's own cancellation (``Task.cancel``: a timeout, a task
group) while the copy's thread still writes pieces of the caller's memory
(stream_st.transports.cache.tee).

A read cancelled waits for the copy's thread to be done with the caller's memory before it
returns; that wait was shielded by anyio only, which asyncio's own cancellation goes through: a
second ``Task.cancel`` arriving during it handed the memory back while the thread still read
it. A read whose bytes were all in, waiting for the thread to write their last pieces (handed as
they landed, or all at once where the source cannot tell), did not even shield that wait: one
cancellation handed the memory back. A caller reusing its memory then (as it may once the read
has returned) had its new bytes written into the copy as the object's: the next read through
the same copy recorded them as held and committed them, and later reads of the cache were
served them. Now every such wait is seen to its end, then the cancellation reaches the caller.
The cancellations land where the test puts them (no timing); the server is real (the Python
test server).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

from stream_st.transports.base import Source
from stream_st.transports.cache import Cache
from stream_st.transports.cache.resolve import resolve
from stream_st.transports.cache.tee import INLINE, PIECE, CopyWriter, TeeSource
from stream_st.transports.options import UNLIMITED

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from .test_cache_native_cancel import Arrays, open_under, read

ARRAYS: Arrays = {f"t{i}": np.random.default_rng(i).random(PIECE // 8) for i in range(3)}
DATA = reference_numpy.save(ARRAYS)
"""Three pieces' worth: the first read lands one or two, the second reads the rest (more than
is written on the event loop's thread: handed to the copy's thread too)."""


@pytest.fixture
def server() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        yield running


FIRST = 2 * PIECE
"""The first read's length: two pieces of the object, the rest read by the second."""


async def one_piece(
    inner: Source, offset: int, buffer: memoryview, landed: Callable[[int, int], None]
) -> int | None:
    """A read that lands one piece (handed to the copy's thread) and waits for the rest: the
    read is cancelled there, and waits for the thread in its clean-up."""
    await inner.read_into_at(offset, buffer)
    landed(offset, offset + PIECE)
    await anyio.sleep_forever()
    return None


async def all_landed(
    inner: Source, offset: int, buffer: memoryview, landed: Callable[[int, int], None]
) -> int | None:
    """A read whose bytes all land, told at once (handed to the copy's thread): the read is
    cancelled as it waits for the thread to write them."""
    got = await inner.read_into_at(offset, buffer)
    landed(offset, offset + got)
    return got


async def untold(
    inner: Source, offset: int, buffer: memoryview, landed: Callable[[int, int], None]
) -> int | None:
    """A source that cannot tell as bytes land: the read is kept once all are in (handed to the
    copy's thread whole), and cancelled as it waits for the thread to write them."""
    return None


Landing = Callable[[Source, int, memoryview, Callable[[int, int], None]], Awaitable["int | None"]]


@pytest.mark.parametrize(
    ("landing", "kept", "cancels"),
    [(one_piece, PIECE, 2), (all_landed, FIRST, 1), (untold, FIRST, 1)],
    ids=["twice as it cleans up", "once as its pieces are written", "once as it keeps them"],
)
async def test_a_cancelled_read_returns_once_the_copy_is_done_with_its_memory(
    server: RangeHTTPServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    landing: Landing,
    kept: int,
    cancels: int,
) -> None:
    """The first read (of :data:`FIRST` bytes, through ``landing``) hands ``kept`` bytes to the
    copy's thread, which holds the first piece while the read is cancelled ``cancels`` times;
    the caller overwrites its memory once the read returns. The read returned while the thread
    still held the piece, whose bytes became the caller's new ones in the copy, committed by the
    next read (of the rest of the object) and served from the cache later. Now the read returns
    once the thread is done, and the copy holds the object's bytes."""
    assert len(DATA) - PIECE > INLINE
    holding, let_go = threading.Event(), threading.Event()
    write = CopyWriter._write

    def writing(self: CopyWriter, offset: int, view: memoryview, fresh: bool) -> None:
        if threading.current_thread() is not threading.main_thread() and not holding.is_set():
            holding.set()  # the copy's thread has the first piece ...
            let_go.wait(30)  # ... and reads it once the test has cancelled the read
        write(self, offset, view, fresh)

    monkeypatch.setattr(CopyWriter, "_write", writing)
    url = server.url("/m.safetensors")
    resolved = await resolve(url, Cache.at(tmp_path), UNLIMITED, read_all=False)
    tee = resolved.target
    assert isinstance(tee, TeeSource)
    inner = tee.inner
    read_landing = inner.read_landing

    async def first_read(
        offset: int, buffer: memoryview, landed: Callable[[int, int], None]
    ) -> int | None:
        inner.read_landing = read_landing  # type: ignore[method-assign]  # the first read only
        return await landing(inner, offset, buffer, landed)

    inner.read_landing = first_read  # type: ignore[method-assign]
    memory = bytearray(FIRST)
    reading = asyncio.create_task(tee.read_into_at(0, memoryview(memory)))
    held_then: list[bool] = []  # whether the thread held the piece as the read returned

    def reuse(_: object) -> None:  # the caller's memory, reused once the read has returned
        held_then.append(holding.is_set() and not let_go.is_set())
        memory[:] = b"\xff" * len(memory)

    reading.add_done_callback(reuse)
    try:
        await anyio.to_thread.run_sync(holding.wait, 30)
        for _ in range(cancels):  # the read's cancellation (then a second during its clean-up)
            reading.cancel()
            for _ in range(10):
                await asyncio.sleep(0)
        let_go.set()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert held_then == [False]  # the memory came back once the thread was done with it
        rest = memoryview(bytearray(len(DATA) - kept))
        assert await tee.read_into_at(kept, rest) == len(rest)
        assert rest == DATA[kept:]
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

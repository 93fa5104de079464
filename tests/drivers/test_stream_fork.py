"""A stream copied by ``os.fork()`` (opened, part read, then the process forked): in the copy,
reading is a UsageError saying to open the source again, before anything of the parent's (its
connection, a local file's read-ahead threads) is touched, and closing lets the copy go without
touching them either; the parent reads on, every byte right."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import SafetensorsError, TensorStream

from ..servers.http_server import RangeHTTPServer

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="forks the test process (os.fork, Linux)"
)

Arrays = dict[str, np.ndarray[Any, Any]]


def _arrays(count: int, shape: tuple[int, int]) -> Arrays:
    rng = np.random.default_rng(7)
    return {f"w{i:02d}": rng.standard_normal(shape).astype(np.float32) for i in range(count)}


@pytest.fixture
def http() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as server:
        yield server


def _said(step: Callable[[], object]) -> str:
    """What ``step()`` gave: "done", or the class and message of the stream_st error it raised."""
    try:
        step()
    except SafetensorsError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "done"


def _in_child(work: Callable[[], list[str]]) -> list[str]:
    """``work()`` in a copy of this process made by ``os.fork()``, which then ends with
    ``os._exit``: what it gave, or what became of the copy (a hang is a death by SIGALRM)."""
    read, write = os.pipe()
    with warnings.catch_warnings():  # 3.12+: a fork of a process running threads is warned of
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover (the copy's coverage is not recorded)
        code = 1
        try:
            signal.alarm(10)
            os.close(read)
            try:
                given = work()
            except BaseException as exc:  # told to the parent, which fails the test with it
                given = [f"raised {type(exc).__name__}: {exc}"]
            os.write(write, json.dumps(given).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + 30
    while not (ended := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    if not ended[0]:
        os.kill(pid, signal.SIGKILL)
        ended = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read()
    status = ended[1]
    if os.WIFSIGNALED(status):
        return [f"killed by signal {os.WTERMSIG(status)}"]
    assert os.WEXITSTATUS(status) == 0, said
    result: list[str] = json.loads(said)
    return result


def _copy_uses(stream: TensorStream, iteration: Any, closing: str) -> list[str]:
    """In the copy: step the iteration, open the stream, take its source, then close the
    iteration and the stream (``closing``: by ``aclose()`` or an ``async with`` block's exit),
    each on a new event loop's turn, under a time limit."""
    loop = asyncio.new_event_loop()

    def run(step: Callable[[], Coroutine[Any, Any, object]]) -> Callable[[], object]:
        return lambda: loop.run_until_complete(asyncio.wait_for(step(), 5))

    async def leave() -> None:
        if closing == "aclose":
            await stream.aclose()
        else:
            await stream.__aexit__(None, None, None)

    return [
        _said(run(lambda: anext(iteration))),
        _said(run(stream.open)),
        _said(lambda: stream.source),
        _said(run(iteration.aclose)),
        _said(run(leave)),
    ]


def _check_refused(said: list[str], name: str) -> None:
    """The copy's reads were refused, saying to open the source again; its closes let go."""
    assert len(said) == 5, said
    for refusal in said[:3]:
        assert refusal.startswith(f"UsageError: {name}: this stream was opened in another "), said
        assert "os.fork()" in refusal and "Open it again in this process" in refusal, said
    assert said[3:] == ["done", "done"], said


def _read_on(loop: asyncio.AbstractEventLoop, iteration: Any, stream: TensorStream) -> Arrays:
    """The rest of ``iteration``'s tensors, read on ``loop``, then the stream closed."""

    async def rest() -> Arrays:
        got = {name: array async for name, array in iteration}
        await stream.aclose()
        return got

    return loop.run_until_complete(asyncio.wait_for(rest(), 30))


def _check_forked_while_reading(
    stream: TensorStream, arrays: Arrays, read: int, shown: str, closing: str
) -> None:
    """Open ``stream`` (of ``arrays``) on a loop of its own, read ``read`` tensors, then fork:
    the copy's uses of it are refused (naming ``shown``, see :func:`_check_refused`), and the
    parent reads the rest, every tensor right."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(stream.__aenter__())
        iteration = aiter(stream)
        got = dict(loop.run_until_complete(anext(iteration)) for _ in range(read))
        _check_refused(_in_child(lambda: _copy_uses(stream, iteration, closing)), shown)
        got.update(_read_on(loop, iteration, stream))
    finally:
        loop.close()
    assert list(got) == list(arrays)
    for name, expected in arrays.items():
        assert got[name].tobytes() == expected.tobytes(), name


@pytest.mark.parametrize("closing", ["aclose", "exit"])
def test_a_url_stream_copied_by_fork(tmp_path: Path, http: RangeHTTPServer, closing: str) -> None:
    """An http stream forked while its response comes: the copy, which shared the parent's
    connection and split its body with it (tensors of wrong bytes on both sides, no error), is
    refused; the parent gets every tensor right."""
    arrays = _arrays(16, (128, 1024))  # 8 MiB: the body still coming at the fork
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(arrays, str(path))
    http.objects["/m.safetensors"] = path.read_bytes()
    url = http.url("/m.safetensors")
    _check_forked_while_reading(stream_st.open_stream(url, timeout=10), arrays, 1, url, closing)


@pytest.mark.parametrize("closing", ["aclose", "exit"])
def test_a_local_stream_reading_ahead_copied_by_fork(tmp_path: Path, closing: str) -> None:
    """A local file's stream forked while its read-ahead threads run: the copy, which waited
    for ever on threads it does not have (a timeout around the step could not end it), is
    refused at once, and its close waits for nothing; the parent reads on."""
    arrays = _arrays(12, (1024, 1024))  # 48 MiB: read ahead by threads
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(arrays, str(path))
    _check_forked_while_reading(stream_st.open_stream(path), arrays, 2, str(path), closing)


def test_a_stream_opened_in_the_copy_reads_there(tmp_path: Path) -> None:
    """A stream made before the fork but opened after it, in the copy, is the copy's own."""
    arrays = _arrays(2, (4, 4))
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(arrays, str(path))
    stream = stream_st.open_stream(path)

    def read() -> list[str]:
        async def names() -> list[str]:
            async with stream:
                return [name async for name, array in stream if array.tobytes()]

        return asyncio.new_event_loop().run_until_complete(names())

    assert _in_child(read) == list(arrays)

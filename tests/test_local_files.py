"""Local paths that are not plain files, and plain files under faults: devices, FIFOs, pipes,
symlinks, full disks, cancelled commits. Everything is real: device nodes made with mknod, FIFOs
made with mkfifo, a small tmpfs or a file size limit for a full disk."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import ReadTimeoutError

from ._util import sample_tensors
from .test_cli import COMMAND

Arrays = dict[str, np.ndarray[Any, Any]]

TENSORS: Arrays = sample_tensors()
BIG: Arrays = {f"w{i}": np.random.default_rng(i).random(600_000) for i in range(3)}  # 3 x 4.8 MB
NULL, FULL = (1, 3), (1, 7)  # the device numbers of /dev/null and /dev/full


def same(got: Arrays, expected: Arrays) -> None:
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].tobytes() == array.tobytes()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fifo(directory: Path, name: str = "pipe") -> Path:
    path = directory / name
    os.mkfifo(path)
    return path


@contextlib.contextmanager
def unblocking(path: Path, after: float = 5.0) -> Iterator[None]:
    """A safety net, never needed when the code under test is right: should the event loop still
    be stuck ``after`` seconds on, in a blocking open of the FIFO ``path``, open and close its
    write end so that the test fails rather than hangs."""
    stop = threading.Event()

    def release() -> None:
        if stop.wait(after):
            return
        while not stop.is_set():
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError:  # no reader yet
                stop.wait(0.05)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# ---------------------------------------------------------------- FIFOs and pipes


async def test_a_fifo_source_leaves_the_loop_free_while_it_waits(tmp_path: Path) -> None:
    path = fifo(tmp_path)
    data = reference_numpy.save(TENSORS)
    loop_ran = threading.Event()
    seen: list[bool] = []

    def writer() -> None:  # a writer that comes only once the event loop has run something
        seen.append(loop_ran.wait(5))
        with open(path, "wb") as out:
            out.write(data)

    async def tick() -> None:
        await anyio.sleep(0.01)
        loop_ran.set()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(tick)
            got = await stream_st.load(path, timeout=30)
    finally:
        thread.join()
    assert seen == [True]
    same(got, TENSORS)


async def test_timeout_applies_to_a_fifo_without_writer(tmp_path: Path) -> None:
    path = fifo(tmp_path)
    before = open_fds()
    with unblocking(path), pytest.raises(ReadTimeoutError, match="no data") as info:
        await stream_st.load(path, timeout=0.2)
    assert info.value.url == str(path)
    assert open_fds() == before


def test_cli_inspect_of_a_fifo_without_writer_times_out(tmp_path: Path) -> None:
    path = fifo(tmp_path)
    result = subprocess.run(
        [COMMAND, "inspect", "--timeout", "1", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "no data for 1.0 s" in result.stderr


def test_cli_inspect_reads_a_pipe_on_stdin() -> None:
    result = subprocess.run(
        [COMMAND, "inspect", "/dev/stdin"],
        input=reference_numpy.save(TENSORS),
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert b"weight" in result.stdout and b"scalar" in result.stdout

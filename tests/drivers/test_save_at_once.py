"""``save`` to a local file: written at once in a worker thread, and what a cancellation leaves."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy

import stream_st
from stream_st.transports.file import atomic
from stream_st.transports.file.atomic import Abandoned
from stream_st.writer import save_at_once

pytestmark = pytest.mark.anyio

OLD = b"the previous content"


def _tensors(count: int = 8) -> dict[str, Any]:
    return {f"t{i}": np.full((64, 16), i, dtype=np.float32) for i in range(count)}


def _left(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


class _Held:
    """An array-like whose conversion waits until the test lets it go, so that a save can be
    cancelled while its worker thread is busy with it."""

    def __init__(self) -> None:
        self.taken = threading.Event()
        self.release = threading.Event()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        self.taken.set()
        self.release.wait(10)
        return np.arange(8, dtype=np.float32)


async def test_save_matches_the_reference_and_keeps_its_options(tmp_path: Path) -> None:
    tensors = _tensors()
    target = tmp_path / "model.safetensors"
    header = await stream_st.save(target, tensors, metadata={"k": "v"})
    expected = safetensors.numpy.save(tensors, metadata={"k": "v"})
    assert target.read_bytes() == expected
    assert header.names() == list(sorted(tensors))
    planned = await stream_st.save(target, tensors, order="plan", fsync=True, checksums=True)
    assert planned.names() == list(tensors)
    assert (await stream_st.read_header(target)).names() == list(tensors)
    assert _left(tmp_path) == ["model.safetensors"]


async def test_a_cancelled_save_leaves_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(OLD)
    held = _Held()
    tensors = {**_tensors(), "zz": held}
    scope = anyio.CancelScope()
    finished = False

    async def save() -> None:
        nonlocal finished
        with scope:
            await stream_st.save(target, tensors)
            finished = True

    async with anyio.create_task_group() as group:
        group.start_soon(save)
        await anyio.to_thread.run_sync(held.taken.wait, 10)
        scope.cancel()
        await anyio.sleep(0.05)  # the save waits for its thread, which holds the array-like
        held.release.set()
    assert not finished
    assert target.read_bytes() == OLD
    assert _left(tmp_path) == ["model.safetensors"]


def test_a_stopped_write_commits_nothing(tmp_path: Path) -> None:
    """``stop`` asked before each block of writes and before the commit: the temporary file
    goes, the old file stays."""
    target = tmp_path / "model.safetensors"
    target.write_bytes(OLD)
    tensors = {f"t{i}": np.full(1 << 16, i, dtype=np.float32) for i in range(2)}  # 3 blocks
    asked = 0

    def count() -> bool:
        nonlocal asked
        asked += 1
        return False

    save_at_once(tensors, str(tmp_path / "counted.safetensors"), stop=count)
    os.unlink(tmp_path / "counted.safetensors")
    assert asked == 4  # before each of the 3 blocks, and before the commit
    for after in range(asked):
        answers = iter([False] * after + [True])
        with pytest.raises(Abandoned):
            save_at_once(tensors, str(target), stop=answers.__next__)
        assert target.read_bytes() == OLD
        assert _left(tmp_path) == ["model.safetensors"]
    save_at_once(tensors, str(target), stop=lambda: False)
    assert target.read_bytes() == safetensors.numpy.save(tensors)


async def test_errors_of_a_save_at_once_are_the_streamed_ones(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    with pytest.raises(stream_st.UsageError):
        await stream_st.save(target, {"a": np.zeros(2)}, order="sideways")  # type: ignore[arg-type]
    with pytest.raises(stream_st.UsageError):
        await stream_st.save(target, {"a": [[1, 2], [3]]})
    with pytest.raises(stream_st.SafetensorsError):
        await stream_st.save(tmp_path, {"a": np.zeros(2)})  # a directory
    assert _left(tmp_path) == []


@pytest.mark.parametrize("named", [False, True], ids=["nameless", "named"])
async def test_a_save_cancelled_while_writing_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, named: bool
) -> None:
    """Cancelled once its temporary file exists (256 MiB to write, from one 1 MiB array): the
    thread stops at its next block and removes it before the cancellation reaches the caller;
    the previous file stays."""
    monkeypatch.setattr(atomic, "USE_TMPFILE", not named)
    target = tmp_path / "model.safetensors"
    target.write_bytes(OLD)
    row = np.ones(1 << 18, dtype=np.float32)
    tensors = {f"t{i:03d}": row for i in range(256)}
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(stream_st.save, target, tensors)
            for _ in range(10_000):  # the file system is polled: nothing signals the file
                if temporary(tmp_path) is not None:
                    break
                await anyio.sleep(0.001)
            scope.cancel()
    assert scope.cancelled_caught
    assert temporary(tmp_path) is None
    assert target.read_bytes() == OLD
    assert _left(tmp_path) == ["model.safetensors"]


def temporary(directory: Path) -> str | None:
    """The temporary file a writer of this process has open in ``directory``: its name, or
    ``#inode (deleted)`` for a nameless one; None if none."""
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{directory}/") and target.endswith((".tmp", " (deleted)")):
                return target
    return None


async def test_a_save_cancelled_before_its_thread_starts(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(OLD)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await stream_st.save(target, {"big": np.zeros(1 << 18, np.float32)})  # in a thread
    assert scope.cancelled_caught
    assert target.read_bytes() == OLD
    assert _left(tmp_path) == ["model.safetensors"]


async def test_a_small_dict_is_saved_on_the_loops_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``SAVE_INLINE`` bytes and ``SAVE_INLINE_TENSORS`` arrays, no worker thread."""
    threads: list[int] = []
    real = os.pwritev

    def pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        threads.append(threading.get_ident())
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    small, large = _tensors(), {"big": np.zeros(1 << 18, np.float32)}
    for tensors, inline in ((small, True), (large, False)):
        threads.clear()
        await stream_st.save(tmp_path / "m.safetensors", tensors)
        assert (tmp_path / "m.safetensors").read_bytes() == safetensors.numpy.save(tensors)
        assert threads and (set(threads) == {threading.get_ident()}) == inline


CTRL_C_DURING_SAVE = """
import os, signal, sys, time, anyio, numpy as np, stream_st

class Interrupting:
    # Converted in the save's worker thread: Ctrl-C comes while the caller waits for it.
    def __array__(self, dtype=None, copy=None):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the interrupt reaches the caller meanwhile
        return np.arange(8, dtype=np.float32)

tensors = {"a": np.ones(1 << 20, np.float32), "zz": Interrupting()}
try:
    anyio.run(stream_st.save, sys.argv[1], tensors, backend=sys.argv[2])
except KeyboardInterrupt:
    print("KeyboardInterrupt")
except BaseException as exc:
    print(repr(exc))
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_during_a_save_stops_it_and_is_a_keyboard_interrupt(
    tmp_path: Path, backend: str
) -> None:
    """Ctrl-C while a save's thread writes: the save stops (nothing is committed) and the
    caller gets a KeyboardInterrupt, as itself. Under trio, which raises it in the task that
    waits for the thread, it came in a BaseExceptionGroup, once the save had committed."""
    target = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_SAVE, str(target), backend],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.strip() == "KeyboardInterrupt", done.stdout + done.stderr
    assert _left(tmp_path) == []

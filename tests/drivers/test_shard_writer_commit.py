"""The sharded writer commits last: its shards take the names of a previous checkpoint only once
the new index is written whole, so a failure before leaves the previous shards as they were; a
process killed at any step of the commit leaves the previous checkpoint whole, the new one whole,
or no index, never an index naming a mix. Until the commit its shards have no name (or a hidden
one that a later writer of the directory removes): a writer killed meanwhile leaves nothing."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import SourceNotFoundError, TransportError
from stream_st.sharded import writer as writer_module
from stream_st.sharded.writer import open_dataset_writer, open_sharded_writer
from stream_st.transports.file import atomic

from .._util import nameless_works

INDEX = "model.safetensors.index.json"


async def _write(directory: Path, value: float) -> None:
    async with open_sharded_writer(directory, max_shard_size=16) as writer:
        for name in ("a", "b"):
            await writer.write(name, np.full(4, value, np.float32))


async def test_an_index_that_cannot_be_written_replaces_no_previous_shard(tmp_path: Path) -> None:
    """The shards were moved over the previous ones before the index was written, then removed
    when it failed: the previous checkpoint lost its shards."""
    await _write(tmp_path, 1.0)
    previous = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != INDEX}
    assert len(previous) == 2
    (tmp_path / INDEX).unlink()
    (tmp_path / INDEX).mkdir()  # where the index goes: writing it fails
    with pytest.raises(TransportError, match="directory"):
        await _write(tmp_path, 2.0)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != INDEX}
    assert after == previous


async def test_a_name_of_other_digits_than_ascii_is_no_earlier_shard(tmp_path: Path) -> None:
    """The commit removed every file named like an earlier checkpoint's shard, taking any
    script's digits for its numbers: a user's ``model-١٢٣٤٥-of-٩٩٩٩٩.safetensors`` (no writer
    makes such a name) was deleted. Only ASCII-numbered shards are an earlier checkpoint's."""
    theirs = (
        tmp_path
        / "model-\u0661\u0662\u0663\u0664\u0665-of-\u0669\u0669\u0669\u0669\u0669.safetensors"
    )
    theirs.write_text("a user's file")
    stale = tmp_path / "model-00007-of-00009.safetensors"
    stale.write_text("an earlier checkpoint's shard")
    await _write(tmp_path, 1.0)
    assert theirs.read_text() == "a user's file"
    assert not stale.exists()


async def test_a_directory_at_a_shards_final_name_keeps_the_previous_index(
    tmp_path: Path,
) -> None:
    """The previous index was removed before the shard's move over the directory failed: the
    previous checkpoint no longer loaded."""
    async with open_sharded_writer(tmp_path, max_shard_size=16) as writer:
        for name in ("a", "b", "c"):
            await writer.write(name, np.full(4, 1.0, np.float32))
    (tmp_path / "model-00002-of-00002.safetensors").mkdir()  # the second write's last shard
    with pytest.raises(TransportError, match="directory"):
        await _write(tmp_path, 2.0)
    loaded = await stream_st.load(tmp_path / INDEX)
    assert sorted(loaded) == ["a", "b", "c"]
    assert all((array == 1.0).all() for array in loaded.values())


CHILD = """
import os, signal, sys, threading, anyio, numpy as np, stream_st
from stream_st.transports.file import atomic

directory, count, value, kill_at, nameless = sys.argv[1:]
atomic.USE_TMPFILE = nameless == "1"
calls = 0
armed = False

def profile(frame, event, arg):
    # once armed, a kill just before the kill_at-th call that names, renames or removes a file
    global calls
    if armed and event == "c_call" and arg in (os.link, os.rename, os.replace, os.unlink):
        calls += 1
        if calls == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)

async def main():
    global armed
    async with stream_st.open_sharded_writer(directory, max_shard_size=64) as writer:
        for i in range(int(count)):
            await writer.write(f"t{i}", np.full(16, float(value), np.float32))
        armed = True

threading.setprofile(profile)  # every thread started from now on: the commit's worker too
sys.setprofile(profile)
anyio.run(main)
"""


async def _checkpoint(directory: Path, count: int, value: float) -> None:
    """``count`` tensors of ``value``, one a shard (one shard: ``model.safetensors``)."""
    async with open_sharded_writer(directory, max_shard_size=64) as writer:
        for i in range(count):
            await writer.write(f"t{i}", np.full(16, value, np.float32))


def _version(tensors: dict[str, np.ndarray], versions: dict[float, int]) -> float:
    """Which of ``versions`` (value: tensor count) ``tensors`` is whole; fails on a mix."""
    values = {float(array[0]) for array in tensors.values()}
    assert len(values) == 1, f"a mix of checkpoints: {tensors}"
    (value,) = values
    assert sorted(tensors) == [f"t{i}" for i in range(versions[value])]
    return value


@pytest.mark.parametrize(
    ("old", "new", "nameless"),
    [(3, 3, True), (3, 3, False), (2, 3, True), (1, 2, True), (2, 1, True)],
    ids=["same-names", "same-names-named", "other-names", "to-shards", "to-one-file"],
)
async def test_a_writer_killed_at_any_step_of_its_commit_leaves_no_mix(
    tmp_path: Path, old: int, new: int, nameless: bool
) -> None:
    """A checkpoint written over another, its process killed (SIGKILL) before each call that
    names, renames or removes a file in turn: the index there, if any, is the old checkpoint's
    or the new one's, whole; a ``model.safetensors`` there (which loaders take before any
    index) is whole too. The old checkpoint stays readable until the new index is in place
    where none of its shards is replaced (2 shards, then 3). A later writer leaves nothing of
    the killed one's."""
    if nameless and not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    directory = tmp_path / "ckpt"
    versions = {1.0: old, 2.0: new}
    index = directory / INDEX
    seen = set()
    shards = [f"model-{i:05d}-of-{new:05d}.safetensors" for i in range(1, new + 1)]
    expected = {INDEX, *(shards if new > 1 else ["model.safetensors"])}
    left: set[str] = set()  # by the killed writers, after the later one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for kill_at in range(1, 100):
        await _checkpoint(directory, old, 1.0)
        args = [os.fspath(directory), str(new), "2", str(kill_at), str(int(nameless))]
        script = textwrap.dedent(CHILD)
        child = await anyio.run_process([sys.executable, "-c", script, *args], env=env, check=False)
        if child.returncode == 0:  # not killed: the new checkpoint, whole
            assert _version(await stream_st.load(index), versions) == 2.0
            break
        assert child.returncode == -signal.SIGKILL, child.stderr.decode()
        if index.exists():
            state = _version(await stream_st.load(index), versions)
        else:
            with pytest.raises(SourceNotFoundError):
                await stream_st.load(index)
            state = None
            assert (old, new) != (2, 3), "the old checkpoint was readable until the new index"
        if (directory / "model.safetensors").exists():
            _version(await stream_st.load(directory / "model.safetensors"), versions)
        seen.add(state)
        await _checkpoint(directory, new, 2.0)  # then a later write, whole: nothing else left
        assert _version(await stream_st.load(index), versions) == 2.0
        left.update(set(os.listdir(directory)) - expected)
    else:
        pytest.fail("the commit never ended")
    assert kill_at > new + 1 and 1.0 in seen  # linked in each shard and the index, killed
    assert left == set()


HELD_BY_A_KILLED_WRITER = """
import sys, anyio, numpy as np, stream_st
from stream_st.transports.file import atomic

kind, directory, nameless, prefix = sys.argv[1:]
atomic.USE_TMPFILE = nameless == "1"

async def main():
    if kind == "checkpoint":
        async with stream_st.open_sharded_writer(
            directory, max_shard_size=1 << 20, prefix=prefix
        ) as writer:
            for i in range(3):
                await writer.write(f"t{i}", np.zeros(1 << 18, np.float32))  # a shard each
            print("sealed", flush=True)
            await anyio.sleep(60)
    async with stream_st.open_dataset_writer(directory, target_shard_size=1 << 20) as writer:
        for i in range(3):
            await writer.write_batch({"x": np.zeros(1 << 18, np.float32)}, samples=1 << 18)
        print("sealed", flush=True)
        await anyio.sleep(60)

anyio.run(main)
"""


def _kill_while_writing(
    kind: str, directory: Path, nameless: bool, sig: int, prefix: str = "model"
) -> None:
    """A writer of ``kind`` into ``directory`` (a checkpoint's shards named after ``prefix``),
    killed with ``sig`` once two shards are sealed and a third is being written."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = textwrap.dedent(HELD_BY_A_KILLED_WRITER)
    args = [kind, os.fspath(directory), str(int(nameless)), prefix]
    with subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, env=env
    ) as child:
        assert child.stdout is not None
        assert child.stdout.readline() == b"sealed\n"
        child.send_signal(sig)
        assert child.wait(timeout=30) == -sig


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
async def test_a_writer_killed_while_writing_leaves_nothing(
    tmp_path: Path, kind: str, sig: int
) -> None:
    """Sealed shards have no name until the commit: a process killed (SIGKILL, or SIGTERM in a
    program that does not handle it) left them under provisional hidden names (a checkpoint's)
    or their final ones with no manifest (a dataset's, which a directory's reader takes as
    data), for ever."""
    if not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    _kill_while_writing(kind, tmp_path / "out", True, sig)
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
async def test_a_later_writer_removes_what_a_killed_one_left(tmp_path: Path, kind: str) -> None:
    """Where a file cannot be nameless, a killed writer's shards are hidden files of held names,
    which the next writer of the directory removes."""
    directory = tmp_path / "out"
    _kill_while_writing(kind, directory, False, signal.SIGKILL)
    left = os.listdir(directory)
    assert len(left) == 3 and all(name.startswith("..") for name in left)
    async with open_dataset_writer(directory) as writer:
        await writer.write_batch({"x": np.ones(2, np.float32)}, samples=2)
    assert not [name for name in os.listdir(directory) if name.startswith(".")]


@pytest.mark.parametrize("size", [205, 220])
async def test_a_later_writer_removes_what_a_killed_one_left_under_long_names(
    tmp_path: Path, size: int
) -> None:
    """A prefix whose held names (``.<tag>.partial.<name>``, 18 bytes longer than the shard's),
    or their temporaries' (``.<held>.<random>.tmp``, 18 more), would pass the longest name the
    directory takes: short held names stand in, which a killed writer's temporaries are still
    named after, for the next writer to remove."""
    directory = tmp_path / "out"
    _kill_while_writing("checkpoint", directory, False, signal.SIGKILL, "p" * size)
    left = os.listdir(directory)
    assert len(left) == 3 and all(name.startswith("..") for name in left)
    async with open_dataset_writer(directory) as writer:
        await writer.write_batch({"x": np.ones(2, np.float32)}, samples=2)
    assert not [name for name in os.listdir(directory) if name.startswith(".")]


@pytest.mark.parametrize("nameless", [True, False], ids=["nameless", "named"])
async def test_a_long_prefix_whose_names_fit_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nameless: bool
) -> None:
    """Final names of up to 242 bytes (the directory takes 255) are written, though their held
    names would be 18 bytes longer, and the held index's too long: short ones stand in."""
    if nameless and not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    monkeypatch.setattr(atomic, "USE_TMPFILE", nameless)
    prefix = "p" * 215
    async with open_sharded_writer(tmp_path, max_shard_size=400, prefix=prefix) as writer:
        await writer.write("a", np.zeros(100, np.float32))
        await writer.write("b", np.ones(100, np.float32))
    index = f"{prefix}.safetensors.index.json"
    shards = [f"{prefix}-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert sorted(os.listdir(tmp_path)) == sorted([index, *shards])
    loaded = await stream_st.load(tmp_path / index)
    assert loaded["b"].tolist() == [1.0] * 100


async def test_a_prefix_whose_names_cannot_fit_is_refused_first(tmp_path: Path) -> None:
    """A prefix whose shard names (``{prefix}-NNNNN-of-NNNNN.safetensors``, 27 bytes longer) or
    index name pass the longest name the directory takes failed only once every byte was
    written, saying "removing the previous index failed: File name too long". Now refused as
    the writer is made, nothing written; the longest prefix that fits is written."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    fits = "p" * (limit - len("-00001-of-00002.safetensors"))
    for prefix in (fits + "p", "é" * (len(fits) // 2 + 1)):
        with pytest.raises(stream_st.UsageError, match=rf"prefix is too long .* over the {limit}"):
            open_sharded_writer(tmp_path / "new" / "ckpt", max_shard_size=400, prefix=prefix)
    assert list(tmp_path.iterdir()) == []
    async with open_sharded_writer(tmp_path, max_shard_size=400, prefix=fits) as writer:
        await writer.write("a", np.zeros(100, np.float32))
        await writer.write("b", np.ones(100, np.float32))
    assert (await stream_st.load(tmp_path / f"{fits}.safetensors.index.json"))["b"][0] == 1.0


async def test_a_live_writers_files_are_not_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer of the directory at work holds it: a second one removes none of its hidden
    files, and both commit."""
    monkeypatch.setattr(atomic, "USE_TMPFILE", False)
    async with open_sharded_writer(tmp_path, max_shard_size=64, prefix="first") as first:
        for i in range(2):
            await first.write(f"t{i}", np.full(16, 1.0, np.float32))
        assert len(os.listdir(tmp_path)) == 2  # a sealed shard, the next
        await _checkpoint(tmp_path, 2, 2.0)
        await first.write("t2", np.full(16, 1.0, np.float32))
    loaded = await stream_st.load(tmp_path / "first.safetensors.index.json")
    assert sorted(loaded) == ["t0", "t1", "t2"]
    assert _version(await stream_st.load(tmp_path / INDEX), {2.0: 2}) == 2.0
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


MANY_SHARDS = """
import sys, anyio, numpy as np, stream_st

async def main():
    async with stream_st.open_sharded_writer(sys.argv[1], max_shard_size=8) as writer:
        for i in range(80):
            await writer.write(f"t{i}", np.full(2, i, np.float32))  # a shard each
    async with stream_st.open_dataset_writer(sys.argv[2], target_shard_size=8) as writer:
        for i in range(80):
            await writer.write_batch({"x": np.full(2, i, np.float32)}, samples=2)

anyio.run(main)
"""


def test_more_shards_than_the_soft_limit_on_open_files(tmp_path: Path) -> None:
    """Every sealed shard is held open until the commit: the writers raise the soft limit on
    open files, within the hard one, as they go."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"the hard limit on open files is {hard}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = textwrap.dedent(MANY_SHARDS)
    args = [os.fspath(tmp_path / "ckpt"), os.fspath(tmp_path / "data")]
    child = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard)),
    )
    assert child.returncode == 0, child.stderr.decode()
    loaded = anyio.run(stream_st.load, tmp_path / "ckpt" / INDEX)
    assert len(loaded) == 80 and float(loaded["t79"][0]) == 79.0
    assert len(os.listdir(tmp_path / "data")) == 81  # and the manifest


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
def test_asyncio_cancellation_in_the_commit_waits_for_it(tmp_path: Path, kind: str) -> None:
    """``Task.cancel`` (what ``asyncio.timeout`` and ``wait_for`` do), which goes through anyio's
    shields, arriving while the commit's worker thread renames: the cancellation was raised at
    once and the writer aborted, removing the shards the thread had just given their final
    names, while the thread moved the index into place: an index naming missing shards, the
    previous checkpoint gone. Now the cancellation is raised once the commit has ended, the new
    checkpoint whole. The worker thread is held (a profile hook, set for the threads the
    event loop starts) just after it moved the index into place, until the cancellation has
    reached the writer's task."""
    index = tmp_path / (INDEX if kind == "checkpoint" else "dataset_manifest.json")
    placed, go = threading.Event(), threading.Event()
    armed = False

    def hold(frame: Any, event: str, arg: Any) -> None:
        in_commit = frame.f_code.co_name == "_commit"  # os.replace there: the index is in place
        if armed and event == "c_return" and arg is os.replace and in_commit:
            placed.set()
            go.wait(10)

    async def write(value: float) -> None:
        if kind == "checkpoint":
            async with open_sharded_writer(tmp_path, max_shard_size=64) as writer:
                for i in range(2):
                    await writer.write(f"t{i}", np.full(16, value, np.float32))
        else:
            async with open_dataset_writer(tmp_path, target_shard_size=64) as dataset:
                for _ in range(2):
                    await dataset.write_batch({"x": np.full((2, 8), value, np.float32)}, 2)

    async def main() -> None:
        nonlocal armed
        await write(1.0)  # the previous checkpoint
        armed = True
        task = asyncio.ensure_future(write(2.0))
        assert await asyncio.to_thread(placed.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)  # the cancellation reaches the task (and, before, its abort)
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    threading.setprofile(hold)  # the event loop's worker threads, all started from now on
    try:
        asyncio.run(main())
    finally:
        threading.setprofile(None)
        go.set()
    document = json.loads(index.read_text())
    if kind == "checkpoint":
        named = sorted(set(document["weight_map"].values()))
    else:
        named = [shard["shard_path"] for shard in document["shards"]]
    assert sorted(os.listdir(tmp_path)) == sorted([index.name, *named])
    values = {
        float(array[0].flat[0])
        for shard in named
        for array in reference_numpy.load_file(str(tmp_path / shard)).values()
    }
    assert values == {2.0} and len(named) == 2


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
def test_a_writer_cancelled_while_it_claims_its_folder_lets_it_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """``Task.cancel`` arriving while the worker thread claims the folder (a shared ``flock``,
    :func:`~stream_st.sharded.writer._claim`): anyio raises it once the thread has returned,
    and the descriptor it returned was dropped, never closed, its lock held for the rest of the
    process; every later writer there took it for a writer at work and never swept what a
    killed one left. Now it is let go with the writer."""
    claim = writer_module._claim
    entered, go = threading.Event(), threading.Event()

    def held_claim(directory: Path) -> int | None:
        entered.set()
        go.wait(10)
        return claim(directory)

    monkeypatch.setattr(writer_module, "_claim", held_claim)

    async def write() -> None:
        if kind == "checkpoint":
            async with open_sharded_writer(tmp_path, max_shard_size=64) as writer:
                await writer.write("t", np.ones(4, np.float32))
        else:
            async with open_dataset_writer(tmp_path, target_shard_size=64) as dataset:
                await dataset.write_batch({"x": np.ones((2, 2), np.float32)}, 2)

    async def main() -> None:
        task = asyncio.ensure_future(write())
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)  # the cancellation reaches the task, shielded
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        go.set()
    probe = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no writer holds the folder
    finally:
        os.close(probe)
    assert os.listdir(tmp_path) == []

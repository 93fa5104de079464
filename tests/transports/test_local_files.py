"""Local paths that are not plain files, and plain files under faults: devices, FIFOs, pipes,
symlinks, full disks, cancelled commits. Everything is real: device nodes made with mknod, FIFOs
made with mkfifo, a small tmpfs or a file size limit for a full disk."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import resource
import stat
import subprocess
import threading
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
import stream_st.sharded.writer
import stream_st.tools
from stream_st import ReadTimeoutError, TensorSpec, TransportError
from stream_st.core.shards import is_index, scheme_of
from stream_st.sharded.writer import open_dataset_writer, open_sharded_writer
from stream_st.transports.file.source import open_file_source

from .._util import mapping_of, sample_tensors
from ..uses.test_cli import COMMAND

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


def device_node(directory: Path, name: str, number: tuple[int, int]) -> Path:
    """A character device node made in ``directory`` (so no test can harm the real /dev);
    skipped where this process may not make or open one."""
    path = directory / name
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*number))
        os.close(os.open(path, os.O_WRONLY))
    except PermissionError as exc:
        pytest.skip(f"cannot make and open a device node here: {exc}")
    return path


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


# ---------------------------------------------------------------- devices as destinations


async def test_save_to_a_character_device_writes_through_it(tmp_path: Path) -> None:
    null = device_node(tmp_path, "null", NULL)
    before = open_fds()
    await stream_st.save(null, BIG)
    async with stream_st.open_writer(null, [TensorSpec("x", np.float32, (2,))]) as writer:
        await writer.write("x", np.ones(2, np.float32))
    assert stat.S_ISCHR(null.stat().st_mode) and os.listdir(tmp_path) == ["null"]
    assert open_fds() == before


def test_cp_to_a_character_device_keeps_it(tmp_path: Path) -> None:
    source = tmp_path / "model.safetensors"
    reference_numpy.save_file(TENSORS, str(source))
    null = device_node(tmp_path, "null", NULL)
    result = subprocess.run(
        [COMMAND, "cp", "--quiet", str(source), str(null)], capture_output=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert stat.S_ISCHR(null.stat().st_mode)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "null"]


async def test_a_full_device_is_a_transport_error(tmp_path: Path) -> None:
    full = device_node(tmp_path, "full", FULL)
    before = open_fds()
    with pytest.raises(TransportError, match="No space left on device") as info:
        await stream_st.save(full, TENSORS)
    assert info.value.url == str(full) and info.value.position == 0
    assert stat.S_ISCHR(full.stat().st_mode) and os.listdir(tmp_path) == ["full"]
    assert open_fds() == before


# ---------------------------------------------------------------- FIFOs and pipes


async def test_fifo_round_trip_in_one_event_loop(tmp_path: Path) -> None:
    """The writer waits for a reader and the reader for a writer, neither blocking the loop."""
    path = fifo(tmp_path)
    got: Arrays = {}

    async def load() -> None:
        got.update(await stream_st.load(path, timeout=30))

    before = open_fds()
    with unblocking(path):
        async with anyio.create_task_group() as group:
            group.start_soon(stream_st.save, path, BIG)
            group.start_soon(load)
    same(got, BIG)
    assert stat.S_ISFIFO(path.stat().st_mode) and os.listdir(tmp_path) == ["pipe"]
    assert open_fds() == before


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


async def test_timeout_applies_to_a_fifo_without_reader(tmp_path: Path) -> None:
    path = fifo(tmp_path)
    before = open_fds()
    with pytest.raises(ReadTimeoutError, match="no reader"):
        async with stream_st.open_writer(path, [TensorSpec("x", "U8", (4,))], timeout=0.2) as w:
            await w.write("x", np.zeros(4, np.uint8))
    assert stat.S_ISFIFO(path.stat().st_mode) and os.listdir(tmp_path) == ["pipe"]
    assert open_fds() == before


async def test_a_fifo_reader_that_hangs_up_fails_the_write(tmp_path: Path) -> None:
    path = fifo(tmp_path)

    async def read_then_hang_up() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            with anyio.fail_after(10):
                await anyio.wait_readable(fd)
            os.read(fd, 100)
        finally:
            os.close(fd)

    before = open_fds()
    async with anyio.create_task_group() as group:
        group.start_soon(read_then_hang_up)
        with pytest.raises(TransportError, match="Broken pipe") as info:
            await stream_st.save(path, BIG)
    assert info.value.url == str(path) and (info.value.position or 0) > 0
    assert stat.S_ISFIFO(path.stat().st_mode)
    assert open_fds() == before


def test_cli_inspect_of_a_fifo_without_writer_times_out(tmp_path: Path) -> None:
    path = fifo(tmp_path)
    result = subprocess.run(
        [COMMAND, "inspect", "--timeout", "1", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "no data for 1 s" in result.stderr


def test_cli_inspect_reads_a_pipe_on_stdin() -> None:
    result = subprocess.run(
        [COMMAND, "inspect", "/dev/stdin"],
        input=reference_numpy.save(TENSORS),
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert b"weight" in result.stdout and b"scalar" in result.stdout


# ---------------------------------------------------------------- regular files


async def test_a_directory_is_not_a_source(tmp_path: Path) -> None:
    before = open_fds()
    with pytest.raises(TransportError, match="cannot read a directory"):
        await stream_st.load(tmp_path)
    assert open_fds() == before


async def test_a_source_dropped_unclosed_gives_its_descriptor_back(tmp_path: Path) -> None:
    """A stream opened and dropped without aclose (a plain file, a FIFO) has its descriptor
    closed when it is collected, with the ResourceWarning a Python file gives; a stream closed
    gives none."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(TENSORS, str(path))
    pipe = fifo(tmp_path)
    gc.collect()  # a descriptor an earlier test dropped is closed now, not counted as ours
    before = open_fds()
    for dropped in (path, pipe):
        with pytest.warns(ResourceWarning, match=f"unclosed file '{dropped}'"):
            for _ in range(10):
                source = open_file_source(dropped)
                if dropped == path:  # the stream's header read: 'stream.open()', forgotten
                    await stream_st.open_stream(source).open()
                del source
            gc.collect()
        assert open_fds() == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        async with stream_st.open_stream(path):
            pass
        gc.collect()


async def test_a_path_holding_colon_slash_slash_is_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any text before ``://`` was taken for a URL scheme: ``dir/with://x``, the file ``x`` in
    the folder ``dir/with:`` (as the reference writes and reads it), was refused as a URL of
    the scheme ``dir/with``. Only an RFC 3986 scheme (a letter, then letters, digits, ``+``,
    ``-``, ``.``) makes a URL; the rest are paths, written and read as files: by save and load,
    the drop-ins, the sharded writer and its index's reader, cp and mirror."""
    assert [scheme_of(a) for a in ("S3://b/k", "git+ssh://h", "file:///a://b", 3)] == [
        "s3",
        "git+ssh",
        "file",
        None,
    ]
    assert [scheme_of(a) for a in ("dir/with://x", "1a://x", "a b://x", "-a://x")] == [None] * 4
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir" / "with:").mkdir(parents=True)
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "a": np.arange(3, dtype=np.float32),
        "b": np.ones(2, np.int8),
    }
    await stream_st.save("dir/with://saved", arrays)
    stream_st.numpy.save_file(arrays, "dir/with://dropped")
    await stream_st.tools.cp("dir/with://saved", "dir/with://copied")
    async with open_sharded_writer("dir/with://ckpt", max_shard_size=1) as writer:
        for name, array in arrays.items():
            await writer.write(name, array)
    index = "dir/with://ckpt/model.safetensors.index.json"
    await stream_st.tools.mirror(index, "dir/with://mirrored")
    assert sorted(os.listdir("dir/with:/mirrored")) == sorted(os.listdir("dir/with:/ckpt"))
    for name in ("saved", "dropped", "copied"):
        assert (tmp_path / "dir" / "with:" / name).read_bytes() == reference_numpy.save(arrays)
        assert stream_st.numpy.load_file(f"dir/with://{name}")["b"].tolist() == [1, 1]
    for source in ("dir/with://saved", index):
        got = {name: array async for name, array in stream_st.open_stream(source)}
        assert got.keys() == arrays.keys() and got["a"].tolist() == [0, 1, 2]


async def test_an_index_in_a_folder_holding_a_hash_or_question_mark_is_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local index or manifest path was split as a URL to judge its name, so in ``run#1/``
    (or ``run?x/``) the name was cut at ``#``: the sharded writer's index was read as a
    safetensors file, and a dataset's manifest as a weight_map index. A path is a path whole."""
    monkeypatch.chdir(tmp_path)
    arrays: Arrays = {"a": np.arange(3, dtype=np.float32), "b": np.ones(2, np.int8)}
    for folder in ("run#1", "run?x"):
        async with open_sharded_writer(folder, max_shard_size=1) as writer:
            for name, array in arrays.items():
                await writer.write(name, array)
        index = f"{folder}/model.safetensors.index.json"
        assert is_index(index)
        same({name: array async for name, array in stream_st.open_stream(index)}, arrays)
        done = await anyio.run_process([COMMAND, "inspect", folder], check=False)
        assert done.returncode == 0, done.stderr
        async with open_dataset_writer(f"data{folder}") as dataset:
            await dataset.write_batch({"x": np.zeros((3, 2), np.float32)}, 3)
        manifest = f"data{folder}/dataset_manifest.json"
        assert is_index(manifest)
        got = {name: array async for name, array in stream_st.open_stream(manifest)}
        assert list(got) == ["x"] and got["x"].shape == (3, 2)


async def test_a_symlink_at_the_destination_is_replaced_not_written_through(
    tmp_path: Path,
) -> None:
    """As the reference's ``save_file`` (and ``os.replace``): the link is replaced by the new
    file, whatever it leads to (a file, nothing, a directory); the file it led to is left as it
    was (a Hugging Face cache's blob, shared by other snapshots, stays whole). The new file
    takes the permission bits of the file the link led to."""
    data = tmp_path / "data"
    data.mkdir()
    target = data / "real.safetensors"
    target.write_bytes(b"old")
    target.chmod(0o640)
    links = {"link": target, "dangling": data / "new.safetensors", "folder": data}
    for name, to in links.items():
        (tmp_path / name).symlink_to(to)
    for name in links:
        path = tmp_path / name
        await stream_st.save(path, TENSORS)
        assert not path.is_symlink()
        same(await stream_st.load(path), TENSORS)
    assert stat.S_IMODE((tmp_path / "link").stat().st_mode) == 0o640
    assert target.read_bytes() == b"old" and os.listdir(data) == ["real.safetensors"]


async def test_a_link_through_a_descriptor_of_the_process_is_not_replaced(tmp_path: Path) -> None:
    """``/dev/stdout`` redirected to a file is a link to ``/proc/self/fd/1``: not the caller's
    to replace (as root, a save would put a file in ``/dev``). Such a link stays; the file the
    descriptor holds is written as if named."""
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    with real.open("rb") as held:
        (tmp_path / "stdout").symlink_to(f"/proc/self/fd/{held.fileno()}")
        await stream_st.save(tmp_path / "stdout", TENSORS)
    assert (tmp_path / "stdout").is_symlink()
    same(await stream_st.load(real), TENSORS)


async def test_dev_fd_is_a_descriptor_of_the_process_too(tmp_path: Path) -> None:
    """``/dev/fd/N`` reaches ``/proc`` through its folder (``/dev/fd`` is a link to
    ``/proc/self/fd``): the file descriptor N holds is written as if named, as through
    ``/proc/self/fd/N``, not a file made in ``/proc``."""
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    with real.open("rb") as held:
        await stream_st.save(f"/dev/fd/{held.fileno()}", TENSORS)
    assert os.listdir(tmp_path) == ["real.safetensors"]
    same(await stream_st.load(real), TENSORS)


@pytest.mark.parametrize("through", ["/dev/fd", "/proc/self/fd"])
async def test_a_descriptor_of_a_removed_file_is_refused(tmp_path: Path, through: str) -> None:
    """A descriptor whose file was removed leads to no file to replace (the kernel names it
    ``<old path> (deleted)``): refused, and no file of that name made."""
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    with real.open("rb") as held:
        real.unlink()
        with pytest.raises(stream_st.SourceNotFoundError, match="removed"):
            await stream_st.save(f"{through}/{held.fileno()}", TENSORS)
    assert os.listdir(tmp_path) == []


async def test_a_symlink_to_a_device_is_written_through(tmp_path: Path) -> None:
    """A link that leads to what is not a regular file (a device, a FIFO: ``/dev/stdout``) is
    written through, as the file it leads to would be; the link stays."""
    null = device_node(tmp_path, "null", NULL)
    (tmp_path / "out").symlink_to(null)
    await stream_st.save(tmp_path / "out", TENSORS)
    assert (tmp_path / "out").is_symlink() and stat.S_ISCHR(null.stat().st_mode)
    assert sorted(os.listdir(tmp_path)) == ["null", "out"]


async def test_replacing_a_file_keeps_its_permission_bits(tmp_path: Path) -> None:
    path = tmp_path / "private.safetensors"
    path.write_bytes(b"old")
    path.chmod(0o640)
    await stream_st.save(path, TENSORS)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    same(await stream_st.load(path), TENSORS)


async def test_replacing_a_set_user_id_file_does_not_keep_that_bit(tmp_path: Path) -> None:
    """New content under a set-user-ID (or set-group-ID) program's name runs as its owner no
    more: a write into the file clears those bits, and so does replacing it, where the new file
    took them with the rest."""
    path = tmp_path / "tool.safetensors"
    path.write_bytes(b"old")
    path.chmod(0o6755)
    assert stat.S_IMODE(path.stat().st_mode) & stat.S_ISUID
    await stream_st.save(path, TENSORS)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755


async def cancel_at_every_turn(
    job: Callable[[int], Awaitable[None]],
    check: Callable[[int, bool], None],
    pause: float = 0.0,
) -> None:
    """Run ``job(turns)`` cancelled after 0, 1, 2... event loop turns (and, with ``pause``,
    ``turns * pause`` seconds more: for a job whose work runs in a thread, which loop turns do
    not measure), until one completes before its cancellation; ``check(turns, returned)`` after
    each run. Some runs must have been stopped by their cancellation and some not."""
    outcomes: set[bool] = set()
    for turns in range(10_000):
        returned = False
        with anyio.CancelScope() as scope:

            async def cancel_later(turns: int = turns, scope: anyio.CancelScope = scope) -> None:
                for _ in range(turns):
                    await anyio.lowlevel.checkpoint()
                if pause:
                    await anyio.sleep(turns * pause)
                scope.cancel()

            async with anyio.create_task_group() as group:
                group.start_soon(cancel_later)
                await job(turns)
                returned = True
                group.cancel_scope.cancel()
        outcomes.add(returned)
        check(turns, returned)
        if returned and not scope.cancel_called:
            break
    assert outcomes == {False, True}


async def test_a_cancelled_fsync_commit_is_all_or_nothing(tmp_path: Path) -> None:
    """Cancelled anywhere, a save with ``fsync`` either returns with the file in place, or
    raises with nothing at the destination."""
    arrays = {"x": np.arange(1 << 18, dtype=np.float32)}
    expected = reference_numpy.save(arrays)

    async def save(turns: int) -> None:  # written in a thread: cancelled after turns and time
        await stream_st.save(tmp_path / f"{turns}.safetensors", arrays, fsync=True)

    def check(turns: int, returned: bool) -> None:
        path = tmp_path / f"{turns}.safetensors"
        if returned:
            assert path.read_bytes() == expected
        else:
            assert not path.exists(), f"cancelled after {turns} turns, yet the file is in place"
        assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []

    await cancel_at_every_turn(save, check, pause=0.0002)


async def test_a_cancelled_checkpoint_is_all_or_nothing(tmp_path: Path) -> None:
    """Cancelled anywhere, a sharded checkpoint is complete with its index, or not there."""
    arrays = {f"t{i}": np.full(100_000, i, np.float32) for i in range(4)}

    async def write(turns: int) -> None:
        async with open_sharded_writer(tmp_path / str(turns), max_shard_size=800_000) as writer:
            for name, array in arrays.items():
                await writer.write(name, array)

    def check(turns: int, returned: bool) -> None:
        directory = tmp_path / str(turns)
        left = sorted(os.listdir(directory)) if directory.exists() else []
        if returned:
            assert len(left) == 3 and left[-1] == "model.safetensors.index.json"
        else:
            assert left == [], f"cancelled after {turns} turns, yet {left} are left"

    await cancel_at_every_turn(write, check)


# ---------------------------------------------------------------- full disks


@pytest.fixture(params=["tmpfs", "file-size-limit"])
def cramped(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """``(directory, size)``: a place where ``size`` bytes of tensor data fit in one file but
    not twice over (a 1 MiB tmpfs: ENOSPC), or not with a header before them (a file size
    limit: EFBIG)."""
    directory = tmp_path / "small"
    directory.mkdir()
    if request.param == "tmpfs":
        command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)]
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        mounted = subprocess.run(command, capture_output=True, text=True)
        if mounted.returncode:
            pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.strip()}")
        try:
            yield directory, 600_000
        finally:
            subprocess.run(["umount", "-l", str(directory)], check=True)
    else:
        limit = 1 << 20
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ
        try:
            yield directory, limit - 16
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


WRITERS: dict[str, Callable[[Path], Any]] = {
    "checkpoint": lambda d: open_sharded_writer(d, max_shard_size=1 << 30),
    "dataset": lambda d: open_dataset_writer(d, target_shard_size=1 << 30),
}


async def add(writer: Any, name: str, array: np.ndarray[Any, Any]) -> None:
    if hasattr(writer, "write_batch"):
        await writer.write_batch({name: array}, 1)
    else:
        await writer.write(name, array)


@pytest.mark.parametrize("kind", sorted(WRITERS))
@pytest.mark.parametrize("when", ["writing", "rewriting"])
async def test_shard_writers_on_a_full_disk(
    cramped: tuple[Path, int], kind: str, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing a tensor, or writing its shard again behind a header that outgrew the room left
    for it (which takes the data's room twice), runs out of room: a TransportError naming the
    place, and nothing left behind."""
    directory, size = cramped
    if when == "writing":
        groups = {"t": np.ones(2 * size, np.uint8)}
    else:  # 100 tensors: a header larger than the room of the first one's (ROOM_MAX 0)
        monkeypatch.setattr(stream_st.sharded.writer, "ROOM_MAX", 0)
        groups = {f"t{i:02d}": np.ones(size // 100, np.uint8) for i in range(100)}
    before = open_fds()
    with pytest.raises(TransportError) as info:
        async with WRITERS[kind](directory / "out") as writer:
            for name, array in groups.items():
                await add(writer, name, array)
    assert str(directory / "out") in str(info.value)
    assert re.search(r"(No space left on device|File too large), url=", str(info.value))
    assert not (directory / "out").exists()  # the folder the writer made goes too
    assert open_fds() == before


async def test_a_failed_final_rename_leaves_no_shard(tmp_path: Path) -> None:
    (tmp_path / "model-00002-of-00002.safetensors").mkdir()  # in the way of the last shard
    with pytest.raises(TransportError, match="model-00002-of-00002"):
        async with open_sharded_writer(tmp_path, max_shard_size=100) as writer:
            await writer.write("a", np.zeros(100, np.uint8))
            await writer.write("b", np.zeros(100, np.uint8))
    assert os.listdir(tmp_path) == ["model-00002-of-00002.safetensors"]


# ---------------------------------------------------------------- memory of copied tensors


async def test_large_copied_tensors_lie_in_a_mapping_unmapped_with_them(tmp_path: Path) -> None:
    """A fresh tensor of 4 MiB and more lies in a mapping of its own (advised for huge pages
    within a bound, see tests/memory/test_recycle.py), unmapped when the array goes; smaller
    ones come from ``np.empty``."""
    tensors: Arrays = {
        "big": np.arange(3 << 20, dtype=np.float32),
        "small": np.arange(7, dtype=np.int8),
    }
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors, str(path))
    got = await stream_st.load(path)
    same(got, tensors)
    assert got["big"].flags.writeable and got["small"].flags.writeable
    address = got["big"].ctypes.data + got["big"].nbytes // 2  # np.empty advises from a page on
    assert mapping_of(address) is not None
    del got
    assert mapping_of(address) is None

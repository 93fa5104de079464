"""The local file sink's temporary file: any valid destination name can be written, and a write
that dies leaves nothing behind.

Where the file system allows it (Linux ``O_TMPFILE``) the temporary has no name until the commit,
so even a process killed by SIGKILL leaves nothing; elsewhere it is a hidden file whose name
fits the longest name the directory takes (``stream_st.transports.file.atomic.USE_TMPFILE =
False`` takes that path here).
"""

from __future__ import annotations

import contextlib
import dis
import errno
import functools
import gc
import itertools
import os
import signal
import stat
import subprocess
import sys
import textwrap
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import TensorSpec, WriterError
from stream_st.compat import _save
from stream_st.transports.file import atomic

from .._util import nameless_works

ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    "a": np.arange(1000, dtype=np.float32),
    "b": np.full(10, 3, np.uint8),
}
EXPECTED = reference_numpy.save(ARRAYS)


@pytest.fixture(params=["nameless", "named"])
def temporaries(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each way the sink makes its temporary file: nameless (``O_TMPFILE``) and hidden."""
    if request.param == "nameless" and not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(atomic, "USE_TMPFILE", request.param == "nameless")
        yield request.param


@pytest.fixture
def python_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop-ins' ``save_file`` writing every file the Python way, whose system calls these
    tests intercept: the compiled module (``stream_st/core/_small.c``), which makes the same
    calls in C out of their reach, takes no file with data."""
    monkeypatch.setattr(_save, "SMALL", 0)


def long_name(size: int, letter: str = "m") -> str:
    """A file name of ``size`` bytes (UTF-8) ending in ``.safetensors``."""
    stem = letter * ((size - len(".safetensors")) // len(letter.encode()))
    name = stem + ".safetensors"
    assert len(name.encode()) == size, (len(name.encode()), size)
    return name


@pytest.mark.parametrize("size", [237, 238, 250, 255])
async def test_a_long_destination_name_is_written(
    tmp_path: Path, temporaries: str, size: int
) -> None:
    path = tmp_path / long_name(size)
    await stream_st.save(path, ARRAYS)
    assert path.read_bytes() == EXPECTED
    await stream_st.save(path, {"a": ARRAYS["a"]})  # replaced: the rename path
    assert path.read_bytes() == reference_numpy.save({"a": ARRAYS["a"]})
    assert os.listdir(tmp_path) == [path.name]


async def test_a_long_multibyte_name_is_written(tmp_path: Path, temporaries: str) -> None:
    path = tmp_path / long_name(254, "é")
    await stream_st.save(path, ARRAYS, fsync=True)
    assert path.read_bytes() == EXPECTED
    assert os.listdir(tmp_path) == [path.name]


async def test_a_failed_write_leaves_the_old_file(tmp_path: Path, temporaries: str) -> None:
    path = tmp_path / long_name(255)
    path.write_bytes(b"old")
    path.chmod(0o640)
    with pytest.raises(WriterError):
        async with stream_st.open_writer(path, [TensorSpec("a", "F32", (1000,))]) as writer:
            await writer.write("a", ARRAYS["b"])  # the wrong dtype: aborted
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == [path.name]
    await stream_st.save(path, ARRAYS)
    assert path.read_bytes() == EXPECTED
    assert path.stat().st_mode & 0o777 == 0o640  # a file replaced keeps its permission bits


def temporary_size(directory: Path) -> int | None:
    """The size of the file a writer in this process has open in ``directory`` and not yet
    committed (``/proc`` shows a nameless one as ``#inode (deleted)``), or None."""
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{directory}/") and target.endswith((".tmp", " (deleted)")):
                return os.fstat(int(fd)).st_size
    return None


async def test_a_writer_dropped_unclosed_leaves_nothing_open_or_behind(
    tmp_path: Path, temporaries: str
) -> None:
    """A writer entered and never left (an exit stack never closed), then dropped: its
    temporary file is closed and removed as it is collected, with the ``ResourceWarning`` an
    unclosed Python file gives, the old file left as it was (the descriptor and the disk space
    were kept for as long as the process ran). A writer left, committed or aborted, and a
    save give no warning."""
    target = tmp_path / "m.safetensors"
    target.write_bytes(b"OLD")
    plan = [TensorSpec("a", "F32", (1000,))]
    with pytest.warns(ResourceWarning, match=f"unclosed file '{target}'"):
        stack = contextlib.AsyncExitStack()
        writer = await stack.enter_async_context(stream_st.open_writer(target, plan))
        await writer.write("a", ARRAYS["a"])
        assert temporary_size(tmp_path) is not None
        del writer, stack
        gc.collect()
    assert temporary_size(tmp_path) is None
    assert os.listdir(tmp_path) == [target.name] and target.read_bytes() == b"OLD"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with stream_st.open_writer(target, plan) as writer:
            await writer.write("a", ARRAYS["a"])
        with pytest.raises(WriterError):
            async with stream_st.open_writer(target, plan) as writer:
                await writer.write("a", ARRAYS["b"])  # the wrong dtype: aborted
        await stream_st.save(target, ARRAYS)
        del writer
        gc.collect()
    assert not [warning for warning in caught if warning.category is ResourceWarning]
    assert os.listdir(tmp_path) == [target.name] and target.read_bytes() == EXPECTED


UNCLOSED_AT_EXIT = """
import sys, anyio, numpy as np, stream_st
from stream_st.transports.file import atomic

atomic.USE_TMPFILE = False  # a hidden temporary, which the process's end does not remove
kept = []

async def main():
    plan = [stream_st.TensorSpec("a", "F32", (1000,))]
    kept.append(await stream_st.open_writer(sys.argv[1], plan).__aenter__())
    await kept[0].write("a", np.ones(1000, np.float32))

anyio.run(main)
"""


def test_a_writer_still_unclosed_as_the_process_exits_leaves_no_hidden_temporary(
    tmp_path: Path,
) -> None:
    target = tmp_path / "m.safetensors"
    done = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", UNCLOSED_AT_EXIT, str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "ResourceWarning: unclosed file" in done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fallocate is Linux-only")
async def test_blocks_are_reserved_on_open(tmp_path: Path, temporaries: str) -> None:
    """From ``ALLOCATE_FROM`` bytes on; a smaller file's blocks are not reserved."""
    size = atomic.ALLOCATE_FROM
    for name, count, reserved in (("r.st", size, True), ("s.st", size // 2, False)):
        plan = [TensorSpec("x", "U8", (count,))]
        async with stream_st.open_writer(tmp_path / name, plan) as writer:
            hidden = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
            assert hidden == [] if temporaries == "nameless" else len(hidden) == 1
            expected = writer.header.file_size if reserved else 0
            assert temporary_size(tmp_path) == expected  # before any tensor
            await writer.write("x", np.ones(count, np.uint8))
    assert sorted(os.listdir(tmp_path)) == ["r.st", "s.st"]


KILLED_WRITER = """
import asyncio, sys
import numpy as np
import stream_st

async def main():
    plan = [stream_st.TensorSpec("a", "F32", (1 << 16,)), stream_st.TensorSpec("b", "U8", (8,))]
    async with stream_st.open_writer(sys.argv[1], plan) as writer:
        await writer.write("a", np.ones(1 << 16, np.float32))
        print("written", flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_killed_writer_leaves_nothing(tmp_path: Path) -> None:
    if not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here: a killed writer leaves its hidden temporary")
    target = tmp_path / "model.safetensors"
    script = textwrap.dedent(KILLED_WRITER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(
        [sys.executable, "-c", script, os.fspath(target)], stdout=subprocess.PIPE, env=env
    ) as child:
        assert child.stdout is not None
        assert child.stdout.readline() == b"written\n"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["link", "open"])
@pytest.mark.usefixtures("python_write")
def test_an_interrupt_as_the_temporary_gets_its_name_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A signal's exception (Ctrl-C) raised just as the system call that names the temporary
    returns: the name is removed with the rest, the old file stays."""
    import stream_st.numpy as st_np

    st_np.save_file({"a": np.ones(4, np.float32)}, tmp_path / "warm.safetensors")  # imports done
    dst = tmp_path / "x.safetensors"
    dst.write_bytes(b"OLD")
    if where == "open":
        monkeypatch.setattr(atomic, "USE_TMPFILE", False)
    real = getattr(os, where)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        done = real(*args, **kwargs)
        if str(args[1 if where == "link" else 0]).endswith(".tmp"):
            if where == "open":
                os.close(done)
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(os, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        st_np.save_file({"a": np.ones(1 << 16, np.float32)}, dst)
    monkeypatch.undo()
    assert dst.read_bytes() == b"OLD"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm.safetensors", "x.safetensors"]


@functools.cache
def checked_next(code: CodeType) -> dict[int, int]:
    """Where CPython runs a pending signal's handler in ``code``, by the instruction before:
    the offset of the instruction it runs it before, the next one after a call (that returned),
    or the target of a jump back."""
    listed = list(dis.get_instructions(code))
    found = {}
    for instruction, following in itertools.pairwise(listed):
        if instruction.opname in ("CALL", "CALL_KW", "CALL_FUNCTION_EX"):
            found[instruction.offset] = following.offset
        elif instruction.opname == "JUMP_BACKWARD":
            found[instruction.offset] = instruction.argval
    return found


class InterruptAt:
    """A trace function raising ``KeyboardInterrupt`` at the ``at``-th point where CPython runs
    a signal's handler in the writer's code (and in ``weakref``'s, which makes its finalizers):
    as a function starts, as a call returns (before the next instruction: what the call
    returned is on the interpreter's stack alone) and as a loop jumps back. ``seen``: the
    points passed, that one included."""

    TRACED = frozenset({atomic.__file__, weakref.__file__})

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen = 0
        self.next: dict[int, int | None] = {}  # each traced frame's next point, if it is next

    def __call__(self, frame: FrameType, event: str, arg: object) -> InterruptAt | None:
        if event == "call":
            if frame.f_code.co_filename not in self.TRACED:
                return None
            frame.f_trace_lines = False
            frame.f_trace_opcodes = True
            self.point()
        elif event == "opcode":
            if self.next.get(id(frame)) == frame.f_lasti:
                self.point()
            self.next[id(frame)] = checked_next(frame.f_code).get(frame.f_lasti)
        elif event == "return":
            self.next.pop(id(frame), None)
        return self

    def point(self) -> None:
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("replacing", [False, True], ids=["new", "replacing"])
@pytest.mark.parametrize("how", ["nameless", "named", "copied"])
def test_an_interrupt_at_any_point_of_a_write_leaves_nothing_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, replacing: bool
) -> None:
    """A signal handler that raises (Ctrl-C, a ``SIGALRM`` timeout) at each point in turn where
    Python runs it, of a whole write (``save_file``'s): the exception reaches the caller with
    no descriptor left open (also one the handler ran for as its open returned) and no
    temporary left, the destination as it was or written whole. Nameless temporaries, hidden
    ones, and nameless ones the file system gives no name (copied into a hidden one)."""
    if how != "named" and not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    monkeypatch.setattr(atomic, "USE_TMPFILE", how != "named")
    monkeypatch.setattr(atomic, "_UNLINKABLE", set())
    if how == "copied":
        real = os.link

        def no_proc(src: str, dst: str, **kwargs: Any) -> None:
            if src.startswith("/proc/"):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), src)
            real(src, dst, **kwargs)

        monkeypatch.setattr(os, "link", no_proc)
    atomic.save_at_once(ARRAYS, os.fspath(tmp_path / "warm.safetensors"))  # imports done
    os.unlink(tmp_path / "warm.safetensors")
    dst = tmp_path / "x.safetensors"
    failed: list[Any] = []  # a finalizer that closed a descriptor already closed, say
    monkeypatch.setattr(sys, "unraisablehook", failed.append)
    tracer = sys.gettrace()
    interrupt = InterruptAt(0)
    while interrupt.seen == interrupt.at:
        interrupt = InterruptAt(interrupt.at + 1)
        atomic._UNLINKABLE.clear()  # each write copies its file
        if replacing:
            dst.write_bytes(b"OLD")
        before = open_fds()
        # a writer the handler stopped as it was made is closed as the exception unwinds,
        # dropped, with a ResourceWarning
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            try:
                sys.settrace(interrupt)
                atomic.save_at_once(ARRAYS, os.fspath(dst), fsync=True)
            except KeyboardInterrupt:
                assert open_fds() == before, interrupt.at  # the exception still alive
            else:
                assert interrupt.seen < interrupt.at, "the interrupt was swallowed"
            finally:
                sys.settrace(tracer)
        left = os.listdir(tmp_path)
        assert left == [dst.name] or (left == [] and not replacing), (interrupt.at, left)
        assert not left or dst.read_bytes() in (b"OLD", EXPECTED), interrupt.at
        assert sys.exc_info()[1] is None  # raised where Python could: no handler left open
    assert interrupt.at > 50  # the points were reached
    assert dst.read_bytes() == EXPECTED
    gc.collect()
    assert not failed, [(unraisable.object, unraisable.exc_value) for unraisable in failed]


@pytest.mark.usefixtures("python_write")
def test_a_nameless_file_the_system_gives_no_name_is_copied_into_a_hidden_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``/proc`` (the link of a nameless file fails with ENOENT): the commit copies the file
    into a hidden one renamed over the old file (its mode kept), nothing left behind; the next
    file there is a hidden one from the start, with no link tried."""
    import stream_st.numpy as st_np

    if not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    monkeypatch.setattr(atomic, "_UNLINKABLE", set())
    real = os.link
    tried: list[str] = []

    def no_proc(src: str, dst: str, **kwargs: Any) -> None:
        if src.startswith("/proc/"):
            tried.append(dst)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), src)
        real(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", no_proc)
    old = tmp_path / "old.safetensors"
    old.write_bytes(b"OLD")
    old.chmod(0o600)
    st_np.save_file(ARRAYS, old)
    st_np.save_file(ARRAYS, tmp_path / "new.safetensors")
    assert old.read_bytes() == (tmp_path / "new.safetensors").read_bytes() == EXPECTED
    assert stat.S_IMODE(old.stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["new.safetensors", "old.safetensors"]
    assert len(tried) == 1
    assert {os.stat(tmp_path).st_dev} == atomic._UNLINKABLE


async def test_a_directory_removed_before_the_commit_does_not_mark_the_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link fails with ENOENT because the directory went away, not for want of ``/proc``:
    the write fails, and later files on that file system still have no name until their
    commit (a killed writer would leave a hidden temporary of each, marked)."""
    if not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    monkeypatch.setattr(atomic, "_UNLINKABLE", set())
    gone, other = tmp_path / "gone", tmp_path / "other"
    gone.mkdir()
    other.mkdir()
    plan = [TensorSpec("a", "U8", (10,))]
    with pytest.raises(stream_st.SourceNotFoundError, match="no such directory"):
        async with stream_st.open_writer(gone / "x.st", plan) as writer:
            await writer.write("a", np.zeros(10, np.uint8))
            gone.rmdir()
    assert not atomic._UNLINKABLE
    assert nameless_works(other)
    async with stream_st.open_writer(other / "y.st", plan) as writer:
        assert writer._sink.temp_path is None  # type: ignore[union-attr]
        await writer.write("a", np.ones(10, np.uint8))
    assert os.listdir(tmp_path) == ["other"] and os.listdir(other) == ["y.st"]


FORKED_WRITER = """
import os, sys
from stream_st.transports.file import atomic
atomic.USE_TMPFILE = False  # a named temporary, as where O_TMPFILE is not
written = atomic.AtomicFile(sys.argv[1])
if os.fork() == 0:
    sys.exit(0)  # a forked helper that ends normally: its exit runs the finalizers it copied
os.wait()
written.write_whole([memoryview(b"done")], 4)
"""


def test_a_forked_copy_leaves_the_writers_temporary_alone(tmp_path: Path) -> None:
    """A process forked while a write is on (a helper that ends normally) inherits the
    finalizer that removes a dropped writer's named temporary: it removed the parent's, whose
    commit then failed. Only the parent's own writer is cleaned up by it."""
    out = tmp_path / "out.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", FORKED_WRITER, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == b"done" and os.listdir(tmp_path) == ["out.safetensors"]


def open_fds() -> set[str]:
    """The descriptors this process has open."""
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("remade", [False, True], ids=["gone", "remade"])
async def test_a_write_whose_directory_moved_away_leaves_nothing(
    tmp_path: Path, temporaries: str, remade: bool
) -> None:
    """The directory renamed while its file is written (a checkpoint folder rotated): the commit
    goes to the path named, as it is then. Where no directory is there, the write fails and its
    temporary is removed from the directory where it went; where another one was made there,
    the file lands in it. Either way no descriptor is left open."""
    before = open_fds()
    folder, moved = tmp_path / "d", tmp_path / "e"
    folder.mkdir()
    plan = [TensorSpec("a", "F32", (1000,)), TensorSpec("b", "U8", (10,))]
    with contextlib.ExitStack() as expect:
        if not remade:
            expect.enter_context(pytest.raises(stream_st.SourceNotFoundError, match="no such dir"))
        async with stream_st.open_writer(folder / "m.safetensors", plan) as writer:
            await writer.write("a", ARRAYS["a"])
            folder.rename(moved)
            if remade:
                folder.mkdir()
            await writer.write("b", ARRAYS["b"])
    assert os.listdir(moved) == []
    if remade:
        assert (folder / "m.safetensors").read_bytes() == EXPECTED
    del writer
    assert open_fds() == before


async def test_no_descriptor_is_left_open(tmp_path: Path, temporaries: str) -> None:
    """A write committed, one replacing a file, one aborted, one dropped unclosed: each closes
    what it opened, the file and any handle on its directory."""
    before = open_fds()
    target = tmp_path / "m.safetensors"
    plan = [TensorSpec("a", "F32", (1000,))]
    await stream_st.save(target, ARRAYS)
    await stream_st.save(target, ARRAYS)
    with pytest.raises(WriterError):
        async with stream_st.open_writer(target, plan) as writer:
            await writer.write("a", ARRAYS["b"])  # the wrong dtype: aborted
    with pytest.warns(ResourceWarning):
        stack = contextlib.AsyncExitStack()
        writer = await stack.enter_async_context(stream_st.open_writer(target, plan))
        del writer, stack
        gc.collect()
    assert open_fds() == before
    assert os.listdir(tmp_path) == [target.name] and target.read_bytes() == EXPECTED


def test_a_name_the_directory_cannot_take_is_named_in_the_error(tmp_path: Path) -> None:
    """A destination name past the longest the directory takes: the error names the path."""
    import stream_st.numpy as st_np

    target = tmp_path / long_name(256)
    with pytest.raises(stream_st.TransportError, match=f"cannot look at {target}: File name"):
        st_np.save_file(ARRAYS, target)

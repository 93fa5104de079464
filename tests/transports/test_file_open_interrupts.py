"""The local file reader's open, interrupted: a signal handler that raises (Ctrl-C's, a
``SIGALRM`` timeout's, ``_thread.interrupt_main``) runs as a call returns, among other points,
also just as ``os.open`` returns, before the code that guards the descriptor. Wherever it runs,
the descriptor opened is closed before the exception reaches the caller, and never closed twice
(a source's finalizer closing the number again once the source is dropped, another file's by
then)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pathlib
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, FrameType, ModuleType
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.core.header import Header
from stream_st.sources import FileSource
from stream_st.transports.file.source import open_file_source

from .test_file_temporaries import InterruptAt, open_fds

RAW = reference_numpy.save({"a": np.arange(10, dtype=np.float32)})


def within(frame: FrameType | None, code: CodeType) -> bool:
    """Whether ``frame`` runs ``code``, or is called (however deep) from a frame that does."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def module_files(module: ModuleType) -> set[str]:
    """The source files of ``module``: its own, or each of its package's (``pathlib`` is a
    package from Python 3.13 on, its classes in ``pathlib/_local.py``)."""
    assert module.__spec__ is not None and module.__file__ is not None
    folders = module.__spec__.submodule_search_locations
    if not folders:
        return {module.__file__}
    return {os.fspath(p) for folder in folders for p in Path(folder).rglob("*.py")}


REACHED = (stream_st, weakref, pathlib)
"""The modules whose code an open runs: the library's, ``weakref``'s (its finalizers),
``pathlib``'s (a path's name)."""


class InterruptOpening(InterruptAt):
    """:class:`InterruptAt` at each point, in turn, of a call of ``opening`` (a code object) and
    of what it calls, in the modules of :data:`REACHED`; nowhere else. ``reached``: the files
    of those modules whose code ran."""

    TRACED = frozenset(path for module in REACHED for path in module_files(module))

    def __init__(self, at: int, opening: CodeType) -> None:
        super().__init__(at)
        self.opening = opening
        self.reached: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> InterruptAt | None:
        if event == "call":
            if not within(frame, self.opening):
                return None
            if frame.f_code.co_filename in self.TRACED:
                self.reached.add(frame.f_code.co_filename)
        return super().__call__(frame, event, arg)


@contextlib.contextmanager
def interrupted(at: int, opening: CodeType) -> Iterator[InterruptOpening]:
    """:class:`InterruptOpening` tracing the block (which catches the ``KeyboardInterrupt``,
    to look while it is still alive; its ``seen`` tells whether it came), ``ResourceWarning``
    ignored (a source the interrupt stopped once it held its file, dropped, closes it)."""
    tracer = sys.gettrace()
    interrupt = InterruptOpening(at, opening)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            sys.settrace(interrupt)
            yield interrupt
        finally:
            sys.settrace(tracer)


def interrupt_each_point(
    attempt: Callable[[int], InterruptOpening], reached: tuple[ModuleType, ...] = REACHED
) -> int:
    """Each point in turn of those an uninterrupted ``attempt(0)`` passes (some in each module
    of ``reached``): ``attempt(at)``, which makes its own checks, is interrupted there; the
    number of points.
    From Python 3.12 on, a function's instructions are traced from its next call once its
    frame asks for them (on 3.13 again once an interrupt has unwound it), so an uninterrupted
    attempt arms them before the points are counted and before each interrupted attempt, which
    then numbers the points as the count did."""
    attempt(0)
    counted = attempt(0)
    for module in reached:
        assert counted.reached & module_files(module), module.__name__
    for at in range(1, counted.seen + 1):
        attempt(0)
        assert attempt(at).seen == at, (at, counted.seen)  # interrupted there
    return counted.seen


async def header_of(path: Path) -> Header:
    """The header of the file at ``path``, read by :func:`stream_st.open_stream`."""
    async with stream_st.open_stream(path) as stream:
        return stream.header


@contextlib.contextmanager
def fed(fifo: Path | None) -> Iterator[None]:
    """``fifo`` (if any) holding a message to read, a writer end held open by the block."""
    if fifo is None:
        yield
        return
    end = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(end, RAW)
        yield
    finally:
        os.close(end)


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_an_interrupt_as_a_local_path_opens_leaves_nothing_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """``open_stream(path)`` interrupted at each point in turn where Python runs a signal's
    handler as the path is opened (:func:`open_file_source`: the open, the file's type, the
    source made, a :class:`FileSource` for a file, a ``PipeSource`` for a FIFO): the exception
    reaches the caller with no descriptor left open (also one the handler ran for as the open
    returned, or as the source took it over), none left to a finalizer that would close its
    number again; uninterrupted, the header is read."""
    path = tmp_path / "x.safetensors"
    fifo = None
    if kind == "fifo":
        fifo = path
        os.mkfifo(fifo)
    else:
        path.write_bytes(RAW)
    with fed(fifo):
        asyncio.run(header_of(path))  # imports done
    failed: list[Any] = []  # a finalizer that closed a descriptor already closed, say
    monkeypatch.setattr(sys, "unraisablehook", failed.append)

    def attempt(at: int) -> InterruptOpening:
        """The header read, interrupted at point ``at`` (none: 0), nothing left open."""
        with fed(fifo):
            before = open_fds()
            with interrupted(at, open_file_source.__code__) as interrupt:
                try:
                    header = asyncio.run(header_of(path))
                except KeyboardInterrupt:
                    assert open_fds() == before, at  # the exception still alive
                else:
                    assert interrupt.seen != at, "the interrupt was swallowed"
                    assert [tensor.name for tensor in header.tensors] == ["a"]
            gc.collect()
            assert open_fds() == before, at
        return interrupt

    interrupt_each_point(attempt)
    assert not failed, [(unraisable.object, unraisable.exc_value) for unraisable in failed]


@pytest.mark.parametrize("given", [False, True], ids=["opened", "given"])
def test_an_interrupt_as_a_file_source_is_made_leaves_nothing_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: bool
) -> None:
    """``FileSource(path)``, which opens the file, interrupted at each point in turn as it is
    made: the exception reaches the caller with nothing open. ``FileSource(path, fd=fd)``, which
    takes the caller's descriptor over: the caller's still, and its alone (a finalizer left
    for it would close it under the caller once the source is dropped)."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(RAW)
    failed: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", failed.append)

    def attempt(at: int) -> InterruptOpening:
        """The source made, interrupted at point ``at`` (none: 0), then closed; nothing left
        open but a given descriptor the interrupt left the caller."""
        start = open_fds()
        fd = os.open(path, os.O_RDONLY) if given else None
        before = open_fds()
        with interrupted(at, FileSource.__init__.__code__) as interrupt:
            try:
                source = FileSource(path, fd=fd)
            except KeyboardInterrupt:
                assert open_fds() == before, at  # the exception still alive
            else:
                assert interrupt.seen != at, "the interrupt was swallowed"
                assert source.size == len(RAW)
                asyncio.run(source.aclose())  # the caller's descriptor too, taken over
                del source
                before = start
        gc.collect()  # a finalizer left for the caller's descriptor would close it now
        assert open_fds() == before, at
        if fd is not None and interrupt.seen == at:
            os.close(fd)  # still the caller's
        return interrupt

    interrupt_each_point(attempt)
    gc.collect()
    assert not failed, [(unraisable.object, unraisable.exc_value) for unraisable in failed]

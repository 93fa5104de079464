"""A pipe's end taken over, interrupted: a signal handler that raises (Ctrl-C's, a ``SIGALRM``
timeout's) as :meth:`PipeSink.open` opens a FIFO, or as a :class:`PipeSink` or
:class:`PipeSource` is made over a descriptor. Wherever it runs, the descriptor is closed
before the exception reaches the caller (or, where the caller passed ``opened``, listed there
for the caller to close), and never closed twice."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import stream_st
from stream_st.transports.file.sink import PipeSink
from stream_st.transports.file.source import PipeSource

from .test_file_open_interrupts import InterruptOpening, interrupt_each_point, interrupted
from .test_file_temporaries import open_fds


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_an_interrupt_as_a_pipe_sink_opens_leaves_nothing_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PipeSink.open(fifo)``, a reader there, interrupted at each point in turn: the exception
    reaches the caller with the FIFO's write end closed (also one the handler ran for as the
    open returned, or as the sink took it over), none left to a finalizer that would close its
    number again; uninterrupted, the sink holds it until closed."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    failed: list[Any] = []  # a finalizer that closed a descriptor already closed, say
    monkeypatch.setattr(sys, "unraisablehook", failed.append)

    def attempt(at: int) -> InterruptOpening:
        """The sink opened, interrupted at point ``at`` (none: 0), closed; nothing left open."""
        before = open_fds()
        with interrupted(at, vars(PipeSink)["open"].__func__.__code__) as interrupt:
            try:
                sink = asyncio.run(PipeSink.open(fifo))
            except KeyboardInterrupt:
                assert open_fds() == before, at  # the exception still alive
            else:
                assert interrupt.seen != at, "the interrupt was swallowed"
                assert len(open_fds() - before) == 1, "not held"
                asyncio.run(sink.aclose())
                del sink
        gc.collect()
        assert open_fds() == before, at
        return interrupt

    try:
        assert interrupt_each_point(attempt, (stream_st,)) > 25  # the points were reached
    finally:
        os.close(reader)
    assert not failed, [(unraisable.object, unraisable.exc_value) for unraisable in failed]


@pytest.mark.parametrize("listed", [False, True], ids=["handed", "listed"])
@pytest.mark.parametrize("end", [PipeSink, PipeSource])
def test_an_interrupt_as_a_pipe_end_is_made_leaves_nothing_open(
    monkeypatch: pytest.MonkeyPatch, end: type[PipeSink] | type[PipeSource], listed: bool
) -> None:
    """``PipeSink(fd, name)`` (the command's standard output) and ``PipeSource(fd, name)``,
    interrupted at each point in turn as they take ``fd`` over: it is closed before the
    exception reaches the caller, but where the handler ran as the constructor was called,
    before any of its code (the caller's still then, as for any call interrupted as it
    starts). Given ``opened``, a list holding ``fd``, the end leaves ``fd`` there for the
    caller to close wherever the interrupt came, and takes it out once it holds it. Never a
    finalizer left that would close the number again once the end is dropped."""
    failed: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", failed.append)

    def attempt(at: int) -> InterruptOpening:
        """The end made, interrupted at point ``at`` (none: 0), closed; nothing left open."""
        before = open_fds()
        read, write = os.pipe()
        fd, other = (write, read) if end is PipeSink else (read, write)
        os.close(other)  # the pipe's other end: not looked at
        os.set_blocking(fd, False)
        opened = [fd] if listed else None
        with interrupted(at, end.__init__.__code__) as interrupt:
            try:
                made = end(fd, "pipe", opened=opened)
            except KeyboardInterrupt:
                if opened is not None:
                    assert opened == [fd], at  # the caller's to close
                    os.close(fd)
                elif at == 1:  # before the constructor ran: the caller's still
                    os.close(fd)
                assert open_fds() == before, at  # the exception still alive
            else:
                assert interrupt.seen != at, "the interrupt was swallowed"
                assert opened in (None, []), "held, yet listed for the caller to close"
                asyncio.run(made.aclose())
                del made
        gc.collect()  # a finalizer left for the descriptor would close its number now
        assert open_fds() == before, at
        return interrupt

    assert interrupt_each_point(attempt, (stream_st,)) > 15  # the points were reached
    assert not failed, [(unraisable.object, unraisable.exc_value) for unraisable in failed]

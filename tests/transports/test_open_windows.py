"""Descriptors opened outside the sources and sinks, interrupted: a signal handler that raises
(Ctrl-C's, a ``SIGALRM`` timeout's) runs as a call returns, among other points, also just as
``os.open`` or ``os.dup`` returns, before the code that guards the descriptor. A header read
from the page cache (:func:`stream_st.reader.header._cached_header`), the cache's read of its
local copy ahead of the answer (``_CopyAhead.run``) and the command's standard output
(``_destination``): wherever the handler runs, what they opened is closed before the exception
reaches the caller (the read ahead's copy: once the read is dropped, as the cache's stream
does), and never closed twice (a finalizer closing the number again later, another file's by
then)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stream_st
from stream_st._api import _CopyAhead
from stream_st.cli.commands import _destination
from stream_st.reader import TensorStream
from stream_st.reader.header import _cached_header
from stream_st.transports.base import Source
from stream_st.transports.file.sink import PipeSink
from stream_st.transports.file.source import _RWF_NOWAIT

from .test_file_open_interrupts import RAW, InterruptOpening, interrupt_each_point, interrupted
from .test_file_temporaries import open_fds


@pytest.fixture
def unraisable(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """What reached :func:`sys.unraisablehook` (a finalizer that closed a descriptor already
    closed, say), checked empty once the test ends."""
    failed: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", failed.append)
    yield failed
    gc.collect()
    assert not failed, [(each.object, each.exc_value) for each in failed]


@pytest.mark.skipif(not _RWF_NOWAIT, reason="no read that never waits: no cached header read")
def test_an_interrupt_as_a_cached_header_is_read_leaves_nothing_open(
    tmp_path: Path, unraisable: list[Any]
) -> None:
    """``read_header(path)`` of a file in the page cache, which reads it at once
    (:func:`_cached_header`), interrupted at each point in turn of that read: the exception
    reaches the caller with the file closed (also where the handler ran as the open
    returned); uninterrupted, the header is read."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(RAW)
    assert _cached_header(os.fspath(path), len(RAW), "refuse") is not None  # read at once

    def attempt(at: int) -> InterruptOpening:
        """The header read, interrupted at point ``at`` (none: 0); nothing left open."""
        before = open_fds()
        with interrupted(at, _cached_header.__code__) as interrupt:
            try:
                header = asyncio.run(stream_st.read_header(path))
            except KeyboardInterrupt:
                assert open_fds() == before, at  # the exception still alive
            else:
                assert interrupt.seen != at, "the interrupt was swallowed"
                assert [tensor.name for tensor in header.tensors] == ["a"]
        gc.collect()
        assert open_fds() == before, at
        return interrupt

    assert interrupt_each_point(attempt, (stream_st,)) > 10  # the points were reached


def test_an_interrupt_as_standard_output_is_taken_leaves_nothing_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unraisable: list[Any]
) -> None:
    """The command's ``-`` destination, standard output redirected to a file (its descriptor
    duplicated into a :class:`PipeSink`), interrupted at each point in turn as it is taken:
    the exception reaches the caller with the duplicate closed (also where the handler ran as
    ``os.dup`` returned, or as the sink's constructor was entered); uninterrupted, the sink
    holds it until closed."""
    with open(tmp_path / "out", "w") as redirected:
        monkeypatch.setattr(sys, "stdout", redirected)

        def attempt(at: int) -> InterruptOpening:
            """The destination taken, interrupted at point ``at`` (none: 0), closed; nothing
            left open."""
            before = open_fds()
            with interrupted(at, _destination.__code__) as interrupt:
                try:
                    sink = asyncio.run(_destination("-"))
                except KeyboardInterrupt:
                    assert open_fds() == before, at  # the exception still alive
                else:
                    assert interrupt.seen != at, "the interrupt was swallowed"
                    assert isinstance(sink, PipeSink)
                    assert len(open_fds() - before) == 1, "not held"
                    asyncio.run(sink.aclose())
                    del sink
            gc.collect()
            assert open_fds() == before, at
            return interrupt

        assert interrupt_each_point(attempt, (stream_st,)) > 10  # the points were reached


def test_an_interrupt_as_a_cached_copy_is_read_ahead_leaves_nothing_open(
    tmp_path: Path, unraisable: list[Any]
) -> None:
    """The cache's read of its local copy while the request that checks it is in flight
    (``_CopyAhead.run``), interrupted at each point in turn as it opens the copy and makes its
    source, up to the stream over it (refused here, as an ordinary failure the read ahead ends
    quietly on: the points are the open's): once the exception reaches the caller and the read
    is dropped, the copy is closed (also where the handler ran as the open returned, or as the
    source took it over), and closed once: a file opened next, given the same number, stays
    open once the source is gone; uninterrupted, the refused read leaves nothing open once
    dropped."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(RAW)

    def refused(source: Source) -> TensorStream:
        """No stream over ``source``: the read ahead fails as the stream is made."""
        raise ValueError("refused")

    def attempt(at: int) -> InterruptOpening:
        """The copy read ahead, interrupted at point ``at`` (none: 0), dropped; nothing left
        open, nothing closed twice."""
        before = open_fds()
        ahead = _CopyAhead(refused)
        later: int | None = None
        with interrupted(at, _CopyAhead.run.__code__) as interrupt:
            try:
                asyncio.run(ahead.run(os.fspath(path)))
            except KeyboardInterrupt:
                asyncio.run(ahead.drop())
                assert open_fds() == before, at  # the exception still alive
                later = os.open(path, os.O_RDONLY)  # the lowest number: one closed before?
            else:
                assert interrupt.seen != at, "the interrupt was swallowed"
                asyncio.run(ahead.drop())
        del ahead
        gc.collect()  # a finalizer left for a number closed would close it now
        if later is not None:
            os.fstat(later)  # still open: not closed under its opener
            os.close(later)
        assert open_fds() == before, at
        return interrupt

    assert interrupt_each_point(attempt, (stream_st,)) > 10  # the points were reached

"""Ctrl-C at each place in turn under trio, for code that shares a lock between the event loop's
thread and threads of its own.

Trio raises KeyboardInterrupt on Ctrl-C wherever the event loop's thread runs Python code, not
at checkpoints only: in ``threading.Condition.__enter__`` after the acquire, for one, which left
the lock held for ever. A test runs a script in a process of its own (:func:`run_script`: the
trace and the interrupts stay there) that calls :func:`everywhere` with the operation to
interrupt and the modules to interrupt it in, then :func:`assert_threads_end`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
THREADING = threading.__file__
RESUMABLE = 0x20 | 0x80 | 0x100 | 0x200  # generators and coroutines


class CtrlC:
    """KeyboardInterrupt raised at the ``at``-th entry to, or return from, a function of the
    files ``ours`` (or of threading called by one) on the thread that sets the trace: places
    trio raises it on Ctrl-C (a function's start, right after a call). A coroutine resumed
    from an await is not one: left out."""

    def __init__(self, at: int, ours: tuple[str, ...]) -> None:
        self.at, self.ours, self.seen, self.raised = at, ours, 0, False

    def event(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_lines = False
        if event in ("call", "return"):
            self.seen += 1
            if self.seen == self.at:
                self.raised = True
                raise KeyboardInterrupt
        return self.event

    def enter(self, frame: FrameType, event: str, arg: Any) -> Any:
        code, caller = frame.f_code, frame.f_back
        if code.co_flags & RESUMABLE:
            return None
        if code.co_filename in self.ours or (
            code.co_filename == THREADING and caller and caller.f_code.co_filename in self.ours
        ):
            return self.event(frame, event, arg)
        return None


async def everywhere(
    operation: Callable[[int], Awaitable[object]], *ours: str, bare: bool = False
) -> int:
    """Run ``operation`` (given the try's number, from 1) again and again, interrupted at the
    next place in ``ours`` each time (see :class:`CtrlC`), until a run meets no such place;
    returns the places tried. What the hang is about: the interrupt may come out bare or in an
    exception group (one raised inside a task), unless ``bare``: then it comes out as itself,
    as ``except KeyboardInterrupt`` catches it."""
    at = 1
    while True:
        ctrl_c = CtrlC(at, ours)
        sys.settrace(ctrl_c.enter)
        try:
            await operation(at)
        except KeyboardInterrupt:
            pass
        except BaseExceptionGroup as group:
            sys.settrace(None)
            if bare or group.subgroup(KeyboardInterrupt) is None:
                raise AssertionError(f"interrupted at place {at}: {group!r}") from group
        finally:
            sys.settrace(None)
        if not ctrl_c.raised:
            return at - 1
        at += 1


def assert_threads_end(name: str) -> None:
    """Every thread called ``name`` ends (within 10 s each)."""
    for thread in threading.enumerate():
        if thread.name == name:
            thread.join(10)
            assert not thread.is_alive(), f"a thread {name!r} is left running"


def run_script(script: str, *args: str) -> int:
    """Run ``script`` with ``args`` in a process of its own (which may import this module);
    what it prints last, a number: the places :func:`everywhere` tried. A hang fails it."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])

"""Small shared pieces with no better home."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, NoReturn, Self, TypeVar

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from .errors import UsageError

__all__ = [
    "AsyncClosing",
    "allow_open_files",
    "call_soon_from_thread",
    "let_go",
    "package_version",
    "process_running",
    "seen_through",
    "task_group",
]

T = TypeVar("T")


class AsyncClosing:
    """``async with`` for objects with an ``aclose()``: entering gives the object, leaving closes
    it. Leaving on an exception calls :meth:`_abandon` instead, which closes too unless the
    object has something to throw away (a writer aborts its message). A plain ``with`` is a
    :class:`~stream_st.UsageError` saying so, where it was a bare ``TypeError``."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def _abandon(self, cause: BaseException) -> None:
        """Leaving the block on ``cause``: close, as on a clean exit."""
        await self.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            await self._abandon(exc)
        else:
            await self.aclose()

    def __enter__(self) -> NoReturn:
        """Refused: the object is entered with ``async with``."""
        raise UsageError(f"{type(self).__name__} is an async context manager: use `async with`")

    def __exit__(self, *exc_info: object) -> None:
        """Never called (:meth:`__enter__` raises); ``with`` wants it to call that."""


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


@asynccontextmanager
async def task_group() -> AsyncIterator[TaskGroup]:
    """anyio's task group, raising the first failure as itself rather than in an exception group.

    Callers catch our errors by type (``except TruncatedStreamError``, ``except
    SafetensorsError``); a task group would hand them an ``ExceptionGroup`` instead. As in anyio,
    a failure in the body or in any task cancels the rest. A ``KeyboardInterrupt`` or
    ``SystemExit`` alone in the group is raised as itself too: Ctrl-C under trio is raised in
    the task it finds running or waiting, the group's body included. Other groups holding
    anything but plain exceptions (cancellation) pass through unchanged.
    """
    try:
        async with anyio.create_task_group() as group:
            yield group
    except BaseExceptionGroup as grouped:
        leaves = _leaves(grouped)
        alone = len(leaves) == 1 and isinstance(leaves[0], KeyboardInterrupt | SystemExit)
        if not alone and not all(isinstance(exc, Exception) for exc in leaves):
            raise
        first = leaves[0]
        context, suppress = first.__context__, first.__suppress_context__
        try:
            raise first  # the group adds nothing to the report ...
        finally:
            first.__context__, first.__suppress_context__ = context, suppress  # ... its own stays


@functools.cache
def package_version() -> str:
    """The installed distribution's version (pyproject.toml is the one place it is written);
    ``0+unknown`` for a source tree on ``sys.path`` that was never installed. Read once: the
    command builds its parser, which shows it, at every call."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stream-st")
    except PackageNotFoundError:
        return "0+unknown"


def lock_and_condition() -> tuple[threading.Lock, threading.Condition]:
    """A lock shared by the event loop's thread with threads of one's own, and a condition over
    it that only waits and notifies. Take the lock as itself (``with lock``) on the event
    loop's thread, never through the condition: Ctrl-C under trio raises KeyboardInterrupt
    there between any two steps of Python code, ``Condition.__enter__``'s included, and one
    raised there after the acquire left the lock held for ever (the threads blocked on it, and
    whoever waited for them). A with statement on a lock written in C is never interrupted
    between the acquire and the release on the way out."""
    lock = threading.Lock()
    return lock, threading.Condition(lock)


def call_soon_from_thread(
    token: anyio.lowlevel.EventLoopToken, function: Callable[[], object]
) -> None:
    """Have the event loop of ``token`` call ``function`` soon, from another thread, without
    waiting for it; nothing if that loop has ended. Through the loop's own public call (asyncio's
    ``call_soon_threadsafe``, trio's ``TrioToken.run_sync_soon``), not anyio's backend classes."""
    native: Any = token.native_token
    # A closed asyncio loop, or trio's RunFinishedError: both RuntimeErrors.
    with contextlib.suppress(RuntimeError):
        if isinstance(native, asyncio.AbstractEventLoop):
            native.call_soon_threadsafe(function)
        else:
            native.run_sync_soon(function)


def let_go(error: BaseException) -> None:
    """Clear the variables of the frames ``error`` (and the errors it came from) went through,
    but those still running: a kept error then holds none of the memory they read into (a
    thread's views, a part's buffer)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__


def process_running(pid: object) -> bool:
    """Whether ``pid`` is a process of this host that still runs (a zombie does not; one this
    user may not signal does)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; no pid of this system
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


async def seen_through(
    call: Callable[[], Awaitable[T]], on_cancel: Callable[[anyio.CancelScope], None] | None = None
) -> T:
    """``call()``'s result, the call seen through whatever cancellation comes meanwhile: it runs
    shielded, in a task of its own, so that a cancellation of the caller (an anyio one, or
    asyncio's own ``Task.cancel``, which goes through anyio's shields) is seen. Cancelled, the
    caller tells ``on_cancel`` (given the shield, to bound it with a deadline, or a flag the
    work asks) and waits for the call to end. Without ``on_cancel`` the call is waited for
    however long it takes: for a step that must not stop midway (a commit's renames, a
    collective every rank joins), which would leave what a killed process leaves. Then: done,
    under a cancelled anyio scope (which cancels the caller's next checkpoint, again and
    again), its result is returned, so that the caller knows what was done; else the
    cancellation goes on, never swallowed (asyncio's own is delivered once, and its timeouts
    and task groups count on it). Interrupted (Ctrl-C under trio raises ``KeyboardInterrupt``
    in the caller as it waits), the caller tells ``on_cancel`` too, waits for the call to end,
    and raises the interrupt as itself (see :func:`task_group`). A failure of the call is
    raised as it is."""
    shield = anyio.CancelScope(shield=True)
    finished = anyio.Event()
    outcome: list[T] = []
    failure: BaseException | None = None

    async def run() -> None:
        nonlocal failure
        try:
            with shield:  # a deadline set on it ends the call: the scope takes that in
                outcome.append(await call())
        except BaseException as exc:
            failure = exc
        finally:
            finished.set()

    cancelled: BaseException | None = None
    try:
        async with task_group() as group:
            group.start_soon(run)
            try:
                await finished.wait()
            except BaseException:  # cancelled, or interrupted
                if on_cancel is not None:
                    on_cancel(shield)
                raise
    except anyio.get_cancelled_exc_class() as exc:
        cancelled = exc
    if cancelled is not None:  # the call has ended (done, failed or given up)
        if outcome and anyio.current_effective_deadline() == -math.inf:
            return outcome[0]  # an anyio scope is cancelled: its next checkpoint raises
        raise cancelled
    if failure is not None:
        raise failure
    return outcome[0]


def allow_open_files(count: int) -> None:
    """Raise this process's soft limit on open files, within the hard one, to leave room for
    ``count`` more (as Go programs do at start): for a writer that holds every file (or
    connection) it writes open until its commit (:func:`~stream_st.tools.mirror`, the sharded
    writers)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * count + 256  # what the process holds besides, and the source being read
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    with contextlib.suppress(ValueError, OSError):  # not allowed: one too many fails cleanly
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def canonical_decimal(text: str) -> int | None:
    """The number ``text`` spells as a canonical decimal (ASCII digits, no sign, space,
    underscore or leading zero: the one spelling ``str(n)`` gives), or None for any other text.
    Layer numbers in tensor names and the numbers in KV metadata are held to it."""
    if not (text.isascii() and text.isdecimal()) or (text[0] == "0" and text != "0"):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than Python converts: no layer count or group size
        return None

"""Run the async core from synchronous code: on a private event loop.

The synchronous facades (:mod:`stream_st.torch`, :mod:`stream_st.numpy`) call the async core on
an asyncio event loop of their own. A one-shot call (:func:`run`) from a thread that runs no
event loop (a plain script, a worker thread) runs that loop right there, in the calling thread: a
fraction of a millisecond. From inside a running event loop (a notebook cell, an asyncio or trio
program calling sync code) it goes through a :class:`Bridge`: a loop in a thread of its own, to
which the calling thread hands the coroutine and then waits for the result (a few milliseconds to
start). Either way the caller's loop is never asked to run anything, so it can neither deadlock on
it nor meet "this event loop is already running". An open file (``safe_open``) keeps a
:class:`Bridge` for its lifetime, usable in the process that opened it only (not in a copy
made by ``os.fork()``, where its loop runs in no thread). The caller's thread is blocked for the
call's duration, as by any synchronous I/O. Not public API.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import os
import signal
import sys
import threading
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any, TypeVar

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream
from anyio.from_thread import BlockingPortal

from ..errors import RAISE_THE_LIMIT, ArgumentTypeError, HeaderTooLargeError, UsageError

__all__ = ["Bridge", "check_sync_address", "run"]

T = TypeVar("T")


class Bridge:
    """A private event loop in a worker thread, alive until :meth:`close`.

    :meth:`call` runs a coroutine function there and blocks until it returns; calls from several
    threads are taken one after another by the loop, which owns every connection they use.

    The loop belongs to the process that made the bridge: a copy made by ``os.fork()`` (a
    ``DataLoader`` worker) has no thread running it, and its connections are the parent's
    sockets, so there a call is a :class:`UsageError` and :meth:`close` lets the copy go
    without touching either.
    """

    def __init__(self) -> None:
        # A thread of its own, not anyio's start_blocking_portal: that context manager, when
        # the bridge's copy in a forked process is collected, would wait on the loop for ever.
        self._pid = os.getpid()
        started: Future[BlockingPortal] = Future()
        self._thread = threading.Thread(
            target=_serve, args=(started,), name="stream_st-bridge", daemon=True
        )
        self._lock = threading.Lock()
        try:
            self._thread.start()
            self._portal: BlockingPortal | None = started.result()
        except BaseException:
            # Interrupted (Ctrl-C) while the thread starts (in Thread.start too): its loop, once
            # up, would serve for ever, with no one to close it. Given up before it is up, it
            # ends itself (see _serve), waited for where the thread runs (one interrupted in
            # Thread.start may not yet); up already, it is stopped here (one that failed is gone).
            if started.cancel():
                if self._thread.is_alive():
                    self._thread.join()
            elif started.exception() is None:
                self._portal = started.result()
                self.close()
            raise

    @property
    def here(self) -> bool:
        """Whether this is the process that made the bridge (not a forked copy of it)."""
        return os.getpid() == self._pid

    def call(self, function: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await function(*args)`` on the bridge's loop; its result or its exception. The
        caller interrupted while it waits (Ctrl-C) stops the call's task too; a call cut short
        by :meth:`close` from another thread, or made in a process forked from the one that
        made the bridge, is a :class:`UsageError`."""
        if not self.here:
            raise UsageError(
                "this file was opened in another process, of which this one is a copy made by "
                "os.fork() (a DataLoader worker is one): its event loop and connections stayed "
                "there. Open it again in this process (in a DataLoader worker: in "
                "worker_init_fn, or on first use in __getitem__); a local file opened by its "
                "path reads in a forked copy as it is"
            )
        portal = self._portal
        if portal is None:
            raise UsageError("the file is closed")
        try:
            future = portal.start_task_soon(function, *args)
        except RuntimeError as exc:
            if "event loop thread" not in str(exc):
                raise UsageError("the file is closed") from None  # closed by another thread
            raise UsageError(
                "a synchronous stream_st call was made from the loop that serves it (from inside "
                "a coroutine it runs); use the async API there"
            ) from None
        try:
            with _no_advice_to_raise_the_limit():
                return future.result()
        except CancelledError:
            raise UsageError("the file was closed during the call") from None
        except BaseException:
            future.cancel()  # a KeyboardInterrupt: the task would otherwise run on to its end
            raise

    def close(self) -> None:
        """Stop the loop, cancelling anything still running on it, and join its thread; in a
        forked copy of the process that made the bridge, only let the copy of it go (its loop
        runs in no thread here: nothing could stop it, and the lock may be held for ever)."""
        if not self.here:
            self._portal = None
            return
        with self._lock:
            portal, self._portal = self._portal, None
        if portal is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop already gone
            portal.call(portal.stop, True)
        self._thread.join()


def _serve(started: Future[BlockingPortal]) -> None:
    """A :class:`Bridge`'s thread: an event loop serving a portal, handed to ``started``, until
    the portal is stopped; a loop that fails to start fails ``started``."""

    async def serve() -> None:
        async with BlockingPortal() as portal:
            try:
                started.set_result(portal)
            except InvalidStateError:  # given up (cancelled) by its maker, interrupted meanwhile
                return
            await portal.sleep_until_stopped()

    try:
        anyio.run(serve, backend="asyncio")
    except BaseException as exc:
        if started.done():
            raise  # failed while serving: threading.excepthook reports it
        started.set_exception(exc)


def _loop_running() -> bool:
    """Whether this thread is running an event loop (asyncio's or trio's) right now, or is
    starting or ending one under ``anyio.run``: there (a signal handler's call, a ``__del__``'s)
    no loop runs yet, or any longer, but ``anyio.run`` would refuse to start another."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return True
        except RuntimeError:
            pass
    sniffio = sys.modules.get("sniffio")  # what anyio.run asks of a thread before it starts
    return sniffio is not None and sniffio.current_async_library_cvar.get(None) is not None


_SIGNALS = sorted(int(signum) for signum in signal.valid_signals())
_getsignal: Callable[[int], object] = importlib.import_module("_signal").getsignal
"""``signal.getsignal`` without its conversion to enums: 3 us for every signal, not 45."""


class _CallersHandlers:
    """The caller's own Python signal handlers, while a call runs its loop in the main thread.

    Python runs a handler in the main thread between any two bytecodes: there, inside the
    loop's own machinery. One that raises (a ``SIGALRM`` timeout, a ``SIGTERM`` handler's
    ``sys.exit()``) would fail whatever callback it landed in: asyncio logs that and drops it
    (a worker thread's result is lost, and the call waits for it for ever), or the loop stops
    with tasks and worker threads left running. Each such handler is wrapped for the call: it
    still runs when its signal comes, and what it raises cancels the call's task instead
    (cleaned up as for Ctrl-C) and is raised to the caller once the loop is over, as a plain
    synchronous call would have raised it; a second one is raised where it lands (the way out
    of a call that does not stop). A handler replaced during the call is left as set."""

    __slots__ = ("_loop", "_over", "_task", "_wrapped", "raised")

    def __init__(self) -> None:
        self.raised: BaseException | None = None
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wrapped: list[tuple[int, Any, Callable[..., None]]] = []
        self._over = False

    def __enter__(self) -> _CallersHandlers:
        if threading.current_thread() is not threading.main_thread():
            return self  # handlers run in the main thread only, not in this call's loop
        try:
            for signum in _SIGNALS:
                handler = _getsignal(signum)
                if callable(handler) and handler is not signal.default_int_handler:
                    wrapper = functools.partial(self._deferred, handler)
                    self._wrapped.append((signum, handler, wrapper))
                    signal.signal(signum, wrapper)
        except BaseException:  # a handler raised while the others were wrapped
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Put the caller's handlers back. Until all are, a wrapped one that raises keeps what
        it raised for the caller (:attr:`raised`); a wrapper left in place by a handler raising
        in between calls its handler as it is from then on."""
        try:
            for signum, handler, wrapper in self._wrapped:
                if _getsignal(signum) is wrapper:
                    signal.signal(signum, handler)
        finally:
            self._over = True

    def started(self) -> None:
        """The call's task is running (on the loop of this thread)."""
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()

    def _deferred(self, handler: Callable[..., object], signum: int, frame: Any) -> None:
        if self._over:  # a wrapper kept by code that chains to the handler it replaced
            handler(signum, frame)
            return
        try:
            handler(signum, frame)
        except BaseException as exc:
            if self.raised is not None:
                raise  # stopping the call hangs: raised where it lands, as a second Ctrl-C is
            self.raised = exc
            task, loop = self._task, self._loop
            if task is not None and loop is not None and not task.done():
                task.cancel()
                loop.call_soon_threadsafe(_nothing)  # wake a loop waiting in select()


def _nothing() -> None:
    pass


@contextlib.contextmanager
def _no_advice_to_raise_the_limit() -> Iterator[None]:
    """A drop-in takes no ``max_header_size`` (its limit is the reference's): a header over it
    read through the streaming reader (a URL, a FIFO) is refused without the advice to raise
    it, as a local file's and bytes' are (:class:`HeaderTooLargeError` ``fixed``)."""
    try:
        yield
    except HeaderTooLargeError as exc:
        if RAISE_THE_LIMIT not in str(exc):
            raise
        fixed = HeaderTooLargeError(str(exc).replace(RAISE_THE_LIMIT, "", 1))
        fixed.__dict__.update(exc.__dict__)
        raise fixed from None


async def _boxed(
    box: list[T], handlers: _CallersHandlers, function: Callable[..., Awaitable[T]], *args: Any
) -> None:
    handlers.started()
    if handlers.raised is None:  # a handler raised while the loop started: nothing to begin
        box.append(await function(*args))


def run(function: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await function(*args)`` on a private event loop started for this call, from sync code:
    in the calling thread when it runs no loop, else in a :class:`Bridge`'s thread."""
    if not _loop_running():
        # The result goes back in a box, not as the task's result: in the main thread asyncio's
        # runner formats its SIGINT handler, which names the task and so the task's result, on
        # the way out (``signal.getsignal``): the repr of every tensor loaded, milliseconds.
        # A loop of our own making, not the thread's current one: asyncio's runner would
        # otherwise make its loop current and, on the way out, leave the thread with none,
        # taking the loop the caller had set (asyncio.set_event_loop) from under it.
        box: list[T] = []
        handlers = _CallersHandlers()
        try:
            with handlers, _no_advice_to_raise_the_limit():
                anyio.run(
                    _boxed,
                    box,
                    handlers,
                    function,
                    *args,
                    backend_options={"loop_factory": asyncio.new_event_loop},
                )
        except BaseException:
            if handlers.raised is None:
                raise  # the call's own error (a handler's supersedes it: it stopped the call)
        if handlers.raised is not None:
            raise handlers.raised.with_traceback(handlers.raised.__traceback__) from None
        return box[0]
    bridge = Bridge()
    try:
        return bridge.call(function, *args)
    finally:
        bridge.close()


def check_sync_address(obj: object, role: str) -> None:
    """:class:`UsageError` for an ``obj`` that belongs to the caller's event loop (a stream, a
    chunk iterator): a synchronous call runs on a loop of its own and cannot use it.
    :class:`ArgumentTypeError` for a source given as bytes that cannot be a file's (a path as
    bytes, which the reference refuses with a TypeError too)."""
    bound = (
        asyncio.StreamReader,
        asyncio.StreamWriter,
        ByteReceiveStream,
        ByteSendStream,
        AsyncIterable,
    )
    if isinstance(obj, bound):
        raise UsageError(
            f"the synchronous API takes a path, URL or bytes as its {role}, not a "
            f"{type(obj).__name__} (it belongs to an event loop): use stream_st's async API"
        )
    if role == "source" and isinstance(obj, bytes | bytearray) and 0 not in obj[:8]:
        # A safetensors file's first 8 bytes, a little-endian header length, end in zeros:
        # these are no file's content, but most likely a path given as bytes (os.fsencode).
        raise ArgumentTypeError(
            f"bytes are read as a safetensors file's content, and {_shown(obj)} is none (no "
            "8-byte header length): give a path as a str or os.PathLike"
        )


def _shown(data: bytes | bytearray, limit: int = 300) -> str:
    """``data`` as ``repr`` shows bytes, cut after ``limit`` bytes (a path is shown whole)."""
    more = f"... ({len(data):,} bytes)" if len(data) > limit else ""
    return f"{bytes(data[:limit])!r}{more}"

"""The entry point of the ``stream-st`` command: parse, run the subcommand, map errors to exit
statuses.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from types import FrameType

import anyio

from ..errors import SafetensorsError
from ..transports.s3.config import unsigned_requests
from .exits import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERNAL,
    EXIT_OK,
    SIGNAL_GRACE,
    interrupted,
)
from .options import aws_settings, caps_of
from .output import (
    PROG,
    OutputError,
    discard_output,
    shown_message,
    standard_error,
    standard_output,
    warnings_as_lines,
)
from .parser import build_parser, complete

__all__ = ["STOPPING_SIGNALS", "main"]


STOPPING_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
"""Signals that stop the command: cancel what runs (a write in progress is aborted, leaving
nothing at its destination, unless it reached its commit point: then it finishes, and so may the
command), then exit with 128 + the signal's number."""


class _Stopped(BaseException):
    """The command was stopped by ``signum`` (one of :data:`STOPPING_SIGNALS`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


async def _run(args: argparse.Namespace) -> int:
    """Run the subcommand; a stopping signal cancels it, so every writer aborts (a temporary
    file removed, an upload abandoned), then raises :class:`_Stopped`, even where the subcommand
    then failed. A subcommand that finishes all the same (a write past its commit point is seen
    through, and reports success under the cancelled scope) is done: its status, with a line
    saying the signal came too late. A second stopping signal during that clean-up stops the
    process at once."""
    loop = asyncio.get_running_loop()
    status: int | None = None
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.getsignal(signum) for signum in STOPPING_SIGNALS}
    # A signal the command was started ignoring stays ignored: ``nohup`` (SIGHUP), a shell's
    # background job (SIGINT) mean the command should not stop on them.
    watched = [s for s, was in previous.items() if was is not signal.SIG_IGN and on_main_thread]
    with anyio.CancelScope() as scope:
        stop = _Stop(loop, scope, watched)
        with _woken_by_signals(loop) if watched else nullcontext():
            for signum in watched:
                signal.signal(signum, stop)
            try:
                status = await args.handler(args)
            except SafetensorsError:
                # A failure that came with a stopping signal (the source ended by the same
                # hangup, a write cut short) is the signal's doing: the signal, delivered but
                # maybe not yet handled, is let in, and reported as for a clean stop.
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(SIGNAL_GRACE)
                if not stop.received:
                    raise
            finally:
                # Done: the signals go to _Completed until main returns; else back to what they
                # were (the command is stopping). Each handler is Python's, put in place of
                # another at once: no moment when a signal gets the system's default.
                after = _Completed(said=bool(stop.received)) if status is not None else None
                stop.after = _stopping if after is None else after
                for signum in watched:
                    signal.signal(signum, previous[signum] if after is None else after)
    if status is None:  # cancelled: only a stopping signal does that
        raise _Stopped(stop.received[0])
    if stop.received:
        print(_completed_line(stop.received[0]), file=sys.stderr)
    return status


class _Stop:
    """The handler of the stopping signals while the subcommand runs: the first cancels
    ``scope`` (in the event loop, woken for it) and gives every stopping signal the system's
    default, so that a second one ends the process at once. Once the subcommand is done
    (``after`` set, the handlers being changed), a signal is ``after``'s, or ignored where the
    command is stopping."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, scope: anyio.CancelScope, watched: list[int]
    ) -> None:
        self.loop = loop
        self.scope = scope
        self.watched = watched
        self.received: list[int] = []
        self.after: Callable[[int, FrameType | None], None] | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.after is not None:
            self.after(signum, frame)
            return
        self.received.append(signum)
        for each in self.watched:
            signal.signal(each, signal.SIG_DFL)
        self.loop.call_soon_threadsafe(self.scope.cancel)


def _stopping(signum: int, frame: FrameType | None) -> None:
    """A stopping signal while the command, stopped by another, sets back the handlers."""


@contextmanager
def _woken_by_signals(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Have a signal wake the event loop's wait, wherever the system delivers it: a signal's
    handler runs on the main thread between two steps of Python, which a wait for the next
    event (a server with no client) would put off while a worker thread took the signal."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    former = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    loop.add_reader(reader.fileno(), _drain, reader)
    try:
        yield
    finally:
        loop.remove_reader(reader.fileno())
        signal.set_wakeup_fd(former)
        reader.close()
        writer.close()


def _drain(reader: socket.socket) -> None:
    """Read what signals wrote to wake the loop (their handlers have run, or run next)."""
    with suppress(BlockingIOError, InterruptedError):
        while reader.recv(4096):
            pass


class _Completed:
    """The handler of the stopping signals once the command has done its work, until
    :func:`main` returns: the first signal is said with :func:`_completed_line` (unless one
    during the work's last steps was), and the command exits as it would have."""

    def __init__(self, said: bool) -> None:
        self.said = said

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.said:
            return
        self.said = True
        with suppress(OSError, ValueError):  # no descriptor (standard error in memory)
            # written past sys.stderr's buffer, which the signal may have come in the middle of
            os.write(sys.stderr.fileno(), f"{_completed_line(signum)}\n".encode())


def _completed_line(signum: int) -> str:
    """What the command says of a stopping signal that came once its work was done."""
    return (
        f"{PROG}: {_signal_name(signum)} came once the command had committed its work: it completed"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-st`` command; returns the exit status. Without ``argv`` it
    runs the process's command, which exits next: the stopping signals are then left ignored
    once its work is done; with ``argv`` (a caller's run) they get back their handlers."""
    if sys.stderr is None:  # started with standard error closed (``2>&-``): its lines are
        # dropped, not printed into standard output (print's default), and its descriptor is
        # taken, so that no file the command opens (a copy's destination) is given it
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    with standard_error():  # one it cannot write (``2>/dev/full``): its lines dropped too
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    """:func:`main`, standard error taken care of."""
    try:
        parser = build_parser()
        complete(parser)
    except KeyboardInterrupt:
        return interrupted()
    handlers = {signum: signal.getsignal(signum) for signum in STOPPING_SIGNALS}
    try:
        with standard_output():
            return _command(parser, argv)
    except OutputError as exc:
        discard_output()
        if isinstance(exc.__cause__, BrokenPipeError):  # the reader went away (``| head``)
            return EXIT_BROKEN_PIPE
        print(f"{PROG}: error: cannot write standard output: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        # Where the command completed: a caller's run (argv given) gets its handlers back; the
        # process's command exits next, and ignores the signals, since Python's finalization
        # sets its handlers to the default (stopping the process) before its long clean-up.
        for signum, handler in handlers.items():
            if isinstance(signal.getsignal(signum), _Completed):
                signal.signal(signum, signal.SIG_IGN if argv is None else handler)


def _command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse the command line and run the subcommand; its exit status."""
    try:
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return interrupted()
    if args.command is None:  # a bare command shows what it can do
        parser.print_help()
        return EXIT_OK
    signing = unsigned_requests() if getattr(args, "no_sign_request", False) else nullcontext()
    try:
        with signing, aws_settings(args), caps_of(args), warnings_as_lines():
            status: int = anyio.run(_run, args)
    except SafetensorsError as exc:
        print(f"{PROG}: error: {shown_message(str(exc))}", file=sys.stderr)  # no line forged
        return EXIT_ERROR
    except BrokenPipeError:  # cp to ``-`` whose reader went away (``| head``): stop quietly
        discard_output()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return interrupted()
    except _Stopped as stopped:
        if stopped.signum == signal.SIGINT:
            return interrupted()
        print(f"{PROG}: stopped by {_signal_name(stopped.signum)}", file=sys.stderr)
        return 128 + stopped.signum
    except OutputError:
        raise
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            print(f"{PROG}: error: {exc.strerror} (see ulimit -n)", file=sys.stderr)
            return EXIT_ERROR  # out of descriptors (the command's own too): no bug of ours
        traceback.print_exc()
        print(
            f"{PROG}: internal error (a bug, please report it with the traceback above)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    return status


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # pragma: no cover - only the signals above are caught
        return f"signal {signum}"

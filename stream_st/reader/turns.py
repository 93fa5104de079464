"""Turns the reader gives the event loop amid work that never waits: :func:`give_turn`."""

from __future__ import annotations

import importlib
import threading
import time

import anyio.lowlevel

# anyio imports its asyncio backend when a loop first calls it: 10-20 ms (more from a cold disk)
# that the first read (``stream_st.load``, a synchronous facade's first call) would pay. Imported
# with the reader instead, as the reference loads its code at import; ``import stream_st`` stays
# light (it imports no reader).
importlib.import_module("anyio._backends._asyncio")

# Turns for the event loop between pieces of a read that may not wait at all. A read of local
# files in the page cache can run for a long time without awaiting anything that suspends: the
# file opens, headers and small tensors are all read on the loop's thread. give_turn(), called
# where a piece of work begins (a stream opening, its header, each tensor), lets the loop run
# other tasks, and a cancellation arrive, once this thread's loop has gone TURN_EVERY without a
# turn given here, counted across every stream of the thread: many small files are paced as one
# big one.

TURN_EVERY = 0.005
"""Seconds of the reader's work between two turns it gives the loop at most (plus one piece of
work: one inline read of at most 4 MiB, or one header parsed on the loop): well under the 50 ms
the loop may be held, and a turn (``anyio.lowlevel.checkpoint``, a few microseconds) costs
under 0.1 % of that."""


TURN_CHECKPOINTS = 3
"""Checkpoints in one turn (see :func:`give_turn`): a few microseconds each, every
:data:`TURN_EVERY` at most."""


class _Last(threading.local):
    at: float | None = None  # time.perf_counter() of this thread's last turn given, or of its
    # first piece of work: until then no work of the reader has held the loop on this thread


_last = _Last()


async def give_turn() -> None:
    """Let the event loop run once, and a pending cancellation be raised, if this thread has
    given none for :data:`TURN_EVERY`; otherwise return at once (one clock read). A thread's
    first call only starts that count: no work of the reader held the loop before it (a
    process's first read pays no turn, 40-120 us of cold event-loop code).

    A turn is :data:`TURN_CHECKPOINTS` checkpoints: a task woken by a timer or a socket during
    the work (a ``sleep`` ending) is queued behind this one in two hops, the expired timer's
    callback, then the task's own step; it runs before the work goes on only if the work
    yields that many times. With one checkpoint it waited for the next stretch of work too:
    the loop's longest stall was two or three stretches, not one."""
    now = time.perf_counter()
    last = _last.at
    if last is None:  # the thread's first piece of work begins: no turn is owed yet
        _last.at = now
    elif now - last >= TURN_EVERY:
        for _ in range(TURN_CHECKPOINTS):
            await anyio.lowlevel.checkpoint()
        _last.at = time.perf_counter()

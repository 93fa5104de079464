"""Turns the reader gives the event loop amid work that never waits: :func:`give_turn`, kept
with the sources (:mod:`stream_st.transports.base`), which give them too, also between the
steps of a long pass (:func:`run_in_turns`)."""

from __future__ import annotations

import importlib
from collections.abc import Generator
from typing import TypeVar, cast

from ..transports.base import TURN_CHECKPOINTS, TURN_EVERY, give_turn

__all__ = ["TURN_CHECKPOINTS", "TURN_EVERY", "give_turn", "run_in_turns"]

# anyio imports its asyncio backend when a loop first calls it: 10-20 ms (more from a cold disk)
# that the first read (``stream_st.load``, a synchronous facade's first call) would pay. Imported
# with the reader instead, as the reference loads its code at import; ``import stream_st`` stays
# light (it imports no reader).
importlib.import_module("anyio._backends._asyncio")

R = TypeVar("R")


async def run_in_turns(steps: Generator[None, None, R]) -> R:
    """What the generator ``steps`` returns, its steps run on the event loop with a turn for the
    loop (:func:`give_turn`) after each: a long pass holds the loop for one step at most. Its
    synchronous twin is :func:`~stream_st.core.header.run_steps`."""
    try:
        while True:
            next(steps)
            await give_turn()
    except StopIteration as done:
        return cast(R, done.value)
    finally:
        steps.close()

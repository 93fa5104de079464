"""Turns the reader gives the event loop amid work that never waits: :func:`give_turn`, kept
with the sources (:mod:`stream_st.transports.base`), which give them too."""

from __future__ import annotations

import importlib

from ..transports.base import TURN_CHECKPOINTS, TURN_EVERY, give_turn

__all__ = ["TURN_CHECKPOINTS", "TURN_EVERY", "give_turn"]

# anyio imports its asyncio backend when a loop first calls it: 10-20 ms (more from a cold disk)
# that the first read (``stream_st.load``, a synchronous facade's first call) would pay. Imported
# with the reader instead, as the reference loads its code at import; ``import stream_st`` stays
# light (it imports no reader).
importlib.import_module("anyio._backends._asyncio")

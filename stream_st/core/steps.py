"""Long passes cut into steps: a sequence in slices (:func:`slices`), for a pass written as a
generator that yields between two, so that a reader on an event loop gives the loop its turn
there (:func:`stream_st.reader.turns.run_in_turns`) and a synchronous caller runs the steps back
to back (:func:`stream_st.core.header.run_steps`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

SLICE = 2048
"""Items one step of a pass over a header's tensors (or its metadata) takes: a millisecond or
two of work (selecting, checking, planning them), where a pass over 200,000 tensors in one go
held the loop for hundreds of milliseconds."""


def slices(items: Sequence[T]) -> Iterator[Sequence[T]]:
    """``items`` in slices of :data:`SLICE`; ``items`` itself, in one slice, when no longer."""
    if len(items) <= SLICE:
        return iter((items,))
    return (items[at : at + SLICE] for at in range(0, len(items), SLICE))

"""The read-ahead of a local file's tensors: how much may be read ahead of the caller and the
loop that drives the worker threads (:func:`_read_ahead`)."""

from __future__ import annotations

import bisect
import functools
import sys
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.header import TensorInfo
from ..memory.delivery import Delivery
from ..memory.fresh import ALIGN
from ..memory.recycle import Recycler
from ..transports.file.readahead import ReadAhead
from ..transports.file.source import FileSource
from .tensors import _allocate_framed as _allocate_framed  # looked up here: tests patch it
from .tensors import _cut_short
from .turns import give_turn

if TYPE_CHECKING:
    from ..core.digests import Digests, Hasher

READ_AHEAD_FROM = 8 << 20
"""A local file's tensors are read ahead by worker threads (:func:`_read_ahead`)
when those wanted hold at least this many bytes; smaller reads stay tensor by tensor, mostly
on the loop's thread from the page cache, where starting threads would cost more."""

READ_AHEAD_BYTES = 16 << 20
"""Fresh arrays read ahead of a caller that drops the arrays it is given hold at most this many
bytes, or two tensors of at most :data:`READ_AHEAD_MOST` together, or one tensor. Two, so that
while the caller works on one tensor the threads read the next and the one after is queued:
with one only, the reading waits for the caller at every tensor (measured: half the speed,
streaming or loading 32 MiB tensors). At most 16 MiB beyond that, so that the caller has
dropped earlier tensors, whose memory is used again (:mod:`stream_st.memory.recycle`), before later
ones are allocated: memory in use stays near the tensors in flight."""

READ_AHEAD_MOST = 64 << 20
"""Fresh arrays read ahead hold at most this many bytes (or one tensor). A caller that keeps
every array (a load; judged once it holds :data:`READ_AHEAD_BYTES` and has dropped none) gets
this much read ahead: it keeps those arrays anyway, and more tensors queued keep the threads
busier (loading 490 MiB of 2-6 MiB tensors: 2.7-3.0 GB/s against 2.2-2.4 with 16 MiB)."""


def _room_ahead(queued: int, fresh: int, nbytes: int, keeping: bool) -> bool:
    """Whether a fresh array of ``nbytes`` may be read ahead, ``queued`` tensors (holding
    ``fresh`` bytes of fresh arrays) being read or waiting already; ``keeping``: the caller
    keeps every array (see :data:`READ_AHEAD_MOST`)."""
    total = fresh + nbytes
    if total <= (READ_AHEAD_MOST if keeping else READ_AHEAD_BYTES):
        return True
    return queued < 2 and total <= READ_AHEAD_MOST


Span = tuple[int, int]
"""The addresses ``[start, end)`` of an array's bytes."""


def _span(array: np.ndarray[Any, Any]) -> Span:
    """Where the bytes of ``array`` (contiguous) lie in memory."""
    start: int = array.__array_interface__["data"][0]
    return start, start + array.nbytes


def _overlaps(spans: list[Span], span: Span) -> bool:
    """Whether ``span`` shares a byte with one of ``spans`` (sorted, none sharing a byte)."""
    at = bisect.bisect_left(spans, span[1], key=lambda each: each[0])
    return at > 0 and spans[at - 1][1] > span[0]


async def _read_ahead(
    source: FileSource,
    wanted: Sequence[TensorInfo],
    base: int,
    delivery: Delivery,
    recycler: Recycler,
    started: Callable[[ReadAhead], None],
    digests: Digests | None = None,
) -> AsyncGenerator[tuple[str, Any]]:
    """The tensors of a local file read ahead of the caller by worker threads kept busy (see
    :mod:`stream_st.transports.file.readahead`): every tensor going into memory the caller gave (but
    memory given for several tensors, such as one staging buffer, takes the next only once
    the tensor before has been handed out and the caller has asked for the next, as without
    read-ahead), and fresh arrays while those not yet handed out leave room
    (:func:`_room_ahead`). ``delivery`` says where tensors land, ``recycler`` gives fresh
    memory; ``started`` is told the :class:`ReadAhead` (for a close from another task).
    With ``digests``, each tensor is hashed by the threads piece by piece as it lands (see
    :class:`~stream_st.transports.file.readahead.InOrder`) and one that does not match its
    digest is never handed out (:class:`~stream_st.IntegrityError`)."""
    queued: deque[tuple[TensorInfo, int, Span | None, np.ndarray[Any, Any], Hasher | None]]
    queued = deque()
    spans: list[Span] = []  # the caller's memory queued tensors go into, sorted
    upcoming = iter(wanted)
    following = next(upcoming, None)
    fresh = 0  # bytes of fresh arrays read or being read, not yet handed out
    handed = 0  # bytes of fresh arrays handed out
    # Not 'async with': a trio run that ends with this generator left by a 'break' closes
    # the async generators still open in any order, this context's own one maybe first;
    # leaving it as a normal exit then finds it finished, where an exception thrown in
    # would be a RuntimeError. Its exit stops and waits for the threads either way.
    reading = source.reading()
    ahead = await reading.__aenter__()
    try:
        started(ahead)
        while True:
            while following is not None:
                info = following
                target = delivery.target(info)
                span = frame = None
                if target is None:
                    keeping = handed >= READ_AHEAD_BYTES and not recycler.dropped
                    if queued and not _room_ahead(len(queued), fresh, info.nbytes, keeping):
                        break
                    phase = (base + info.start) % ALIGN  # as the bytes lie in the blocks
                    target_array, view, frame = _allocate_framed(
                        info, functools.partial(recycler.take_framed, phase=phase)
                    )
                    fresh += info.nbytes
                else:
                    target_array, view = target
                    span = _span(target_array)
                    if info.nbytes:
                        if _overlaps(spans, span):  # memory used again (a staging buffer)
                            break  # filled once the tensor queued there is handed out
                        bisect.insort(spans, span)
                hasher = None if digests is None else digests.hasher()
                feed = None if hasher is None else hasher.update
                # memory of its own, new unless the caller has let go of some to reuse
                new = frame is not None and not recycler.dropped
                job = ahead.add(base + info.start, view, frame, feed, new) if info.nbytes else -1
                queued.append((info, job, span, target_array, hasher))
                following = next(upcoming, None)
            if not queued:
                break
            await give_turn()
            info, job, span, array, hasher = queued.popleft()
            source.clock.check(source.name, source.position)
            with source.clock.within_deadline(source.name, base + info.start):
                got = await ahead.wait(job) if job >= 0 else 0  # a big tensor: seconds
            source.position = base + info.start + got
            if got < info.nbytes:
                raise _cut_short(info, source, base)
            if digests is not None and hasher is not None:
                digests.check(info.name, hasher, source.name)
            if span is None:
                fresh -= info.nbytes
                handed += info.nbytes
            elif info.nbytes:
                spans.remove(span)
            if sys.byteorder == "big" and array.dtype.itemsize > 1:  # pragma: no cover
                array.byteswap(inplace=True)
            yield info.name, delivery.deliver(info, array, span is not None)
            del array
    finally:
        await reading.__aexit__(None, None, None)

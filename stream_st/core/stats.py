"""What one read took: bytes, tensors, seconds, throughput, time to the first tensor, time waited.

Every :class:`~stream_st.TensorStream` keeps a :class:`LoadStats` as ``stream.stats``, updated as
the header arrives and as each tensor is handed out; read it during the read or after it::

    async with stream_st.open_stream(path) as stream:
        async for name, array in stream:
            ...
    print(stream.stats.summary())   # 291 tensors, 13.5 GB in 4.10 s (3.29 GB/s), ...

A sharded stream's shards all report to the sharded stream's one object.

Calls that read without handing you a stream (:func:`stream_st.load`, the drop-ins'
``load_file`` and ``load``, :func:`stream_st.tools.cp`) leave theirs for
:func:`last_stats`, as the seed's ``get_last_stats()`` does::

    state = stream_st.torch.load_file("s3://bucket/model.safetensors")
    print(stream_st.last_stats().summary())
"""

from __future__ import annotations

import _thread  # not threading: 0.5 ms of every drop-in import, for a lock
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoadStats", "last_stats"]


@dataclass
class LoadStats:
    """Counters of one read, all starting at zero and growing as the read goes on.

    ``bytes_read``: the length prefix, the header and the bytes of every tensor handed out
    (tensors skipped by ``include=`` are not counted). ``tensors``: tensors handed out.
    ``seconds``: from opening the stream to the last tensor handed out (or the header, before
    any). ``first_tensor_seconds``: from opening to the first tensor handed out (None before).
    ``wait_seconds``: how long the caller waited for the stream, summed from each time it asked
    for the next tensor to the moment it got it: the time spent on the transport and the
    reading that the caller's own work did not hide. ``seconds - wait_seconds`` is the time
    the caller spent between tensors (its own work, once the header is read).
    """

    bytes_read: int = 0
    tensors: int = 0
    seconds: float = 0.0
    first_tensor_seconds: float | None = None
    wait_seconds: float = 0.0
    _started: float | None = field(default=None, repr=False, compare=False)
    _asked: float | None = field(default=None, repr=False, compare=False)

    @classmethod
    def total(cls, reads: list[LoadStats]) -> LoadStats:
        """Reads made one after another (a checkpoint's shards) as one: their counts and times
        summed; the first tensor came after the reads before the first that handed one out."""
        first: float | None = None
        before = 0.0
        for read in reads:
            if read.first_tensor_seconds is not None:
                first = before + read.first_tensor_seconds
                break
            before += read.seconds
        return cls(
            bytes_read=sum(read.bytes_read for read in reads),
            tensors=sum(read.tensors for read in reads),
            seconds=sum(read.seconds for read in reads),
            first_tensor_seconds=first,
            wait_seconds=sum(read.wait_seconds for read in reads),
        )

    @property
    def throughput(self) -> float:
        """Bytes per second over ``seconds`` (0.0 before any time has passed)."""
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def begin(self) -> None:
        """The stream opens: the clock starts. Later calls (a sharded stream's shards) keep the
        first start."""
        if self._started is None:
            self._started = time.perf_counter()

    def received(self, nbytes: int) -> None:
        """``nbytes`` arrived outside any tensor (the length prefix and the header)."""
        self.bytes_read += nbytes
        self._tick()

    def asked(self, *, first: bool = False) -> None:
        """The caller asks for the next tensor. ``first``: the iteration starts, which keeps a
        request already waiting (a sharded stream moving on to its next shard)."""
        if not first or self._asked is None:
            self._asked = time.perf_counter()

    def handed(self, nbytes: int) -> None:
        """A tensor of ``nbytes`` is handed out."""
        now = self._tick()
        if self._asked is not None:
            self.wait_seconds += now - self._asked
            self._asked = None
        self.tensors += 1
        self.bytes_read += nbytes
        if self.first_tensor_seconds is None:
            self.first_tensor_seconds = self.seconds

    def _tick(self) -> float:
        now = time.perf_counter()
        if self._started is None:
            self._started = now
        self.seconds = now - self._started
        return now

    def to_json(self) -> dict[str, Any]:
        """The counters and the throughput, as JSON-ready values."""
        return {
            "bytes_read": self.bytes_read,
            "tensors": self.tensors,
            "seconds": self.seconds,
            "throughput": self.throughput,
            "first_tensor_seconds": self.first_tensor_seconds,
            "wait_seconds": self.wait_seconds,
        }

    def summary(self) -> str:
        """One line for people: ``3 tensors, 1.2 MB in 0.010 s (120 MB/s), first tensor after
        0.004 s, waited 0.006 s``."""
        first = (
            "no tensor"
            if self.first_tensor_seconds is None
            else f"first tensor after {self.first_tensor_seconds:.3f} s"
        )
        return (
            f"{self.tensors} tensors, {_si(self.bytes_read)}B in {self.seconds:.3f} s "
            f"({_si(self.throughput)}B/s), {first}, waited {self.wait_seconds:.3f} s"
        )


_last: LoadStats | None = None
_last_lock = _thread.allocate_lock()


def last_stats() -> LoadStats | None:
    """The :class:`LoadStats` of the last read closed in this process (by any thread: with reads
    in several threads at once, prefer each stream's own ``stream.stats``); None before any."""
    with _last_lock:
        return _last


def record_last(stats: LoadStats) -> None:
    """``stats`` is the last read's (what :func:`last_stats` gives from now on)."""
    global _last
    with _last_lock:
        _last = stats


def _si(value: float) -> str:
    """``value`` with a decimal SI prefix: 1.23 k, 45.6 M, 7.89 G; under 1000 as it is."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.0f} "
